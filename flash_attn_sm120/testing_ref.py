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

if TYPE_CHECKING:  # the case types live in testing.py, which imports this module
    from flash_attn_sm120.testing import AttnCase, AttnProblem, Inputs

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

        sq, sk = inputs.q.shape[1], inputs.k_seq(seq).shape[1]
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


