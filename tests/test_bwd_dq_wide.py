"""The wide dQ adds (launch plan's dq_wide_adds, off by default) on a CPU: routing, refusals, the tile rule
over the search grid, and sm_120a code (16-byte reductions, same tensor-core work, no spills); this
package's step (own_step) against upstream's for plain calls; the wide postprocess builds for sm_120a.

The GPU half (gradients against fp32 autograd with the plan forced on) is test_bwd_dq_wide_gpu.py.
"""

import os
import sys
from pathlib import Path

import pytest

from flash_attn_sm120 import codegen, driver_bwd
from flash_attn_sm120.kernels.bwd_mods import FlashAttentionBackwardSm120Mods
from flash_attn_sm120.kernels.bwd_sm120 import FlashAttentionBackwardSm120Tuned
from flash_attn_sm120.kernels.bwd_tiling import (
    DQ_WIDE_ELEMS,
    BwdConfig,
    bwd_config_error,
    dq_wide_fits,
    upstream_bwd_config,
)

cutlass = pytest.importorskip("cutlass")


def test_the_plan_flags_route_to_this_packages_step():
    cfg = upstream_bwd_config(64)
    mods = driver_bwd.Mods()
    plain = driver_bwd.kernel_for(cutlass.BFloat16, 64, 64, 1, cfg, mods, is_causal=True)
    assert type(plain) is FlashAttentionBackwardSm120Tuned
    wide = driver_bwd.kernel_for(cutlass.BFloat16, 64, 64, 1, cfg, mods, is_causal=True, dq_wide_adds=True)
    assert isinstance(wide, FlashAttentionBackwardSm120Mods) and wide.dq_wide_adds
    own = driver_bwd.kernel_for(cutlass.BFloat16, 64, 64, 1, cfg, mods, is_causal=True, own_step=True)
    assert isinstance(own, FlashAttentionBackwardSm120Mods) and not own.dq_wide_adds


def test_upstreams_step_refuses_the_wide_adds():
    with pytest.raises(ValueError, match="dq_wide_adds needs the modifier step"):
        FlashAttentionBackwardSm120Tuned(cutlass.BFloat16, 64, config=upstream_bwd_config(64), dq_wide_adds=True)


def test_the_tile_rule():
    """Four-element pieces over every thread: 64x128 over 256 threads splits, 16x32 over 256 does not."""
    assert dq_wide_fits(BwdConfig(256, 64, 64, 1, 1), 128)
    assert dq_wide_fits(upstream_bwd_config(96), 96)  # 64x96 over 128 threads
    assert not dq_wide_fits(BwdConfig(256, 16, 64, 1, 1), 32)  # 512 elements < 4 x 256


def test_every_search_candidate_takes_the_wide_adds():
    """The plan can be forced for any config the search times (and the table ships)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import search_bwd

    for d in (64, 96, 128):
        cands = search_bwd.enumerate_bwd_candidates(d)
        assert cands and all(dq_wide_fits(c, d) for c in cands if bwd_config_error(d, d, c) is None)


@pytest.fixture(scope="module")
def sm120a():
    os.environ.update(CUTE_DSL_ARCH="sm_120a", FLASH_ATTENTION_ARCH="sm_120", FLASH_ATTENTION_NUM_SMS="188")


needs_cuobjdump = pytest.mark.skipif(codegen.find_tool("cuobjdump") is None, reason="needs cuobjdump")


@needs_cuobjdump
@pytest.mark.slow
@pytest.mark.parametrize("d,causal", [(64, True), (96, False), (128, True)])
def test_sm120a_wide_adds_are_16_byte_reductions(sm120a, d, causal):
    """Four times fewer dQ reductions, each 16 bytes, with the same tensor-core work and no local memory;
    the package's step alone (own_step) does upstream's step's memory and tensor-core work (its masking
    code differs by a few predicate instructions where the plan masks only where needed)."""
    from flash_attn_sm120.config_bwd import load_bwd_table, select_bwd_config

    cfg = select_bwd_config(load_bwd_table(), d, d, causal, False)
    base = dict(lpt=False, mask_where_needed=not causal, dq_wide_adds=False, own_step=False)
    hists, sass = {}, {}
    for name, flags in (("upstream", {}), ("own", dict(own_step=True)), ("wide", dict(dq_wide_adds=True))):
        cubin, _ = codegen.compile_bwd_cubin(cfg, d, causal=causal, ordering=dict(base, **flags))
        usage, hists[name], sass[name] = codegen.inspect_cubin(cubin)
        assert usage["local"] == 0 and usage["stack"] == 0, (name, usage)
    work = ("HMMA", "LDSM", "LDS", "STS", "LDGSTS", "REDG", "BAR", "MUFU")
    assert {op: hists["own"].get(op, 0) for op in work} == {op: hists["upstream"].get(op, 0) for op in work}
    assert abs(sum(hists["own"].values()) - sum(hists["upstream"].values())) <= 0.02 * sum(hists["upstream"].values())
    assert hists["wide"]["HMMA"] == hists["upstream"]["HMMA"]
    assert hists["wide"]["REDG"] * DQ_WIDE_ELEMS == hists["upstream"]["REDG"]
    assert "REDG.E.ADD.F32x4" in sass["wide"] and "REDG.E.ADD.F32x4" not in sass["upstream"]


@needs_cuobjdump
@pytest.mark.slow
def test_the_wide_postprocess_builds_for_sm120a(sm120a):
    from flash_attn_sm120.kernels import bwd_postprocess

    # the d96 table tile (32x96, 4 warps, two along M) and a varlen one of the d64 causal tile
    assert bwd_postprocess._compile(cutlass.BFloat16, 96, 32, 128, 2, False, False, False, False, 32) is not None
    compiled = bwd_postprocess._compile(cutlass.BFloat16, 64, 64, 256, 2, False, True, True, False, 32)
    assert compiled is not None
    with pytest.raises(ValueError, match="does not split"):
        bwd_postprocess.FlashAttentionBackwardPostprocessWide(cutlass.BFloat16, 32, 120, 16, 256, 1, False)
