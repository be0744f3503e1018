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
from flash_attn_sm120.kernels.fwd_tma_proposals import DYNAMIC_CONFIGS, PERSISTENT_CONFIGS, Q_RING_CONFIGS

import cutlass

LISTED = [(d, FwdConfig(*c, family="tma", persistent=True), masks, ok) for d, c, masks, ok in PERSISTENT_CONFIGS] + [
    (d, FwdConfig(*c, family="tma", persistent=True, q_stages=2), masks, ok) for d, c, masks, ok in Q_RING_CONFIGS
] + [
    (d, FwdConfig(*c, family="tma", persistent=True, q_stages=qs, dynamic=True), masks, ok)
    for d, c, masks, ok, qs in DYNAMIC_CONFIGS
]
CASES = [(d, cfg, mask, None) for d, cfg, masks, _ in LISTED for mask in masks] + [
    (d, cfg, "none", (1, 128 // cfg.tile_n, True)) for d, cfg, _, sparse_ok in LISTED if sparse_ok
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


def test_q_ring_flag_name_smem_and_refusals():
    """Two Q slots: one more Q tile of shared memory and two more mbarriers; persistent TMA configs only."""
    from flash_attn_sm120.config import config_from_name
    from flash_attn_sm120.kernels.fwd_tma import num_mbarriers, smem_bytes

    cfg = FwdConfig(256, 128, 64, 1, False, "tma", persistent=True, q_stages=2)
    assert cfg.name == "tma-w8-128x64-s1-pers-q2" and config_from_name(cfg.name) == cfg
    assert FwdConfig.from_row(dict(num_threads=256, tile_m=128, tile_n=64, family="tma", persistent=True,
                                   q_stages=2)) == cfg
    assert num_mbarriers(1, 2) == num_mbarriers(1) + 2
    one = FwdConfig(256, 128, 64, 1, False, "tma", persistent=True)
    assert cfg.smem_bytes(128, 128) - one.smem_bytes(128, 128) == 128 * 128 * 2  # one more 32 KB Q tile
    assert cfg.smem_bytes(128, 128) == smem_bytes(128, 128, 128, 64, 1, q_stages=2) == 99328
    assert cfg.error(128, 128) is None
    assert "needs persistent=True" in FwdConfig(256, 128, 64, 1, False, "tma", q_stages=2).error(128, 128)
    assert "TMA-family option" in FwdConfig(128, 128, 64, 1, q_stages=2).error(64, 64)
    assert "1 or 2 slots" in FwdConfig(256, 128, 64, 1, False, "tma", persistent=True, q_stages=3).error(64, 64)
    too_big = FwdConfig(256, 128, 64, 2, False, "tma", persistent=True, q_stages=2).error(128, 128)
    assert "with 2 Q slots" in too_big and "101376" in too_big
    with pytest.raises(ValueError, match="needs persistent=True"):
        FlashAttentionForwardSm120Tma(cutlass.BFloat16, 128, tile_m=128, tile_n=64, num_stages=1, num_threads=256,
                                      q_stages=2)


def test_q_ring_keeps_two_ctas_per_sm_where_listed():
    """The d64 4-warp 128x48 entry is listed for staying at two CTAs per SM with its second Q slot."""
    from flash_attn_sm120.kernels.fwd_tma import register_split
    from flash_attn_sm120 import hardware

    cfg = FwdConfig(128, 128, 48, 1, False, "tma", persistent=True, q_stages=2)
    assert register_split(cfg.smem_bytes(64, 64) + hardware.DSL_STATIC_SMEM, 128).ctas_per_sm == 2
    wider = FwdConfig(128, 128, 64, 1, False, "tma", persistent=True, q_stages=2)
    assert register_split(wider.smem_bytes(64, 64) + hardware.DSL_STATIC_SMEM, 128).ctas_per_sm == 1


def test_dynamic_flag_name_and_refusals():
    from flash_attn_sm120.config import config_from_name

    cfg = FwdConfig(256, 128, 64, 1, False, "tma", persistent=True, q_stages=2, dynamic=True)
    assert cfg.name == "tma-w8-128x64-s1-pers-q2-dyn" and config_from_name(cfg.name) == cfg
    assert FwdConfig.from_row(dict(num_threads=256, tile_m=128, tile_n=64, family="tma", persistent=True,
                                   q_stages=2, dynamic=True)) == cfg
    assert cfg.error(128, 128) is None
    assert cfg.smem_bytes(128, 128) == FwdConfig(256, 128, 64, 1, False, "tma", persistent=True,
                                                  q_stages=2).smem_bytes(128, 128)
    assert "needs persistent=True" in FwdConfig(256, 128, 64, 1, False, "tma", dynamic=True).error(128, 128)
    assert "TMA-family option" in FwdConfig(128, 128, 64, 1, dynamic=True).error(64, 64)
    with pytest.raises(ValueError, match="dynamic needs persistent"):
        FlashAttentionForwardSm120Tma(cutlass.BFloat16, 128, tile_m=128, tile_n=64, num_stages=1, num_threads=256,
                                      dynamic=True)


def test_dynamic_counter_is_fresh_and_zero_per_call():
    """The host's counter: a new zeroed int32 for each call of a dynamic config, none otherwise."""
    import torch

    q = torch.empty(1, 128, 4, 64, dtype=torch.bfloat16)
    common = dict(causal=True, local=False, pack_gqa=False, has_lse=True, cu_seqlens_q=None, cu_seqlens_k=None,
                  seqused_q=None, seqused_k=None, window_size_left=None, window_size_right=None, score_mod=None,
                  mask_mod=None, aux_tensors=None, emulate_host_smem=None)
    dyn = driver.build_statics(q, q, q, config=FwdConfig(256, 256, 64, 2, False, "tma", persistent=True,
                                                         dynamic=True), **common)
    a, b = driver.tile_counter(dyn, q.device), driver.tile_counter(dyn, q.device)
    assert a.dtype == torch.int32 and a.shape == (1,) and int(a) == 0 and a.data_ptr() != b.data_ptr()
    plain = driver.build_statics(q, q, q, config=FwdConfig(256, 256, 64, 2, False, "tma", persistent=True), **common)
    assert driver.tile_counter(plain, q.device) is None
    # varlen q runs one CTA per tile (the kernel drops persistence): no counter, and the kernel pops none
    from dataclasses import replace

    assert driver.tile_counter(replace(dyn, has_cu_seqlens_q=True), q.device) is None
    assert driver.tile_counter(replace(dyn, has_seqused_q=True), q.device) is None


def test_given_config_over_shared_memory_with_two_q_slots_names_it():
    """A forced config that only its second Q slot pushes past 99 KB is refused as not implementable (the
    config's own rule), not as a call the family cannot serve."""
    import torch

    q = torch.empty(1, 128, 4, 128, dtype=torch.bfloat16)
    common = dict(causal=False, local=False, pack_gqa=False, has_lse=True, cu_seqlens_q=None, cu_seqlens_k=None,
                  seqused_q=None, seqused_k=None, window_size_left=None, window_size_right=None, score_mod=None,
                  mask_mod=None, aux_tensors=None, emulate_host_smem=None)
    cfg = FwdConfig(256, 128, 64, 2, False, "tma", persistent=True, q_stages=2)
    statics = driver.build_statics(q, q, q, config=cfg, **common)
    with pytest.raises(ValueError, match="not implementable: needs .* with 2 Q slots"):
        driver._route(statics, pack_gqa_chosen=False, config_given=True, causal=False, local=False)


def test_dynamic_kernel_takes_its_tiles_with_one_atomic():
    """One atomicAdd (lane 0 of the producer warp) per fetched tile; the fixed stride has none."""
    cfg = FwdConfig(256, 256, 64, 2, False, "tma", persistent=True, dynamic=True)
    _, hist, _ = inspect_cubin(compile_fwd_cubin(cfg, 64, causal=True)[0])
    _, static_hist, _ = inspect_cubin(compile_fwd_cubin(FwdConfig(256, 256, 64, 2, False, "tma", persistent=True),
                                                        64, causal=True)[0])
    assert hist.get("ATOMG") == 1 and not static_hist.get("ATOMG")


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
    assert cfg.error(d, d) is None, cfg.error(d, d)
    _, plain_hist, plain_sass = inspect_cubin(compile_fwd_cubin(plain, d, **kw)[0])
    assert hist.get("HMMA") == plain_hist.get("HMMA") and sass.count("MUFU.EX2") == plain_sass.count("MUFU.EX2") > 0


def test_configs_left_out_do_spill():
    """The d128 32-row-warp causal tile (the table's entry) spills with the tile loop: why it is not listed."""
    cfg = FwdConfig(256, 256, 64, 1, False, "tma", persistent=True)
    res, _, _ = inspect_cubin(compile_fwd_cubin(cfg, 128, causal=True)[0])
    assert res["stack"] > 0


def test_q_ring_entries_left_out_of_block_sparse_do_spill():
    """The 8-warp d128 two-slot entry's block-sparse walk spills (64 B): why block_sparse_ok is False there."""
    cfg = FwdConfig(256, 128, 64, 1, False, "tma", persistent=True, q_stages=2)
    res, _, _ = inspect_cubin(compile_fwd_cubin(cfg, 128, block_sparse=(1, 2, True))[0])
    assert res["stack"] > 0


@pytest.mark.parametrize("name", ["tma-w8-256x64-s3-qreg-pers", "cpasync-w4-128x80-s1", "tma-w8-128x64-s2-pp-nolpt",
                                  "tma-w4-128x48-s1-pers-q2", "tma-w8-128x64-s1-pers-q2-dyn"])
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
