"""TMA forward family, on the CPU: config rules, register split, refusals, and sm_120a / sm_90a codegen.

Every proposed config compiles for sm_120a with TMA loads (UTMALDG) and mma.sync (HMMA), nothing
Hopper/datacenter-Blackwell only (HGMMA, UTC*), no spills, within 99 KB of shared memory, and its
shared memory equals the family's smem_bytes formula. It also builds for sm_90a (the H200
emulation target).
"""

import re
import tempfile
from pathlib import Path

import pytest

import cutlass
from flash_attn_sm120 import driver, hardware
from flash_attn_sm120.codegen import compile_fwd_cubin, inspect_cubin
from flash_attn_sm120.config import FwdConfig
from flash_attn_sm120.kernels import FAMILIES
from flash_attn_sm120.kernels import fwd_tma
from flash_attn_sm120.kernels.fwd_tma import (
    PROPOSED_CONFIGS,
    FlashAttentionForwardSm120Tma,
    register_split,
    smem_bytes,
    tma_config_error,
    unsupported_reason,
)

# every proposed (config, mask) in bf16; in fp16 the config's last (most register-hungry) mask
PROPOSED = [
    (d, FwdConfig(*c, family="tma"), mask, "bfloat16")
    for d, entries in PROPOSED_CONFIGS.items() for c, masks in entries for mask in masks
] + [(d, FwdConfig(*c, family="tma"), masks[-1], "float16") for d, entries in PROPOSED_CONFIGS.items() for c, masks in entries]
H200_SMEM = hardware.EmulationHost(233472, 232448, 1024, 0)  # an H200 as its driver reports it


def _statics(cfg, d=128, **over):
    base = dict(
        dtype="bfloat16", head_dim=d, head_dim_v=d, qhead_per_kvhead=1, causal=False, local=False,
        pack_gqa=False, has_lse=True, has_cu_seqlens_q=False, has_cu_seqlens_k=False, has_seqused_q=False,
        has_seqused_k=False, has_window_left=False, has_window_right=False, score_mod_hash=False,
        mask_mod_hash=False, aux_metadata=None, broadcast=(), config=cfg, emulate_host_smem=None,
    )
    base.update(over)
    return driver.FwdStatics(**base)


def _forbidden(sass: dict) -> list:
    return [op for op in sass if op.startswith("HGMMA") or op.startswith("UTC") or op == "WARPGROUP"]


def _compile_with(kernel, d, arch="sm_120a", cu_seqlens=False):
    """Compile a kernel object with fake (b, s, h, d) tensors; for what compile_fwd_cubin does not cover."""
    import cutlass.cute as cute
    from flash_attn.cute.utils import AuxData
    from quack.compile_utils import make_fake_tensor

    dt = cutlass.BFloat16
    b, sq, sk, h = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
    q = make_fake_tensor(dt, (b, sq, h, d), divisibility=8)
    k = make_fake_tensor(dt, (b, sk, h, d), divisibility=8)
    v = make_fake_tensor(dt, (b, sk, h, d), divisibility=8)
    o = make_fake_tensor(dt, (b, sq, h, d), divisibility=8)
    lse = make_fake_tensor(cutlass.Float32, (b, h, sq), divisibility=1)
    cu = make_fake_tensor(cutlass.Int32, (cute.sym_int(),), divisibility=1) if cu_seqlens else None
    with tempfile.TemporaryDirectory() as tmp:
        compiled = driver.compile_kernel(
            kernel, q, k, v, o, lse, cu, cu, None, None, None, None, AuxData(None, None),
            options=f"--keep-cubin --dump-dir={tmp} --gpu-arch={arch}",
        )
        cubin = compiled.artifacts.CUBIN
        return Path(cubin).read_bytes() if isinstance(cubin, str) else cubin


# ------------------------------------------------------------------------------------------------
# pure rules
# ------------------------------------------------------------------------------------------------


def test_family_registered():
    fam = FAMILIES["tma"]
    assert fam.kernel_cls is FlashAttentionForwardSm120Tma
    assert fam.config_error is tma_config_error and fam.smem_bytes is smem_bytes
    assert FwdConfig(256, 128, 64, 2, family="tma").error(128, 128) is None
    assert FwdConfig(256, 128, 64, 2, family="tma").smem_bytes(128, 128) == 99328


@pytest.mark.parametrize(
    "args,needle",
    [
        ((128, 128, 128, 64, 2, 192), "num_threads"),
        ((80, 80, 128, 64, 2, 256), "head_dim=80"),
        ((128, 64, 128, 64, 2, 256), "must be equal"),
        ((128, 128, 64, 64, 2, 256), "multiple of 128"),
        ((128, 128, 128, 40, 2, 256), "tile_n"),
        ((128, 128, 128, 64, 0, 256), "1 to 4 stages"),
        ((128, 128, 128, 64, 5, 256), "1 to 4 stages"),
        ((128, 128, 128, 128, 2, 256), "shared memory"),
        ((64, 64, 512, 64, 2, 256), "at most 256"),
    ],
)
def test_config_errors_name_the_problem(args, needle):
    d, dv, tm, tn, st, nt = args
    err = tma_config_error(d, dv, tm, tn, st, nt)
    assert err is not None and needle in err, err


def test_smem_bytes_counts_buffers_and_mbarriers():
    # 32 KB Q + 2 x (16 KB K + 16 KB V) + 80 B of mbarriers, rounded up to 1 KB
    assert smem_bytes(128, 128, 128, 64, 2) == 98304 + 1024
    assert smem_bytes(96, 96, 128, 64, 3) == 24576 + 3 * 24576 + 1024
    for d, entries in PROPOSED_CONFIGS.items():
        for (nt, tm, tn, st, _), _ in entries:
            assert smem_bytes(d, d, tm, tn, st) + hardware.DSL_STATIC_SMEM <= hardware.SMEM_PER_BLOCK_MAX


def test_register_split():
    eight = register_split(99328 + 1024, 256)  # 8 MMA warps + producer warpgroup, 1 CTA/SM
    assert (eight.ctas_per_sm, eight.launch_regs, eight.producer_regs, eight.mma_regs) == (1, 168, 24, 240)
    # rebalanced total stays within what the CTA was launched with (else setmaxnreg.inc deadlocks)
    assert 128 * eight.producer_regs + 256 * eight.mma_regs <= eight.launch_regs * 384
    four = register_split(66560 + 1024, 128)  # 256 threads: every thread may already use 255
    assert four.mma_regs is None and four.launch_regs == 255
    two_ctas = register_split(40960 + 1024, 128)  # 2 CTAs/SM halve the budget; rebalance pays
    assert two_ctas.ctas_per_sm == 2 and two_ctas.mma_regs > two_ctas.launch_regs


def test_unsupported_reason_routes_seqused_k_and_unpackable_gqa():
    cfg = FwdConfig(256, 128, 64, 2, family="tma")
    assert unsupported_reason(_statics(cfg)) is None
    assert FlashAttentionForwardSm120Tma.supports(_statics(cfg, qhead_per_kvhead=4, pack_gqa=False))
    for ratio in (2, 4, 8, 16, 32, 64, 128):  # whole head groups fit a 128-row tile
        assert unsupported_reason(_statics(cfg, qhead_per_kvhead=ratio, pack_gqa=True)) is None, ratio
    for ratio in (3, 5, 6, 12):
        reason = unsupported_reason(_statics(cfg, qhead_per_kvhead=ratio, pack_gqa=True))
        assert reason is not None and "pack_gqa" in reason and "tile_m=128" in reason and str(ratio) in reason
        assert unsupported_reason(_statics(cfg, qhead_per_kvhead=ratio, pack_gqa=False)) is None
    assert fwd_tma.pack_gqa_error(256, 3) is not None and fwd_tma.pack_gqa_error(192, 3) is None
    # varlen: packed K/V through ragged descriptors; seqused_k alone, and packed GQA with varlen q, go to cp.async
    assert unsupported_reason(_statics(cfg, has_cu_seqlens_q=True, has_cu_seqlens_k=True)) is None
    assert unsupported_reason(_statics(cfg, has_seqused_q=True, has_cu_seqlens_k=True, has_seqused_k=True)) is None
    assert "seqused_k without cu_seqlens_k" in unsupported_reason(_statics(cfg, has_seqused_k=True))
    assert unsupported_reason(_statics(cfg, qhead_per_kvhead=4, pack_gqa=True, has_cu_seqlens_q=True)) is None
    assert unsupported_reason(_statics(cfg, qhead_per_kvhead=4, pack_gqa=True, has_cu_seqlens_k=True)) is None
    assert "head_dim" in unsupported_reason(_statics(FwdConfig(256, 128, 64, 2, family="tma"), d=256))


def test_fp16_rule_routes_wide_32_row_tiles_at_d128():
    wide = FwdConfig(256, 256, 64, 1, family="tma")
    assert unsupported_reason(_statics(wide)) is None  # bf16
    reason = unsupported_reason(_statics(wide, dtype="float16"))
    assert reason is not None and "float16" in reason and "tile_n=64" in reason
    for ok in (FwdConfig(256, 256, 48, 1, family="tma"), FwdConfig(256, 256, 32, 2, family="tma"),
               FwdConfig(256, 128, 64, 2, True, family="tma")):
        assert unsupported_reason(_statics(ok, dtype="float16")) is None, ok
    assert unsupported_reason(_statics(FwdConfig(256, 256, 64, 2, family="tma"), d=96, dtype="float16")) is None


def test_table_paths_of_fp16_refusing_tma_entries_draw_bf16_only():
    """A forced TMA config raises for float16 where the family refuses it, so the fuzz / sanitizer path
    of such a table entry draws bfloat16 only (float16 calls run the entry after it)."""
    from flash_attn_sm120.paths import kernel_paths

    tma_paths = [p for p in kernel_paths() if p.family == "tma" and isinstance(p.config, FwdConfig)]
    assert tma_paths
    for p in tma_paths:
        refused = any(fwd_tma.fp16_register_error(d, p.config.tile_m, p.config.tile_n, p.config.num_threads)
                      for d in p.head_dims())
        assert ("float16" not in p.supports.dtypes) == refused, (p.name, p.supports.dtypes)


def test_constructor_packs_gqa_only_in_whole_head_groups():
    with pytest.raises(NotImplementedError, match="multiple of 3"):
        FlashAttentionForwardSm120Tma(cutlass.BFloat16, 128, 128, 3, pack_gqa=True)
    packed = FlashAttentionForwardSm120Tma(cutlass.BFloat16, 128, 128, 4, pack_gqa=True)
    assert packed.pack_gqa and packed.qhead_per_kvhead_packgqa == 4
    mha = FlashAttentionForwardSm120Tma(cutlass.BFloat16, 128, 128, 1, pack_gqa=True)  # nothing to pack
    assert not mha.pack_gqa and mha.qhead_per_kvhead_packgqa == 1


def test_constructor_refusals():
    with pytest.raises(ValueError, match="head_dim=80"):
        FlashAttentionForwardSm120Tma(cutlass.BFloat16, 80, 80)
    with pytest.raises(TypeError):
        FlashAttentionForwardSm120Tma(cutlass.Float32, 128, 128)
    k = FlashAttentionForwardSm120Tma(cutlass.Float16, 128, 128, 4, pack_gqa=False)
    assert k.num_threads_total == 256 + 128 and k.producer_warp_idx == 8


def test_intra_warp_overlap_is_a_constructor_flag():
    """None follows the tile's rule (16-row warps overlap), False or True overrides it per kernel."""
    r1 = dict(tile_m=128, tile_n=64, num_threads=256)  # 16-row warps
    r2 = dict(tile_m=256, tile_n=32, num_threads=256)  # 32-row warps
    assert FlashAttentionForwardSm120Tma(cutlass.BFloat16, 128, **r1).intra_warp_overlap
    assert not FlashAttentionForwardSm120Tma(cutlass.BFloat16, 128, **r2).intra_warp_overlap
    assert not FlashAttentionForwardSm120Tma(cutlass.BFloat16, 128, intra_warp_overlap=False, **r1).intra_warp_overlap
    assert FlashAttentionForwardSm120Tma(cutlass.BFloat16, 128, intra_warp_overlap=True, **r2).intra_warp_overlap


def test_module_split_keeps_the_public_names_and_pure_rules():
    """fwd_tma re-exports what its users import; the rules module imports no CuTe DSL."""
    import ast
    import inspect

    from flash_attn_sm120.kernels import fwd_tma_rules

    for name in fwd_tma.__all__:
        assert hasattr(fwd_tma, name), name
    for name in ("tma_config_error", "smem_bytes", "unsupported_reason", "register_split", "fp16_register_error",
                 "pack_gqa_error", "pingpong_error", "PROPOSED_CONFIGS", "ALL_MASKS", "SUPPORTED_HEAD_DIMS"):
        assert name in fwd_tma.__all__, name
    imported = set()
    for node in ast.parse(inspect.getsource(fwd_tma_rules)).body:
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module)
    assert imported <= {"dataclasses", "typing", "flash_attn_sm120"}, imported


def test_driver_builds_tma_kernel():
    k = driver.make_kernel(_statics(FwdConfig(256, 128, 64, 2, True, family="tma"), qhead_per_kvhead=2))
    assert isinstance(k, FlashAttentionForwardSm120Tma) and k.Q_in_regs and k.qhead_per_kvhead == 2


# ------------------------------------------------------------------------------------------------
# codegen (each compile takes a few seconds)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d,cfg,mask,dtype", PROPOSED, ids=[f"d{d}-{c.name}-{m}-{t}" for d, c, m, t in PROPOSED])
def test_proposed_config_codegen_sm120a(d, cfg, mask, dtype):
    kernels = []
    cubin, smem = compile_fwd_cubin(
        cfg, d, causal=mask == "causal", local=mask == "local", dtype=dtype, kernel_out=kernels
    )
    res, hist, sass = inspect_cubin(cubin)
    if dtype == "float16" and fwd_tma.fp16_register_error(d, cfg.tile_m, cfg.tile_n, cfg.num_threads):
        # the family refuses fp16 here (the driver runs the cp.async entry): the rule must be needed
        assert res["stack"] > 0, f"fp16_register_error refuses {cfg.name} at d={d}, but fp16 fits: narrow the rule"
        return
    assert hist.get("UTMALDG", 0) > 0, "no TMA loads"
    assert hist.get("UTMASTG", 0) > 0, "no TMA store of O"
    assert hist.get("HMMA", 0) > 0 and hist.get("LDSM", 0) > 0
    assert not _forbidden(hist), _forbidden(hist)
    assert res["stack"] == 0 and res["local"] == 0, res
    assert hist.get("LDL", 0) == 0 and hist.get("STL", 0) == 0
    assert smem == kernels[0].smem_bytes_unpadded == cfg.smem_bytes(d, d)
    assert smem + res["shared"] <= hardware.SMEM_PER_BLOCK_MAX
    split = kernels[0].registers
    assert res["regs"] == split.launch_regs or (split.mma_regs is None and res["regs"] <= split.launch_regs)
    if split.mma_regs is not None:
        assert "USETMAXREG" in sass
        # the MMA warps stay within their rebalanced budget (highest register index + 1)
        assert max(int(r) for r in re.findall(r"\bR(\d+)\b", sass)) < split.mma_regs


# packed GQA on the shipped tiles: 8 MMA warps at R=1 (128 rows) and R=2 (256 rows), every mask
PACKED = [
    (128, FwdConfig(256, 128, 64, 2, True, family="tma"), "causal", 4),
    (128, FwdConfig(256, 256, 32, 2, family="tma"), "none", 8),
    (96, FwdConfig(256, 256, 64, 2, family="tma"), "causal", 2),
    (64, FwdConfig(256, 256, 64, 3, True, family="tma"), "local", 4),
]


@pytest.mark.parametrize("d,cfg,mask,ratio", PACKED, ids=[f"d{d}-{c.name}-{m}-g{r}" for d, c, m, r in PACKED])
def test_packed_gqa_codegen_sm120a(d, cfg, mask, ratio):
    """GQA packing keeps the TMA loads and store (UTMALDG/UTMASTG), adds no spills and no shared memory."""
    kernels = []
    cubin, smem = compile_fwd_cubin(cfg, d, causal=mask == "causal", local=mask == "local",
                                    qhead_per_kvhead=ratio, pack_gqa=True, kernel_out=kernels)
    assert kernels[0].pack_gqa and kernels[0].qhead_per_kvhead_packgqa == ratio
    res, hist, _ = inspect_cubin(cubin)
    assert hist.get("UTMALDG", 0) > 0 and hist.get("UTMASTG", 0) > 0 and hist.get("HMMA", 0) > 0
    assert res["stack"] == 0 and res["local"] == 0 and hist.get("LDL", 0) == 0 and hist.get("STL", 0) == 0
    assert smem == cfg.smem_bytes(d, d)


def test_fp16_softcap_builds_sm120a():
    from flash_attn.cute import utils as fa_utils

    cubin, _ = compile_fwd_cubin(FwdConfig(256, 128, 64, 2, True, family="tma"), 128, dtype="float16", causal=True)
    res, hist, _ = inspect_cubin(cubin)
    assert res["stack"] == 0 and hist.get("UTMALDG", 0) > 0
    kernel = driver.make_kernel(
        _statics(FwdConfig(256, 128, 64, 2, True, family="tma")), score_mod=fa_utils.create_softcap_scoremod(30.0)
    )
    res, hist, _ = inspect_cubin(_compile_with(kernel, 128))
    assert res["stack"] == 0 and hist.get("UTMALDG", 0) > 0 and hist.get("HMMA", 0) > 0


@pytest.mark.parametrize("d,cfg,mask", [(128, FwdConfig(256, 128, 64, 2, True, family="tma"), "causal"),
                                        (64, FwdConfig(256, 128, 128, 2, True, family="tma"), "none")])
def test_builds_for_sm90a(d, cfg, mask):
    cubin, smem = compile_fwd_cubin(cfg, d, causal=mask == "causal", arch="sm_90a")
    res, hist, sass = inspect_cubin(cubin)
    assert "sm_90a" in sass
    assert hist.get("UTMALDG", 0) > 0 and hist.get("HMMA", 0) > 0 and hist.get("HGMMA", 0) == 0
    assert res["stack"] == 0


@pytest.mark.parametrize("cfg,d,ctas", [(FwdConfig(256, 128, 128, 2, True, family="tma"), 64, 1),
                                        (FwdConfig(128, 64, 64, 2, True, family="tma"), 64, 2)])
def test_emulation_padding_reaches_the_kernel(cfg, d, ctas):
    """An H200 (228 KB/SM) keeps exactly as many CTAs per SM as SM120 would."""
    kernels = []
    _, smem = compile_fwd_cubin(cfg, d, emulate_host_smem=H200_SMEM, kernel_out=kernels, arch="sm_90a")
    k = kernels[0]
    threads = k.num_threads_total
    sm120 = hardware.sm120_occupancy(k.smem_bytes_unpadded + hardware.DSL_STATIC_SMEM, threads).ctas_per_sm
    per_cta = smem + H200_SMEM.static_smem + H200_SMEM.reserved_per_cta
    assert smem == k.smem_bytes_launched > k.smem_bytes_unpadded
    assert k.launch_threads == threads
    assert H200_SMEM.smem_per_sm // per_cta == sm120 == ctas == k.registers.ctas_per_sm


def test_module_documents_the_pipeline_and_the_sm120_risk():
    doc = fwd_tma.__doc__
    for needle in ("producer", "mbarrier", "PipelineTmaAsync", "3189", "cp.async", "num_stages"):
        assert needle in doc, needle
