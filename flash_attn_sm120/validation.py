"""Input checks for the SM120 path: every bad input gets a TypeError/ValueError naming the problem.

They run before any tensor is converted or kernel compiled. Order: types, dtypes and ranks;
shapes, head dims and GQA; 16-byte alignment; devices last (mismatches first, then "not CUDA"),
so CPU and meta tensors reach every other check and CPU tests cover them all.
Unsupported features raise NotImplementedError naming the feature.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
ALIGN_BYTES = 16
WINDOW_LIMIT = 1 << 30  # |window| beyond this is clamped: longer than any int32-indexed sequence


@dataclass(frozen=True)
class ProblemShape:
    batch: int
    seqlen_q: Optional[int]  # None for varlen q (total_q instead)
    seqlen_k: int  # padded K length (dense) or total_k (varlen)
    total_q: int
    num_heads: int
    num_heads_kv: int
    head_dim: int
    head_dim_v: int
    dtype: torch.dtype

    @property
    def qhead_per_kvhead(self) -> int:
        return self.num_heads // self.num_heads_kv


def _name_dtype(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def _check_tensor(name: str, t, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} has dtype {_name_dtype(t)}; SM120 kernels take float16 or bfloat16")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last (head) dimension, got strides {t.stride()}")


def _check_alignment(name: str, t: torch.Tensor) -> None:
    """The kernels assume 16-byte aligned rows (upstream's ABI). The entry points copy q/k/v into it first, as
    upstream does (interface._canonical); this check guards the other callers (the driver, the harness)."""
    # meta and fake tensors have no address: their storage offset tells the same thing
    no_address = t.device.type == "meta" or isinstance(t, FakeTensor)
    address = t.storage_offset() * t.element_size() if no_address else t.data_ptr()
    if address % ALIGN_BYTES:
        raise ValueError(f"{name}'s data pointer is not {ALIGN_BYTES}-byte aligned (storage offset {t.storage_offset()})")
    step = ALIGN_BYTES // t.element_size()
    if any(s % step for s in t.stride()[:-1]):
        raise ValueError(
            f"{name}'s strides {t.stride()} must be multiples of {step} elements ({ALIGN_BYTES}-byte aligned rows)"
        )


def _check_devices(q, *others: tuple[str, Optional[torch.Tensor]]) -> None:
    """All tensors on q's device (mismatches named first), and that device a CUDA one."""
    for name, t in others:
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if q.device.type != "cuda":
        raise ValueError(f"q is on {q.device}; the kernels need CUDA tensors")


def check_index_tensor(name: str, t, shape: tuple, device: torch.device) -> None:
    """An optional int32 index tensor (cu_seqlens / seqused) of this shape on q's device, contiguous."""
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {_name_dtype(t)}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")
    if t.dim() and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous")


def check_head_dim(head_dim: int, head_dim_v: int) -> None:
    for label, d in (("head_dim", head_dim), ("head_dim_v", head_dim_v)):
        if d % 8 != 0:
            raise ValueError(f"{label}={d} is not a multiple of 8 (16-byte rows are required)")
        if not 8 <= d <= MAX_HEAD_DIM:
            raise ValueError(f"{label}={d} is outside the supported range [8, {MAX_HEAD_DIM}] on SM120")


def normalize_window(window_size) -> tuple[Optional[int], Optional[int]]:
    """(left, right) as ints or None, values unchanged: upstream FA4's meaning, resolved later by
    its `_resolve_causal_local_window`.

    None is unbounded. A negative value is a real bound unless *both* sides are negative (then the
    window is unbounded): (None, -1) attends only to keys strictly before the diagonal, (-2, None)
    only to keys at least two after it. This is not FA2's convention, where -1 on one side meant
    unbounded; `window_bounds` states the rule.
    """
    if window_size is None or (type(window_size) is tuple and window_size == (None, None)):
        return None, None
    if not isinstance(window_size, Sequence) or isinstance(window_size, (str, bytes)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a pair (left, right), got {window_size!r}")
    out = []
    for side, w in zip(("left", "right"), window_size):
        if w is None:
            out.append(None)
            continue
        if isinstance(w, bool) or not isinstance(w, numbers.Integral):
            raise TypeError(f"window_size {side} must be an int or None, got {w!r}")
        w = int(w)
        # beyond any sequence length a bound means the same; clamped so that the kernels' int32
        # index + window arithmetic cannot overflow
        out.append(max(-WINDOW_LIMIT, min(w, WINDOW_LIMIT)))
    return out[0], out[1]


def window_bounds(causal: bool, left: Optional[int], right: Optional[int]) -> tuple[Optional[int], Optional[int]]:
    """The key range a query row attends to, as offsets from its (bottom-right aligned) diagonal:
    keys j with diag - left <= j <= diag + right, None = unbounded. Upstream FA4's rule: both sides
    negative means no window; causal sets right to 0; one negative side is a bound like any other.
    (The reference masks use this; the kernels get upstream's resolver, and the CPU tests pin the
    two to each other.)"""
    if left is not None and right is not None and left < 0 and right < 0:
        left = right = None
    if causal:
        right = 0
    return left, right


def check_flags(**flags) -> None:
    """Boolean options: a bool (or 0/1) or None, which upstream's truth tests read as off (pack_gqa's None:
    automatic). A string such as "False" would otherwise be truthy and silently switch the option on."""
    for name, value in flags.items():
        if value is None:
            continue
        if isinstance(value, bool) or type(value).__name__ == "bool_":
            continue
        if isinstance(value, numbers.Integral) and value in (0, 1):
            continue
        raise TypeError(f"{name} must be a bool, got {value!r}")


def check_scheduler_metadata(metadata, batch: int, disabled: bool) -> None:
    """Upstream's checks of a varlen call's scheduler_metadata, which it reads unless disabled: a
    SchedulerMetadataTensorsTorch whose tensors are on CUDA, (batch,) per-sequence tensors and a (1,)
    semaphore. The kernels here schedule without it (a hint: no result depends on it)."""
    if metadata is None or disabled:
        return
    from flash_attn.cute.prepare_scheduler import SchedulerMetadataTensorsTorch

    if not isinstance(metadata, SchedulerMetadataTensorsTorch):
        raise TypeError("scheduler_metadata must be a flash_attn.cute.prepare_scheduler.SchedulerMetadataTensorsTorch"
                        f" (or None), got {type(metadata).__name__}")
    for name in metadata._fields:
        t = getattr(metadata, name)
        if t is not None and not (isinstance(t, torch.Tensor) and t.is_cuda):
            raise ValueError(f"scheduler_metadata.{name} must be a CUDA tensor, got "
                             f"{t.device if isinstance(t, torch.Tensor) else type(t).__name__}")
    for name in ("num_m_blocks_ptr", "num_splits_dynamic_ptr", "virtual_batch_idx_ptr", "num_nheads_in_l2_ptr"):
        t = getattr(metadata, name)
        if t is not None and tuple(t.shape) != (batch,):
            raise ValueError(f"scheduler_metadata.{name} must have shape (batch_size,) = ({batch},), got {tuple(t.shape)}")
    if metadata.tile_count_semaphore is not None and tuple(metadata.tile_count_semaphore.shape) != (1,):
        raise ValueError("scheduler_metadata.tile_count_semaphore must have shape (1,), got "
                         f"{tuple(metadata.tile_count_semaphore.shape)}")


def check_num_splits(num_splits) -> int:
    """num_splits as a Python int: any integer (numpy's too, as upstream's arithmetic takes), not a bool."""
    if type(num_splits) is int:
        return num_splits
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
        raise TypeError(f"num_splits must be an int, got {num_splits!r}")
    return int(num_splits)


def check_scalars(softmax_scale, softcap):
    """softcap as the kernels take it: |softcap| (upstream's softcap * tanh(s / softcap) is the same function
    for -softcap, tanh being odd), 0 or None for none.

    softmax_scale must be finite and > 0. Upstream passes any value through, but its kernels scale the
    -inf of masked scores too: a zero scale gives NaN (0 * -inf) and a negative one +inf in every masked
    row, so a clear error here is the faithful answer."""
    if softmax_scale is None and type(softcap) is float and softcap == 0.0:
        return softcap  # the defaults (skips the numbers.Real ABC checks: per-call host time)
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
            raise TypeError(f"softmax_scale must be a float or None, got {softmax_scale!r}")
        if not math.isfinite(softmax_scale) or softmax_scale <= 0:
            raise ValueError(f"softmax_scale must be finite and > 0, got {softmax_scale}")
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
            raise TypeError(f"softcap must be a float, got {softcap!r}")
        if not math.isfinite(softcap):
            raise ValueError(f"softcap must be finite (0 disables it), got {softcap}")
        return abs(softcap)
    return softcap


_INT32 = (-(1 << 31), (1 << 31) - 1)


def normalize_aux_scalars(aux_scalars) -> Optional[tuple]:
    """aux_scalars as the kernels take them: a tuple of CuTe numerics (None when empty).

    Upstream passes them to the DSL as given, which compiles only CuTe numerics such as
    `cutlass.Int32(2)` (a Python int fails deep in the DSL); here a Python bool, int or float
    becomes `cutlass.Boolean`, `cutlass.Int32` or `cutlass.Float32`, the type the kernel is
    specialized on, so both spellings mean the same. Anything else is a TypeError naming it.
    """
    if aux_scalars is None:
        return None
    if isinstance(aux_scalars, (str, bytes, torch.Tensor)) or not isinstance(aux_scalars, Sequence):
        raise TypeError(f"aux_scalars must be a list or tuple of scalars, got {type(aux_scalars).__name__}")
    if len(aux_scalars) == 0:
        return None
    import cutlass

    out = []
    for i, x in enumerate(aux_scalars):
        if isinstance(x, cutlass.Numeric):
            out.append(x)
        elif isinstance(x, bool):
            out.append(cutlass.Boolean(x))
        elif isinstance(x, numbers.Integral):
            if not _INT32[0] <= int(x) <= _INT32[1]:
                raise ValueError(f"aux_scalars[{i}] = {x} does not fit in int32 (pass a cutlass numeric of a wider type)")
            out.append(cutlass.Int32(int(x)))
        elif isinstance(x, numbers.Real):
            out.append(cutlass.Float32(float(x)))
        else:
            raise TypeError(f"aux_scalars[{i}] must be a bool, int, float or cutlass numeric, got {type(x).__name__}")
    return tuple(out)


def validate_dense(q, k, v) -> ProblemShape:
    """q (b, sq, h, d), k (b, sk, hk, d), v (b, sk, hk, dv)."""
    _check_tensor("q", q, 4)
    _check_tensor("k", k, 4)
    _check_tensor("v", v, 4)
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k has batch {k.shape[0]} but q has batch {q.shape[0]}")
    shape = _shape_common(q, k, v, batch=q.shape[0], seqlen_q=q.shape[1], total_q=q.shape[0] * q.shape[1])
    _check_devices(q, ("k", k), ("v", v))
    return shape


# Inputs that passed validate_dense, by metadata (the checks read nothing else): a decode step
# repeats the same shapes every call, and its whole host path is on the critical path.
_VALID_DENSE: set = set()
_VALID_DENSE_MAX = 4096


def _metadata(t: torch.Tensor) -> tuple:
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % ALIGN_BYTES)


def validate_dense_memo(q, k, v) -> None:
    """validate_dense, skipped for metadata that already passed (plain CUDA tensors only: fake
    and meta tensors have no address to key on). Failures are never cached: they raise each time."""
    plain = type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor
    if not (plain and q.is_cuda):
        validate_dense(q, k, v)
        return
    key = (_metadata(q), _metadata(k), _metadata(v))
    if key in _VALID_DENSE:
        return
    validate_dense(q, k, v)
    if len(_VALID_DENSE) >= _VALID_DENSE_MAX:
        _VALID_DENSE.clear()
    _VALID_DENSE.add(key)


def validate_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k
) -> ProblemShape:
    """q (total_q, h, d) with cu_seqlens_q, or (b, sq, h, d); k/v likewise with cu_seqlens_k."""
    q_ndim = 3 if cu_seqlens_q is not None else 4
    k_ndim = 3 if cu_seqlens_k is not None else 4
    _check_tensor("q", q, q_ndim)
    _check_tensor("k", k, k_ndim)
    _check_tensor("v", v, k_ndim)
    if cu_seqlens_q is not None:
        if not isinstance(cu_seqlens_q, torch.Tensor) or cu_seqlens_q.dim() != 1 or cu_seqlens_q.numel() < 2:
            raise ValueError("cu_seqlens_q must be a 1-D int32 tensor of length batch + 1 (>= 2)")
        batch = cu_seqlens_q.shape[0] - 1
    elif cu_seqlens_k is not None:
        if not isinstance(cu_seqlens_k, torch.Tensor) or cu_seqlens_k.dim() != 1 or cu_seqlens_k.numel() < 2:
            raise ValueError("cu_seqlens_k must be a 1-D int32 tensor of length batch + 1 (>= 2)")
        batch = q.shape[0]
    else:
        batch = q.shape[0]
    if cu_seqlens_k is None and k.shape[0] != batch:
        raise ValueError(f"k has batch {k.shape[0]} but q describes {batch} sequences")
    check_index_tensor("cu_seqlens_q", cu_seqlens_q, (batch + 1,), q.device)
    check_index_tensor("cu_seqlens_k", cu_seqlens_k, (batch + 1,), q.device)
    check_index_tensor("seqused_q", seqused_q, (batch,), q.device)
    check_index_tensor("seqused_k", seqused_k, (batch,), q.device)
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if m is not None and not isinstance(m, torch.Tensor):
            if isinstance(m, bool) or not isinstance(m, numbers.Integral) or m < 0:
                raise ValueError(f"{name} must be a non-negative int or None, got {m!r}")
    seqlen_q = None if cu_seqlens_q is not None else q.shape[1]
    total_q = q.shape[0] if cu_seqlens_q is not None else q.shape[0] * q.shape[1]
    shape = _shape_common(q, k, v, batch=batch, seqlen_q=seqlen_q, total_q=total_q)
    _check_devices(q, ("k", k), ("v", v))
    return shape


def _shape_common(q, k, v, *, batch: int, seqlen_q: Optional[int], total_q: int) -> ProblemShape:
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {_name_dtype(q)}, {_name_dtype(k)}, {_name_dtype(v)}")
    num_heads, head_dim = q.shape[-2], q.shape[-1]
    num_heads_kv, head_dim_v = v.shape[-2], v.shape[-1]
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree in all but the last dimension")
    if k.shape[-1] != head_dim:
        raise ValueError(f"k head dim {k.shape[-1]} does not match q head dim {head_dim}")
    if num_heads_kv == 0 or num_heads % num_heads_kv != 0:
        raise ValueError(f"nheads={num_heads} must be a multiple of nheads_kv={num_heads_kv} (GQA/MQA)")
    check_head_dim(head_dim, head_dim_v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_alignment(name, t)
    seqlen_k = k.shape[-3]
    return ProblemShape(batch, seqlen_q, seqlen_k, total_q, num_heads, num_heads_kv, head_dim, head_dim_v, q.dtype)


# this package's parameters beyond upstream's (keyword-only, None by default): refused on the upstream path
OWN_PARAMETERS = {"flash_attn_varlen_func": ("block_sparse_tensors_bwd",)}


def upstream_kwargs(name: str, kwargs: dict) -> dict:
    """kwargs for upstream's `name` on a GPU that runs upstream FA4: ValueError for this package's own parameters
    when set (upstream has no such feature), and without them otherwise."""
    own = OWN_PARAMETERS.get(name, ())
    for n in own:
        if kwargs.get(n) is not None:
            raise ValueError(f"{n} in {name} is this package's, for its SM120 kernels; upstream FA4 (this GPU's "
                             "path) has no such parameter")
    return {k: v for k, v in kwargs.items() if k not in own}


def reject_unsupported(**features) -> None:
    """NotImplementedError for features the SM120 path does not have yet (names in the message)."""
    for feature, used in features.items():
        if used:
            raise NotImplementedError(
                f"{feature.replace('_', ' ')} is not supported by the SM120 kernels yet"
                " (upstream FA4 does not support it on SM120 either)"
            )


def grad_plan(q, k, v, learnable_sink, return_lse) -> tuple[bool, bool, bool]:
    """(want_lse, records, bwd_needed): the LSE comes back when asked or when an input requires grad, in
    any grad mode (upstream's rule); autograd records when grad mode is on and an input requires grad; the
    dQ/dK/dV backward (and its refusals) only when q, k or v does (a sink alone needs none of it)."""
    qkv_grad = q.requires_grad or k.requires_grad or v.requires_grad
    sink_grad = learnable_sink is not None and learnable_sink.requires_grad
    records = torch.is_grad_enabled() and (qkv_grad or sink_grad)
    return bool(return_lse) or qkv_grad or sink_grad, records, records and qkv_grad
