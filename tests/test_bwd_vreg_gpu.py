"""V in registers (BwdConfig.v_in_regs) on a GPU, against fp32 autograd with NaN-poisoned grads.

With V in registers the kernel's prologue copies V from shared memory to registers and then lends
V's shared memory to the Q and dO rings (V's copy lands in sQ and runs on into sdO); the modifier
step takes dP = dO V^T from the registers. A step that still read sV would compute dP against Q
(wrong dQ and dK, right dV: what upstream's own step does), so every case here checks all three
gradients. Configs: the table's tiles with V in
registers at d64/96/128, a two-stage Q ring sharing V's memory, and V in registers together with
P/dS in registers (S/dP swapped, V as the A operand). Cases: dense MHA/GQA, causal, windows
(negative sides), varlen and seqused, softcap with the LSE's gradient, fp16, position-dependent
modifiers, deterministic=True (turns and fixed point), and grids with many CTAs per SM over time.
"""

import pytest

torch = pytest.importorskip("torch")

import bwd_config_checks  # noqa: E402
from flash_attn_sm120 import driver_bwd, testing  # noqa: E402
from flash_attn_sm120.kernels.bwd_tiling import BwdConfig, bwd_config_error  # noqa: E402
from flash_attn_sm120.testing import AttnCase, AttnProblem  # noqa: E402

pytestmark = pytest.mark.gpu

VREG = {  # (config, head dims it is spill-free at on sm_120a)
    "w8-64x128-q2do2-a242": (BwdConfig(256, 64, 128, 2, 2, False, False, False, 2, 4, 2, True), (64,)),
    "w4-32x64-q1do1-a222": (BwdConfig(128, 32, 64, 1, 1, False, False, False, 2, 2, 2, True), (96,)),
    "w4-32x64-q1do1-a122": (BwdConfig(128, 32, 64, 1, 1, False, False, False, 1, 2, 2, True), (96,)),
    "w8-32x128-q1do1-a142": (BwdConfig(256, 32, 128, 1, 1, False, False, False, 1, 4, 2, True), (128,)),
    "w8-64x64-q2do1-a242": (BwdConfig(256, 64, 64, 2, 1, False, False, False, 2, 4, 2, True), (128,)),
    # d128 on 4 warps, two CTAs per SM: V's prologue copy runs from sQ into sdO (spill-free in one mask each)
    "w4-32x64-q1do1-a121": (BwdConfig(128, 32, 64, 1, 1, False, False, False, 1, 2, 1, True), (128,)),
    "w4-32x64-q1do1-a112": (BwdConfig(128, 32, 64, 1, 1, False, False, False, 1, 1, 2, True), (128,)),
    # with P/dS in registers: S/dP swapped, V the A operand of dP^T
    "w8-64x128-q2do2-a184-rs": (BwdConfig(256, 64, 128, 2, 2, True, False, False, 1, 8, 4, True), (64,)),
    "w4-32x64-q1do1-a142-rs": (BwdConfig(128, 32, 64, 1, 1, True, False, False, 1, 4, 2, True), (96,)),
    "w8-32x128-q1do1-a182-rs": (BwdConfig(256, 32, 128, 1, 1, True, False, False, 1, 8, 2, True), (128,)),
}
CASES = [(name, d) for name, (_, dims) in VREG.items() for d in dims]


def _run(cfg, case, problem):
    assert cfg.v_in_regs and bwd_config_error(case.head_dim, case.head_dim_v, cfg) is None
    inputs = testing.make_inputs(case, problem, "cuda", requires_grad=True)
    with driver_bwd.force_config(cfg):
        return testing.check_backward(inputs, case, problem)


@pytest.mark.parametrize("name,d", CASES, ids=[f"{n}-d{d}" for n, d in CASES])
def test_dense(name, d):
    cfg = VREG[name][0]
    for mask, hk, ratio, sq, sk in (("none", 2, 1, 200, 333), ("causal", 1, 4, 257, 300), ("causal", 2, 1, 300, 100)):
        case = AttnCase("bfloat16", d, d, ratio, None, mask)
        _run(cfg, case, AttnProblem((sq, sq), (sk, sk), nheads_kv=hk, seed=d + sq))


@pytest.mark.parametrize("name,d", [("w8-64x128-q2do2-a242", 64), ("w4-32x64-q1do1-a222", 96),
                                    ("w8-32x128-q1do1-a142", 128), ("w8-64x64-q2do1-a242", 128),
                                    ("w4-32x64-q1do1-a121", 128), ("w4-32x64-q1do1-a112", 128)])
def test_large_grid(name, d):
    """Many CTAs per SM over time: a Q load landing in V's memory before every warp has copied V out
    would show here."""
    case = AttnCase("bfloat16", d, d, 2, None, "causal")
    _run(VREG[name][0], case, AttnProblem((2048, 2048), (2048, 2048), nheads_kv=4, seed=d))
    case = AttnCase("bfloat16", d, d, 1, None, "none")
    _run(VREG[name][0], case, AttnProblem((1536,), (2000,), nheads_kv=8, seed=d + 1))


FEATURES = [
    ("varlen-gqa-causal", "w8-32x128-q1do1-a142",
     AttnCase("bfloat16", 128, 128, 2, None, "causal", q_layout="packed", k_layout="packed"),
     AttnProblem((77, 300, 5), (90, 300, 64), nheads_kv=2, seed=1)),
    ("seqused-padded-fp16", "w8-64x128-q2do2-a242", AttnCase("float16", 64, 64, 1, None, "none", q_layout="padded",
                                                             k_layout="padded"),
     AttnProblem((65, 130), (129, 200), nheads_kv=2, pad_q=7, pad_k=13, seed=2)),
    ("mqa-local", "w4-32x64-q1do1-a222", AttnCase("bfloat16", 96, 96, 8, None, "local_lr"),
     AttnProblem((300,), (300,), nheads_kv=1, window_left=40, window_right=7, seed=3)),
    ("negative-window", "w8-32x128-q1do1-a182-rs", AttnCase("bfloat16", 128, 128, 1, None, "local_lr"),
     AttnProblem((200,), (333,), nheads_kv=2, window_left=300, window_right=-70, seed=4)),
    ("softcap-lse", "w8-64x64-q2do1-a242", AttnCase("bfloat16", 128, 128, 1, None, "causal", softcap=15.0,
                                                    return_lse=True),
     AttnProblem((129,), (129,), nheads_kv=3, seed=6)),
    ("varlen-rs-fp16", "w4-32x64-q1do1-a142-rs",
     AttnCase("float16", 96, 96, 4, None, "none", q_layout="packed", k_layout="packed"),
     AttnProblem((33, 190), (70, 129), nheads_kv=2, seed=7)),
]


@pytest.mark.parametrize("label,name,case,problem", FEATURES, ids=[f[0] for f in FEATURES])
def test_features(label, name, case, problem):
    _run(VREG[name][0], case, problem)


@pytest.mark.parametrize("name,d", [("w8-64x128-q2do2-a242", 64), ("w8-32x128-q1do1-a182-rs", 128)])
def test_position_dependent_modifiers(name, d):
    bwd_config_checks.check_position_dependent_modifiers(VREG[name][0], d)


@pytest.mark.parametrize("name,d,causal,window", [
    ("w8-32x128-q1do1-a142", 128, True, None),    # turns: descending, reversed launch
    ("w8-64x128-q2do2-a242", 64, False, None),    # turns: rotated
    ("w4-32x64-q1do1-a222", 96, False, (64, 16)),  # fixed point (a window)
])
def test_deterministic_bitwise_and_correct(name, d, causal, window):
    bwd_config_checks.check_deterministic(VREG[name][0], d, causal, window)
