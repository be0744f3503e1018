"""Learnable attention sinks (gpt-oss), exactly as upstream FA4 defines them, on every SM120 path.

A sink is one extra softmax column per query head h with logit sink[h] (natural-log units, not
multiplied by softmax_scale) and no value vector: it enlarges the normalizer, never the output's
numerator. From a kernel's sink-free result (O, LSE) of any family (cp.async, TMA, SplitKV after its
combine, decode, paged), the sink's result is exact:

    LSE' = logaddexp(LSE, sink[h])          O' = O * exp(LSE - LSE')

so a fully masked row (LSE = -inf) gets O' = 0 and LSE' = sink[h], as upstream's kernels give; and the
sink enters once per row whatever the split count. The backward's dQ/dK/dV are the sink-free
formulas evaluated at (O', LSE') (the sink column has no value, so it adds nothing to dP, and
D = rowsum(dO * O') already holds its share); the sink's own gradient is

    dsink[h] = sum over rows of exp(sink[h] - LSE') * (dLSE' - rowsum(dO * O'))

(upstream: -sum exp(sink - lse) * dpsum, with dpsum = D - dLSE). The forward's kernels count the sink themselves
(the TMA family in its final softmax; cp.async and SplitKV fold it into the output tile in registers,
kernels/sink_fold.py; SplitKV: split 0 only), so they return (O', LSE').
This module is the same arithmetic on whole tensors (`apply_sink`, the reference the tests hold the
kernels to), the API's checks, and the backward's dsink, on the layouts the drivers use: O (b, s, h, d)
with LSE (b, h, s), or varlen O (total, h, d) with LSE (h, total). dsink costs one pass over dO and O'
(in slices, so the fp32 temporaries stay small).
"""

from __future__ import annotations

from typing import Optional

import torch

SINK_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_sink(learnable_sink: torch.Tensor, num_heads: int, device: torch.device) -> None:
    """ValueError/TypeError naming the problem, as upstream's shape and dtype rules."""
    if not isinstance(learnable_sink, torch.Tensor):
        raise TypeError(f"learnable_sink must be a tensor of shape ({num_heads},), got {type(learnable_sink).__name__}")
    if learnable_sink.shape != (num_heads,):
        raise ValueError(f"learnable_sink must have shape (num_heads,) = ({num_heads},), got {tuple(learnable_sink.shape)}")
    if learnable_sink.dtype not in SINK_DTYPES:
        raise ValueError(f"learnable_sink must be float16, bfloat16 or float32, got {learnable_sink.dtype}")
    if learnable_sink.device != device:
        raise ValueError(f"learnable_sink is on {learnable_sink.device}, q on {device}")


def sink_like_lse(sink: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """sink broadcast against lse: (1, h, 1) for (b, h, s), (h, 1) for varlen (h, total)."""
    s = sink.to(torch.promote_types(lse.dtype, torch.float32))
    return s[None, :, None] if lse.dim() == 3 else s[:, None]


def _per_token(x: torch.Tensor) -> torch.Tensor:
    """An LSE-shaped tensor as a factor on O: (b, h, s) -> (b, s, h, 1); (h, total) -> (total, h, 1)."""
    return (x.transpose(1, 2) if x.dim() == 3 else x.transpose(0, 1)).unsqueeze(-1)


def apply_sink(out: torch.Tensor, lse: torch.Tensor, learnable_sink: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(O', LSE') from the sink-free (O, LSE); O is rescaled in place, LSE' is a new tensor (fp32 from
    the kernels' fp32 LSE)."""
    lse_sink = torch.logaddexp(lse, sink_like_lse(learnable_sink, lse))
    # 0 for an empty row (lse = -inf); a sink of -inf on an empty row leaves LSE' = -inf, O' = 0, as upstream
    factor = torch.where(torch.isneginf(lse_sink), 0.0, torch.exp(lse - lse_sink))
    out.mul_(_per_token(factor))  # one pass over O, the product in fp32, rounded once to O's dtype
    return out, lse_sink


def valid_rows(lse: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor] = None,
               seqused_q: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """Which LSE rows belong to a sequence (bool, LSE's layout), or None when all do. Rows past a
    sequence's seqused_q, or past cu_seqlens_q[-1], hold whatever the kernels left there."""
    if cu_seqlens_q is None and seqused_q is None:
        return None
    if lse.dim() == 3:  # (b, h, s) with seqused_q (b,)
        pos = torch.arange(lse.shape[2], device=lse.device)
        return (pos[None, :] < seqused_q[:, None])[:, None, :]
    total = lse.shape[1]
    pos = torch.arange(total, device=lse.device)
    cu = cu_seqlens_q.long()
    seq = torch.searchsorted(cu[1:], pos, right=True).clamp_max(cu.numel() - 2)
    length = cu[1:] - cu[:-1]
    used = length if seqused_q is None else torch.minimum(length, seqused_q.long())
    ok = (pos < cu[-1]) & (pos - cu[seq] < used[seq])
    return ok[None, :]


def sink_grad(out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor, dlse: Optional[torch.Tensor],
              learnable_sink: torch.Tensor, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """dsink (shape and dtype of learnable_sink) from the sink's forward result (O', LSE') and its
    gradients; rows (valid_rows) leaves out rows that belong to no sequence."""
    wide = torch.promote_types(lse.dtype, torch.float32)
    rowsum = _rowsum(dout, out, wide)  # (b, s, h) or (total, h)
    rowsum = rowsum.transpose(1, 2) if lse.dim() == 3 else rowsum.transpose(0, 1)  # LSE's layout
    sink = sink_like_lse(learnable_sink, lse)
    p_sink = torch.where(torch.isneginf(sink), 0.0, torch.exp(sink - lse))  # a -inf sink has no share
    coeff = -rowsum if dlse is None else dlse.to(wide) - rowsum
    per_row = p_sink * coeff
    if rows is not None:
        per_row = torch.where(rows, per_row, 0.0)
    dims = (0, 2) if lse.dim() == 3 else (1,)
    return per_row.sum(dim=dims).to(learnable_sink.dtype)


def _rowsum(dout: torch.Tensor, out: torch.Tensor, wide: torch.dtype, chunk_elems: int = 1 << 26) -> torch.Tensor:
    """rowsum(dO * O') over the head dim in `wide` precision, a slice of the leading dim at a time, so
    that the widened temporaries stay near chunk_elems elements (not three times O's size in fp32)."""
    if dout.shape[0] == 0:  # no rows (a varlen batch of empty sequences)
        return torch.zeros(dout.shape[:-1], dtype=wide, device=dout.device)
    rows = max(1, chunk_elems // max(1, dout[0].numel()))
    parts = [(dout[i:i + rows].to(wide) * out[i:i + rows].to(wide)).sum(-1) for i in range(0, dout.shape[0], rows)]
    return torch.cat(parts) if len(parts) != 1 else parts[0]
