"""Paged KV for the splitkv family: the page-size and head-dim rules, and the K/V tile loaders.

K and V may live in a cache of pages (num_pages, page_size, nheads_kv, d) addressed through an int32
page table (batch, max_pages). `KVTileLoaders.make_kv_loaders` gives the mainloop its K/V tile loads:
the SM80 forward's dense cp.async tile copies or, with a page table, row gathers through
`PagedKVManager` (paged_kv.py): each copy thread looks up the pages of the rows it owns and issues
16-byte cp.async into the same swizzled tile, so the MMA side is unchanged. The host rules say which calls the
gathers can serve: `paged_tile_error` (a tile the gather's passes divide), `paged_head_dim_error`
(whole 16-column chunks), and the page sizes (multiples of PAGE_SIZE_MULTIPLE up to MAX_PAGE_SIZE).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Optional

import cutlass.cute as cute
from cutlass import const_expr
from cutlass.cute import FastDivmodDivisorV2

from flash_attn.cute import utils
from flash_attn.cute.paged_kv import PagedKVManager

# PagedKVManager's layout flag for "V pages laid out like K pages" (see the module docstring)
_PAGED_V_LIKE_K = 90
MAX_PAGE_SIZE = 512
PAGE_SIZE_MULTIPLE = 16


def paged_tile_error(num_threads: int, tile_n: int, head_dim: int, head_dim_v: int, elem_bytes: int = 2) -> Optional[str]:
    """Why upstream's PagedKVManager cannot gather a tile_n-row K/V tile, or None.

    Its tiled copy moves num_threads / threads_per_row rows per pass, threads_per_row being
    gcd(head dims, 128 B) / 16 B; a tile_n that is not a multiple of that row count makes the last
    pass run past the tile. Measured (2026-11-29, H200 at SM120 occupancy, d=128: 32 rows per pass
    with 8 warps, 16 with 4): 8 warps with tile_n 48 gave errors of 0.3-0.5 against the fp32
    reference; 8 warps with tile_n 32 / 64 and 4 warps with tile_n 48 were right.
    """
    block = math.gcd(-(-head_dim // 16) * 16, -(-head_dim_v // 16) * 16, 128 // elem_bytes)
    rows_per_pass = num_threads // (block // (16 // elem_bytes))
    if tile_n % rows_per_pass:
        return (
            f"paged KV gathers {rows_per_pass} rows per pass with {num_threads} threads at head dims "
            f"({head_dim}, {head_dim_v}); tile_n={tile_n} is not a multiple of it"
        )
    return None


def paged_head_dim_error(head_dim: int, head_dim_v: int) -> Optional[str]:
    """The paged gather copies whole 16-column chunks with no column predicate."""
    if head_dim % 16 or head_dim_v % 16:
        return f"paged KV needs head dims that are multiples of 16, got ({head_dim}, {head_dim_v})"
    return None


class KVTileLoaders:
    """Mixin of the splitkv kernel class: its K/V tile loads, dense or paged (module docstring)."""

    def make_kv_loaders(
        self, mK, mV, mPageTable, sK, sV, seqlen, head_idx_kv, batch_idx, gmem_tiled_copy_K, gmem_tiled_copy_V, tidx,
    ):
        """(load_K, load_V, fetch_pages): dense tile loads, or paged row gathers.

        load_K / load_V(block, smem_stage, need_predicates) issue one tile's cp.async. Paged, the rows'
        pages come from `fetch_pages(block)` (page-table reads into registers), which the mainloop
        issues before the QK^T MMAs so that their latency hides behind them; K and V of a block
        share one fetch, because the pipeline always loads V[b] right after K[b] and before
        K[b - 1]. Dense, fetch_pages is None.
        """
        stage_of = (lambda s: s) if const_expr(self.num_stages > 1) else (lambda s: 0)
        if const_expr(mPageTable is not None):
            pages = PagedKVManager.create(
                mPageTable, mK, mV, FastDivmodDivisorV2(mK.shape[0]), batch_idx, head_idx_kv, tidx, seqlen.seqlen_k,
                0,  # leftpad_k
                self.tile_n, self.tile_hdim, self.tile_hdimv, self.num_threads, self.dtype,
                arch=_PAGED_V_LIKE_K,
            )

            def load_paged(sX, which, block, smem_pipe_write, need_predicates=False):
                # rows past the sequence are zero-filled by the gather itself: need_predicates is implied
                pages.load_KV(block, sX[None, None, stage_of(smem_pipe_write)], which)

            return partial(load_paged, sK, "K"), partial(load_paged, sV, "V"), pages.load_page_table

        if const_expr(not seqlen.has_cu_seqlens_k):
            mK_cur = mK[None, None, head_idx_kv, batch_idx]
            mV_cur = mV[None, None, head_idx_kv, batch_idx]
        else:
            mK_cur = cute.domain_offset((seqlen.offset_k, 0), mK[None, None, head_idx_kv])
            mV_cur = cute.domain_offset((seqlen.offset_k, 0), mV[None, None, head_idx_kv])
        gK = cute.local_tile(mK_cur, (self.tile_n, self.tile_hdim), (None, 0))
        gV = cute.local_tile(mV_cur, (self.tile_n, self.tile_hdimv), (None, 0))
        thr_K = gmem_tiled_copy_K.get_slice(tidx)
        thr_V = gmem_tiled_copy_V.get_slice(tidx)
        cK = cute.make_identity_tensor((self.tile_n, self.tile_hdim))
        tKcK, t0KcK = thr_K.partition_S(cK), gmem_tiled_copy_K.get_slice(0).partition_S(cK)
        if const_expr(self.tile_hdim == self.tile_hdimv):
            tVcV, t0VcV = tKcK, t0KcK
        else:
            cV = cute.make_identity_tensor((self.tile_n, self.tile_hdimv))
            tVcV, t0VcV = thr_V.partition_S(cV), gmem_tiled_copy_V.get_slice(0).partition_S(cV)
        tKpK = utils.predicate_k(tKcK, limit=mK.shape[1])
        tVpV = tKpK if const_expr(self.same_hdim_kv) else utils.predicate_k(tVcV, limit=mV.shape[1])
        load_K = partial(
            self.load_K, gmem_tiled_copy_K, thr_K.partition_S(gK), thr_K.partition_D(sK), tKcK, t0KcK, tKpK,
            seqlen=seqlen.seqlen_k,
        )
        load_V = partial(
            self.load_V, gmem_tiled_copy_V, thr_V.partition_S(gV), thr_V.partition_D(sV), tVcV, t0VcV, tVpV,
            seqlen=seqlen.seqlen_k,
        )
        return load_K, load_V, None
