"""SM120 occupancy model and emulation padding (pure)."""

import pytest

from flash_attn_sm120 import hardware as hw


def test_occupancy_examples():
    # upstream d128 default: 64 KB + 1 KB static -> one CTA per SM
    assert hw.sm120_occupancy(65536 + 1024, 128).ctas_per_sm == 1
    # d64 128x128: 48 KB -> two CTAs
    occ = hw.sm120_occupancy(49152 + 1024, 128)
    assert (occ.ctas_per_sm, occ.limiter) == (2, "smem")
    # tiny smem: threads limit (1536 / 256 = 6)
    occ = hw.sm120_occupancy(4096, 256)
    assert (occ.ctas_per_sm, occ.limiter) == (6, "threads")
    # registers: 255 regs x 256 threads = 65280 -> 1 CTA by registers
    occ = hw.sm120_occupancy(8192, 256, regs_per_thread=255)
    assert (occ.ctas_per_sm, occ.limiter) == (1, "regs")
    assert hw.sm120_occupancy(hw.SMEM_PER_BLOCK_MAX + 1, 128).ctas_per_sm == 0


def test_regs_allocation_granularity():
    assert hw.regs_per_cta(1, 32) == 256
    assert hw.regs_per_cta(200, 256) == 200 * 32 * 8
    assert hw.regs_per_cta(201, 32) == 6656  # 6432 rounded up to 256


# an H200 as its driver reports it: 228 KB per SM, 227 KB per block, 1 KB reserved per CTA, and (Nsight
# Compute, 2026-12-01) 0 B static shared memory for these kernels
H200 = hw.EmulationHost(233472, 232448, 1024, 0)


def test_padding_h200_64kb_to_one_cta_with_zero_static():
    """The issue's case: upstream's d128 tile, 64 KB dynamic, 0 B static on the host. The old padding
    assumed 1 KB static there and left room for two CTAs (2 x (115712 + 1024) = 233472)."""
    padded = hw.emulation_padded_smem(65536, 128, H200)
    assert 233472 // (padded + 1024) == 1
    assert 233472 // (115712 + 1024) == 2  # what the 1 KB assumption launched: two CTAs fit
    assert padded == 116736
    assert 233472 // (65536 + 1024) == 3  # unpadded the H200 fits three


def test_padding_uses_the_measured_host_static():
    """A host static size moves the padding down by exactly that much (1 KB granules)."""
    with_static = hw.emulation_padded_smem(65536, 128, H200.with_static(1024))
    assert 233472 // (with_static + 1024 + 1024) == 1
    assert hw.emulation_padded_smem(65536, 128, H200) - with_static == 1024


@pytest.mark.parametrize("static", [0, 1024, 3000])
@pytest.mark.parametrize("smem", [4096, 16384, 33792, 49152, 65536, 81920, 99328])
@pytest.mark.parametrize("threads", [128, 256, 384])
def test_padding_matches_sm120_count(smem, threads, static):
    host = H200.with_static(static)
    target = hw.sm120_occupancy(smem + hw.DSL_STATIC_SMEM, threads).ctas_per_sm
    padded = hw.emulation_padded_smem(smem, threads, host)
    assert padded >= smem
    per_cta = static + host.reserved_per_cta
    host_by_smem = 233472 // (padded + per_cta)
    assert host_by_smem == target or (padded == smem and host_by_smem < target)
    # minimal in 1 KB granules: 1 KB less would fit one more CTA (unless unpadded)
    if padded > smem:
        assert padded % 1024 == 0
        assert 233472 // (padded - 1024 + per_cta) > target


def test_padding_refuses_oversize_and_bare_tuples():
    with pytest.raises(ValueError, match="does not fit"):
        hw.emulation_padded_smem(101376, 128, H200)
    with pytest.raises(ValueError, match="allows"):
        hw.emulation_padded_smem(1024, 128, hw.EmulationHost(1 << 20, 4096, 1024))
    with pytest.raises(TypeError, match="EmulationHost"):
        hw.emulation_padded_smem(65536, 128, (233472, 232448))
