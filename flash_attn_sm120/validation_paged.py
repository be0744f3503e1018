"""Input checks for paged KV: clear errors on the host, before any kernel work, with no device sync.

Layout (upstream FA4's): k, v are page pools (num_pages, page_size, nheads_kv, d / dv); page_table
is int32 (batch, max_pages_per_seq); sequence b reads pages page_table[b, 0 .. ceil(len_b /
page_size) - 1], where len_b = seqused_k[b] if given, else max_pages_per_seq * page_size.

Checked here: tensor types, ranks, dtypes and devices; page size a multiple of 16 in [16, 512];
pools and page table consistent; q / cu_seqlens_q / seqused shapes; a host max_seqlen_k not
longer than a page-table row can address (max_pages_per_seq * page_size).
Not checked (each would need the device's data, i.e. a sync): that seqused_k[b] <= max_pages *
page_size, and that the page indices a sequence uses lie in [0, num_pages). Out-of-range values
read out of bounds, as in upstream.
"""

from __future__ import annotations

import numbers
from typing import Optional

import torch

from flash_attn_sm120 import validation
from flash_attn_sm120.kernels.fwd_splitkv_paged import MAX_PAGE_SIZE, PAGE_SIZE_MULTIPLE, paged_head_dim_error


def check_page_size(page_size: int) -> None:
    if page_size % PAGE_SIZE_MULTIPLE or not PAGE_SIZE_MULTIPLE <= page_size <= MAX_PAGE_SIZE:
        raise ValueError(
            f"page size {page_size} is not supported: it must be a multiple of {PAGE_SIZE_MULTIPLE} "
            f"in [{PAGE_SIZE_MULTIPLE}, {MAX_PAGE_SIZE}]"
        )


def _check_tensor(name: str, t, ndim: int, device: Optional[torch.device]) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in validation.SUPPORTED_DTYPES:
        raise TypeError(f"{name} has dtype {str(t.dtype).replace('torch.', '')}; SM120 kernels take float16 or bfloat16")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")
    if t.device.type != "cuda":
        raise ValueError(f"{name} is on {t.device}; the kernels need CUDA tensors")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last (head) dimension, got strides {t.stride()}")
    # every row is copied with 16-byte cp.async: rows must start 16-byte aligned
    step = 16 // t.element_size()
    if t.storage_offset() % step or any(st % step for st in t.stride()[:-1]):
        raise ValueError(f"{name} rows must be 16-byte aligned (storage offset {t.storage_offset()}, strides {t.stride()})")


def validate_paged(
    q, k, v, page_table, *, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k
) -> validation.ProblemShape:
    """q (total_q, h, d) with cu_seqlens_q or (b, sq, h, d); k/v page pools; page_table (b, pages)."""
    if cu_seqlens_k is not None:
        raise NotImplementedError(
            "paged KV (page_table) cannot be combined with cu_seqlens_k (upstream FA4 refuses it too): "
            "give each sequence's length with seqused_k"
        )
    if not isinstance(page_table, torch.Tensor):
        raise TypeError(f"page_table must be a torch.Tensor, got {type(page_table).__name__}")
    if page_table.dtype != torch.int32:
        raise TypeError(f"page_table must be int32, got {str(page_table.dtype).replace('torch.', '')}")
    if page_table.dim() != 2:
        raise ValueError(f"page_table must be 2-D (batch, max_pages_per_seq), got shape {tuple(page_table.shape)}")
    _check_tensor("q", q, 3 if cu_seqlens_q is not None else 4, None)
    if page_table.device != q.device:
        raise ValueError(f"page_table is on {page_table.device} but q is on {q.device}")
    if page_table.stride(-1) != 1:
        raise ValueError("page_table must be contiguous in its last dimension")
    _check_tensor("k", k, 4, q.device)
    _check_tensor("v", v, 4, q.device)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError("q, k, v must share one dtype")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"paged k {tuple(k.shape)} and v {tuple(v.shape)} must agree in (num_pages, page_size, nheads_kv)"
        )
    num_pages, page_size, num_heads_kv, head_dim = k.shape
    head_dim_v = v.shape[-1]
    check_page_size(page_size)
    if num_pages == 0 and page_table.shape[1] > 0:
        raise ValueError("the page pools k, v hold no pages but page_table refers to some")
    if cu_seqlens_q is not None:
        if not isinstance(cu_seqlens_q, torch.Tensor) or cu_seqlens_q.dim() != 1 or cu_seqlens_q.numel() < 2:
            raise ValueError("cu_seqlens_q must be a 1-D int32 tensor of length batch + 1 (>= 2)")
        batch = cu_seqlens_q.shape[0] - 1
    else:
        batch = q.shape[0]
    if page_table.shape[0] != batch:
        raise ValueError(
            f"page_table has {page_table.shape[0]} rows but q describes {batch} sequences "
            "(cache shape does not match page_table)"
        )
    validation.check_index_tensor("cu_seqlens_q", cu_seqlens_q, (batch + 1,), q.device)
    validation.check_index_tensor("seqused_q", seqused_q, (batch,), q.device)
    validation.check_index_tensor("seqused_k", seqused_k, (batch,), q.device)
    num_heads = q.shape[-2]
    if q.shape[-1] != head_dim:
        raise ValueError(f"k head dim {head_dim} does not match q head dim {q.shape[-1]}")
    if num_heads_kv == 0 or num_heads % num_heads_kv:
        raise ValueError(f"nheads={num_heads} must be a multiple of nheads_kv={num_heads_kv} (GQA/MQA)")
    validation.check_head_dim(head_dim, head_dim_v)
    err = paged_head_dim_error(head_dim, head_dim_v)
    if err:
        raise NotImplementedError(err)
    capacity = page_table.shape[1] * page_size
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if m is not None and not isinstance(m, torch.Tensor):
            if isinstance(m, bool) or not isinstance(m, numbers.Integral) or m < 0:
                raise ValueError(f"{name} must be a non-negative int or None, got {m!r}")
    if isinstance(max_seqlen_k, numbers.Integral) and max_seqlen_k > capacity:
        raise ValueError(
            f"max_seqlen_k={max_seqlen_k} is longer than the pages hold: {page_table.shape[1]} pages per "
            f"sequence x page size {page_size} = {capacity} (seqused_k longer than the pages hold)"
        )
    seqlen_q = None if cu_seqlens_q is not None else q.shape[1]
    total_q = q.shape[0] if cu_seqlens_q is not None else q.shape[0] * q.shape[1]
    return validation.ProblemShape(
        batch, seqlen_q, capacity, total_q, num_heads, num_heads_kv, head_dim, head_dim_v, q.dtype
    )
