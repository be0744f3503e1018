"""The TMA forward's persistent tile order on the CPU: the config flag, its refusals, and sm_120a codegen.

Every PERSISTENT_CONFIGS entry compiles for sm_120a spill-free with the same mma.sync count as the
one-tile-per-CTA kernel (the tile loop must not change the math), in each mask it lists and, where
marked, with block-sparse lists; a config it leaves out is shown to spill, so the list stays honest.
The kernel grid of a persistent launch is one wave (num_sms * ctas_per_sm CTAs) or the tile count.
"""

import pytest

from flash_attn_sm120 import driver
from flash_attn_sm120.codegen import compile_fwd_cubin, inspect_cubin
from flash_attn_sm120.config import FwdConfig
from flash_attn_sm120.kernels.fwd_tma import FlashAttentionForwardSm120Tma
from flash_attn_sm120.kernels.fwd_tma_proposals import PERSISTENT_CONFIGS

import cutlass

CASES = [
    (d, FwdConfig(*c, family="tma", persistent=True), mask, None)
    for d, c, masks, _ in PERSISTENT_CONFIGS for mask in masks
] + [
    (d, FwdConfig(*c, family="tma", persistent=True), "none", (1, 128 // c[2], True))
    for d, c, _, sparse_ok in PERSISTENT_CONFIGS if sparse_ok
]


def test_flag_name_and_row():
    cfg = FwdConfig(256, 256, 64, 2, False, "tma", persistent=True)
    assert cfg.name.endswith("-pers")
    assert FwdConfig.from_row(dict(num_threads=256, tile_m=256, tile_n=64, num_stages=2, family="tma",
                                   persistent=True)) == cfg
    assert cfg.error(64, 64) is None


def test_refusals_name_the_problem():
    assert "TMA-family option" in FwdConfig(128, 128, 64, 1, persistent=True).error(64, 64)
    err = FwdConfig(256, 128, 64, 2, False, "tma", pingpong=True, persistent=True).error(128, 128)
    assert "persistent and pingpong" in err
    with pytest.raises(ValueError, match="persistent and pingpong"):
        FlashAttentionForwardSm120Tma(cutlass.BFloat16, 128, tile_m=128, tile_n=64, num_stages=2, num_threads=256,
                                      pingpong=True, persistent=True)


def test_driver_keys_persistent_configs_by_sm_count():
    import torch

    q = torch.empty(1, 128, 4, 64, dtype=torch.bfloat16)
    common = dict(causal=False, local=False, pack_gqa=False, has_lse=True, cu_seqlens_q=None, cu_seqlens_k=None,
                  seqused_q=None, seqused_k=None, window_size_left=None, window_size_right=None, score_mod=None,
                  mask_mod=None, aux_tensors=None, emulate_host_smem=None)
    pers = driver.build_statics(q, q, q, config=FwdConfig(256, 256, 64, 2, False, "tma", persistent=True), **common)
    plain = driver.build_statics(q, q, q, config=FwdConfig(256, 256, 64, 2, False, "tma"), **common)
    assert pers.num_sms == 188 and plain.num_sms is None
    kernel = driver.make_kernel(pers)
    assert kernel.persistent and kernel.num_sms == 188


@pytest.mark.parametrize("d,cfg,mask,sparse", CASES,
                         ids=[f"d{d}-{c.name}-{m}{'-sparse' if s else ''}" for d, c, m, s in CASES])
def test_persistent_config_spill_free_same_math(d, cfg, mask, sparse):
    """Spill-free, and the same tensor-core and exp2 instructions as the one-CTA-per-tile kernel (exp2 counted
    in the SASS: the schedulers' integer divisions also use the SFU, for reciprocals)."""
    kw = dict(causal=mask == "causal", block_sparse=sparse)
    res, hist, sass = inspect_cubin(compile_fwd_cubin(cfg, d, **kw)[0])
    assert res["stack"] == 0 and res["local"] == 0, (cfg.name, d, mask, res)
    plain = FwdConfig(cfg.num_threads, cfg.tile_m, cfg.tile_n, cfg.num_stages, cfg.q_in_regs, "tma")
    _, plain_hist, plain_sass = inspect_cubin(compile_fwd_cubin(plain, d, **kw)[0])
    assert hist.get("HMMA") == plain_hist.get("HMMA") and sass.count("MUFU.EX2") == plain_sass.count("MUFU.EX2") > 0


def test_configs_left_out_do_spill():
    """The d128 32-row-warp causal tile (the table's entry) spills with the tile loop: why it is not listed."""
    cfg = FwdConfig(256, 256, 64, 1, False, "tma", persistent=True)
    res, _, _ = inspect_cubin(compile_fwd_cubin(cfg, 128, causal=True)[0])
    assert res["stack"] > 0


@pytest.mark.parametrize("name", ["tma-w8-256x64-s3-qreg-pers", "cpasync-w4-128x80-s1", "tma-w8-128x64-s2-pp-nolpt"])
def test_config_from_name_round_trips(name):
    from flash_attn_sm120.config import config_from_name

    assert config_from_name(name).name == name


def test_config_from_name_refuses_bad_names():
    from flash_attn_sm120.config import config_from_name

    with pytest.raises(ValueError, match="unknown flag 'fast'"):
        config_from_name("tma-w8-256x64-s2-fast")
    with pytest.raises(ValueError, match="is not FAMILY"):
        config_from_name("tma-256x64")
    with pytest.raises(ValueError, match="canonical form; write 'tma-w8-256x64-s2-qreg-pers'"):
        config_from_name("tma-w8-256x64-s2-pers-qreg")


def test_persistent_sms_env_sets_the_wave(monkeypatch):
    import torch

    q = torch.empty(1, 128, 4, 64, dtype=torch.bfloat16)
    common = dict(causal=False, local=False, pack_gqa=False, has_lse=True, cu_seqlens_q=None, cu_seqlens_k=None,
                  seqused_q=None, seqused_k=None, window_size_left=None, window_size_right=None, score_mod=None,
                  mask_mod=None, aux_tensors=None, emulate_host_smem=None)
    cfg = FwdConfig(256, 256, 64, 2, False, "tma", persistent=True)
    monkeypatch.setenv(driver.PERSISTENT_SMS_ENV, "3")
    assert driver.build_statics(q, q, q, config=cfg, **common).num_sms == 3
    monkeypatch.setenv(driver.PERSISTENT_SMS_ENV, "zero")
    with pytest.raises(ValueError, match="positive SM count"):
        driver.build_statics(q, q, q, config=cfg, **common)
