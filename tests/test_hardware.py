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


H200 = dict(host_smem_per_sm=233472, host_smem_per_block_max=232448)


def test_padding_h200_64kb_to_one_cta():
    padded = hw.emulation_padded_smem(65536, 128, static_smem=1024, **H200)
    # issue's example: a 64 KB CTA must be padded to just over 114 KB so only one fits
    assert 114 * 1024 - 2048 < padded + 1024 <= 114 * 1024 + 1024
    assert 233472 // (padded + 2048) == 1
    assert 233472 // (65536 + 2048) == 3  # unpadded the H200 fits three


@pytest.mark.parametrize("smem", [4096, 16384, 33792, 49152, 65536, 81920, 99328])
@pytest.mark.parametrize("threads", [128, 256])
def test_padding_matches_sm120_count(smem, threads):
    target = hw.sm120_occupancy(smem + 1024, threads).ctas_per_sm
    padded = hw.emulation_padded_smem(smem, threads, static_smem=1024, **H200)
    assert padded >= smem
    host_by_smem = 233472 // (padded + 2048)
    assert host_by_smem == target or (padded == smem and host_by_smem < target)
    # minimal in 1 KB granules: 1 KB less would fit one more CTA (unless unpadded)
    if padded > smem:
        assert padded % 1024 == 0
        assert 233472 // (padded - 1024 + 2048) > target


def test_padding_refuses_oversize():
    with pytest.raises(ValueError, match="does not fit"):
        hw.emulation_padded_smem(101376, 128, static_smem=1024, **H200)
