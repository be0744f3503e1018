"""Causal / local / seqlen masking of the backward's S tile for any warp layout of its MMA.

Why this exists: upstream's `AttentionMask.apply_mask` masks causal and local tiles with the "R2P"
trick, which turns a column limit into a bit mask over the columns a thread holds. Its bit positions
assume the accumulator layout of one warp along N (SM90 WGMMA, or an SM80 tiled MMA whose N
permutation is 16 wide). Upstream's SM120 backward always has that (4 warps along M for S/dP), so
it never shows. With 2 or more warps along N (an 8-warp 64-row tile, or 4 warps as 2x2) the
permuted columns no longer match the bits and the backward's gradients are wrong under a causal or
local mask (measured on the H200: dQ errors of order 1 on every such config).

`layout_free(mask_fn)` replaces upstream's mask callback with one that compares every element's
own (row, col) coordinate, from `thr_mma.partition_C` of an identity tensor, with the limits:

    masked  <=>  col >= seqlen_k                                   (mask_seqlen)
             or  col >  row + seqlen_k - seqlen_q                  (causal)
             or  col >  row + seqlen_k - seqlen_q + window_right   (local, right bound)
             or  col <  row + seqlen_k - seqlen_q - window_left    (local, left bound)

which is upstream's bottom-right-aligned definition, negative window sides included.

`where_needed(mask_fn, ...)` runs a mask callback only on the tiles that hold a masked element (a
runtime test per m_block, uniform over the CTA): with causal attention most of a CTA's m_blocks lie
wholly below the diagonal, and without it only the last n_block of a sequence can reach past
seqlen_k. The tiles it skips are the ones every rule above leaves unchanged:

    seqlen:  (n_block + 1) * tile_n <= seqlen_k
    causal:  (n_block + 1) * tile_n - 1 <= m_block * tile_m + seqlen_k - seqlen_q
             (the tile's last column against its first row: no column past any row's diagonal)

Local windows keep masking every tile.
"""

from __future__ import annotations

from functools import partial

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr


def layout_free(mask_fn):
    """The same masking as upstream's `partial(AttentionMask.apply_mask, ...)`, for any MMA layout."""
    mask = mask_fn.func.__self__
    kw = dict(mask_fn.keywords)
    return partial(apply_mask_any_layout, mask, n_block=kw["n_block"], thr_mma=kw["thr_mma"],
                   mask_seqlen=kw["mask_seqlen"], mask_causal=kw["mask_causal"],
                   mask_local=kw.get("mask_local", False))


@cute.jit
def apply_mask_any_layout(
    mask,
    acc_S: cute.Tensor,
    m_block: Int32,
    n_block: Int32,
    thr_mma: cute.TiledMma,
    mask_seqlen: cutlass.Constexpr[bool],
    mask_causal: cutlass.Constexpr[bool],
    mask_local: cutlass.Constexpr[bool],
    transposed: cutlass.Constexpr[bool] = False,
):
    # transposed: acc_S holds S^T (keys x queries), the S/dP product swapped (P and dS in registers)
    tile = (mask.tile_n, mask.tile_m) if const_expr(transposed) else (mask.tile_m, mask.tile_n)
    tScS = thr_mma.partition_C(cute.make_identity_tensor(tile))
    row_mode, col_mode = (1, 0) if const_expr(transposed) else (0, 1)
    row0 = m_block * mask.tile_m
    col0 = n_block * mask.tile_n
    shift = mask.seqlen_k - mask.seqlen_q
    for i in cutlass.range(cute.size(acc_S), unroll_full=True):
        row = tScS[i][row_mode] + row0
        col = tScS[i][col_mode] + col0
        masked = False
        if const_expr(mask_seqlen):
            masked = masked or col >= mask.seqlen_k
        if const_expr(mask_causal):
            masked = masked or col > row + shift
        if const_expr(mask_local):
            if const_expr(mask.window_size_right is not None):
                masked = masked or col > row + shift + mask.window_size_right
            if const_expr(mask.window_size_left is not None):
                masked = masked or col < row + shift - mask.window_size_left
        acc_S[i] = -Float32.inf if masked else acc_S[i]


def tile_needs_mask(mask, m_block, n_block, mask_seqlen: bool, mask_causal: bool, mask_local: bool):
    """Whether the (m_block, n_block) tile holds an element that the mask rules set to -inf. Plain
    arithmetic on `mask`'s tile_m, tile_n, seqlen_q and seqlen_k (Int32 in a kernel, ints in the tests)."""
    if mask_local:
        return True  # a plain True: a kernel's `if` on it is resolved when the kernel is traced
    cols_end = (n_block + 1) * mask.tile_n
    needed = False
    if mask_seqlen:
        needed = needed | (cols_end > mask.seqlen_k)
    if mask_causal:
        needed = needed | (cols_end - 1 > m_block * mask.tile_m + mask.seqlen_k - mask.seqlen_q)
    return needed


def where_needed(mask_fn):
    """`mask_fn` (a partial of AttentionMask.apply_mask, or layout_free's) applied only to the
    tiles that hold a masked element (tile_needs_mask); the call convention is the same."""
    mask = mask_fn.args[0] if mask_fn.args else mask_fn.func.__self__  # layout_free's, else AttentionMask's
    kw = mask_fn.keywords
    return partial(_apply_where_needed, mask_fn, mask, kw["n_block"], kw["mask_seqlen"], kw["mask_causal"],
                   kw.get("mask_local", False))


@cute.jit
def _apply_where_needed(
    mask_fn: cutlass.Constexpr,
    mask,
    n_block: Int32,
    mask_seqlen: cutlass.Constexpr[bool],
    mask_causal: cutlass.Constexpr[bool],
    mask_local: cutlass.Constexpr[bool],
    acc_S: cute.Tensor,
    m_block: Int32,
):
    if tile_needs_mask(mask, m_block, n_block, mask_seqlen, mask_causal, mask_local):
        mask_fn(acc_S, m_block=m_block)
