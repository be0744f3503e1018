"""FlexAttention-style modifiers for the test suites: CuTe callables, each with a PyTorch twin.

The fuzz harness, the sanitizer and the GPU tests draw `AttnCase.mods` from `MODS` by name. Every
modifier depends on what a kernel that got the indices wrong would miss: the element's q_idx and
kv_idx, its query head, its batch row, aux tensors indexed by those, or aux scalars:

  position   score * (1 + ((q_idx + 2 kv_idx + h) mod 4) / 4), with its score_mod_bwd
  alibi      score + slope[h] * (kv_idx - q_idx), slopes an aux tensor (h,) fp32
  scalar     score * aux_scalars[0] (a cutlass.Int32), with its score_mod_bwd
  document   mask_mod: q and kv in the same document, ids an aux tensor (batch, length) int32
  prefix     mask_mod: kv_idx <= q_idx or kv_idx < 37 (prefix-LM)
  prefix+position  both

A twin takes the scaled scores of one sequence (1, h, sq, sk) with broadcastable index tensors and
returns what the kernel should use; masks are True where attention is kept. Indices are sequence-
local and the batch index is the sequence's, as the kernels give them. A mask_mod replaces causal
and window flags (upstream's rule), which testing.attention_ref follows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

import cutlass
import cutlass.cute as cute
from flash_attn.cute import utils as fa_utils

PREFIX = 37
SCALAR = 2


@cute.jit
def position_scale(score, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
    k = (q_idx + kv_idx * cute.full_like(kv_idx, 2) + h) % cute.full_like(q_idx, 4)
    return score * (k.to(cutlass.Float32) * cute.full_like(score, 0.25) + cute.full_like(score, 1.0))


@cute.jit
def position_scale_bwd(grad, score, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
    k = (q_idx + kv_idx * cute.full_like(kv_idx, 2) + h) % cute.full_like(q_idx, 4)
    return grad * (k.to(cutlass.Float32) * cute.full_like(grad, 0.25) + cute.full_like(grad, 1.0))


@cute.jit
def alibi(score, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
    slopes = aux_tensors[0]
    h_frag = cute.make_rmem_tensor(1, cutlass.Int32)
    h_frag.store(h)
    slope = cute.make_rmem_tensor(1, cutlass.Float32)
    slope[0] = slopes[h_frag[0]]
    return score + slope.load() * (kv_idx - q_idx).to(cutlass.Float32)


@cute.jit
def identity_bwd(grad, score, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
    return grad


@cute.jit
def scalar_scale(score, b, h, q_idx, kv_idx, seqlen_info, aux_tensors, aux_scalars):
    return score * cute.full_like(score, cutlass.Float32(aux_scalars[0]))


@cute.jit
def scalar_scale_bwd(grad, score, b, h, q_idx, kv_idx, seqlen_info, aux_tensors, aux_scalars):
    return grad * cute.full_like(grad, cutlass.Float32(aux_scalars[0]))


@cute.jit
def same_document(b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
    doc = aux_tensors[0]
    return (fa_utils.scalar_to_ssa(doc[b[0], q_idx[0]], cutlass.Int32)
            == fa_utils.scalar_to_ssa(doc[b[0], kv_idx[0]], cutlass.Int32))


@cute.jit
def prefix_lm(b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
    return (kv_idx <= q_idx) | (kv_idx < cute.full_like(kv_idx, PREFIX))


@dataclass(frozen=True)
class ModSpec:
    score_mod: Optional[Callable] = None
    score_mod_bwd: Optional[Callable] = None
    mask_mod: Optional[Callable] = None
    aux: str = ""  # "", "slopes" or "documents"
    scalars: bool = False  # aux_scalars = (cutlass.Int32(SCALAR),)
    score_twin: Optional[Callable] = None  # (s, b, h, qi, ki, aux) -> scores
    keep_twin: Optional[Callable] = None  # (b, h, qi, ki, aux) -> bool, True = attend


def _position_twin(s, b, h, qi, ki, aux):
    return s * (1.0 + ((qi + 2 * ki + h) % 4).to(s.dtype) / 4)


def _alibi_twin(s, b, h, qi, ki, aux):
    return s + aux[0].to(s.dtype)[h] * (ki - qi).to(s.dtype)


def _prefix_keep(b, h, qi, ki, aux):
    return (ki <= qi) | (ki < PREFIX)


MODS: dict[str, ModSpec] = {
    "position": ModSpec(position_scale, position_scale_bwd, score_twin=_position_twin),
    "alibi": ModSpec(alibi, identity_bwd, aux="slopes", score_twin=_alibi_twin),
    "scalar": ModSpec(scalar_scale, scalar_scale_bwd, scalars=True, score_twin=lambda s, *_: s * SCALAR),
    "document": ModSpec(mask_mod=same_document, aux="documents",
                        keep_twin=lambda b, h, qi, ki, aux: aux[0][b, qi] == aux[0][b, ki]),
    "prefix": ModSpec(mask_mod=prefix_lm, keep_twin=_prefix_keep),
    "prefix+position": ModSpec(position_scale, position_scale_bwd, prefix_lm, score_twin=_position_twin,
                               keep_twin=_prefix_keep),
}


def spec(name: str) -> ModSpec:
    try:
        return MODS[name]
    except KeyError:
        raise ValueError(f"no test modifier {name!r}; known: {sorted(MODS)}") from None


def has_score_mod(name: str) -> bool:
    return bool(name) and spec(name).score_mod is not None


def make_aux(name: str, seqlens_q, seqlens_k, num_heads: int, device, gen: torch.Generator) -> Optional[list]:
    """The aux tensors of modifier `name` for these sequences (None without any)."""
    kind = spec(name).aux
    if kind == "slopes":
        return [torch.exp2(-torch.arange(1, num_heads + 1, device=device, dtype=torch.float32) * (8.0 / num_heads))]
    if kind == "documents":  # each row: 1-4 documents of random lengths over max(seqlen) positions
        length = max([2, *seqlens_q, *seqlens_k])  # 2+ columns: a (b, 1) tensor has no unique stride-1 dim
        starts = torch.rand(len(seqlens_q), length, generator=gen, device=device) < 3.0 / length
        starts[:, 0] = False
        ids = starts.cumsum(dim=1).to(torch.int32).contiguous()
        ids.__leading_dim__ = 1  # upstream's to_cute_aux_tensor: the contiguous mode, even for one row
        return [ids]
    return None


def api_kwargs(name: str, aux: Optional[list]) -> dict:
    """The public API's modifier arguments."""
    s = spec(name)
    kw = {k: getattr(s, k) for k in ("score_mod", "score_mod_bwd", "mask_mod") if getattr(s, k) is not None}
    if aux is not None:
        kw["aux_tensors"] = aux
    if s.scalars:
        kw["aux_scalars"] = (cutlass.Int32(SCALAR),)
    return kw


def twins(name: str, aux: Optional[list], seq: int) -> tuple[Optional[Callable], Optional[Callable]]:
    """(score_fn(s, h, qi, ki), keep_fn(h, qi, ki)) for sequence `seq`, as testing.attention_ref takes them."""
    s = spec(name)
    score_fn = keep_fn = None
    if s.score_twin is not None:
        score_fn = lambda x, h, qi, ki: s.score_twin(x, seq, h, qi, ki, aux)  # noqa: E731
    if s.keep_twin is not None:
        keep_fn = lambda h, qi, ki: s.keep_twin(seq, h, qi, ki, aux)  # noqa: E731
    return score_fn, keep_fn
