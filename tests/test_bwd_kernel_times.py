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


def test_bwd_real_set_holds_the_training_shapes_and_stays_out_of_all():
    from flash_attn_sm120 import bench

    names = [p.name for p in bench.problem_set("bwd_real")]
    # NVIDIA's cuDNN SDPA training benchmark shape (llama3.1), both masks
    assert "b2s8192h64k8d128-causal" in names and "b2s8192h64k8d128" in names
    dense = [p for p in bench.problem_set("bwd_real") if not p.is_varlen]
    assert all(p.nheads > p.nheads_kv for p in dense)
    packed = [p for p in bench.problem_set("bwd_real") if p.is_varlen]
    # packed documents: GQA and MHA, causal, 16k tokens of unequal lengths
    assert {p.nheads > p.nheads_kv for p in packed} == {True, False}
    assert all(p.causal and sum(p.seqlens_q) == 16384 and len(set(p.seqlens_q)) > 1 for p in packed)
    assert all(p.tag != "bwd_real" for p in bench.problem_set("all"))
    chosen = bwd_kernel_times.select_problems("b8s2048h16k4d64-causal", "bwd_real")
    assert [p.name for p in chosen] == ["b8s2048h16k4d64-causal"]
    with pytest.raises(SystemExit, match="bwd_real"):
        bwd_kernel_times.select_problems("b4s2048h32d64", "bwd_real")


@pytest.mark.parametrize("batch,heads,kv_heads,per_chunk", [(1, 16, 16, 4), (4, 32, 32, 4), (2, 64, 8, 4),
                                                             (3, 16, 4, 4), (2, 12, 4, 8), (1, 6, 1, 4)])
def test_reference_chunks_cover_every_head_once_and_never_split_a_kv_group(batch, heads, kv_heads, per_chunk):
    import prepare_bwd
    from flash_attn_sm120.bench import Problem

    p = Problem(batch, 256, 256, heads, kv_heads, 64)
    chunks = prepare_bwd.reference_chunks(p, per_chunk)
    ratio = heads // kv_heads
    seen = [(b, h) for b, h0, h1, _, _ in chunks for h in range(h0, h1)]
    assert sorted(seen) == [(b, h) for b in range(batch) for h in range(heads)]  # each (batch, head) once
    for _, h0, h1, hk0, hk1 in chunks:
        assert (h0, h1) == (hk0 * ratio, hk1 * ratio)  # a piece's query heads are exactly its KV heads' groups
        assert h1 - h0 >= min(per_chunk, heads) or hk1 == kv_heads


@pytest.mark.parametrize("causal", [True, False])
def test_reference_grads_of_a_varlen_gqa_batch_match_one_autograd_per_sequence(causal):
    """The chunked reference (one sequence and whole KV groups per piece, written into packed rows)
    against plain softmax attention differentiated per sequence in fp64: every row and head is written
    (the buffers start NaN) and none is mixed with another sequence's."""
    import prepare_bwd
    from flash_attn_sm120.bench import Problem, make_inputs

    lens = (5, 17, 1, 9)
    p = Problem(len(lens), 0, 0, 6, 2, 16, causal=causal, seqlens_q=lens, seqlens_k=lens, dtype="float32")
    x = make_inputs(p, device="cpu", seed=3)
    x["dout"] = torch.randn(x["q"].shape, generator=torch.Generator().manual_seed(4))
    ref, pt = prepare_bwd.reference_grads(p, x, heads_per_chunk=3)
    cu = x["cu_seqlens_q"].tolist()
    for b in range(p.batch):
        rows = slice(cu[b], cu[b + 1])
        q, k, v = (x[n][rows].double().requires_grad_(True) for n in ("q", "k", "v"))
        kk, vv = (t.repeat_interleave(3, dim=1) for t in (k, v))  # 3 query heads per KV head
        s = torch.einsum("thd,shd->hts", q, kk) / 4.0  # 1 / sqrt(16)
        if causal:
            n = lens[b]
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        o = torch.einsum("hts,shd->thd", s.softmax(-1), vv)
        want = torch.autograd.grad(o, (q, k, v), x["dout"][rows].double())
        for got_ref, got_pt, w in zip(ref, pt, want):
            assert not got_ref[rows].isnan().any()
            torch.testing.assert_close(got_ref[rows].double(), w, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got_pt[rows].double(), w, rtol=1e-4, atol=1e-4)
