"""Deterministic dQ by fixed-point accumulation: the same bits whatever order the CTAs add in.

Why: dQ is the one gradient that several CTAs of the backward add into (every n_block CTA adds its
dS K to each m_block it sees). fp32 addition is not associative, so with atomics the result depends on
the order in which the CTAs arrive. The ordered backward (bwd_deterministic.py) fixes that order with
turn counters and pays for the waits (0.72-0.85x the default backward, emulated). Integer addition is
associative: if each CTA adds its contribution as a 64-bit fixed-point integer, the sum has the same
bits in any order, and no CTA ever waits.

The bound. The kernel accumulates dQ before the softmax scale (the postprocess applies it):

    dQ_acc[i, c] = sum_j dS[i, j] K[j, c],   dS = P * (dP - D),   dP[i, j] = dO_i . V_j,   D_i = dO_i . O_i

P's row sums to at most 1 and O_i is a convex combination of V rows, so over any set of keys j (one
CTA's n_block, or all of them)

    |sum_j dS[i, j] K[j, c]| <= 2 * max|K| * max_j |dO_i . V_j| <= 2 * d_v * max|dO| * max|V| * max|K| =: B

Softcap's derivative is at most 1 and a learnable sink only lowers P's row sum, so neither raises B. A
gradient of the LSE (dLSE) replaces D_i by D_i - dLSE_i and adds max|K| max|dLSE| to B (`scales_with_dlse`);
a user's score_mod_bwd can return anything and is not covered (the ordered backward serves it). Per
query head h, B_h comes from three per-head max |x| (K, V, dO) and k_h is the largest integer with
B_h * 2^k_h <= 2^59, in exact integer arithmetic on the maxima's bit patterns (`scales_from_patterns`).
One launch computes both (kernels/bwd_fixed_point_scales.py); `dq_scales` is its torch reference and
fallback, with the same bits. 2^59 leaves a 16x margin under int64's 2^63 for the rounding of P, dS and O. The
kernel adds round(x * 2^k_h) with one `red.global.add.u64` per element (`red_add_fixed`); the
multiplication by a power of two is exact, and rounding drops only what lies below 2^-k_h (about
2^-59 B_h), far under fp32's own rounding of the larger terms. kernels/bwd_fixed_point_post.py turns
the integer sum into fp32 times 2^-k_h and writes dQ in one pass; `dequantize` followed by upstream's
postprocess is its torch reference (the same bits).

Non-finite inputs: a head whose bound is not finite (NaN or inf in its K, V or dO) gets a NaN scale and
a NaN dQ, where the fp32 atomics would give NaN in the rows that touch the bad value.

Layout: the kernel keeps upstream's fp32 accumulator partition (`tdQgdQaccum`). Element e of that
fp32 layout is element e of an int64 buffer: for the fp32 element's address p = base + 4e its int64
address is base + 8e = 2p - base. The fp32 tensor the kernel receives is a view of the int64 buffer's
first half (`fixed_accumulator`), so its addresses, and upstream's partition of them, are unchanged.
"""

from __future__ import annotations

from typing import Optional

import torch

from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

SCALE_LOG2_CEILING = 59  # B_h * 2^k_h <= 2^59: 16x under int64's range for the kernel's rounding
SCALE_LOG2_RANGE = (-100, 100)  # 2^k_h stays a normal fp32 (k_h clamped: a zero bound takes 2^100)


@dsl_user_op
def red_add_fixed(address: Int64, value: Float32, scale: Float32, *, loc=None, ip=None) -> None:
    """*address (int64) += round(value * scale), as one relaxed global reduction (no return value)."""
    llvm.inline_asm(
        None,
        [Int64(address).ir_value(loc=loc, ip=ip), Float32(value).ir_value(loc=loc, ip=ip),
         Float32(scale).ir_value(loc=loc, ip=ip)],
        "{\n.reg .f32 s;\n.reg .s64 t;\nmul.rn.f32 s, $1, $2;\ncvt.rni.s64.f32 t, s;\n"
        "red.global.add.u64 [$0], t;\n}",
        "l,f,f",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def head_scale(scales: Int64, head: Int32, *, loc=None, ip=None) -> Float32:
    """scales[head] (fp32), address and load in one asm with side effects: the compiler keeps it in the loop
    that asks for it instead of hoisting the 64-bit address out and holding it live (spilled on sm_120a)."""
    return Float32(llvm.inline_asm(
        T.f32(),
        [Int64(scales).ir_value(loc=loc, ip=ip), Int32(head).ir_value(loc=loc, ip=ip)],
        "{\n.reg .u64 a;\nmad.wide.u32 a, $2, 4, $1;\nld.global.nc.f32 $0, [a];\n}",
        "=f,l,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    ))


def int64_address(fp32_address: Int64, base: Int64) -> Int64:
    """The int64 element's address for an fp32 element's (both indexed from `base`)."""
    return fp32_address + fp32_address - base


def _max_abs_per_head(x: torch.Tensor) -> torch.Tensor:
    """max |x| per head (the second-to-last dim), in float64, over every other dim: min and max per
    (head, column) in one pass down the tokens (a contiguous column reduction: torch's amax over the
    token and column dims at once measured 46 us per 33 MB tensor on an H100), then per head; exact in
    x's dtype, no copy."""
    heads, dim = x.shape[-2], x.shape[-1]
    low, high = torch.aminmax(x.reshape(-1, heads * dim), dim=0)
    return torch.maximum(high.view(heads, dim).amax(dim=1).double(), -low.view(heads, dim).amin(dim=1).double())


# (mantissa bits, exponent bias) of the 16-bit input formats: a |value|'s bit pattern is m 2^e exactly
FORMATS = {torch.bfloat16: (7, 127), torch.float16: (10, 15)}


def max_patterns(x: torch.Tensor) -> torch.Tensor:
    """max |x| per head as its 16-bit pattern (sign cleared; NaN and inf keep their all-ones exponent),
    int64 (heads,): what kernels/bwd_fixed_point_scales.py computes on the GPU."""
    return _max_abs_per_head(x).to(x.dtype).view(torch.int16).to(torch.int64) & 0x7FFF


def scales_from_patterns(p_do: torch.Tensor, p_k: torch.Tensor, p_v: torch.Tensor, dtype: torch.dtype,
                         head_dim_v: int, p_q: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(2^k_h, 2^-k_h) per query head from the |max| patterns of dO, K and V (int64, one per query head):
    k_h = SCALE_LOG2_CEILING - ceil(log2 B_h), the largest power of two with B_h 2^k_h <= 2^59, in exact
    integer arithmetic (B_h = 2 d_v |dO| |K| |V| = P 2^E, P < 2^42 an integer), clamped to
    SCALE_LOG2_RANGE; a zero bound takes the range's top, a NaN or inf pattern NaN scales (`p_q`: Q's
    patterns, for their finiteness only). The kernel's `scale_exponent` does the same operations, so both
    give the same bits."""
    mant_bits, bias = FORMATS[dtype]
    field_max = (1 << (15 - mant_bits)) - 1
    product = torch.full_like(p_do, head_dim_v)
    exponent = torch.zeros_like(p_do)
    nonfinite = torch.zeros_like(p_do, dtype=torch.bool) if p_q is None else (p_q >> mant_bits) & field_max == field_max
    for pattern in (p_do, p_k, p_v):
        field, mantissa = (pattern >> mant_bits) & field_max, pattern & ((1 << mant_bits) - 1)
        nonfinite |= field == field_max
        normal = field > 0  # else subnormal or zero: no implicit bit, the smallest normal exponent
        product = product * torch.where(normal, mantissa | (1 << mant_bits), mantissa)
        exponent = exponent + torch.where(normal, field, 1) - (bias + mant_bits)
    ceil_log2 = torch.frexp((product - 1).clamp(min=0).double())[1].to(torch.int64)  # exact below 2^53
    low, high = SCALE_LOG2_RANGE
    k = torch.where(product == 0, high, (SCALE_LOG2_CEILING - (1 + exponent + ceil_log2)).clamp(low, high))
    nan = torch.full_like(k, NAN_BITS)
    scale = torch.where(nonfinite, nan, (k + 127) << 23).to(torch.int32).view(torch.float32)
    inverse = torch.where(nonfinite, nan, (127 - k) << 23).to(torch.int32).view(torch.float32)
    return scale.contiguous(), inverse.contiguous()


NAN_BITS = 0x7FC00000  # fp32 quiet NaN


def used_rows(x: torch.Tensor, cu_seqlens: Optional[torch.Tensor], seqused: Optional[torch.Tensor]) -> torch.Tensor:
    """x with the rows no sequence uses set to 0 (a new tensor; x itself without index tensors): with
    cu_seqlens, the rows before the first sequence or past the last one's end and, with seqused, past each
    sequence's used length;
    dense (b, s, h, d) with seqused, the positions at or past seqused[b]. No host synchronization."""
    if cu_seqlens is None and seqused is None:
        return x
    if cu_seqlens is None:  # dense (b, s, h, d)
        keep = torch.arange(x.shape[1], device=x.device)[None, :] < seqused[:, None]
    else:  # packed (total, h, d)
        rows = torch.arange(x.shape[0], device=x.device, dtype=cu_seqlens.dtype)
        batch = (torch.searchsorted(cu_seqlens, rows, right=True) - 1).clamp(0, cu_seqlens.shape[0] - 2)
        keep = (rows < cu_seqlens[-1]) & (rows >= cu_seqlens[0])
        if seqused is not None:
            keep &= rows - cu_seqlens[batch] < seqused[batch]
    return torch.where(keep[..., None, None], x, torch.zeros((), dtype=x.dtype, device=x.device))


def _pattern_values(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float64 values of 16-bit |x| patterns (exact; NaN/inf patterns give NaN/inf)."""
    return p.to(torch.int16).view(dtype).double()


def _max_abs_dlse(dlse: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor],
                  seqused_q: Optional[torch.Tensor]) -> torch.Tensor:
    """max |dLSE| per head (float64) over the rows the backward reads: dlse (b, h, s) or packed (h, total)."""
    rows = dlse.t() if cu_seqlens_q is not None else dlse.transpose(1, 2)  # (total, h) or (b, s, h)
    x = used_rows(rows[..., None], cu_seqlens_q, seqused_q)[..., 0]  # used_rows' (.., h, d) with d = 1
    return x.abs().flatten(0, -2).amax(dim=0).double()


def scales_with_dlse(p_do: torch.Tensor, p_k: torch.Tensor, p_v: torch.Tensor, dlse_max: torch.Tensor,
                     dtype: torch.dtype, head_dim_v: int, p_q: Optional[torch.Tensor] = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(2^k_h, 2^-k_h) when the LSE has a gradient: the backward's D becomes D - dLSE, so the bound grows to
    B_h = max|K| (2 d_v max|dO| max|V| + max|dLSE|). float64, rounded up (B (1 + 2^-40), log2 less 1e-9),
    so k_h may be one below the largest power of two that fits; NaN for a non-finite bound."""
    mk, mv, mdo = (_pattern_values(p, dtype) for p in (p_k, p_v, p_do))
    bound = mk * (2.0 * head_dim_v * mdo * mv + dlse_max) * (1.0 + 2.0 ** -40)
    if p_q is not None:  # Q only for its finiteness
        bound = torch.where(torch.isfinite(_pattern_values(p_q, dtype)), bound, torch.full_like(bound, float("nan")))
    low, high = SCALE_LOG2_RANGE
    k = torch.floor(SCALE_LOG2_CEILING - torch.log2(bound) - 1e-9).clamp(low, high)
    k = torch.where(bound == 0, torch.full_like(k, high), k)
    finite = torch.isfinite(bound)
    nan = torch.full_like(k, float("nan"))
    return (torch.where(finite, torch.exp2(k), nan).float().contiguous(),
            torch.where(finite, torch.exp2(-k), nan).float().contiguous())


def dq_scales(k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor] = None,
              cu_seqlens_k: Optional[torch.Tensor] = None, seqused_q: Optional[torch.Tensor] = None,
              seqused_k: Optional[torch.Tensor] = None, dlse: Optional[torch.Tensor] = None,
              q: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(2^k_h, 2^-k_h) per query head, fp32 tensors of shape (num_heads,): the bound B_h of the module
    docstring from K, V (per KV head) and dO (per query head) over the rows the backward reads (`used_rows`:
    padding past seqused or the last sequence may hold anything), and the LSE's gradient where it has one
    (`dlse`, scales_with_dlse). With `out` (the forward's O, as the caller passes it) the bound takes
    max(|V|, |O|) instead of assuming |O| <= max |V|; with `q`, a NaN or inf in Q makes its head's scales
    NaN (the int64 conversion would turn a NaN dS into 0). NaN for a head whose bound is not finite.
    torch's reductions, no host synchronization: the reference and fallback of
    kernels/bwd_fixed_point_scales.py, which gives the same bits in one launch."""
    ratio = dout.shape[-2] // k.shape[-2]
    k, v = (used_rows(t, cu_seqlens_k, seqused_k) for t in (k, v))
    p_k, p_v = (max_patterns(t).repeat_interleave(ratio) for t in (k, v))
    p_do = max_patterns(used_rows(dout, cu_seqlens_q, seqused_q))
    if out is not None:  # patterns order like magnitudes: the larger pattern is max(|V|, |O|)
        p_v = torch.maximum(p_v, max_patterns(used_rows(out, cu_seqlens_q, seqused_q)))
    p_q = None if q is None else max_patterns(used_rows(q, cu_seqlens_q, seqused_q))
    if dlse is not None:  # the LSE's gradient enters D: a wider bound (scales_with_dlse)
        return scales_with_dlse(p_do, p_k, p_v, _max_abs_dlse(dlse, cu_seqlens_q, seqused_q), dout.dtype,
                                v.shape[-1], p_q)
    return scales_from_patterns(p_do, p_k, p_v, dout.dtype, v.shape[-1], p_q)


def fixed_accumulator(shape: tuple, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(a zeroed int64 accumulator of `shape`, the fp32 view of its first half with `shape`'s contiguous
    strides): the kernel partitions the fp32 view as upstream's accumulator and adds into the int64
    elements at the same indices."""
    acc = torch.zeros(shape, dtype=torch.int64, device=device)
    strides = torch.empty(shape, device="meta").stride()
    return acc, acc.view(torch.float32).as_strided(shape, strides)


def dequantize(acc: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """(The reference for kernels/bwd_fixed_point_post.py.) The fp32 accumulator (upstream's layout, new tensor) of an int64 one whose head dim is dims[-2]
    (dense: (batch, heads, n)) or dims[0] (varlen: (heads, n)); `inverse`: dq_scales' 2^-k_h."""
    return torch.mul(acc, inverse.view(-1, 1))  # int64 * fp32 -> fp32, one pass
