"""The fp32 (and input-precision) attention references the checks in testing.py compare kernels to.

`attention_ref` is differentiable dense attention over one sequence (b, s, h, d), with upstream's
window and sink semantics and the PyTorch twins of FlexAttention-style modifiers (testing_mods);
`reference_forward` runs it, or bench's reference, per sequence of a case's layout.
"""

from __future__ import annotations

import math
from typing import Optional

from typing import TYPE_CHECKING

import torch

from flash_attn_sm120 import bench
from flash_attn_sm120.validation import window_bounds

if TYPE_CHECKING:  # the case types (testing_inputs.py)
    from flash_attn_sm120.testing_inputs import AttnCase, AttnProblem, Inputs

def attention_mask(seqlen_q: int, seqlen_k: int, causal: bool, window, device) -> Optional[torch.Tensor]:
    """(sq, sk) bool, True = masked (`bench.window_mask`); None if nothing can be masked."""
    if window_bounds(causal, *window) == (None, None):
        return None
    return bench.window_mask(seqlen_q, seqlen_k, causal, window, device)


def _mod_twins(case: AttnCase, inputs: Inputs, seq: int) -> dict:
    """attention_ref's score_fn / keep_fn for sequence `seq` of a modifier case (testing_mods) or a
    block-sparse case (testing_sparse: the lists' dense mask, the mask_mod's twin on partial blocks,
    causal when no mask_mod replaces it)."""
    score_fn = keep_fn = None
    if case.mods:
        from flash_attn_sm120 import testing_mods

        score_fn, keep_fn = testing_mods.twins(case.mods, inputs.aux, seq)
    if case.block_sparse:
        from flash_attn_sm120 import testing_sparse

        sq, sk = inputs.q_layout.seq(inputs.q, seq).shape[1], inputs.k_seq(seq).shape[1]
        keep = testing_sparse.case_keep(case.block_sparse, inputs.sparse_kinds, seq, sq, sk, keep_fn,
                                        causal=case.causal and keep_fn is None)
        keep_fn = lambda h, qi, ki: keep  # noqa: E731
    if score_fn is None and keep_fn is None:
        return {}
    return dict(score_fn=score_fn, keep_fn=keep_fn)


def attention_ref(q, k, v, *, causal=False, window=(None, None), softmax_scale=None, softcap=0.0,
                  upcast=True, reorder_ops=False, learnable_sink=None, score_fn=None, keep_fn=None):
    """Differentiable attention on (b, sq, h, d) / (b, sk, hk, d): returns (out, lse (b, h, sq)).

    upcast: fp32 math and fp32 out (the reference); else the input precision throughout (PyTorch's
    own low-precision result; reorder_ops scales K instead of Q, as upstream's reference does).
    Empty rows give out 0 and lse -inf with zero (not NaN) gradients. learnable_sink (h,): one more
    softmax column per head with that logit (natural-log units, unscaled) and no value, as upstream;
    an empty row then gives out 0 and lse = sink. score_fn(scores, h, q_idx, kv_idx) rewrites the scaled
    scores and keep_fn(h, q_idx, kv_idx) masks (True = attend) with broadcastable index tensors, the
    twins of a score_mod / mask_mod (testing_mods); a keep_fn replaces causal and window, as upstream.
    """
    dtype = q.dtype
    wide = torch.promote_types(dtype, torch.float32)  # fp32, or fp64 for gradcheck
    if upcast:
        q, k, v = q.to(wide), k.to(wide), v.to(wide)
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    k = k.repeat_interleave(h // hk, dim=2)
    v = v.repeat_interleave(h // hk, dim=2)
    if reorder_ops:
        scores = torch.einsum("bthd,bshd->bhts", q, k * scale)
    else:
        scores = torch.einsum("bthd,bshd->bhts", q * scale, k)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    dev = q.device
    hi, qi, ki = (torch.arange(n, device=dev).view(*shape) for n, shape in
                  ((h, (1, h, 1, 1)), (sq, (1, 1, sq, 1)), (sk, (1, 1, 1, sk))))
    if score_fn is not None:
        scores = score_fn(scores, hi, qi, ki)
    if keep_fn is not None:
        mask = ~keep_fn(hi, qi, ki).expand(1, h, sq, sk)
    else:
        mask = attention_mask(sq, sk, causal, window, q.device)
    if learnable_sink is not None:
        if mask is not None:
            scores = scores.masked_fill(mask, float("-inf"))
        sink = learnable_sink.to(scores.dtype if upcast else torch.float32)[None, :, None, None].expand(b, h, sq, 1)
        full = torch.cat([scores.to(sink.dtype), sink], dim=-1)
        lse = torch.logsumexp(full.to(wide), dim=-1)
        probs = torch.softmax(full, dim=-1)[..., :sk]
        out = torch.einsum("bhts,bshd->bthd", probs.to(v.dtype), v)
        return (out if upcast else out.to(dtype)), lse
    if mask is not None:
        empty = mask.all(dim=-1, keepdim=True)  # (sq, 1) or (1, h, sq, 1)
        # empty rows: softmax over zeros, then zeroed, so gradients stay finite
        scores = scores.masked_fill(mask & ~empty, float("-inf")).masked_fill(empty, 0.0)
    probs = torch.softmax(scores, dim=-1)
    lse = torch.logsumexp(scores.to(wide), dim=-1)
    if mask is not None and bool(empty.any()):
        probs = probs.masked_fill(empty, 0.0)
        lse = lse.masked_fill(empty.squeeze(-1), float("-inf"))
    out = torch.einsum("bhts,bshd->bthd", probs.to(v.dtype), v)
    return (out if upcast else out.to(dtype)), lse


def _empty_result(q, v, upcast: bool):
    b, sq, h, _ = q.shape
    out = torch.zeros(b, sq, h, v.shape[-1], dtype=torch.float32 if upcast else q.dtype, device=q.device)
    lse = torch.full((b, h, sq), float("-inf"), dtype=torch.float32, device=q.device)
    return out, lse


def reference_forward(inputs: Inputs, case: AttnCase, problem: AttnProblem, upcast: bool):
    """Per-sequence `bench.reference_attention` (fp32 if upcast): lists of (1, sq, h, dv), (1, h, sq)."""
    outs, lses = [], []
    window = problem.window(case)
    with torch.no_grad():
        for i in range(problem.batch):
            q_i, k_i, v_i = inputs.q_layout.seq(inputs.q, i), inputs.k_seq(i), inputs.v_seq(i)
            twins = (case.mods or case.block_sparse) and q_i.shape[1] > 0 and k_i.shape[1] > 0
            if (case.sink and q_i.shape[1] > 0) or twins:
                # the sink as a softmax column (no keys: out 0, lse = sink); modifiers through their twins
                o, l = attention_ref(q_i, k_i, v_i, causal=case.causal, window=window,
                                     softmax_scale=problem.softmax_scale, softcap=case.softcap, upcast=upcast,
                                     reorder_ops=not upcast, learnable_sink=inputs.sink, **_mod_twins(case, inputs, i))
            elif q_i.shape[1] == 0 or k_i.shape[1] == 0:
                o, l = _empty_result(q_i, v_i, upcast)
            else:
                o, l = bench.reference_attention(
                    q_i, k_i, v_i, causal=case.causal, window=window, softmax_scale=problem.softmax_scale,
                    softcap=case.softcap, upcast=upcast,
                )
            outs.append(o)
            lses.append(l)
    return outs, lses




def fa_backward_ref(q, k, v, dout, *, causal=False, window=(None, None), softmax_scale=None, softcap=0.0,
                    learnable_sink=None, score_fn=None, keep_fn=None, dlse=None, out=None):
    """FlashAttention's backward algorithm in the inputs' precision: (dq, dk, dv, dsink or None).

    Why: the backward rule compares a kernel's error with the error of a computation in the inputs'
    precision. Autograd of `attention_ref(upcast=False)` is one such computation, but not the one a
    FlashAttention backward performs: FA takes D = rowsum(dO * O) from the output O as stored (rounded
    to the dtype), and with few keys (one key: dP - D = (1 - P) dO.V) that rounding dominates dS where
    P is near 1, e.g. when a learnable sink takes little of the row (scripts/sim_sink_bwd_tolerance.py).
    This function is that algorithm, with every matmul accumulated in fp32 (fp64 for fp64 inputs, where
    it is exact) and a rounding to q.dtype wherever FA stores: P for the P V product, O, dO, P for dV,
    dS, and dq / dk / dv at the end.
      forward  O = round(round(exp(S - m)) V / l), m the row max over keys and sink, l the row sum
               (sink included), S the scaled scores after softcap / score_fn, masked to -inf;
      backward P = exp(S - LSE) (the fp32 LSE, sink column included), D = rowsum(dO O) - dLSE,
               dS = round(P (dO V^T - D)) (through softcap / score_fn's derivative in fp32 first),
               dq = round(dS K scale), dk = round(sum over a KV head's query heads of dS^T Q scale),
               dv = round(sum of round(P)^T dO), dsink = sum over rows of p_sink (dLSE - rowsum(dO O)).
    Masks, windows, keep_fn (replacing causal / window), sink and empty rows as `attention_ref`: an empty
    row gives zero gradients (with a sink: p_sink = 1, its dsink term dLSE). dout: the gradient of out
    (b, sq, h, dv), rounded to q.dtype as the kernel receives it; dlse: (b, h, sq) or None.
    out: the forward's stored output, which FA's backward takes D from (the harness passes the kernel's,
    already held to the forward rule: the forward kernels round O in different orders, sink folds
    included, and each order moves D differently); None: the forward model above.
    """
    dtype = q.dtype
    wide = torch.promote_types(dtype, torch.float32)
    rnd = lambda t: t.to(dtype).to(wide)  # noqa: E731  (a store in the inputs' precision)
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g = h // hk
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    qw = q.detach().to(wide)
    kw, vw = (t.detach().to(wide).repeat_interleave(g, dim=2) for t in (k, v))
    raw = torch.einsum("bthd,bshd->bhts", qw, kw) * scale
    dev = q.device
    hi, qi, ki = (torch.arange(n, device=dev).view(*shape) for n, shape in
                  ((h, (1, h, 1, 1)), (sq, (1, 1, sq, 1)), (sk, (1, 1, 1, sk))))
    modified = bool(softcap) or score_fn is not None
    with torch.enable_grad():  # the elementwise score transform, differentiated on its own (a VJP below)
        raw_leaf = raw.requires_grad_(modified)
        scores = softcap * torch.tanh(raw_leaf / softcap) if softcap else raw_leaf
        if score_fn is not None:
            scores = score_fn(scores, hi, qi, ki)
    if keep_fn is not None:
        mask = ~keep_fn(hi, qi, ki).expand(1, h, sq, sk)
    else:
        mask = attention_mask(sq, sk, causal, window, dev)
    s = scores.detach() if mask is None else scores.detach().masked_fill(mask, float("-inf"))
    neg_inf = torch.full((b, h, sq), float("-inf"), dtype=wide, device=dev)
    m = s.amax(dim=-1) if sk else neg_inf
    sink = None
    if learnable_sink is not None:
        sink = learnable_sink.detach().to(wide)[None, :, None].expand(b, h, sq)
        m = torch.maximum(m, sink)
        lse = torch.logsumexp(torch.stack([torch.logsumexp(s, -1) if sk else neg_inf, sink]), 0)
    else:
        lse = torch.logsumexp(s, -1) if sk else neg_inf
    m = torch.where(torch.isfinite(m), m, 0.0)
    p_un = torch.exp(s - m[..., None])
    denom = p_un.sum(-1) + (torch.exp(sink - m) if sink is not None else 0.0)
    o = torch.einsum("bhts,bshd->bthd", rnd(p_un), vw) / torch.where(denom > 0, denom, 1.0).transpose(1, 2)[..., None]
    o = rnd(o) if out is None else rnd(out.detach().to(wide))
    do = rnd(dout.detach().to(wide))
    rowsum = (do * o).sum(-1).transpose(1, 2)  # (b, h, sq)
    dsum = rowsum - (dlse.detach().to(wide) if dlse is not None else 0.0)
    live = torch.isfinite(lse)[..., None]
    p = torch.where(live, torch.exp(s - torch.where(live, lse[..., None], 0.0)), 0.0)
    ds = p * (torch.einsum("bthd,bshd->bhts", do, vw) - dsum[..., None])
    if modified:
        ds = torch.autograd.grad(scores, raw_leaf, ds)[0]
    ds = rnd(ds)

    def per_kv_head(t):  # (b, sk, h, x) -> (b, sk, hk, x): the query heads of a group summed
        return t.view(b, sk, hk, g, t.shape[-1]).sum(3)

    dq = rnd(torch.einsum("bhts,bshd->bthd", ds, kw) * scale)
    dk = rnd(per_kv_head(torch.einsum("bhts,bthd->bshd", ds, qw) * scale))
    dv = rnd(per_kv_head(torch.einsum("bhts,bthd->bshd", rnd(p), do)))
    dsink = None
    if learnable_sink is not None:
        p_sink = torch.where(live[..., 0], torch.exp(sink - torch.where(live[..., 0], lse, 0.0)), 0.0)
        dsink = (-p_sink * dsum).sum(dim=(0, 2)).to(learnable_sink.dtype)
    return dq.to(dtype), dk.to(dtype), dv.to(dtype), dsink


def _loss(outs, lses, g_out, g_lse):
    """sum(out * g) (+ sum(lse * g_lse)) over the sequences: the loss every backward check differentiates."""
    total = 0.0
    for i, o in enumerate(outs):
        total = total + (o.float() * g_out[i].float()).sum()
        if g_lse is not None:
            total = total + (lses[i] * g_lse[i]).sum()
    return total


def reference_backward(inputs: Inputs, case: AttnCase, problem: AttnProblem, wrt, g_out, g_lse, out=None) -> dict:
    """The backward references for the gradients of `_loss` wrt `wrt` (q, k, v[, sink]), in their storage:
    "ref" fp32 autograd of `attention_ref`, "pt" its autograd in the inputs' precision, "fa"
    `fa_backward_ref` (FlashAttention's algorithm in the inputs' precision, D from `out`, the kernel's
    output in q's storage, when given), for every case (softcap, score_mod and mask_mod twins, block-sparse
    keep masks included)."""
    results = {}
    window = problem.window(case)
    nq = range(problem.batch)
    for name, upcast in (("ref", True), ("pt", False)):
        # fp32 leaves for the reference (fp32 gradients), input-precision leaves for PyTorch's own
        leaves = [(t.detach().float() if upcast else t.detach().clone()).requires_grad_(True) for t in wrt]
        ref_inputs = type(inputs)(*leaves[:3], inputs.q_layout, inputs.k_layout)
        sink = leaves[3] if case.sink else None
        r_outs, r_lses = [], []
        for i in nq:
            q_i, k_i, v_i = (ref_inputs.q_layout.seq(leaves[0], i), ref_inputs.k_seq(i), ref_inputs.v_seq(i))
            o, l = attention_ref(q_i, k_i, v_i, causal=case.causal, window=window, softmax_scale=problem.softmax_scale,
                                 softcap=case.softcap, upcast=upcast, reorder_ops=not upcast, learnable_sink=sink,
                                 **_mod_twins(case, inputs, i))
            r_outs.append(o)
            r_lses.append(l)
        loss = _loss(r_outs, r_lses if case.return_lse else None, g_out, g_lse)
        results[name] = torch.autograd.grad(loss, leaves, allow_unused=True)
    fa = [torch.zeros_like(t, memory_format=torch.contiguous_format).detach() for t in wrt]
    for i in nq:
        q_i, k_i, v_i = inputs.q_layout.seq(inputs.q, i), inputs.k_seq(i), inputs.v_seq(i)
        dq, dk, dv, dsink = fa_backward_ref(
            q_i, k_i, v_i, g_out[i], causal=case.causal, window=window, softmax_scale=problem.softmax_scale,
            softcap=case.softcap, learnable_sink=inputs.sink if case.sink else None,
            dlse=g_lse[i] if g_lse is not None else None, out=None if out is None else inputs.q_layout.seq(out, i),
            **_mod_twins(case, inputs, i))
        inputs.q_layout.seq(fa[0], i).copy_(dq)
        inputs.k_layout.seq(fa[1], i).add_(dk)
        inputs.k_layout.seq(fa[2], i).add_(dv)
        if dsink is not None:
            fa[3] += dsink
    results["fa"] = tuple(fa)
    return results
