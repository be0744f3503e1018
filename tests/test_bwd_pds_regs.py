"""P and dS in registers (BwdConfig.pds_in_regs) on a CPU: which configs qualify, who runs them, and the
sm_120a code they make (the GPU checks are in test_bwd_pds_regs_gpu.py)."""

import pytest

from flash_attn_sm120 import codegen
from flash_attn_sm120.driver_bwd import Mods, kernel_for
from flash_attn_sm120.kernels.bwd_mods import FlashAttentionBackwardSm120Mods
from flash_attn_sm120.kernels.bwd_sm120 import FlashAttentionBackwardSm120Tuned
from flash_attn_sm120.kernels.bwd_tiling import BwdConfig, bwd_config_error

RS_D64 = BwdConfig(256, 64, 128, 2, 2, True, False, False, 1, 8, 4)
SMEM_D64 = BwdConfig(256, 64, 128, 2, 2, False, False, False, 1, 8, 4)  # the same tile through shared memory


@pytest.mark.parametrize("cfg,expected", [
    (RS_D64, True),
    (BwdConfig(128, 32, 64, 1, 1, True, False, False, 1, 4, 2), True),
    (SMEM_D64, False),                                                      # not swapped
    (BwdConfig(256, 64, 128, 2, 2, True, False, False, 2, 4, 4), False),    # warps along the queries
    (BwdConfig(256, 64, 128, 2, 2, True, True, False, 1, 8, 4), False),     # dK/dV swapped
])
def test_which_configs_keep_p_and_ds_in_registers(cfg, expected):
    assert cfg.pds_in_regs is expected


@pytest.mark.parametrize("cfg,match", [
    (BwdConfig(256, 64, 128, 2, 2, True, False, False, 2, 4, 4), "only with P/dS in registers"),
    (BwdConfig(256, 64, 128, 2, 2, True, True, False, 1, 8, 4), "dkv_swapab"),
    (BwdConfig(256, 64, 128, 2, 2, False, True, False, 2, 4, 4), "dkv_swapab"),
])
def test_swaps_outside_the_register_path_are_refused(cfg, match):
    err = bwd_config_error(64, 64, cfg)
    assert err is not None and match in err, err


def test_the_register_path_runs_on_this_packages_step_only():
    import cutlass

    assert bwd_config_error(64, 64, RS_D64) is None
    kernel = kernel_for(cutlass.BFloat16, 64, 64, 1, RS_D64, Mods())
    assert type(kernel) is FlashAttentionBackwardSm120Mods and kernel.pds_in_regs
    assert type(kernel_for(cutlass.BFloat16, 64, 64, 1, SMEM_D64, Mods())) is FlashAttentionBackwardSm120Tuned
    with pytest.raises(ValueError, match="the modifier step"):
        FlashAttentionBackwardSm120Tuned(cutlass.BFloat16, 64, 64, 1, RS_D64)


@pytest.mark.skipif(codegen.find_tool("cuobjdump") is None, reason="needs cuobjdump")
@pytest.mark.parametrize("causal", [False, True])
def test_sm120a_code_stores_only_ds_and_through_stmatrix(causal):
    """Against the same tile through shared memory: spill-free, the dS^T store is stmatrix.trans (STSM),
    P is never stored (half the STS), one barrier fewer per step, the same tensor-core work."""
    rows = {}
    for name, cfg in (("regs", RS_D64), ("smem", SMEM_D64)):
        cubin, _ = codegen.compile_bwd_cubin(cfg, 64, causal=causal)
        res, hist, _ = codegen.inspect_cubin(cubin)
        rows[name] = (res, hist)
    (res, regs), (_, smem) = rows["regs"], rows["smem"]
    assert res["stack"] == 0 and res["local"] == 0, res
    assert regs.get("STSM", 0) > 0 and smem.get("STSM", 0) == 0
    assert regs.get("STS", 0) < smem.get("STS", 0)
    assert regs.get("BAR", 0) < smem.get("BAR", 0)
    assert regs["HMMA"] == smem["HMMA"]


def test_the_backward_search_grid_offers_the_register_path():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import search_bwd

    for d in (64, 96, 128):
        cands = search_bwd.enumerate_bwd_candidates(d)
        rs = [c for c in cands if c.pds_in_regs]
        assert rs and all(bwd_config_error(d, d, c) is None for c in cands)
        assert not [c for c in cands if c.sdp_swapab and not c.pds_in_regs]
