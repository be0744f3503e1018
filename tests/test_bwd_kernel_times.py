"""scripts/bwd_kernel_times.py on a CPU: per-call kernel times from profiler events, problem selection."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import bwd_kernel_times  # noqa: E402

CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


def test_per_call_times_sums_cuda_kernels_per_call_longest_first():
    events = [SimpleNamespace(name="main", device_type=CUDA, device_time=800.0),
              SimpleNamespace(name="reduce", device_type=CUDA, device_time=100.0),
              SimpleNamespace(name="main", device_type=CUDA, device_time=840.0),
              SimpleNamespace(name="reduce", device_type=CUDA, device_time=120.0),
              SimpleNamespace(name="aten::mul", device_type=CPU, device_time=5.0),  # host op: not a kernel
              SimpleNamespace(name="old", device_type=CUDA, device_time=None, cuda_time=10.0)]  # older torch
    times = bwd_kernel_times.per_call_times(events, calls=2)
    assert times == {"main": 820.0, "reduce": 110.0, "old": 5.0}
    assert list(times) == ["main", "reduce", "old"]


def test_select_problems_names_the_unknown_ones():
    chosen = bwd_kernel_times.select_problems("b4s2048h32d64-causal,b1s8192h16d128")
    assert sorted(p.name for p in chosen) == ["b1s8192h16d128", "b4s2048h32d64-causal"]
    assert len(bwd_kernel_times.select_problems("")) == 8  # the whole bwd set
    with pytest.raises(SystemExit, match="unknown problems \\['b9'\\]"):
        bwd_kernel_times.select_problems("b9,b1s8192h16d128")


def test_unknown_variants_are_refused_before_any_device_work():
    with pytest.raises(SystemExit, match="unknown --det-variants \\['det_nope'\\]"):
        bwd_kernel_times.main(["--det-variants", "det_fixed_point,det_nope"])
