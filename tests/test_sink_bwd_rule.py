"""CPU checks of the backward rule's second input-precision reference, testing_ref.fa_backward_ref.

check_backward's bound for dq / dk / dv / dsink is 2 x the larger input-precision error of autograd of
attention_ref(upcast=False) and of FlashAttention's own backward algorithm in the input precision (D from
the rounded O), + atol. Here: that algorithm computes the true gradients (fp64, where no rounding is
left); a simulated FlashAttention backward on the 1-query / 1-key GQA 2:1 sink problems that failed the
fuzz run passes the new rule everywhere and failed the old one; wrong gradients still fail it.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import sys
from pathlib import Path

import pytest
import torch

from flash_attn_sm120 import testing
from flash_attn_sm120.testing import AttnCase, AttnProblem, CheckFailure
from flash_attn_sm120.testing_ref import attention_ref, fa_backward_ref

ROOT = Path(__file__).resolve().parent.parent


def _load_sim():
    name = "sim_sink_bwd_tolerance"
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


sim = _load_sim()


def _autograd(q, k, v, sink, do, dl, **kw):
    out, lse = attention_ref(q, k, v, learnable_sink=sink, **kw)
    loss = (out * do).sum() + ((lse.masked_fill(torch.isneginf(lse), 0.0) * dl).sum() if dl is not None else 0.0)
    wrt = [q, k, v] + ([sink] if sink is not None else [])
    grads = torch.autograd.grad(loss, wrt, allow_unused=True)
    return [g if g is not None else torch.zeros_like(w) for g, w in zip(grads, wrt)]


def _leaf(gen, *shape, mul=1.0):
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * mul).requires_grad_()


# (sq, sk): (7, 3) with causal leaves the first rows empty; (4, 0) has no keys at all
@pytest.mark.parametrize("sink,mask,softcap,with_dlse,shape", [
    (sink, mask, softcap, dl, shape) for sink, mask, softcap, dl, shape in itertools.product(
        (False, True), ("none", "causal", "local"), (0.0, 2.0), (False, True), ((5, 9), (7, 3), (1, 1), (4, 0)))
    if not (softcap and dl and shape == (1, 1))
])
def test_fa_backward_ref_is_the_exact_gradient_in_fp64(sink, mask, softcap, with_dlse, shape):
    sq, sk = shape
    gen = torch.Generator().manual_seed(sq * 100 + sk)
    b, h, hk, d, dv = 2, 4, 2, 8, 6  # GQA 2:1
    q, k, v = _leaf(gen, b, sq, h, d), _leaf(gen, b, sk, hk, d), _leaf(gen, b, sk, hk, dv)
    s = _leaf(gen, h, mul=2.0) if sink else None
    do = torch.randn(b, sq, h, dv, generator=gen, dtype=torch.float64)
    dl = torch.randn(b, h, sq, generator=gen, dtype=torch.float64) if with_dlse else None
    kw = dict(causal=mask == "causal", window=(2, 0) if mask == "local" else (None, None), softcap=softcap,
              softmax_scale=0.4)
    want = _autograd(q, k, v, s, do, dl, **kw)
    got = fa_backward_ref(q, k, v, do, learnable_sink=s, dlse=dl, **kw)
    assert (got[3] is None) == (s is None)
    for name, w, g in zip(("dq", "dk", "dv", "dsink"), want, got):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert torch.allclose(g, w, rtol=1e-10, atol=1e-10), (name, (g - w).abs().max().item())


@pytest.mark.parametrize("mods,block_sparse", [("position", ""), ("alibi", ""), ("prefix+position", ""),
                                               ("document", ""), ("", "random"), ("prefix", "nofull")])
def test_fa_backward_ref_follows_the_modifier_twins_in_fp64(mods, block_sparse):
    """score_mod twins through their derivative, mask_mod twins and block-sparse lists as keep masks."""
    case = AttnCase("float64", 8, 8, 2, None, "none", 0.0, False, "dense", "dense", mods=mods,
                    block_sparse=block_sparse, sink=True)
    n_q, n_k = (300, 260) if block_sparse else (20, 24)
    problem = AttnProblem((n_q, n_q), (n_k, n_k), nheads_kv=1, seed=3)
    inputs = testing.make_inputs(case, problem, "cpu")
    gen = torch.Generator().manual_seed(4)
    for i in range(problem.batch):
        q, k, v = (t[i:i + 1].detach().clone().requires_grad_() for t in (inputs.q, inputs.k, inputs.v))
        s = inputs.sink.double().requires_grad_()
        do = torch.randn(1, n_q, 2, 8, generator=gen, dtype=torch.float64)
        twins = testing._mod_twins(case, inputs, i)
        want = _autograd(q, k, v, s, do, None, **twins)
        got = fa_backward_ref(q, k, v, do, learnable_sink=s, **twins)
        for name, w, g in zip(("dq", "dk", "dv", "dsink"), want, got):
            assert torch.allclose(g, w, rtol=1e-10, atol=1e-10), (mods, block_sparse, name, (g - w).abs().max().item())


def test_fa_backward_ref_rounds_where_flash_attention_stores():
    """In bf16 the O it takes D from is the rounded one: rounding dO . O moves dq (one key, sink)."""
    q, k, v, s, do = sim.problems(torch.bfloat16, 8)
    exact = fa_backward_ref(q.double(), k.double(), v.double(), do.double(), learnable_sink=s)[0]
    low = fa_backward_ref(q, k, v, do, learnable_sink=s)
    assert low[0].dtype == torch.bfloat16 and low[3].dtype == torch.float32
    assert (low[0].double() - exact).abs().max() > 0


N_PROBLEMS = 200


@functools.lru_cache(maxsize=None)
def _counts(dtype) -> dict:
    """Failures per rule over N_PROBLEMS problems (sim.rule_counts), computed once per dtype."""
    return {name: sum(v) for name, v in sim.rule_counts(dtype, N_PROBLEMS).items()}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_simulated_fa_backward_passes_the_new_rule_and_failed_the_old(dtype):
    counts = _counts(dtype)
    print(f"{dtype}: of {N_PROBLEMS} problems the simulated FA dq fails {counts}")
    assert counts["new"] == 0, counts
    assert counts["old"] >= 1, counts  # the change matters: the old rule rejected FA's own algorithm


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_wrong_dq_still_fails_the_new_rule(dtype):
    c = _counts(dtype)
    # measured (200 problems): x1.05 fails 198 fp16 / 156 bf16 (old rule: 199 / 187), swapped heads 199 / 199
    assert c["scaled"] >= 0.7 * N_PROBLEMS and c["swapped"] >= 0.95 * N_PROBLEMS, c


# ------------------------------------------------------------------------------------------------
# through check_backward: a stand-in "kernel" whose backward is FlashAttention's algorithm
# ------------------------------------------------------------------------------------------------


class _FAStyle(torch.autograd.Function):
    """Forward: the fp32 reference rounded to the dtype; backward: fa_backward_ref from that O
    (dq times dq_scale, to make a wrong kernel)."""

    @staticmethod
    def forward(ctx, q, k, v, sink, dq_scale):
        out, lse = attention_ref(q, k, v, learnable_sink=sink)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, sink, out)
        ctx.dq_scale = dq_scale
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, sink, out = ctx.saved_tensors
        dq, dk, dv, dsink = fa_backward_ref(q, k, v, dout, learnable_sink=sink, dlse=dlse, out=out)
        return (dq.float() * ctx.dq_scale).to(q.dtype), dk, dv, dsink, None


def _fa_kernel(dq_scale=1.0):
    def forward_via_api(inputs, case, problem):
        return _FAStyle.apply(inputs.q, inputs.k, inputs.v, inputs.sink, dq_scale)
    return forward_via_api


def _old_rule(original):
    def reference_backward(*args, **kw):
        res = original(*args, **kw)
        return res | {"fa": res["pt"]}
    return reference_backward


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_check_backward_takes_fa_algorithm_on_one_key_sink_problems(monkeypatch, dtype):
    """The fuzz run's failing shape (dense, sink, GQA 2:1, d96, one query, one key) through the harness."""
    case = AttnCase(dtype, 96, 96, 2, None, "none", 0.0, False, "dense", "dense", backward=True, sink=True)
    seeds = range(40)

    def failures(**patches):
        for name, value in patches.items():
            monkeypatch.setattr(testing, name, value)
        bad = 0
        for seed in seeds:
            problem = AttnProblem((1,), (1,), nheads_kv=1, seed=seed)
            try:
                testing.check_backward(testing.make_inputs(case, problem, "cpu", requires_grad=True), case, problem)
            except CheckFailure as e:
                assert str(e).startswith(("dq", "dk", "dv", "dsink")), e
                bad += 1
        return bad

    original = testing.reference_backward
    new = failures(forward_via_api=_fa_kernel())
    wrong = failures(forward_via_api=_fa_kernel(dq_scale=1.05))
    old = failures(forward_via_api=_fa_kernel(), reference_backward=_old_rule(original))
    print(f"{dtype}: of {len(seeds)} problems failing: new rule {new}, old rule {old}, dq x1.05 {wrong}")
    assert new == 0 and old >= 1 and wrong >= 0.6 * len(seeds), (new, old, wrong)
