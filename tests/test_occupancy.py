"""The occupancy check's decisions (pure; the CUDA side is tests/test_occupancy_gpu.py)."""

from types import SimpleNamespace

import pytest

from flash_attn_sm120 import hardware, occupancy
from flash_attn_sm120.occupancy import HostFunction


def _kernel(unpadded=65536, launched=116736, threads=128):
    return SimpleNamespace(smem_bytes_unpadded=unpadded, smem_bytes_launched=launched, launch_threads=threads)


@pytest.fixture(autouse=True)
def _fresh_records():
    occupancy.reset_records()
    yield
    occupancy.reset_records()


def test_sm120_count_adds_the_sm120a_static_smem():
    # 64 KB + the cubin's 1 KB + 1 KB reserved: one CTA; registers can lower it further
    assert occupancy.sm120_count(65536, 128, 255).ctas_per_sm == 1
    assert occupancy.sm120_count(32768, 128, 255).ctas_per_sm == 2
    assert occupancy.sm120_count(16384, 128, 168).ctas_per_sm == 3  # 168 x 128 registers: 3 CTAs
    assert occupancy.sm120_count(16384, 128, 168).limiter == "regs"


def test_match_is_recorded():
    rec = occupancy.check("upstream d128", _kernel(), HostFunction(0, 255, 1), "emulated")
    assert rec.matches and rec.sm120_ctas_per_sm == 1 and rec.sm120_regs_source == "host cubin"
    assert occupancy.records() == [rec] and occupancy.all_verified()
    assert rec.to_dict()["matches"] is True


def test_emulation_refuses_another_occupancy():
    """The bug this check exists for: the 1 KB static assumption left room for 2 CTAs of upstream's tile."""
    with pytest.raises(RuntimeError, match=r"upstream d128: the GPU fits 2 CTAs per SM .*SM120 fits 1"):
        occupancy.check("upstream d128", _kernel(launched=115712), HostFunction(0, 255, 2), "emulated")
    assert not occupancy.all_verified()


def test_real_sm120_only_warns_and_unpadded_runs_are_never_verified():
    with pytest.warns(RuntimeWarning, match="model disagrees"):
        rec = occupancy.check("k", _kernel(launched=65536), HostFunction(0, 255, 2), "sm120")
    assert not rec.matches
    occupancy.reset_records()
    occupancy.check("k", _kernel(launched=65536), HostFunction(0, 255, 3), "unpadded")  # no error, no warning
    assert not occupancy.all_verified()  # a run with an unpadded kernel is not occupancy-verified


def test_sm120a_registers_where_known_take_precedence():
    rec = occupancy.compare("k", _kernel(unpadded=16384, launched=16384), HostFunction(0, 128, 3), "emulated",
                            sm120_regs=168)
    assert rec.sm120_regs == 168 and rec.sm120_regs_source == "sm_120a cubin" and rec.sm120_ctas_per_sm == 3


def test_a_kernel_without_launch_facts_is_an_error():
    with pytest.raises(RuntimeError, match="recorded no launch size"):
        occupancy.compare("k", SimpleNamespace(smem_bytes_unpadded=None, smem_bytes_launched=None,
                                               launch_threads=None), HostFunction(0, 1, 1), "emulated")


def test_no_records_is_not_verified():
    assert not occupancy.all_verified()


def test_padding_of_the_check_example_lands_on_one_cta():
    host = hardware.EmulationHost(233472, 232448, 1024, 0)
    padded = hardware.emulation_padded_smem(65536, 128, host)
    assert padded == _kernel().smem_bytes_launched
