"""Learnable sinks on the GPU, every route: against the fp32 reference with the sink as a softmax column.

Forward on the cp.async and TMA table entries, varlen, a sliding window that leaves rows with no key,
SplitKV decode (the sink once per row, not per split) and paged decode; the LSE too. Backward: dQ,
dK, dV and dsink against fp32 autograd through the same reference, with upstream's rule (2x the
error of the reference in the inputs' precision, plus an atol).
"""

import pytest

torch = pytest.importorskip("torch")

import flash_attn_sm120  # noqa: E402
from flash_attn_sm120 import testing  # noqa: E402
from flash_attn_sm120.bench import paged_copy  # noqa: E402

pytestmark = pytest.mark.gpu


def _close(name, actual, ref, pt, atol=2e-3):
    assert actual.isfinite().all(), name
    err = (actual.float() - ref.float()).abs().max().item()
    bound = 2 * (pt.float() - ref.float()).abs().max().item() + atol
    assert err <= bound, (name, err, bound)


def _inputs(b, sq, sk, h, hk, d, seed, dtype=torch.bfloat16, sink_dtype=torch.bfloat16, grad=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(s, device="cuda", dtype=dtype, generator=g) for s in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d)))
    sink = (torch.randn(h, device="cuda", generator=g) * 2).to(sink_dtype)
    if grad:
        for t in (q, k, v, sink):
            t.requires_grad_(True)
    return q, k, v, sink


def _refs(q, k, v, sink, **kw):
    ref = testing.attention_ref(q, k, v, learnable_sink=sink, **kw)
    pt = testing.attention_ref(q, k, v, learnable_sink=sink, upcast=False, reorder_ops=True, **kw)
    return ref, pt


@pytest.mark.parametrize("d,causal,window", [(64, False, (None, None)), (128, True, (None, None)),
                                             (96, True, (None, None)), (128, False, (None, None)),
                                             (64, False, (40, -30))])
def test_forward_dense(d, causal, window):
    q, k, v, sink = _inputs(2, 300, 300, 8, 2, d, seed=d + causal)
    out, lse = flash_attn_sm120.flash_attn_func(q, k, v, causal=causal, window_size=window, learnable_sink=sink,
                                                return_lse=True)
    (ro, rl), (po, pl) = _refs(q, k, v, sink, causal=causal, window=window)
    _close("out", out, ro, po)
    _close("lse", lse, rl, pl, atol=1e-3)
    if window == (40, -30):  # rows with no key (the first 30): out exactly 0, lse = sink, as upstream
        empty = torch.isinf(testing.attention_ref(q, k, v, window=window)[1])[0, 0]  # (sq,), the same per head
        assert empty.sum() == 30
        assert (out[:, empty] == 0).all()
        torch.testing.assert_close(lse[:, :, empty], sink.float()[None, :, None].expand(2, -1, 30), rtol=0, atol=1e-6)


def test_forward_varlen():
    lens = [130, 1, 257]
    cu = torch.tensor([0, 130, 131, 388], dtype=torch.int32, device="cuda")
    q, k, v, sink = _inputs(1, 388, 388, 8, 2, 128, seed=5, sink_dtype=torch.float32)
    out, lse = flash_attn_sm120.flash_attn_varlen_func(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                       max_seqlen_q=max(lens), max_seqlen_k=max(lens), causal=True,
                                                       learnable_sink=sink, return_lse=True)
    for i in range(3):
        a, b = int(cu[i]), int(cu[i + 1])
        (ro, rl), (po, pl) = _refs(q[:, a:b], k[:, a:b], v[:, a:b], sink, causal=True)
        _close(f"out[{i}]", out[a:b], ro[0], po[0])
        _close(f"lse[{i}]", lse[:, a:b], rl[0], pl[0], atol=1e-3)


@pytest.mark.parametrize("num_splits", [0, 1, 5])
def test_decode_splits_once_per_row(num_splits):
    q, k, v, sink = _inputs(3, 1, 4000, 32, 8, 128, seed=7)
    out, lse = flash_attn_sm120.flash_attn_func(q, k, v, num_splits=num_splits, learnable_sink=sink, return_lse=True)
    (ro, rl), (po, pl) = _refs(q, k, v, sink)
    _close("out", out, ro, po)
    _close("lse", lse, rl, pl, atol=1e-3)


def test_paged_decode():
    b, sk, page = 2, 1500, 64
    q, k, v, sink = _inputs(b, 1, sk, 16, 4, 128, seed=9)
    pool_k, pool_v, table = paged_copy(k, v, page, torch.Generator().manual_seed(1))
    out, _ = flash_attn_sm120.flash_attn_varlen_func(
        q.reshape(b, 16, 128), pool_k, pool_v, cu_seqlens_q=torch.arange(b + 1, dtype=torch.int32, device="cuda"),
        max_seqlen_q=1, page_table=table, seqused_k=torch.full((b,), sk, dtype=torch.int32, device="cuda"),
        num_splits=0, learnable_sink=sink)
    (ro, _), (po, _) = _refs(q, k, v, sink)
    _close("out", out, ro[:, 0], po[:, 0])


@pytest.mark.parametrize("d,causal,hk,sink_dtype", [(128, True, 2, torch.bfloat16), (64, False, 8, torch.float32),
                                                     (96, True, 4, torch.bfloat16)])
def test_backward_with_dsink(d, causal, hk, sink_dtype):
    q, k, v, sink = _inputs(2, 257, 257, 8, hk, d, seed=11 + d, sink_dtype=sink_dtype, grad=True)
    g = torch.randn_like(q)
    out, _ = flash_attn_sm120.flash_attn_func(q, k, v, causal=causal, learnable_sink=sink)
    got = torch.autograd.grad(out, (q, k, v, sink), g)
    want, low = [], []
    for upcast, dst in ((True, want), (False, low)):
        leaves = [(t.detach().float() if upcast else t.detach().clone()).requires_grad_(True) for t in (q, k, v, sink)]
        o, _ = testing.attention_ref(*leaves[:3], learnable_sink=leaves[3], causal=causal, upcast=upcast,
                                     reorder_ops=not upcast)
        dst.extend(torch.autograd.grad(o, leaves, g.to(o.dtype)))
    for name, a, r, lo in zip(("dq", "dk", "dv", "dsink"), got, want, low):
        assert a.dtype == (sink_dtype if name == "dsink" else q.dtype)
        _close(name, a, r, lo, atol=2e-3 if name != "dsink" else 2e-2)


def test_backward_with_lse_gradient_varlen():
    cu = torch.tensor([0, 100, 357], dtype=torch.int32, device="cuda")
    q, k, v, sink = _inputs(1, 357, 357, 4, 4, 128, seed=13, sink_dtype=torch.float32, grad=True)
    go, gl = torch.randn(357, 4, 128, device="cuda", dtype=torch.bfloat16), torch.randn(4, 357, device="cuda")
    out, lse = flash_attn_sm120.flash_attn_varlen_func(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                       max_seqlen_q=257, max_seqlen_k=257, causal=True,
                                                       learnable_sink=sink, return_lse=True)
    got = torch.autograd.grad((out, lse), (q, k, v, sink), (go, gl))
    leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v, sink)]
    outs, lses = [], []
    for a, b in ((0, 100), (100, 357)):
        o, l = testing.attention_ref(leaves[0][:, a:b], leaves[1][:, a:b], leaves[2][:, a:b], learnable_sink=leaves[3],
                                     causal=True)
        outs.append(o[0])
        lses.append(l[0])
    want = torch.autograd.grad((torch.cat(outs), torch.cat(lses, dim=1)), leaves, (go.float(), gl))
    for name, a, r in zip(("dq", "dk", "dv", "dsink"), got, want):
        scale = r.abs().max().item()
        assert (a.float() - r).abs().max().item() <= 0.02 * scale + 2e-3, name


@pytest.mark.parametrize("d,causal", [(64, True), (128, True), (96, True), (64, False)])
def test_sink_far_above_every_score(d, causal):
    """A score_mod that lowers every score by 100 (ALiBi far from the diagonal does so): the sink is the
    row's largest logit by more than e^88, where a sink term scaled by the row's max overflows fp32 (LSE
    inf; FA4's Softmax.finalize does). The TMA entries count it against the larger of the two."""
    import cutlass.cute as cute

    @cute.jit
    def far_below(score, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        return score - cute.full_like(score, 100.0)

    q, k, v, sink = _inputs(2, 300, 300, 8, 2, d, seed=11 + d, sink_dtype=torch.float32)
    out, lse = flash_attn_sm120.flash_attn_func(q, k, v, causal=causal, learnable_sink=sink, score_mod=far_below,
                                                return_lse=True)
    kw = dict(causal=causal, score_fn=lambda s, h, qi, ki: s - 100.0)
    (ro, rl), (po, pl) = _refs(q, k, v, sink, **kw)
    _close("out", out, ro, po)
    _close("lse", lse, rl, pl, atol=1e-3)
