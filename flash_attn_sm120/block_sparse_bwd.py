"""The block-sparse backward's host side: what the walk refuses, its config, and its lists for varlen calls.

`plan` (called by driver_bwd.backward) checks the call, picks the walk's config (SPARSE_BWD_CONFIGS where it was
measured faster, else the table's entry with one Q and one dO stage, else upstream's SM120 default tile) and
normalizes the lists with upstream's helper, adding the deterministic dQ turns (block_sparse.dq_turns).

Varlen calls (cu_seqlens_q / cu_seqlens_k / seqused_q / seqused_k):
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

from dataclasses import replace
from typing import Optional

import torch
from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

from flash_attn_sm120 import block_sparse
from flash_attn_sm120.config_bwd import bwd_config_from_name
from flash_attn_sm120.kernels.bwd_tiling import BwdConfig, bwd_config_error, upstream_bwd_config

__all__ = ["SPARSE_BWD_CONFIGS", "check_block_sparse", "per_sequence_lists", "plan", "sparse_preferred_config"]


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


def check_block_sparse(deterministic: bool, varlen: bool, turns_from_lists: bool = False,
                       per_sequence_lists: bool = False) -> None:
    """NotImplementedError for what the block-sparse backward walk is not given: deterministic=True unless the
    caller gives the walk its dQ turns (`turns_from_lists`: block_sparse.dq_turns); varlen unless the caller gives
    it per-sequence lists and launches it with `rows_end` (`per_sequence_lists`: block_sparse_bwd.py). This
    package's driver does both. Causal and local windows apply inside the listed tiles."""
    for what, used in (("deterministic=True", deterministic and not turns_from_lists),
                       ("varlen", varlen and not per_sequence_lists)):
        if used:
            raise NotImplementedError(f"block-sparse backward with {what} is not supported by the SM120 kernels yet")


# The block-sparse walk's own config where the table's would serve it at this head dim, for a dense-layout,
# non-deterministic call without a causal/local mask, a score_mod (softcap's included) or aux tensors (what
# was measured; a mask_mod is fine): d128 32x128 with 8 warps along N for dK/dV, spill-free in the walk
# with or without a mask_mod (tests/test_block_sparse.py); 1.05x / 1.06x the table's 64x64 on 10% random and
# window + global lists, kernel time (2026-12-04_block_sparse_bwd_graph_emulated.json; session 22's eager
# run: 1.06x on window + global). d64: 0.71-0.73x, not taken.
SPARSE_BWD_CONFIGS: dict[int, BwdConfig] = {128: bwd_config_from_name("bwd-w8-32x128-q1do1-a282")}


def sparse_preferred_config(
    head_dim: int, head_dim_v: int, causal: bool, local: bool, score_mod_or_aux: bool, deterministic: bool,
    varlen: bool,
) -> Optional[BwdConfig]:
    """The entry of SPARSE_BWD_CONFIGS for a block-sparse backward, or None (the table's serves).
    score_mod_or_aux: the call has a score_mod (or softcap) or aux tensors."""
    if causal or local or score_mod_or_aux or deterministic or varlen or head_dim != head_dim_v:
        return None
    return SPARSE_BWD_CONFIGS.get(head_dim)


def plan(tensors, q, k, cfg: BwdConfig, *, head_dim_v: int, causal: bool, local: bool,
                       deterministic: bool, varlen: bool, config_given: bool,
                       preferred: Optional[BwdConfig] = None, batch: Optional[int] = None,
                       bounds: Optional[tuple[int, int]] = None, q_varlen: bool = False):
    """(config, (upstream's normalized lists, compile key)) of a block-sparse backward: the chosen config with
    one Q and one dO stage (a given config: at most two unless deterministic; kernels/bwd_block_sparse.py),
    else upstream's SM120 default tile when the chosen one does not divide the sparse block. `preferred`
    (sparse_preferred_config), when no config is given, goes before the chosen one. A varlen call (`varlen`,
    with its `batch`, host `bounds` (seqlen_q, seqlen_k) and whether q rows vary, `q_varlen`) takes its lists
    per sequence, with any number of rows (per_sequence_lists). NotImplementedError names what the walk does not
    cover."""
    from flash_attn.cute.block_sparsity import NormalizedBlockSparseConfig, normalize_block_sparse_config_bwd

    check_block_sparse(deterministic, varlen, turns_from_lists=True, per_sequence_lists=True)
    if tensors.block_size is None:
        raise ValueError("block_sparse_tensors_bwd needs block_size (the BlockMask's BLOCK_SIZE)")
    bq, bk = (int(x) for x in tensors.block_size)
    if bq <= 0 or bk <= 0:
        raise ValueError(f"block_sparse_tensors_bwd.block_size must be positive, got {tensors.block_size}")
    if varlen:  # the shapes upstream's normalization checks are the lists' own (rows past them are empty)
        tensors = per_sequence_lists(tensors, batch=batch, bound_q=bounds[0], bound_k=bounds[1],
                                                      q_varlen=q_varlen, block_size=(bq, bk))
        batch_size, num_head = batch, q.shape[-2]
        seqlen_q, seqlen_k = tensors.mask_block_idx.shape[-1] * bq, tensors.mask_block_cnt.shape[-1] * bk
    else:
        batch_size, num_head, seqlen_q, seqlen_k = q.shape[0], q.shape[2], q.shape[1], k.shape[1]
    candidates = [cfg] if config_given else [c for c in (preferred,) if c is not None] + [
        cfg, upstream_bwd_config(q.shape[-1])]
    for c in candidates:
        # the walk takes no V in registers and up to two Q / dO stages (one when deterministic); a table
        # entry runs with one of each, the faster at 10% density (d64: 0.649 vs 0.628 of dense, d128: 0.581
        # vs 0.533; 2026-12-03_block_sparse_bwd_walk_emulated.json); a given config keeps up to two
        stages = 2 if config_given and not deterministic else 1
        c = replace(c, stages_q=min(c.stages_q, stages), stages_do=min(c.stages_do, stages), v_in_regs=False)
        if bq % c.m_block or bk % c.n_block or bwd_config_error(q.shape[-1], head_dim_v, c) is not None:
            continue
        norm, pattern = normalize_block_sparse_config_bwd(
            tensors, batch_size=batch_size, num_head=num_head, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
            block_size=(c.m_block, c.n_block), q_subtile_factor=bq // c.m_block, kv_subtile_factor=bk // c.n_block)
        # deterministic: each list entry's dQ turn, in upstream's dq_write_order fields (ascending, computed
        # here from the lists: a given order or spt is not needed); otherwise none (the compile key has none)
        # (Q blocks: a varlen call's compact lists may be narrower than the sequences' blocks)
        q_blocks = max(-(-seqlen_q // bq), -(-bounds[0] // bq) if varlen else 0)
        turns = (block_sparse.dq_turns(norm.mask_block_cnt, norm.mask_block_idx, norm.full_block_cnt,
                                       norm.full_block_idx, q_blocks) if deterministic else (None, None))
        norm = norm._replace(dq_write_order=turns[0], dq_write_order_full=turns[1])
        wrapped = NormalizedBlockSparseConfig(norm, pattern, bq // c.m_block, bk // c.n_block)
        return c, (wrapped, (bq // c.m_block, bk // c.n_block, norm.full_block_cnt is not None, pattern, varlen))
    raise ValueError(f"block_sparse_tensors_bwd: sparse block {tensors.block_size} is not a multiple of the backward "
                     f"tile ({cfg.m_block}, {cfg.n_block}) or of upstream's SM120 default")
