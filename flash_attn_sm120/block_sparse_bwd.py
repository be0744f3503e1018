"""The block-sparse backward's lists for varlen calls (cu_seqlens_q / cu_seqlens_k / seqused_q / seqused_k).

The backward walks, for each K/V tile, the Q tiles its Q-direction list names (kernels/bwd_block_sparse.py), and
reads that list at (sequence, head, the sequence's own sparse K/V block). A varlen call takes the lists in either
of two forms:

* per sequence: (batch, heads, kv_blocks) counts and (batch, heads, kv_blocks, width) indices, with block indices
  local to each sequence; batch and heads may be 1 (broadcast). This is the dense call's form, and what PyTorch's
  `create_block_mask(mask_mod, B, H, max_seqlen_q, max_seqlen_k)` writes over the padded batch. The longest
  sequence is device data, so the shape is not checked against it. A K/V block past the lists' rows is named by
  no list, so it is skipped, like any block in no list (the kernel checks the row: `rows_end`).
* packed, upstream's varlen form (set `cu_total_m_blocks`): the forward's varlen layout, transposed. Counts are
  (heads, total K/V blocks); sequence b's rows start at cu_total_m_blocks[b]. Indices are (heads, total entries);
  the list of sequence b's K/V block j starts at entry cu_block_idx_offsets[b] + j * q_blocks_b, where
  q_blocks_b = (cu_block_idx_offsets[b + 1] - cu_block_idx_offsets[b]) / kv_blocks_b. `compute_block_sparsity`
  writes this form with the roles swapped: tile (block_k, block_q), the K lengths where it takes Q's, and the
  mask_mod with q_idx and kv_idx exchanged. A call with varlen q needs cu_block_idx_offsets. Without it, every
  sequence has ceil(seqlen_q / block_q) Q blocks. This form is copied into the per-sequence one on the device
  (no host sync). The copy has ceil(bound / block) rows and columns, where bound is max_seqlen_k / max_seqlen_q
  where given, else the total rows: without host max_seqlen_q / max_seqlen_k it holds batch x heads x
  ceil(total_k / block_k) x ceil(total_q / block_q) int32s, so pass them. A count longer than its sequence's Q
  blocks (or the copy's width) is cut to them: a list cannot name more.
"""

from __future__ import annotations

from typing import Optional

import torch
from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

__all__ = ["per_sequence_lists"]


def per_sequence_lists(tensors: BlockSparseTensorsTorch, *, batch: int, bound_q: int, bound_k: int, q_varlen: bool,
                       block_size: tuple[int, int]) -> BlockSparseTensorsTorch:
    """The per-sequence form of a varlen call's backward lists (module docstring): `tensors` itself when
    already in that form (checked for rank), else the packed form copied into it. bound_q / bound_k: host
    bounds on a sequence's rows (max_seqlen_q / max_seqlen_k, else the totals); q_varlen: q rows vary per
    sequence (cu_seqlens_q or seqused_q), so the packed form must say where each sequence's entries start."""
    cnt, idx = tensors.mask_block_cnt, tensors.mask_block_idx
    if tensors.cu_total_m_blocks is None:
        if cnt.ndim != 3 or idx.ndim != 4:
            raise ValueError(
                "varlen block_sparse_tensors_bwd: per-sequence lists are (batch, heads, kv_blocks) counts and "
                "(batch, heads, kv_blocks, q_blocks) indices, or the packed form with cu_total_m_blocks; got "
                f"{tuple(cnt.shape)} and {tuple(idx.shape)}")
        return tensors
    if cnt.ndim != 2 or idx.ndim != 2:
        raise ValueError(
            "varlen block_sparse_tensors_bwd with cu_total_m_blocks (packed) must be 2-D: (heads, total K/V blocks) "
            f"counts and (heads, total entries) indices, got {tuple(cnt.shape)} and {tuple(idx.shape)}")
    cu_rows = tensors.cu_total_m_blocks
    if cu_rows.ndim != 1 or cu_rows.shape[0] != batch + 1:
        raise ValueError(f"block_sparse_tensors_bwd.cu_total_m_blocks must have batch + 1 = {batch + 1} entries "
                         f"(each sequence's first K/V block row), got shape {tuple(cu_rows.shape)}")
    offsets = tensors.cu_block_idx_offsets
    if offsets is None and q_varlen:
        raise ValueError("packed varlen block_sparse_tensors_bwd with cu_seqlens_q or seqused_q needs "
                         "cu_block_idx_offsets (where each sequence's list entries start)")
    if offsets is not None and (offsets.ndim != 1 or offsets.shape[0] != batch + 1):
        raise ValueError(f"block_sparse_tensors_bwd.cu_block_idx_offsets must have batch + 1 = {batch + 1} entries, "
                         f"got shape {tuple(offsets.shape)}")
    for name in ("full_block_cnt", "full_block_idx"):
        t = getattr(tensors, name)
        if t is not None and t.ndim != 2:
            raise ValueError(f"packed block_sparse_tensors_bwd.{name} must be 2-D like the mask lists, got "
                             f"{tuple(t.shape)}")
    bq, bk = block_size
    rows, width = -(-bound_k // bk), -(-bound_q // bq)
    # each sequence's first row, its K/V blocks, its first entry and its Q blocks (the width of its lists)
    cu_rows = cu_rows.to(device=cnt.device, dtype=torch.int64)
    kv_blocks = cu_rows[1:] - cu_rows[:-1]
    if offsets is None:
        first_entry, q_blocks = cu_rows[:-1] * width, torch.full_like(kv_blocks, width)
    else:
        offsets = offsets.to(device=cnt.device, dtype=torch.int64)
        first_entry = offsets[:-1]
        q_blocks = (offsets[1:] - offsets[:-1]) // kv_blocks.clamp(min=1)
    j = torch.arange(rows, device=cnt.device).view(1, rows)
    row_ok = j < kv_blocks.view(batch, 1)  # (batch, rows)
    i = torch.arange(width, device=cnt.device).view(1, 1, width)
    entry_ok = row_ok[..., None] & (i < q_blocks.view(batch, 1, 1))  # (batch, rows, width)
    row_at = (cu_rows[:-1].view(batch, 1) + j).masked_fill(~row_ok, 0)
    entry_at = (first_entry.view(batch, 1, 1) + j[..., None] * q_blocks.view(batch, 1, 1) + i).masked_fill(~entry_ok, 0)

    def counts(c: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if c is None:
            return None
        got = c[:, row_at.clamp(max=max(c.shape[1] - 1, 0))] if c.shape[1] else torch.zeros(
            c.shape[0], batch, rows, dtype=c.dtype, device=c.device)  # (heads, batch, rows)
        # a count past the sequence's Q blocks would walk the zero-filled entries: cut to them
        got = torch.minimum(torch.where(row_ok, got, torch.zeros_like(got)), q_blocks.clamp(max=width).view(batch, 1))
        return got.permute(1, 0, 2).to(torch.int32).contiguous()

    def indices(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if x is None:
            return None
        got = x[:, entry_at.clamp(max=max(x.shape[1] - 1, 0))] if x.shape[1] else torch.zeros(
            x.shape[0], batch, rows, width, dtype=x.dtype, device=x.device)  # (heads, batch, rows, width)
        got = torch.where(entry_ok, got, torch.zeros_like(got))
        return got.permute(1, 0, 2, 3).to(torch.int32).contiguous()

    return BlockSparseTensorsTorch(
        mask_block_cnt=counts(cnt), mask_block_idx=indices(idx), full_block_cnt=counts(tensors.full_block_cnt),
        full_block_idx=indices(tensors.full_block_idx), block_size=tensors.block_size,
        dq_write_order=None, dq_write_order_full=None, spt=tensors.spt,
    )
