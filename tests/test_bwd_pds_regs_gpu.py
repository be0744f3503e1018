"""P and dS in registers (BwdConfig.pds_in_regs) on a GPU, against fp32 autograd with NaN-poisoned grads.

The S/dP product runs transposed (S^T = K Q^T, every warp along the keys) so that the dV and dK
products take P^T and dS^T from registers; dS^T reaches shared memory (through stmatrix.trans)
only for dQ. Every index the step uses flips with the tile: the LSE and dPsum per column, the
causal/local/seqlen mask, score_mod / mask_mod indices. So every one of them is checked here on
the candidate configs (configs/measurements/search_bwd/round6_rs_candidates.json): dense MHA/GQA,
causal, windows (negative sides), varlen and seqused, softcap with the LSE's gradient, fp16,
position-dependent modifiers, and deterministic=True (turns and fixed point, bit for bit).
"""

import pytest

torch = pytest.importorskip("torch")

import bwd_config_checks  # noqa: E402
from flash_attn_sm120 import driver_bwd, testing  # noqa: E402
from flash_attn_sm120.kernels.bwd_tiling import BwdConfig, bwd_config_error  # noqa: E402
from flash_attn_sm120.testing import AttnCase, AttnProblem  # noqa: E402

pytestmark = pytest.mark.gpu

RS = {  # (config, head dims it is spill-free at on sm_120a)
    "w8-64x128-q2do2-a184": (BwdConfig(256, 64, 128, 2, 2, True, False, False, 1, 8, 4), (64,)),
    "w8-64x128-q2do2-a182": (BwdConfig(256, 64, 128, 2, 2, True, False, False, 1, 8, 2), (64,)),
    "w4-64x64-q2do2-a144": (BwdConfig(128, 64, 64, 2, 2, True, False, False, 1, 4, 4), (64,)),
    "w4-32x64-q1do1-a142": (BwdConfig(128, 32, 64, 1, 1, True, False, False, 1, 4, 2), (96, 64)),
    "w4-64x64-q1do1-a144": (BwdConfig(128, 64, 64, 1, 1, True, False, False, 1, 4, 4), (96,)),
    "w8-32x128-q1do1-a182": (BwdConfig(256, 32, 128, 1, 1, True, False, False, 1, 8, 2), (128, 64)),
}
CASES = [(name, d) for name, (_, dims) in RS.items() for d in dims]


def _run(cfg, case, problem):
    assert cfg.pds_in_regs and bwd_config_error(case.head_dim, case.head_dim_v, cfg) is None
    inputs = testing.make_inputs(case, problem, "cuda", requires_grad=True)
    with driver_bwd.force_config(cfg):
        return testing.check_backward(inputs, case, problem)


@pytest.mark.parametrize("name,d", CASES, ids=[f"{n}-d{d}" for n, d in CASES])
def test_dense(name, d):
    cfg = RS[name][0]
    for mask, hk, ratio, sq, sk in (("none", 2, 1, 200, 333), ("causal", 1, 4, 257, 300), ("causal", 2, 1, 300, 100)):
        case = AttnCase("bfloat16", d, d, ratio, None, mask)
        _run(cfg, case, AttnProblem((sq, sq), (sk, sk), nheads_kv=hk, seed=d + sq))


@pytest.mark.parametrize("name,d", [("w8-64x128-q2do2-a184", 64), ("w4-32x64-q1do1-a142", 96),
                                    ("w8-32x128-q1do1-a182", 128)])
def test_large_grid(name, d):
    """Many CTAs per SM over time (a race between the dS store and the previous step's dQ reads shows here)."""
    case = AttnCase("bfloat16", d, d, 2, None, "causal")
    _run(RS[name][0], case, AttnProblem((2048, 2048), (2048, 2048), nheads_kv=4, seed=d))
    case = AttnCase("bfloat16", d, d, 1, None, "none")
    _run(RS[name][0], case, AttnProblem((1536,), (2000,), nheads_kv=8, seed=d + 1))


FEATURES = [
    ("varlen-gqa-causal", "w8-32x128-q1do1-a182",
     AttnCase("bfloat16", 128, 128, 2, None, "causal", q_layout="packed", k_layout="packed"),
     AttnProblem((77, 300, 5), (90, 300, 64), nheads_kv=2, seed=1)),
    ("seqused-padded-fp16", "w8-64x128-q2do2-a184", AttnCase("float16", 64, 64, 1, None, "none", q_layout="padded",
                                                             k_layout="padded"),
     AttnProblem((65, 130), (129, 200), nheads_kv=2, pad_q=7, pad_k=13, seed=2)),
    ("mqa-local", "w4-32x64-q1do1-a142", AttnCase("bfloat16", 96, 96, 8, None, "local_lr"),
     AttnProblem((300,), (300,), nheads_kv=1, window_left=40, window_right=7, seed=3)),
    ("negative-window", "w8-32x128-q1do1-a182", AttnCase("bfloat16", 128, 128, 1, None, "local_lr"),
     AttnProblem((200,), (333,), nheads_kv=2, window_left=300, window_right=-70, seed=4)),
    ("negative-left", "w8-64x128-q2do2-a182", AttnCase("bfloat16", 64, 64, 2, None, "local_l"),
     AttnProblem((190,), (190,), nheads_kv=1, window_left=-20, seed=5)),
    ("softcap-lse", "w8-32x128-q1do1-a182", AttnCase("bfloat16", 128, 128, 1, None, "causal", softcap=15.0,
                                                     return_lse=True),
     AttnProblem((129,), (129,), nheads_kv=3, seed=6)),
    ("softcap-fp16-gqa", "w4-64x64-q2do2-a144", AttnCase("float16", 64, 64, 4, None, "none", softcap=8.0),
     AttnProblem((211,), (97,), nheads_kv=2, seed=7)),
]


@pytest.mark.parametrize("label,name,case,problem", FEATURES, ids=[f[0] for f in FEATURES])
def test_features(label, name, case, problem):
    _run(RS[name][0], case, problem)


@pytest.mark.parametrize("name,d", [("w8-64x128-q2do2-a184", 64), ("w8-32x128-q1do1-a182", 128)])
def test_position_dependent_modifiers(name, d):
    """score_mod / score_mod_bwd and mask_mod see (q_idx, kv_idx) from the transposed tile: a swap would
    change both the scores and the mask (prefix-LM is not symmetric)."""
    bwd_config_checks.check_position_dependent_modifiers(RS[name][0], d)


@pytest.mark.parametrize("name,d,causal,window", [
    ("w8-32x128-q1do1-a182", 128, True, None),    # turns: descending, reversed launch
    ("w8-64x128-q2do2-a184", 64, False, None),    # turns: rotated
    ("w4-32x64-q1do1-a142", 96, False, (64, 16)),  # fixed point (a window)
])
def test_deterministic_bitwise_and_correct(name, d, causal, window):
    bwd_config_checks.check_deterministic(RS[name][0], d, causal, window)
