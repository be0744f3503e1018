"""Block sparsity in the SM120 TMA forward: which K/V tiles a Q tile visits, and in what order.

Upstream's block sparsity (flash_attn.cute.block_sparsity; FlexAttention's BlockMask) gives, for
each sparse Q block (sparse_block_q query rows) of each (batch, head), two lists of sparse KV
blocks (sparse_block_kv keys each):
  * mask ("partial") blocks: computed with the mask_mod applied;
  * full blocks: computed without it.
A block in neither list is skipped, exactly as if every score in it were masked. A causal or
local mask, when the call has one, still applies to every visited tile (as upstream's SM90 kernel
applies it). Each list's indices ascend, as `create_block_mask` and upstream's
`compute_block_sparsity` write them and as upstream's SM90/SM100 kernels assume.

A kernel tile is tile_m x tile_n, so one sparse block spans q_subtile_factor = sparse_block_q /
tile_m Q tiles and kv_subtile_factor = sparse_block_kv / tile_n K/V tiles. With packed GQA the
kernel's M tiles hold tile_m / qhead_per_kvhead positions of every query head of a group (the
sparse tensors then broadcast over heads, as upstream requires).

Order: the producer warp and the MMA warps walk the same sequence of K/V tiles, the mask list
from its last block down, then the full list from its last block down, and within a sparse block
its tiles from the last down (FA2's high-to-low order, so the first tile visited holds the
seqlen_k boundary). Tiles of the last sparse block that lie wholly past seqlen_k are dropped from
the count, so only the first tile visited of each list needs the seqlen_k mask. A Q tile with no
tiles writes O = 0 and LSE = -inf (the sink's logit with a learnable sink), upstream's
convention for fully masked rows.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from flash_attn.cute.block_sparse_utils import (
    get_curr_blocksparse_tensors,
    sparse_physical_n_block_forward,
    sparse_tensor_m_block,
)
from flash_attn.cute.block_sparsity import BlockSparseTensors
from flash_attn.cute.seqlen_info import SeqlenInfoQK


class SparseTiles(NamedTuple):
    """One Q tile's visiting lists: sparse block indices and the K/V tiles each list covers."""

    mask_idx: cute.Tensor
    mask_tiles: Int32
    full_idx: Optional[cute.Tensor]
    full_tiles: Optional[Int32]


@cute.jit
def _tiles_in_list(count: Int32, block_idx: cute.Tensor, kv_subtile_factor: cutlass.Constexpr[int],
                   num_n_tiles: Int32) -> Int32:
    """K/V tiles of a list of `count` sparse blocks, less the last block's tiles past seqlen_k."""
    tiles = count * kv_subtile_factor
    if const_expr(kv_subtile_factor > 1):
        if count > 0:
            past_end = (block_idx[count - 1] + 1) * kv_subtile_factor - num_n_tiles
            tiles = tiles - cutlass.max(past_end, 0)
    return tiles


@cute.jit
def tile_lists(
    blocksparse_tensors: BlockSparseTensors,
    batch_idx: Int32,
    head_idx: Int32,
    m_block: Int32,
    seqlen: SeqlenInfoQK,
    tile_n: cutlass.Constexpr[int],
    qhead_per_kvhead_packgqa: cutlass.Constexpr[int],
    q_subtile_factor: cutlass.Constexpr[int],
    kv_subtile_factor: cutlass.Constexpr[int],
) -> SparseTiles:
    """The lists of the sparse Q block holding kernel M tile `m_block` (upstream's indexing helpers)."""
    m_sparse = sparse_tensor_m_block(m_block, qhead_per_kvhead_packgqa, q_subtile_factor)
    mask_cnt, mask_idx, full_cnt, full_idx = get_curr_blocksparse_tensors(
        batch_idx, head_idx, m_sparse, blocksparse_tensors, seqlen, kv_subtile_factor
    )
    num_n_tiles = cute.ceil_div(seqlen.seqlen_k, tile_n)
    mask_tiles = _tiles_in_list(mask_cnt, mask_idx, kv_subtile_factor, num_n_tiles)
    full_tiles = None
    if const_expr(full_idx is not None):
        full_tiles = _tiles_in_list(full_cnt, full_idx, kv_subtile_factor, num_n_tiles)
    return SparseTiles(mask_idx, mask_tiles, full_idx, full_tiles)


@cute.jit
def _nth_tile(block_idx: cute.Tensor, tiles: Int32, i, kv_subtile_factor: cutlass.Constexpr[int]):
    """The i-th K/V tile visited of a list (0 = its last tile)."""
    return sparse_physical_n_block_forward(block_idx, tiles - 1 - i, kv_subtile_factor)


@cute.jit
def load_list(block_idx: cute.Tensor, tiles: Int32, kv_state, load_K: Callable, load_V: Callable,
              pipeline_k, pipeline_v, kv_subtile_factor: cutlass.Constexpr[int], start=0, stop=None):
    """Producer warp: K then V of the list's visited tiles `start` to `stop` (default: all) into the
    rings; returns the advanced state."""
    for i in cutlass.range(start, tiles if const_expr(stop is None) else stop, unroll=1):
        n_block = _nth_tile(block_idx, tiles, i, kv_subtile_factor)
        pipeline_k.producer_acquire(kv_state)
        load_K(src_idx=n_block, producer_state=kv_state)
        pipeline_v.producer_acquire(kv_state)
        load_V(src_idx=n_block, producer_state=kv_state)
        kv_state.advance()
    return kv_state


@cute.jit
def load_tiles(sparse: SparseTiles, kv_state, load_K: Callable, load_V: Callable, pipeline_k, pipeline_v,
               kv_subtile_factor: cutlass.Constexpr[int], load_q: Optional[Callable] = None, q_state=None):
    """Producer warp: the mask list's tiles, then the full list's.

    `load_q(q_state)` (the persistent kernel): Q goes after the first tile visited instead of before
    every tile (the producer's docstring says why); called once, also for a tile with no lists."""
    mask_start = 0
    full_start = 0
    if const_expr(load_q is not None):
        mask_start = cutlass.min(sparse.mask_tiles, 1)
        if sparse.mask_tiles > 0:
            kv_state = load_list(sparse.mask_idx, sparse.mask_tiles, kv_state, load_K, load_V, pipeline_k,
                                 pipeline_v, kv_subtile_factor, stop=1)
        if const_expr(sparse.full_idx is not None):
            full_start = Int32(0)
            if sparse.mask_tiles == 0:
                full_start = cutlass.min(sparse.full_tiles, 1)
                if sparse.full_tiles > 0:
                    kv_state = load_list(sparse.full_idx, sparse.full_tiles, kv_state, load_K, load_V,
                                         pipeline_k, pipeline_v, kv_subtile_factor, stop=1)
        load_q(q_state)
    kv_state = load_list(sparse.mask_idx, sparse.mask_tiles, kv_state, load_K, load_V, pipeline_k, pipeline_v,
                         kv_subtile_factor, start=mask_start)
    if const_expr(sparse.full_idx is not None):
        kv_state = load_list(sparse.full_idx, sparse.full_tiles, kv_state, load_K, load_V, pipeline_k, pipeline_v,
                             kv_subtile_factor, start=full_start)
    return kv_state


@cute.jit
def total_tiles(sparse: SparseTiles) -> Int32:
    if const_expr(sparse.full_idx is not None):
        return sparse.mask_tiles + sparse.full_tiles
    return sparse.mask_tiles


@cute.jit
def consume_tiles(sparse: SparseTiles, block: Callable, kv_k, kv_v, overlap: cutlass.Constexpr[bool],
                  kv_subtile_factor: cutlass.Constexpr[int]):
    """MMA warps: the producer's sequence of tiles through `block` (TMA's mma_one_n_block).

    `block(kv_k, kv_v, n_block, is_first=, mask_seqlen=, use_mask_mod=)`. The first tile visited
    starts the online softmax (is_first); the first tile of each list takes the seqlen_k mask;
    mask-list tiles take the mask_mod, full-list tiles do not. Returns the advanced (kv_k, kv_v);
    with the intra-warp overlap the last tile's PV product is still due (the caller's).
    """
    F = kv_subtile_factor
    has_full = const_expr(sparse.full_idx is not None)
    if total_tiles(sparse) > 0:
        if sparse.mask_tiles > 0:
            block(kv_k, kv_v, _nth_tile(sparse.mask_idx, sparse.mask_tiles, 0, F), is_first=True, mask_seqlen=True,
                  use_mask_mod=True)
        else:
            if const_expr(has_full):
                block(kv_k, kv_v, _nth_tile(sparse.full_idx, sparse.full_tiles, 0, F), is_first=True,
                      mask_seqlen=True, use_mask_mod=False)
        kv_k.advance()
        if const_expr(not overlap):
            kv_v.advance()
        for i in cutlass.range(1, sparse.mask_tiles, unroll=1):
            block(kv_k, kv_v, _nth_tile(sparse.mask_idx, sparse.mask_tiles, i, F), is_first=False,
                  mask_seqlen=False, use_mask_mod=True)
            kv_k.advance()
            kv_v.advance()
        if const_expr(has_full):
            if sparse.mask_tiles > 0 and sparse.full_tiles > 0:
                # the full list's first tile, after the mask list: it may hold the seqlen_k boundary
                block(kv_k, kv_v, _nth_tile(sparse.full_idx, sparse.full_tiles, 0, F), is_first=False,
                      mask_seqlen=True, use_mask_mod=False)
                kv_k.advance()
                kv_v.advance()
            for i in cutlass.range(1, sparse.full_tiles, unroll=1):
                block(kv_k, kv_v, _nth_tile(sparse.full_idx, sparse.full_tiles, i, F), is_first=False,
                      mask_seqlen=False, use_mask_mod=False)
                kv_k.advance()
                kv_v.advance()
    return kv_k, kv_v
