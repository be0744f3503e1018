"""The SM120 backward family (kernels/bwd_sm120.py) on a CPU: feasibility rules, the exact shared-memory
footprint, sm_120a codegen of upstream's own SM120 backward config, and emulation padding.

No GPU: kernels are traced with upstream's fake backward tensors and compiled for sm_120a
(codegen.compile_bwd_cubin). The backward is not dispatched to yet; these tests hold the slice in place.
"""

import re

import pytest

from flash_attn_sm120 import codegen, hardware
from flash_attn_sm120.kernels.bwd_tiling import BwdConfig, bwd_config_error, smem_bytes, upstream_bwd_config

pytestmark = pytest.mark.skipif(codegen.find_tool("cuobjdump") is None, reason="needs cuobjdump")


def test_upstream_sm120_default_is_what_its_interface_runs():
    assert upstream_bwd_config(64) == BwdConfig(128, 64, 64, 2, 2)
    assert upstream_bwd_config(128) == BwdConfig(128, 64, 64, 1, 1)
    assert upstream_bwd_config(96).name == "bwd-w4-64x64-q1do1-a444"


@pytest.mark.parametrize("cfg,d,match", [
    (BwdConfig(num_threads=192), 128, "num_threads"),
    (BwdConfig(stages_q=3), 64, "stages"),
    (BwdConfig(atom_m_sdp=3), 64, "do not divide"),
    (BwdConfig(256, 64, 64, atom_m_sdp=8), 128, r"S/dP: a 64x64 tile is not a multiple of 128x16"),
    (BwdConfig(256, 64, 64, atom_n_dkv=8), 128, r"dK: a 64x128 tile is not a multiple of 128x16"),
    (BwdConfig(128, 128, 128, 2, 2), 128, "shared memory"),
    (BwdConfig(), 260, "head dims"),
])
def test_refusals_name_the_reason(cfg, d, match):
    err = bwd_config_error(d, d, cfg)
    assert err is not None and re.search(match, err), err


def test_smem_counts_what_upstreams_can_implement_leaves_out():
    """Upstream's SM120 can_implement counts Q, dO, K and V; the struct also holds sP, sdS, sLSE, sdPsum."""
    cfg = upstream_bwd_config(128)
    qdokv = 64 * 128 * 2 * 4
    assert smem_bytes(128, 128, cfg) == 82944 > qdokv == 65536
    # a config upstream's check accepts that does not fit 99 KB once sP / sdS are counted
    big = BwdConfig(128, 64, 128, 1, 1, atom_m_sdp=4, atom_n_dkv=4, atom_m_dq=4)
    assert 128 * 128 * 2 * 2 + 64 * 128 * 2 * 2 <= 101376 < smem_bytes(128, 128, big) + hardware.DSL_STATIC_SMEM
    assert "shared memory" in bwd_config_error(128, 128, big)


@pytest.mark.slow
@pytest.mark.parametrize("d,cfg", [(64, upstream_bwd_config(64)), (128, upstream_bwd_config(128)),
                                   (96, BwdConfig(256, 64, 64, 1, 1)),
                                   (64, BwdConfig(256, 64, 128, 2, 2, True, False, False, 1, 8, 4))])  # sP cut
def test_smem_formula_is_the_traced_struct_size(d, cfg):
    kernels = []
    _, smem = codegen.compile_bwd_cubin(cfg, d, kernel_out=kernels)
    assert smem == kernels[0].smem_bytes_unpadded == smem_bytes(d, d, cfg)
    assert kernels[0].launch_threads == cfg.num_threads


@pytest.mark.slow
def test_upstream_sm120_backward_spills_at_d128_on_sm120a():
    """The reason the backward family exists: upstream's SM120 backward at d=128 (4 warps, 64x64) runs out
    of registers on sm_120a. At d=64 it fits."""
    res128, hist128, _ = codegen.inspect_cubin(codegen.compile_bwd_cubin(upstream_bwd_config(128), 128)[0])
    assert res128["regs"] == 255 and res128["stack"] > 0 and hist128.get("LDL", 0) > 0
    res64, hist64, _ = codegen.inspect_cubin(codegen.compile_bwd_cubin(upstream_bwd_config(64), 64)[0])
    assert res64["stack"] == 0 and hist64.get("LDL", 0) == 0 and hist64.get("HMMA", 0) > 0


@pytest.mark.slow
def test_emulation_padding_reaches_the_backward_kernel():
    """An H200 as its driver reports it keeps as many CTAs of the backward per SM as SM120 would."""
    host = hardware.EmulationHost(233472, 232448, 1024, 0)
    cfg = upstream_bwd_config(64)  # 65 KB + 1 KB static on SM120: 1 CTA/SM; the H200 would fit 3
    kernels = []
    _, launched = codegen.compile_bwd_cubin(cfg, 64, arch="sm_90a", emulate_host_smem=host, kernel_out=kernels)
    k = kernels[0]
    target = hardware.sm120_occupancy(k.smem_bytes_unpadded + hardware.DSL_STATIC_SMEM, cfg.num_threads).ctas_per_sm
    assert launched == k.smem_bytes_launched > k.smem_bytes_unpadded
    assert host.smem_per_sm // (launched + host.static_smem + host.reserved_per_cta) == target == 1


def _shipped_bwd():
    from flash_attn_sm120.config_bwd import BWD_FALLBACKS, load_bwd_table

    # a modifier entry (modifiers = true) is compiled with the modifier step it serves (codegen.report_mods)
    out = [(f"table-d{e.head_dim}-{e.mask}{'-mods' if e.modifiers else ''}{'-mha' if e.plain_mha_only else ''}"
            f"{'-plain' if e.plain_only else ''}{'-turns' if e.turns_only else ''}", e.config, e.head_dim, e.mask)
           for e in load_bwd_table()]
    # a plain-MHA entry also serves float16 calls (its tile sits at 255 registers), a plain entry GQA calls
    # of either dtype (the dK/dV accumulators' epilogue)
    out += [(f"table-d{e.head_dim}-{e.mask}-mha-fp16", e.config, e.head_dim, e.mask)
            for e in load_bwd_table() if e.plain_mha_only]
    out += [(f"table-d{e.head_dim}-{e.mask}-plain-gqa{suffix}", e.config, e.head_dim, e.mask)
            for e in load_bwd_table() if e.plain_only for suffix in ("", "-fp16")]
    # a turns entry runs deterministic calls in turns (descending with a causal mask, rotated without), MHA or
    # GQA, either dtype
    out += [(f"table-d{e.head_dim}-{e.mask}-turns{suffix}", e.config, e.head_dim, e.mask)
            for e in load_bwd_table() if e.turns_only for suffix in ("-fp16", "-gqa")]
    for i, cfg in enumerate(BWD_FALLBACKS):
        d = max(d for d in range(8, 257, 8) if bwd_config_error(d, d, cfg) is None)
        out += [(f"fallback{i}-d{d}-{m}", cfg, d, m) for m in ("none", "causal")]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name,cfg,d,mask", _shipped_bwd(), ids=[x[0] for x in _shipped_bwd()])
def test_shipped_backward_configs_do_not_spill_on_sm120a(name, cfg, d, mask):
    mods = codegen.report_mods() if name.endswith("-mods") else None
    dtype = "float16" if name.endswith("-fp16") else "bfloat16"
    gqa = 4 if "-gqa" in name else 1
    turns = "-turns" in name  # in the deterministic plan's turns
    ordering = codegen.deterministic_report_plan(cfg, mask == "causal", turns_entry=True) if turns else None
    res, hist, _ = codegen.inspect_cubin(codegen.compile_bwd_cubin(cfg, d, causal=mask == "causal", mods=mods,
                                                                   dtype=dtype, qhead_per_kvhead=gqa,
                                                                   deterministic=turns, ordering=ordering)[0])
    assert hist.get("HMMA", 0) > 0
    if d > 192:
        # d > 192, the one exception, and why: no 8-warp tile fits 99 KB, so 4 warps hold the dK/dV/dQ
        # accumulators and spill (measured: 16-24 B of stack at d256; 160-208 B at d200-224, where the
        # preprocess's 64-row passes need a 64-row tile, config_bwd.BWD_FALLBACKS)
        assert not [c for c in _eight_warp_tiles() if bwd_config_error(d, d, c) is None]
        small = d % 64 == 0
        assert res["stack"] <= (64 if small else 256) and hist.get("LDL", 0) <= (16 if small else 64), (name, res)
        return
    assert res["stack"] == 0 and res["local"] == 0, (name, res)
    assert hist.get("LDL", 0) == 0 and hist.get("STL", 0) == 0, name


# The deterministic packed calls (cu_seqlens: fixed-point dQ) on each key's regular entry, which serves them,
# MHA and GQA 2:1. Found spilling in session 35 (the shipped-config test above compiles each entry's own call
# only): stack bytes on sm_120a, pinned so that a change either way shows. Every other one is spill-free.
DET_PACKED_SPILLS = {
    ("d96-causal", 2): 16,  # 4 warps 32x64 with V in registers (MHA spill-free since head_scale: was 24 B, GQA 48 B)
    ("d128-none", 2): 16,  # 8 warps 32x128 with V in registers
}


def _det_packed_cases():
    from flash_attn_sm120.config_bwd import load_bwd_table

    return [(f"d{e.head_dim}-{e.mask}", e.config, e.head_dim, e.mask, g)
            for e in load_bwd_table() if not e.kind and e.mask in ("none", "causal") for g in (1, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("key,cfg,d,mask,gqa", _det_packed_cases(), ids=[f"{c[0]}-g{c[4]}" for c in _det_packed_cases()])
def test_deterministic_packed_calls_spill_only_where_pinned(key, cfg, d, mask, gqa):
    res, _, _ = codegen.inspect_cubin(codegen.compile_bwd_cubin(
        cfg, d, causal=mask == "causal", deterministic=True, varlen=True, qhead_per_kvhead=gqa,
        ordering={"dq_fixed_point": True})[0])
    assert res["stack"] == DET_PACKED_SPILLS.get((key, gqa), 0), (key, gqa, res)


def _eight_warp_tiles():
    return [BwdConfig(256, m, n, 1, 1, atom_m_sdp=a, atom_n_dkv=b, atom_m_dq=c)
            for m in (16, 32, 48, 64, 80, 96, 112, 128) for n in (16, 32, 48, 64, 80, 96, 112, 128)
            for a in (1, 2, 4, 8) for b in (1, 2, 4, 8) for c in (1, 2, 4, 8)]


def test_compiles_do_not_print_the_dsl_aux_data_warning():
    """The DSL's 'aux_data cannot be converted to a JitArgument' warning is filtered at this package's
    compile calls (driver.quiet_compile); other warnings still show."""
    import warnings

    from flash_attn_sm120.config import FwdConfig

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        codegen.compile_fwd_cubin(FwdConfig(128, 64, 64, 1), 64)
        codegen.compile_bwd_cubin(upstream_bwd_config(64), 64)
    assert not [w for w in seen if "aux_data" in str(w.message)], [str(w.message)[:100] for w in seen]


# Deterministic calls with a window (session 38: turns from the window's edges) on the entry that serves them (the
# key's modifier entry with a user score_mod, else its regular one): with a score_mod dense (descending turns, the
# shortest-first launch) and varlen (ascending), without one dense (varlen: fixed point), MHA and GQA 2:1: stack
# bytes on sm_120a, pinned like the packed calls above. Every other one is spill-free.
DET_WINDOW_SPILLS = {  # varlen d96: 4 warps 32x64 with V in registers at 254 registers (the ascending turn's offset)
    (96, True, 1): 16,
    (96, True, 2): 8,
}


def _det_window_cases():
    # (without a score_mod only dense calls take turns: varlen ones add in fixed point)
    return [(d, varlen, g, mods) for d in (64, 96, 128) for varlen in (False, True) for g in (1, 2)
            for mods in (True, False) if mods or not varlen]


@pytest.mark.slow
@pytest.mark.parametrize("d,varlen,gqa,mods", _det_window_cases(),
                         ids=[f"d{d}-{'varlen' if v else 'dense'}-g{g}{'-mods' if m else ''}"
                              for d, v, g, m in _det_window_cases()])
def test_deterministic_windows_spill_only_where_pinned(d, varlen, gqa, mods):
    from flash_attn_sm120 import bwd_plans
    from flash_attn_sm120.config_bwd import load_bwd_table, select_bwd_config

    cfg = select_bwd_config(load_bwd_table(), d, d, False, True, modifiers=mods)
    index = (object(), object(), None, None) if varlen else (None,) * 4
    plan = bwd_plans.deterministic_plan(188, cfg, False, 4096, 4096, index_tensors=index, local=True,
                                        fixed_point=not mods)
    assert plan["dq_descending"] != varlen and plan["fused_turns"] and not plan["dq_fixed_point"]
    res, _, _ = codegen.inspect_cubin(codegen.compile_bwd_cubin(
        cfg, d, local=True, mods=codegen.report_mods() if mods else None, deterministic=True, varlen=varlen,
        qhead_per_kvhead=gqa, ordering={k: v for k, v in plan.items() if v})[0])
    assert res["stack"] == DET_WINDOW_SPILLS.get((d, varlen, gqa), 0), (d, varlen, gqa, mods, res)
