"""Block sparsity on the host: sparse block sizes, the forward config, upstream's normalization, launch.

A call's `block_sparse_tensors` is upstream's BlockSparseTensorsTorch (FlexAttention's BlockMask
lists, kernels/fwd_block_sparse.py has the semantics). On SM120 the TMA family runs it: its
producer warp streams only the listed K/V tiles. The kernel tile must divide the sparse block
(tile_m | sparse_block_q, tile_n | sparse_block_kv), so the config is the first of `CONFIGS` for
the call's head dim whose tile divides the block. The dense table's TMA entries are not used: the
block-sparse loop keeps two index lists live, and the R=2 and Q-in-registers d=128 tiles spill with
it on sm_120a (tests/test_block_sparse.py compiles every entry here spill-free). Normalization (shape
checks, broadcasting over batch and heads, compact index tensors) is upstream's
`normalize_block_sparse_config`, by import.

Tiles launch longest first (`tile_order`, kernels/ordered_scheduler.py): the lists give each Q tile's
work, and a window with global tokens, or random lists, make it very unequal across tiles.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from flash_attn.cute.block_sparsity import (
    BlockSparseTensorsTorch,
    NormalizedBlockSparseConfig,
    ceildiv,
    get_sparse_q_block_size,
    normalize_block_sparse_config,
    to_cute_block_sparse_tensors,
)

from flash_attn_sm120.config import FwdConfig

# TMA configs per head dim, best first. d64/d96: 4 warps x 32 rows with one K/V stage (34-45 KB, two
# CTAs per SM, so that one CTA's prologue and epilogue run under the other's loop: short sparse tiles
# have little loop to hide them), measured 1.02-1.29x the 8-warp tiles on 10-16% of 128 x 128 blocks.
# Then 8 warps x 16 rows (the intra-warp overlap; d128
# keeps it first: its 4-warp tiles run one CTA per SM), then 4 warps on 64 x 64 for 64-row sparse
# blocks. FlexAttention's default block is 128 x 128.
CONFIGS: dict[int, tuple[FwdConfig, ...]] = {
    64: (FwdConfig(128, 128, 64, 1, False, "tma"), FwdConfig(256, 128, 128, 2, False, "tma"),
         FwdConfig(256, 128, 64, 2, True, "tma"), FwdConfig(128, 64, 64, 2, False, "tma")),
    96: (FwdConfig(128, 128, 32, 1, False, "tma"), FwdConfig(256, 128, 64, 2, True, "tma"),
         FwdConfig(128, 64, 64, 2, False, "tma")),
    128: (FwdConfig(256, 128, 64, 2, False, "tma"), FwdConfig(128, 64, 64, 2, False, "tma")),
}

# CONFIGS entries whose list walk spills on sm_120a with varlen q (d64 4w 128x64 s1: 16-56 B of stack with the
# varlen scheduler's values live): calls with varlen q skip them
VARLEN_Q_SPILLS: dict[int, tuple[FwdConfig, ...]] = {
    64: (FwdConfig(128, 128, 64, 1, False, "tma"),),
}


def _inferred(n_blocks: int, seqlen: int) -> Optional[int]:
    """The block size that splits `seqlen` into `n_blocks` blocks, or None if several do."""
    lo = ceildiv(seqlen, n_blocks)
    hi = seqlen if n_blocks == 1 else (seqlen - 1) // (n_blocks - 1)
    return lo if lo == hi else None


def sparse_block_size(tensors: BlockSparseTensorsTorch, seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    """(sparse_block_q, sparse_block_kv): `tensors.block_size`, else inferred from the tensors' shapes
    when that is unambiguous (upstream's rule for Q; KV from a full-width index tensor)."""
    if tensors.mask_block_cnt is None or tensors.mask_block_idx is None:
        raise ValueError("block_sparse_tensors needs mask_block_cnt and mask_block_idx")
    if is_varlen_form(tensors):
        if tensors.block_size is None:
            raise ValueError("varlen block_sparse_tensors (cu_total_m_blocks) need block_size: the lists' shapes do "
                             "not give it")
    elif tensors.mask_block_cnt.ndim != 3:
        raise ValueError(f"block_sparse_tensors.mask_block_cnt must be (batch, heads, q_blocks), or (heads, "
                         f"total_q_blocks) with cu_total_m_blocks; got shape {tuple(tensors.mask_block_cnt.shape)}")
    if tensors.block_size is not None:
        bq, bk = (int(x) for x in tensors.block_size)
        if bq <= 0 or bk <= 0:
            raise ValueError(f"block_sparse_tensors.block_size must be positive, got {tensors.block_size}")
        return bq, bk
    bq = get_sparse_q_block_size(tensors, seqlen_q)
    bk = _inferred(tensors.mask_block_idx.shape[-1], seqlen_k) if tensors.mask_block_idx.ndim == 4 else None
    if bq is None or bk is None:
        raise ValueError(
            f"block_sparse_tensors: cannot infer the sparse block size from shapes {tuple(tensors.mask_block_idx.shape)}"
            f" for seqlen_q={seqlen_q}, seqlen_k={seqlen_k}; set BlockSparseTensorsTorch.block_size"
            " (the BlockMask's BLOCK_SIZE)"
        )
    return bq, bk


def is_varlen_form(tensors: BlockSparseTensorsTorch) -> bool:
    """The varlen form of BlockSparseTensorsTorch: (heads, total_q_blocks) counts and (heads, total entries) indices over the
    packed sequences, with cu_total_m_blocks (each sequence's first Q block) and, for varlen K,
    cu_block_idx_offsets (each sequence's first index entry); compute_block_sparsity writes them."""
    return tensors.cu_total_m_blocks is not None


def check_varlen_form(tensors: BlockSparseTensorsTorch, *, packed_q: bool, varlen_k: bool) -> None:
    """ValueError when the lists' layout does not fit the call (upstream's rules): packed q takes the varlen
    form only, which with varlen K needs cu_block_idx_offsets; a dense q takes the (batch, heads, ...) form."""
    if packed_q and not is_varlen_form(tensors):
        raise ValueError("block sparsity with packed q (cu_seqlens_q) needs the varlen lists: "
                         "block_sparse_tensors.cu_total_m_blocks (compute_block_sparsity(..., cu_seqlens_q=...))")
    if is_varlen_form(tensors):
        if not packed_q:
            raise ValueError("varlen block_sparse_tensors (cu_total_m_blocks) need packed q (cu_seqlens_q)")
        if tensors.mask_block_cnt.ndim != 2 or tensors.mask_block_idx.ndim != 2:
            raise ValueError("varlen block_sparse_tensors must be 2-D: (heads, total_q_blocks) counts and "
                             f"(heads, total entries) indices, got {tuple(tensors.mask_block_cnt.shape)} and "
                             f"{tuple(tensors.mask_block_idx.shape)}")
        if varlen_k and tensors.cu_block_idx_offsets is None:
            raise ValueError("varlen block sparsity with cu_seqlens_k or seqused_k requires "
                             "block_sparse_tensors.cu_block_idx_offsets")


def divides(config: FwdConfig, block_size: tuple[int, int]) -> bool:
    return block_size[0] % config.tile_m == 0 and block_size[1] % config.tile_n == 0


def forward_candidates(head_dim: int, head_dim_v: int, block_size: tuple[int, int],
                       varlen_q: bool = False) -> list[FwdConfig]:
    """The CONFIGS entries for this head dim whose tile divides the sparse block, best first (with varlen q,
    less VARLEN_Q_SPILLS)."""
    if head_dim != head_dim_v or head_dim not in CONFIGS:
        return []
    spills = VARLEN_Q_SPILLS.get(head_dim, ()) if varlen_q else ()
    return [cfg for cfg in CONFIGS[head_dim] if divides(cfg, block_size) and cfg not in spills]


def no_config_error(block_size: tuple[int, int], head_dim: int, head_dim_v: int, reasons: list[str]) -> Exception:
    if head_dim != head_dim_v or head_dim not in CONFIGS:
        return NotImplementedError(
            f"block sparsity on SM120 runs in the TMA family: head dims {head_dim}/{head_dim_v} are not supported"
            f" (head_dim == head_dim_v in {tuple(CONFIGS)})"
        )
    if not reasons:
        tiles = sorted({(c.tile_m, c.tile_n) for c in CONFIGS[head_dim]})
        return ValueError(
            f"block sparsity: sparse block size {block_size} is not a multiple of an SM120 tile for head dim"
            f" {head_dim} (tiles {tiles}: tile_m must divide the Q block and tile_n the KV block)"
        )
    return NotImplementedError(
        "block sparsity runs in the SM120 TMA family, which cannot serve this call: " + "; ".join(dict.fromkeys(reasons))
    )


def normalize(tensors: BlockSparseTensorsTorch, config: FwdConfig, *, batch: int, num_heads: int,
              seqlen_q: int, seqlen_k: int, block_size: tuple[int, int],
              device: Optional[torch.device] = None) -> NormalizedBlockSparseConfig:
    """Upstream's checks and broadcasting for the kernel tile of `config` (ValueError on bad tensors)."""
    for name in ("mask_block_cnt", "mask_block_idx", "full_block_cnt", "full_block_idx"):
        t = getattr(tensors, name)
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"block_sparse_tensors.{name} must be a torch.Tensor, got {type(t).__name__}")
        if t is not None and device is not None and t.device != device:
            raise ValueError(f"block_sparse_tensors.{name} is on {t.device}, q on {device}")
    if tensors.block_size is None:
        tensors = tensors._replace(block_size=block_size)
    return normalize_block_sparse_config(
        tensors, batch_size=batch, num_head=num_heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        block_size=(config.tile_m, config.tile_n), q_stage=1, allow_kv_subtile=True,
    )


def statics_key(norm: NormalizedBlockSparseConfig) -> tuple:
    """What a compiled kernel is specialized on: subtile factors, full lists or not, stride-0 dims, and
    for varlen lists whether they carry cu_block_idx_offsets (the last entry: a 4-tuple without it)."""
    key = (norm.q_subtile_factor, norm.kv_subtile_factor, norm.tensors.full_block_cnt is not None,
           norm.broadcast_pattern)
    if norm.tensors.cu_total_m_blocks is not None:
        key += (norm.tensors.cu_block_idx_offsets is not None,)
    return key


def cute_tensors(norm: NormalizedBlockSparseConfig):
    """The BlockSparseTensors a kernel compiles with (upstream's conversion)."""
    return to_cute_block_sparse_tensors(norm.tensors)


def launch_tuple(norm: NormalizedBlockSparseConfig) -> tuple:
    """The torch tensors a compiled kernel takes in place of its BlockSparseTensors argument."""
    t = norm.tensors
    return (t.mask_block_cnt, t.mask_block_idx, t.full_block_cnt, t.full_block_idx, t.cu_total_m_blocks,
            t.cu_block_idx_offsets, t.dq_write_order, t.dq_write_order_full)


def heads_broadcast(tensors: BlockSparseTensorsTorch) -> bool:
    """Whether the sparse lists are the same for every head (size-1 head dim): packed GQA needs it."""
    return tensors.mask_block_cnt.shape[0 if tensors.mask_block_cnt.ndim == 2 else 1] == 1


def dq_turns(mask_cnt: torch.Tensor, mask_idx: torch.Tensor, full_cnt: Optional[torch.Tensor],
             full_idx: Optional[torch.Tensor], num_q_blocks: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The deterministic backward's dQ turn of each entry of the Q-direction lists (kernels/bwd_block_sparse.py):
    for sparse KV block n and a Q block m its lists name, the number of sparse KV blocks before n whose lists name
    m too (ascending; BlockSparseTensorsTorch's dq_write_order layout, from the backward lists alone). Shapes as the
    index tensors ((batch, heads, kv blocks, width), int32, contiguous); entries past a list's count are 0."""
    b, h, n, _ = mask_idx.shape
    # each list's Q blocks, num_q_blocks past its count (a spare column, dropped below)
    named = [None if idx is None else _valid_or(idx, cnt, num_q_blocks)
             for cnt, idx in ((mask_cnt, mask_idx), (full_cnt, full_idx))]
    visits = torch.zeros(b, h, n, num_q_blocks + 1, dtype=torch.int32, device=mask_idx.device)
    for q_blocks in named:
        if q_blocks is not None:
            visits.scatter_(3, q_blocks, 1, reduce="add")
    visits = visits.narrow(3, 0, num_q_blocks).clamp(max=1)
    ranks = visits.cumsum(2, dtype=torch.int32) - visits  # earlier KV blocks naming each Q block
    turns = []
    for q_blocks in named:
        if q_blocks is None:
            turns.append(None)
            continue
        got = ranks.gather(3, q_blocks.clamp(max=num_q_blocks - 1))
        turns.append(torch.where(q_blocks < num_q_blocks, got, torch.zeros_like(got)).contiguous())
    return turns[0], turns[1]


def _valid_or(idx: torch.Tensor, cnt: torch.Tensor, fill: int) -> torch.Tensor:
    """idx (int64, contiguous) with the entries past each list's count set to `fill`."""
    # (ops that also run on fake CUDA tensors without a CUDA build: no arange, `...` indexing or `~`)
    position = torch.ones_like(idx, dtype=torch.int32).cumsum(-1) - 1
    past = position >= cnt.expand(idx.shape[:-1]).unsqueeze(-1)
    return idx.long().masked_fill(past, fill).contiguous()


# a tile's work in the launch order's sort key: a mask-list block (mask_mod applied) weighs more than a full one
MASK_BLOCK_WEIGHT = 3
FULL_BLOCK_WEIGHT = 2
# the launch orders of the latest calls (longest_first_order): key -> (order, weak references to the count
# tensors the key names, so that a key is only ever matched by the same live tensors)
_ORDER_CACHE: "OrderedDict[tuple, tuple]" = OrderedDict()
_ORDER_CACHE_SIZE = 16
# orders a CUDA graph captured from the cache, held until their count tensors die
_PINNED: dict = {}
# the forced launch order (grid_order(), head_groups()): a stack, so that nested blocks restore the outer state;
# False: longest first, True: the grid's order, an int: longest first within groups of that many heads
_order_forced: list = [False]


@contextmanager
def _forced_order(value) -> Iterator[None]:
    _order_forced.append(value)
    try:
        yield
    finally:
        _order_forced.pop()


def grid_order():
    """Within the block, block-sparse calls (the forward, and the backward's non-deterministic walk) launch
    their tiles in the grid's own order instead of longest first: the A/B of scripts/bench_block_sparse.py
    --grid-order."""
    return _forced_order(True)


def head_groups(heads: int):
    """Within the block, block-sparse calls launch their tiles longest first within groups of `heads`
    consecutive (batch, grid head) pairs, the groups in grid order (grid heads: the KV heads of a packed-GQA
    forward, the query heads of the backward walk): the tiles running at once then read the K/V of
    few heads, which L2 may hold, where longest first over the whole grid reads every head's at once.
    scripts/bench_block_sparse.py --head-groups times it beside the default."""
    if heads < 1:
        raise ValueError(f"head_groups({heads}): a group holds at least one head")
    return _forced_order(int(heads))


def orders_tiles(config: FwdConfig, *, varlen_q: bool) -> bool:
    """Whether a block-sparse forward launches its tiles longest first: one CTA per tile of a fixed-length
    grid (varlen q has its own scheduler, a persistent config its own stride)."""
    return not varlen_q and not config.persistent


def tile_order(norm: NormalizedBlockSparseConfig, *, batch: int, grid_heads: int, num_block: int,
               tiles_per_sparse_row: int) -> torch.Tensor:
    """The launch order of a block-sparse call's tiles (`longest_first_order`; grid order inside
    `grid_order()`, head groups inside `head_groups()`)."""
    forced = _order_forced[-1]
    return longest_first_order(norm, batch=batch, grid_heads=grid_heads, num_block=num_block,
                               tiles_per_sparse_row=tiles_per_sparse_row, grid=forced is True,
                               head_group=0 if isinstance(forced, bool) else forced)


def longest_first_order(norm: NormalizedBlockSparseConfig, *, batch: int, grid_heads: int, num_block: int,
                        tiles_per_sparse_row: int, grid: bool = False, head_group: int = 0) -> torch.Tensor:
    """The launch order of a block-sparse kernel's tiles (WorkOrderedTileScheduler): an int32 permutation
    of the linear tile indices m + num_block * (head + grid_heads * batch), by descending work (the tile's
    list lengths, mask blocks weighted MASK_BLOCK_WEIGHT, full ones FULL_BLOCK_WEIGHT), ties in grid
    order; `grid`: the identity (the grid's own order); `head_group` > 0: longest first within each group
    of that many consecutive (batch, head) pairs, the groups in grid order. Tile m reads sparse row
    m // tiles_per_sparse_row (packed GQA rows per position times the subtile factor). Cached per count
    tensors (the same live tensor objects at the same version and layout), grid and head_group, so that a
    mask reused across layers and steps sorts once; not cached: fake tensors. Under CUDA-graph capture a
    cached order is reused (the graph then holds no sort: its replays run the attention kernel alone) and
    kept alive as long as the count tensors the graph also reads; replays after an in-place change of the
    counts keep that order (any order computes the same result). An order first computed during capture is
    only recorded in the graph, not cached (its values exist only at replay)."""
    t = norm.tensors
    counts = [(c, w) for c, w in ((t.mask_block_cnt, MASK_BLOCK_WEIGHT), (t.full_block_cnt, FULL_BLOCK_WEIGHT))
              if c is not None]
    owners = [c if c._base is None else c._base for c, _ in counts]  # the caller's tensors behind the views
    key = None
    count_tensors = [c for c, _ in counts]
    cacheable = _cacheable(count_tensors)
    capturing = cacheable and _capturing(count_tensors)  # (fake tensors never ask the CUDA runtime)
    if cacheable:
        key = tuple((id(o), o._version, c.data_ptr(), tuple(c.shape), c.stride(), str(c.device))
                    for o, (c, _) in zip(owners, counts))
        key += (batch, grid_heads, num_block, tiles_per_sparse_row, grid, head_group)
        cached = _ORDER_CACHE.get(key)
        if cached is not None and all(ref() is o for ref, o in zip(cached[1], owners)):
            _ORDER_CACHE.move_to_end(key)
            if capturing:
                _pin(key, cached[0], owners)
            return cached[0]
    work = sum(c.to(torch.int32) * w for c, w in counts)  # (batch or 1, heads or 1, sparse rows)
    if work.shape[1] != grid_heads:
        work = work.narrow(1, 0, 1)  # packed GQA: the lists are the same for every head
    rows = work.shape[2]
    # (counting with new_ones: no factory call with a device, so that fake tensors stay fake)
    sparse_row = torch.div(_count(work, num_block), tiles_per_sparse_row, rounding_mode="floor")
    work = work.expand(batch, grid_heads, rows).index_select(2, sparse_row.clamp_(max=rows - 1))
    if grid:
        order = _count(work, work.numel())
    elif head_group:
        # longest first, then (stable) by group: group-major, descending work inside a group, ties in grid order
        by_work = torch.sort(work.reshape(-1), descending=True, stable=True).indices
        group = torch.div(_count(work, work.numel()), num_block * head_group, rounding_mode="floor")
        order = by_work[torch.sort(group[by_work], stable=True).indices].to(torch.int32)
    else:
        order = torch.sort(work.reshape(-1), descending=True, stable=True).indices.to(torch.int32)
    if key is not None and not capturing:
        _ORDER_CACHE[key] = (order, tuple(weakref.ref(o) for o in owners))
        _ORDER_CACHE.move_to_end(key)
        if len(_ORDER_CACHE) > _ORDER_CACHE_SIZE:
            _ORDER_CACHE.popitem(last=False)
    return order


def _cacheable(tensors: list) -> bool:
    """Real tensors (longest_first_order's cache)."""
    from torch._subclasses.fake_tensor import is_fake

    return not any(is_fake(c) for c in tensors)


def _capturing(tensors: list) -> bool:
    """Whether a call on these tensors is being captured into a CUDA graph."""
    return any(c.is_cuda for c in tensors) and torch.cuda.is_current_stream_capturing()


def _pin(key: tuple, order: torch.Tensor, owners: list) -> None:
    """Keep a cached order that a CUDA graph captured alive while the count tensors live: the cache may
    drop it, and the graph's replays read it as they read the counts."""
    if key not in _PINNED:
        _PINNED[key] = order
        weakref.finalize(owners[0], _PINNED.pop, key, None)


def _count(like: torch.Tensor, n: int) -> torch.Tensor:
    """0, 1, ..., n - 1 (int32) on `like`'s device."""
    return like.new_ones(n, dtype=torch.int32).cumsum(0, dtype=torch.int32) - 1


def cut_lists_at(tensors: BlockSparseTensorsTorch, seqused_k: torch.Tensor, block_k: int) -> BlockSparseTensorsTorch:
    """Dense-form lists without the entries past each batch row's seqused_k: a block starting at or past
    seqused_k[b] holds no key, and the walk masks seqlen_k only in each list's first visited (highest) tile.
    The lists ascend, so the kept entries are each list's first ones: only the counts change, to (batch,
    heads, m) int32 (the index tensors stay as given)."""
    limit = torch.div(seqused_k.to(torch.int32) + (block_k - 1), block_k, rounding_mode="floor")  # (batch,)
    cut = {}
    for cnt_name, idx_name in (("mask_block_cnt", "mask_block_idx"), ("full_block_cnt", "full_block_idx")):
        cnt, idx = getattr(tensors, cnt_name), getattr(tensors, idx_name)
        if cnt is None:
            continue
        position = torch.ones_like(idx, dtype=torch.int32).cumsum(-1) - 1  # (b|1, h|1, m, n)
        kept = (position < cnt.unsqueeze(-1)) & (idx < limit.view(-1, 1, 1, 1))
        cut[cnt_name] = kept.sum(-1, dtype=torch.int32).contiguous()
    return tensors._replace(**cut)


def seqused_cache_as_packed(
    k: torch.Tensor, v: torch.Tensor, seqused_k: torch.Tensor, tensors: BlockSparseTensorsTorch, seqlen_q: int,
    packed_q: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, BlockSparseTensorsTorch]:
    """A block-sparse call with seqused_k on a (batch, seqlen_k, heads, d) K/V cache, as the TMA family runs
    it: the cache viewed as packed sequences of seqlen_k rows (cu_seqlens_k = 0, s, 2s, ...; a copy only if
    the batch and seqlen dims cannot merge, e.g. a slice of a longer cache), so that its ragged descriptors
    stop each sequence at seqused_k (the unused rows, which may hold NaN, are never read). seqused_k is
    clamped to seqlen_k on the device (a larger value must not reach the next sequence's rows). Dense-form
    lists are checked (upstream's layout rules, as ValueErrors) and cut at seqused_k (`cut_lists_at`,
    block_size filled in); varlen-form lists (packed q) already have rows of ceil(seqused_k / block)
    entries, upstream's layout. Returns (k, v, cu_seqlens_k, seqused_k, tensors).

    A score_mod / mask_mod sees the packed form's seqlen_info (offset_k = b * seqlen_k): positions (q_idx,
    kv_idx) are the same as in the (batch, seqlen_k) form."""
    batch, seqlen_k = k.shape[:2]
    check_varlen_form(tensors, packed_q=packed_q, varlen_k=True)
    for name in ("mask_block_cnt", "mask_block_idx", "full_block_cnt", "full_block_idx"):
        t = getattr(tensors, name)
        if t is not None and (not isinstance(t, torch.Tensor) or t.device != k.device or t.dtype != torch.int32):
            raise ValueError(f"block_sparse_tensors.{name} must be an int32 tensor on {k.device}")
    if not is_varlen_form(tensors):
        block_size = tensors.block_size or sparse_block_size(tensors, seqlen_q, seqlen_k)
        bk = int(block_size[1])
        width, n_blocks = tensors.mask_block_idx.shape[-1], -(-seqlen_k // bk)
        if tensors.mask_block_idx.ndim != 4 or width > n_blocks:
            raise ValueError(f"block_sparse_tensors.mask_block_idx must be (batch, heads, q_blocks, <= {n_blocks}) "
                             f"for seqlen_k {seqlen_k} and {bk}-key blocks, got {tuple(tensors.mask_block_idx.shape)}")
        tensors = cut_lists_at(tensors._replace(block_size=tuple(int(b) for b in block_size)), seqused_k, bk)
    cu_seqlens_k = _count(k, batch + 1) * seqlen_k  # 0, s, 2s, ...
    packed_k, packed_v = (t.reshape(batch * seqlen_k, *t.shape[2:]) for t in (k, v))
    return packed_k, packed_v, cu_seqlens_k, seqused_k.clamp(max=seqlen_k), tensors
