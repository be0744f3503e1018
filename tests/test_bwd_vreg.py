"""V in registers (BwdConfig.v_in_regs) on a CPU: admitted for this package's step only, the shared-memory
footprint without sV, and sm_120a code whose mainloop reads V from registers, not shared memory.

Upstream's SM80/SM120 kernel copies V to registers in its prologue and lends V's shared memory to Q,
but its step still reads V from that memory for every dP (wrong dQ and dK: measured on the H200,
2026-12-01_bwd_first_emulated.md). The modifier step (kernels/bwd_mods.py) reads the registers.
The GPU half (gradients against fp32 autograd) is test_bwd_vreg_gpu.py.
"""

import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from flash_attn_sm120 import bwd_traffic, codegen, driver_bwd, hardware
from flash_attn_sm120.config_bwd import load_bwd_table
from flash_attn_sm120.kernels.bwd_mods import FlashAttentionBackwardSm120Mods
from flash_attn_sm120.kernels.bwd_sm120 import FlashAttentionBackwardSm120Tuned
from flash_attn_sm120.kernels.bwd_tiling import (
    BwdConfig,
    _sm120_ctas_by_smem,
    bwd_config_error,
    shared_qv_bytes,
    smem_bytes,
    v_runs_into_sdo,
)
from flash_attn_sm120.kernels.fwd_cpasync import _round_up

cutlass = pytest.importorskip("cutlass")

# the table's tile at each seed head dim with V in registers (spill-free on sm_120a)
VREG = {
    64: BwdConfig(256, 64, 128, 2, 2, atom_m_sdp=2, atom_n_dkv=4, atom_m_dq=2, v_in_regs=True),
    96: BwdConfig(128, 32, 64, 1, 1, atom_m_sdp=2, atom_n_dkv=2, atom_m_dq=2, v_in_regs=True),
    128: BwdConfig(256, 32, 128, 1, 1, atom_m_sdp=1, atom_n_dkv=4, atom_m_dq=2, v_in_regs=True),
}


def test_admitted_and_smaller():
    """sV's memory goes: V's prologue copy lands in sQ (sized max(Q, V)), so V costs what it needs beyond
    Q's ring; the table's tiles gain no CTA per SM from running it on into sdO, so they keep that layout."""
    for d, cfg in VREG.items():
        assert bwd_config_error(d, d, cfg) is None
        assert not v_runs_into_sdo(d, d, cfg)
        plain = replace(cfg, v_in_regs=False)
        v = cfg.n_block * _round_up(d, 32) * 2
        q = cfg.m_block * _round_up(d, 32) * cfg.stages_q * 2
        # the smaller of Q's ring and V, less at most 1 KB where sV's one element rounds the struct up
        assert smem_bytes(d, d, plain) - smem_bytes(d, d, cfg) in (min(q, v), min(q, v) - 1024)


def test_v_runs_from_sq_into_sdo_only_when_sdo_follows_at_once():
    assert shared_qv_bytes(8192, 16384, 8192, True) == 8192  # d128 32x64: V fits Q's and dO's rings
    assert shared_qv_bytes(8192, 32768, 8192, True) == 24576  # d128 32x128: sQ grows by what dO cannot hold
    assert shared_qv_bytes(8192, 4096, 8192, True) == 8192  # V smaller than Q
    assert shared_qv_bytes(3584, 16384, 3584, True) == 16384  # Q's ring off a 1 KB boundary: a gap before sdO
    assert shared_qv_bytes(8192, 16384, 8192, False) == 16384  # upstream's shared Q/V


def test_d128_four_warp_tile_fits_two_ctas_per_sm():
    """d128 4 warps 32x64 with V in registers: 41 KB with V across sQ and sdO, two CTAs per SM on SM120;
    49 KB with V in an sQ of its own size: one."""
    cfg = BwdConfig(128, 32, 64, 1, 1, atom_m_sdp=1, atom_n_dkv=2, atom_m_dq=2, v_in_regs=True)
    assert v_runs_into_sdo(128, 128, cfg)
    assert smem_bytes(128, 128, cfg) == 41 * 1024 and smem_bytes(128, 128, cfg, v_into_sdo=False) == 49 * 1024
    for into in (True, False):
        occupancy = hardware.sm120_occupancy(smem_bytes(128, 128, cfg, v_into_sdo=into) + hardware.DSL_STATIC_SMEM, 128)
        assert occupancy.ctas_per_sm == (2 if into else 1)


def test_the_layout_rule_counts_ctas_as_the_occupancy_model_does():
    for smem in range(0, hardware.SMEM_PER_BLOCK_MAX - hardware.DSL_STATIC_SMEM + 1, 512):
        assert _sm120_ctas_by_smem(smem) == hardware.sm120_occupancy(smem + hardware.DSL_STATIC_SMEM, 128).by_smem


def test_upstreams_step_refuses_it_and_the_driver_routes_it():
    cfg = VREG[96]
    with pytest.raises(ValueError, match="v_in_regs needs the modifier step"):
        FlashAttentionBackwardSm120Tuned(cutlass.BFloat16, 96, config=cfg)
    kernel = driver_bwd.kernel_for(cutlass.BFloat16, 96, 96, 1, cfg, driver_bwd.Mods(), is_causal=True)
    assert isinstance(kernel, FlashAttentionBackwardSm120Mods) and kernel.V_in_regs


def test_the_search_grid_offers_it():
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import search_bwd

    for d in (64, 96, 128):
        assert any(c.v_in_regs for c in search_bwd.enumerate_bwd_candidates(d))


def test_patch_generation_refuses_a_table_row_the_patched_interface_cannot_run():
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from patchgen.core import AnchorError
    from patchgen.step_bwd_configs import render_bwd_configs_module

    table = list(load_bwd_table())
    # P/dS in registers (S/dP swapped, every warp along the keys): the tuned class cannot run it
    table[0] = replace(table[0], config=replace(table[0].config, sdp_swapab=True, atom_m_sdp=1,
                                                atom_n_dkv=table[0].config.num_warps))
    with pytest.raises(AnchorError, match="keep P/dS in registers"):
        render_bwd_configs_module(tuple(table))


@pytest.mark.slow
@pytest.mark.skipif(codegen.find_tool("cuobjdump") is None, reason="needs cuobjdump")
def test_sm120a_traced_storage_with_v_across_sq_and_sdo(sm120a):
    """The traced struct of a tile whose V runs into sdO equals smem_bytes (41 KB)."""
    cfg = BwdConfig(128, 32, 64, 1, 1, atom_m_sdp=1, atom_n_dkv=2, atom_m_dq=2, v_in_regs=True)
    kernels = []
    _, smem = codegen.compile_bwd_cubin(cfg, 128, kernel_out=kernels)
    assert smem == kernels[0].smem_bytes_unpadded == smem_bytes(128, 128, cfg) == 41 * 1024


@pytest.fixture(scope="module")
def sm120a():
    os.environ.update(CUTE_DSL_ARCH="sm_120a", FLASH_ATTENTION_ARCH="sm_120", FLASH_ATTENTION_NUM_SMS="188")


@pytest.mark.slow
@pytest.mark.skipif(codegen.find_tool("cuobjdump") is None, reason="needs cuobjdump")
@pytest.mark.parametrize("d", sorted(VREG))
def test_sm120a_mainloop_reads_v_from_registers(sm120a, d):
    """Per pass of the mainloop each warp reads exactly its dP fragment of V less from shared memory
    (n_block * atom_m_sdp / warps rows of V), with the same tensor-core work, no local memory, and the
    traced shared storage equal to smem_bytes."""
    cfg = VREG[d]
    rows = {}
    for name, c in (("plain", replace(cfg, v_in_regs=False)), ("vreg", cfg)):
        kernels = []
        cubin, smem = codegen.compile_bwd_cubin(c, d, kernel_out=kernels)
        usage, hist, sass = codegen.inspect_cubin(cubin)
        assert usage["local"] == 0 and usage["stack"] == 0, (name, usage)
        assert smem == kernels[0].smem_bytes_unpadded == smem_bytes(d, d, c)
        rows[name] = (hist["HMMA"], codegen.main_loop_ldsm_bytes(sass))
        assert rows[name][1] == 2 * bwd_traffic.ldsm_elems_per_warp(c, d, d)  # the traffic model counts the same
    v_fragment = cfg.n_block * cfg.atom_m_sdp // cfg.num_warps * _round_up(d, 32) * 2
    assert rows["vreg"][0] == rows["plain"][0]
    assert rows["plain"][1] - rows["vreg"][1] == v_fragment


@pytest.mark.slow
@pytest.mark.skipif(codegen.find_tool("cuobjdump") is None, reason="needs cuobjdump")
def test_traffic_model_counts_the_register_path_as_the_sass_does(sm120a):
    """P/dS and V in registers (S/dP swapped, V the A operand): the dV/dK products read no A rows."""
    cfg = BwdConfig(256, 32, 128, 1, 1, True, False, False, 1, 8, 2, True)
    cubin, _ = codegen.compile_bwd_cubin(cfg, 128)
    usage, _, sass = codegen.inspect_cubin(cubin)
    assert usage["stack"] == 0
    assert codegen.main_loop_ldsm_bytes(sass) == 2 * bwd_traffic.ldsm_elems_per_warp(cfg, 128, 128) == 49152


def test_traffic_model_by_hand():
    """The d128 table tile (8 warps, 32x128, atoms 2/4/2), elements per warp: S and dP 16x32 warp tiles over
    k=128 (6144 each), dV and dK 32x64 over k=32 (3072 each), dQ 16x32 over k=128 (6144)."""
    cfg = BwdConfig(256, 32, 128, 1, 1, atom_m_sdp=2, atom_n_dkv=4, atom_m_dq=2)
    assert bwd_traffic.ldsm_elems_per_warp(cfg, 128, 128) == 24576
    assert bwd_traffic.ldsm_elems_per_warp(replace(cfg, v_in_regs=True), 128, 128) == 24576 - 32 * 128
    flops = bwd_traffic.pass_flops(cfg, 128, 128)
    assert flops == 2 * 32 * 128 * 5 * 128
    moved = bwd_traffic.pass_smem_bytes(cfg, 128, 128)
    assert moved == (24576 * 8 + 2 * 32 * 128 + 32 * 256) * 2
    bound = bwd_traffic.smem_bound_tflops(cfg, 128, 128, 132, 1.98, 640.0)
    assert bound == pytest.approx(128 * flops / moved * 132 * 1.98 / 1e3)
    assert bwd_traffic.smem_bound_tflops(cfg, 128, 128, 132, 1.98, 100.0) == 100.0  # mma.sync binds first


def test_fit_reads_a_prepare_run(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import json

    import bwd_ldsm_probe

    run = tmp_path / "run.json"
    rows = [dict(impl="upstream_sm120", problem="b1s8192h16d128", status="ok", bwd_tflops=200.0),
            dict(impl="cand", problem="b1s8192h16d128-causal", status="ok", bwd_tflops=250.0),
            dict(impl="unknown", problem="b1s8192h16d128", status="ok", bwd_tflops=1.0)]
    run.write_text(json.dumps(dict(num_sms=132, rows=rows)))
    cands = tmp_path / "c.json"
    cands.write_text(json.dumps({"cand": {**VREG[128].to_dict(), "head_dims": [128]}}))
    out = bwd_ldsm_probe.fit(run, cands, 1.98)
    assert [r["impl"] for r in out] == ["upstream_sm120", "cand"]
    assert out[1]["causal"] and out[1]["warps_per_sm"] == 8 and out[0]["warps_per_sm"] == 4
    assert out[0]["of_bound"] == pytest.approx(200.0 / out[0]["bound_tflops"], abs=1e-3)


def test_probe_refuses_an_unknown_variant():
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import bwd_ldsm_probe

    with pytest.raises(SystemExit):
        bwd_ldsm_probe.main(["128:bwd-w4-32x64-q1do1-a112-vreg", "--variants", "local,sideways"])
    assert set(bwd_ldsm_probe.VARIANTS) == {"local", "gqa", "fp16", "det", "det_fixed", "varlen", "varlen_gqa",
                                             "det_gqa", "det_fp16", "det_rotated", "det_fixed_causal",
                                             "det_fixed_varlen_gqa", "det_fixed_mask_always",
                                             "det_fixed_mask_always_gqa", "det_fixed_mask_always_fp16",
                                             "det_fixed_mask_always_varlen", "det_rotated_gqa",
                                             "det_rotated_fp16"}
    assert bwd_ldsm_probe.VARIANTS["det_fixed"]["ordering"] == {"dq_fixed_point": True}


def test_probe_reports_a_config_it_cannot_build_as_a_row():
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import bwd_ldsm_probe

    row = bwd_ldsm_probe.probe_variant("128:bwd-w8-64x128-q1do1-a242@det")  # 133 KB of shared memory
    assert row["variant"] == "det" and "shared memory" in row["error"]
