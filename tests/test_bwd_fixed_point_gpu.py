"""deterministic=True by fixed-point dQ (kernels/bwd_fixed_point.py) on the GPU: bitwise-identical and correct.

Each case runs the public API's forward and autograd backward three times with deterministic=True, fixed point
forced (the plan's default only for sliding windows and block-sparse lists: without a window the turn orders
are faster, bwd_plans.deterministic_plan); the gradients must be equal bit for bit, and the first
within upstream's rule against fp32 autograd (one case through the driver with dq/dk/dv poisoned with NaN
before the call). Covered: the
table's entries at d64/d96/d128, causal and not, GQA, varlen, and what the turn orders could not run:
sliding windows. Plus: the bound holds at extreme input scales, a NaN in one head's dO leaves the other
heads' gradients finite, and fixed point agrees with the turn order it replaced.
"""

import pytest

torch = pytest.importorskip("torch")

from flash_attn_sm120 import driver_bwd, flash_attn_func, flash_attn_varlen_func, testing  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _fixed_point():
    with driver_bwd.force_deterministic_plan(dq_fixed_point=True):
        yield


def _grads(fn, q, k, v, g, **kw):
    out, _ = fn(q, k, v, **kw)
    return torch.autograd.grad(out, (q, k, v), g)


def _reference_grads(q, k, v, g, **kw):
    out = []
    for upcast in (True, False):
        leaves = [(t.detach().float() if upcast else t.detach().clone()).requires_grad_(True) for t in (q, k, v)]
        o, _ = testing.attention_ref(*leaves, upcast=upcast, reorder_ops=not upcast, **kw)
        out.append(torch.autograd.grad(o, leaves, g.to(o.dtype)))
    return out


def _check(actual, ref, pt, atol=2e-3):
    for name, a, r, lo in zip(("dq", "dk", "dv"), actual, ref, pt):
        assert a.isfinite().all(), name
        err, bound = (a.float() - r).abs().max().item(), 2 * (lo.float() - r).abs().max().item() + atol
        assert err <= bound, (name, err, bound)


def _assert_bitwise(runs):
    for other in runs[1:]:
        for a, c in zip(runs[0], other):
            assert torch.equal(a, c)


def _inputs(b, sq, sk, h, hk, d, seed, dtype=torch.bfloat16, grad_scale=1.0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=gen, device="cuda", dtype=torch.float32).to(dtype).requires_grad_(True)  # noqa: E731
    g = (torch.randn(b, sq, h, d, generator=gen, device="cuda") * grad_scale).to(dtype)
    return mk(b, sq, h, d), mk(b, sk, hk, d), mk(b, sk, hk, d), g


def _fixed_point_keys() -> set:
    return {s for s in driver_bwd._verified_keys if s.deterministic and s.dq_fixed_point}


@pytest.mark.parametrize("b,sq,sk,h,hk,d,kw", [
    (2, 1000, 1000, 8, 2, 128, dict(causal=True)),  # GQA causal d128 (the dK/dV order stays)
    (1, 777, 900, 4, 4, 128, dict()),
    (2, 513, 513, 8, 2, 64, dict(causal=True)),  # the d64 entry (Q/dO 2 stages)
    (1, 600, 700, 6, 3, 96, dict()),  # the d96 entry (4 warps, one Q stage: dQ after dK)
    (2, 640, 640, 4, 4, 96, dict(causal=True)),
    (1, 900, 1100, 4, 2, 128, dict(window_size=(200, 50))),  # sliding window: the turn orders refused it
    (2, 700, 700, 4, 4, 64, dict(window_size=(None, 0))),  # one-sided window (upstream's meaning: causal-like)
    (1, 800, 800, 4, 1, 128, dict(causal=True, softcap=15.0)),  # softcap's derivative <= 1: the bound holds (MQA)
])
def test_bitwise_and_correct(b, sq, sk, h, hk, d, kw):
    q, k, v, g = _inputs(b, sq, sk, h, hk, d, seed=sq + d)
    before = _fixed_point_keys()
    runs = [_grads(flash_attn_func, q, k, v, g, deterministic=True, **kw) for _ in range(3)]
    assert _fixed_point_keys() - before or any(s.head_dim == d for s in before), "fixed point did not run"
    _assert_bitwise(runs)
    window = kw.get("window_size", (None, None))
    ref_kw = dict(causal=kw.get("causal", False), window=window, softcap=kw.get("softcap", 0.0))
    _check(runs[0], *_reference_grads(q, k, v, g, **ref_kw))


def test_varlen_gqa_bitwise_and_correct():
    lens_q, lens_k = (300, 77, 512), (350, 90, 512)
    gen = torch.Generator(device="cuda").manual_seed(5)
    mk = lambda n, hh: torch.randn(n, hh, 128, generator=gen, device="cuda").to(torch.bfloat16).requires_grad_(True)  # noqa: E731
    q, k, v = mk(sum(lens_q), 8), mk(sum(lens_k), 2), mk(sum(lens_k), 2)
    g = torch.randn(q.shape, generator=gen, device="cuda").to(torch.bfloat16)
    cq = torch.tensor([0, 300, 377, 889], dtype=torch.int32, device="cuda")
    ck = torch.tensor([0, 350, 440, 952], dtype=torch.int32, device="cuda")
    kw = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=512, max_seqlen_k=512, causal=True, deterministic=True)
    runs = [_grads(flash_attn_varlen_func, q, k, v, g, **kw) for _ in range(3)]
    _assert_bitwise(runs)
    for i in range(3):
        sl_q, sl_k = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        ref, pt = _reference_grads(q[sl_q][None], k[sl_k][None], v[sl_k][None], g[sl_q][None], causal=True)
        _check([runs[0][0][sl_q][None], runs[0][1][sl_k][None], runs[0][2][sl_k][None]], ref, pt)


@pytest.mark.parametrize("grad_scale", [1e-6, 1e4])
def test_extreme_gradient_scales(grad_scale):
    """The per-head scale follows dO's magnitude: tiny and large output gradients stay within the rule."""
    q, k, v, g = _inputs(1, 700, 700, 4, 4, 128, seed=3, grad_scale=grad_scale)
    runs = [_grads(flash_attn_func, q, k, v, g, causal=True, deterministic=True) for _ in range(2)]
    _assert_bitwise(runs)
    ref, pt = _reference_grads(q, k, v, g, causal=True)
    _check(runs[0], ref, pt, atol=2e-3 * grad_scale)


def test_nan_in_one_head_stays_in_that_head():
    """A NaN in head 1's dO: head 1's dQ is NaN, the other heads' gradients are finite and equal the
    same call's without the NaN bit for bit (their scales do not see it)."""
    q, k, v, g = _inputs(1, 500, 500, 4, 4, 64, seed=4)
    clean = _grads(flash_attn_func, q, k, v, g, deterministic=True)
    bad = g.clone()
    bad[0, 10, 1, 3] = float("nan")
    dirty = _grads(flash_attn_func, q, k, v, bad, deterministic=True)
    assert dirty[0][:, :, 1].isnan().all()
    for head in (0, 2, 3):
        for a, c in zip(clean, dirty):
            assert torch.equal(a[:, :, head], c[:, :, head]), head


@pytest.mark.parametrize("causal", [True, False])
def test_agrees_with_the_turn_order(causal):
    """Fixed point and the turn order it replaced (fused turns) are both within the rule and close to each
    other: dQ within fp32 rounding; dK/dV identical under causal (the same m order; the descending turns
    change dQ's order only), within rounding without a mask (the rotated order starts each K/V tile's m
    loop elsewhere, so dK/dV sum in another order)."""
    q, k, v, g = _inputs(2, 900, 900, 4, 4, 128, seed=21 + causal)
    fixed = _grads(flash_attn_func, q, k, v, g, causal=causal, deterministic=True)
    turns = {True: dict(dq_descending=True, reverse_n_blocks=True, fused_turns=True),
             False: dict(dq_rotated=True, fused_turns=True)}[causal]
    with driver_bwd.force_deterministic_plan(**turns):
        ordered = _grads(flash_attn_func, q, k, v, g, causal=causal, deterministic=True)
    ref, pt = _reference_grads(q, k, v, g, causal=causal)
    _check(fixed, ref, pt)
    _check(ordered, ref, pt)
    if causal:
        assert torch.equal(fixed[1], ordered[1]) and torch.equal(fixed[2], ordered[2])
    for i in range(3) if not causal else range(1):
        assert (fixed[i].float() - ordered[i].float()).abs().max().item() <= \
            2 * (pt[i].float() - ref[i]).abs().max().item(), ("dq", "dk", "dv")[i]


def test_poisoned_gradient_buffers_are_overwritten():
    """driver_bwd.backward into NaN-filled dq/dk/dv (GQA causal d128): every element written, correct."""
    q, k, v, g = _inputs(1, 600, 600, 4, 2, 128, seed=8)
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    bufs = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    grads = driver_bwd.backward(q, k, v, out.detach(), g, lse.detach(), softmax_scale=None, causal=True,
                                window_size_left=None, window_size_right=None, deterministic=True,
                                dq=bufs[0], dk=bufs[1], dv=bufs[2])
    assert all(a is b for a, b in zip(grads, bufs))
    _check(grads, *_reference_grads(q, k, v, g, causal=True))
