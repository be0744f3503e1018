"""Block-sparse lists and their dense meaning, for the tests and the benchmark.

A block map is an int tensor (batch, heads, q_blocks, kv_blocks) of kinds: 0 = skipped, 1 = mask
("partial": the mask_mod applies), 2 = full. `lists_from_map` writes upstream's
BlockSparseTensorsTorch from it (ascending indices, as FlexAttention's BlockMask has them), and
`keep_from_map` the dense (batch, heads, seqlen_q, seqlen_k) mask that a correct kernel computes:
a key is attended when its block is full, or partial and the mask_mod's twin keeps it.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

SKIP, PARTIAL, FULL = 0, 1, 2


def random_block_map(batch: int, heads: int, q_blocks: int, kv_blocks: int, *, density: float,
                     full_share: float, generator: torch.Generator, device="cuda") -> torch.Tensor:
    """Each block visited with probability `density`; a visited block is full with `full_share`."""
    shape = (batch, heads, q_blocks, kv_blocks)
    visit = torch.rand(shape, generator=generator, device=device) < density
    full = torch.rand(shape, generator=generator, device=device) < full_share
    return torch.where(visit, torch.where(full, FULL, PARTIAL), SKIP).to(torch.int32)


def _list(kinds: torch.Tensor, kind: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(count (b, h, m), indices (b, h, m, n) ascending, packed left) of the blocks of one kind."""
    hit = kinds == kind
    count = hit.sum(-1).to(torch.int32)
    n = kinds.shape[-1]
    # stable sort of "not hit" brings the hit columns first, in ascending order
    order = torch.sort((~hit).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
    col = torch.arange(n, device=kinds.device)
    order = torch.where(col < count[..., None], order, torch.zeros_like(order))
    return count.contiguous(), order.contiguous()


def lists_from_map(kinds: torch.Tensor, block_size: tuple[int, int], with_full: bool = True) -> BlockSparseTensorsTorch:
    """upstream's tensors for a block map; without full lists, full blocks go into the mask list."""
    if not with_full:
        kinds = torch.where(kinds == FULL, PARTIAL, kinds)
    mask_cnt, mask_idx = _list(kinds, PARTIAL)
    full_cnt, full_idx = _list(kinds, FULL) if with_full else (None, None)
    return BlockSparseTensorsTorch(mask_block_cnt=mask_cnt, mask_block_idx=mask_idx, full_block_cnt=full_cnt,
                                   full_block_idx=full_idx, block_size=block_size)


def varlen_lists_from_maps(maps: list, block_size: tuple[int, int], with_full: bool = True,
                           offsets: bool = True) -> BlockSparseTensorsTorch:
    """upstream's varlen tensors (compute_block_sparsity's layout) for per-sequence block maps, each
    (heads, q_blocks_b, kv_blocks_b): counts (heads, total Q blocks) and indices (heads, total entries),
    sequence b's Q block m listing from entry cu_block_idx_offsets[b] + m * kv_blocks_b. offsets=False
    leaves cu_block_idx_offsets out (every sequence then has the same kv_blocks, the uniform-K layout)."""
    mask_cnt, mask_idx, full_cnt, full_idx, cu_m, cu_idx = [], [], [], [], [0], [0]
    for kinds in maps:
        lists = lists_from_map(kinds[None], block_size, with_full)
        h, m, n = kinds.shape
        mask_cnt.append(lists.mask_block_cnt[0])
        mask_idx.append(lists.mask_block_idx[0].reshape(h, m * n))
        if with_full:
            full_cnt.append(lists.full_block_cnt[0])
            full_idx.append(lists.full_block_idx[0].reshape(h, m * n))
        cu_m.append(cu_m[-1] + m)
        cu_idx.append(cu_idx[-1] + m * n)
    dev = maps[0].device
    cat = lambda parts: torch.cat(parts, dim=1).contiguous() if parts else None  # noqa: E731
    tensor = lambda values: torch.tensor(values, dtype=torch.int32, device=dev)  # noqa: E731
    return BlockSparseTensorsTorch(
        mask_block_cnt=cat(mask_cnt), mask_block_idx=cat(mask_idx), full_block_cnt=cat(full_cnt),
        full_block_idx=cat(full_idx), cu_total_m_blocks=tensor(cu_m),
        cu_block_idx_offsets=tensor(cu_idx) if offsets else None, block_size=block_size,
    )


def keep_from_map(kinds: torch.Tensor, block_size: tuple[int, int], seqlen_q: int, seqlen_k: int,
                  keep_twin: Optional[Callable] = None, causal: bool = False) -> torch.Tensor:
    """The dense (b, h, sq, sk) attend mask: full blocks, and partial blocks where keep_twin(b, h, qi, ki)."""
    bq, bk = block_size
    dev = kinds.device
    qi = torch.arange(seqlen_q, device=dev)
    ki = torch.arange(seqlen_k, device=dev)
    per_elem = kinds[:, :, qi // bq][:, :, :, ki // bk]  # (b, h, sq, sk)
    keep = per_elem == FULL
    partial = per_elem == PARTIAL
    if keep_twin is None:
        keep = keep | partial
    else:
        b, h = kinds.shape[:2]
        bi = torch.arange(b, device=dev).view(b, 1, 1, 1)
        hi = torch.arange(h, device=dev).view(1, h, 1, 1)
        keep = keep | (partial & keep_twin(bi, hi, qi.view(1, 1, -1, 1), ki.view(1, 1, 1, -1)))
    if causal:
        keep = keep & (ki.view(1, 1, 1, -1) <= qi.view(1, 1, -1, 1) + (seqlen_k - seqlen_q))
    return keep


def computed_fraction(kinds: torch.Tensor) -> float:
    return float((kinds != SKIP).float().mean())


# ---- the test harness's block-sparse cases (AttnCase.block_sparse) ----------------------------------------
# name -> (sparse block size, full lists, density); drawn by the fuzz suite and the sanitizer
CASES: dict[str, tuple[tuple[int, int], bool, float]] = {
    "random": ((128, 128), True, 0.4),
    "nofull": ((128, 128), False, 0.5),
    "q256": ((256, 128), True, 0.5),
}
HEAD_DIMS = (64, 96, 128)  # what block sparsity runs (block_sparse.CONFIGS)


def case_spec(name: str) -> tuple[tuple[int, int], bool, float]:
    try:
        return CASES[name]
    except KeyError:
        raise ValueError(f"no block-sparse test case {name!r}; known: {sorted(CASES)}") from None


def case_map(name: str, batch: int, heads: int, seqlen_q: int, seqlen_k: int, generator: torch.Generator,
             device="cuda") -> torch.Tensor:
    """The block map of a harness case (full blocks become partial without full lists)."""
    (bq, bk), with_full, density = case_spec(name)
    kinds = random_block_map(batch, heads, -(-seqlen_q // bq), -(-seqlen_k // bk), density=density,
                             full_share=0.5, generator=generator, device=device)
    if not with_full:
        kinds = torch.where(kinds > 0, PARTIAL, SKIP).to(torch.int32)
    return kinds


def case_lists(name: str, kinds: torch.Tensor, backward: bool) -> dict:
    """The public API's block_sparse_tensors (and block_sparse_tensors_bwd for a backward) of a case."""
    block, with_full, _ = case_spec(name)
    kw = {"block_sparse_tensors": lists_from_map(kinds, block, with_full)}
    if backward:
        kw["block_sparse_tensors_bwd"] = lists_from_map(kinds.transpose(2, 3).contiguous(), block, with_full)
    return kw


# cases whose sparse Q block is one kernel tile: upstream's varlen lists take only those (the forward's; a
# backward case's lists are the same maps transposed, flash_attn_varlen_func's block_sparse_tensors_bwd)
VARLEN_CASES = frozenset(n for n, ((bq, _), _, _) in CASES.items() if bq <= 128)


def varlen_case_ok(name: str, q_layout: str, k_layout: str, backward: bool) -> bool:
    """Whether a block-sparse case runs in these storage layouts with varlen lists (forward or backward)."""
    return (q_layout, k_layout) == ("packed", "packed") and name in VARLEN_CASES


def case_varlen_lists(name: str, kinds: torch.Tensor, seqlens_q, seqlens_k, backward: bool = False) -> dict:
    """The public API's varlen block_sparse_tensors of a case: sequence b's part of the block map; with
    `backward`, block_sparse_tensors_bwd too: the parts transposed, in the packed form (block_sparse_bwd.py)."""
    block, with_full, _ = case_spec(name)
    maps = [kinds[b, :, :-(-sq // block[0]), :-(-sk // block[1])] for b, (sq, sk) in enumerate(zip(seqlens_q, seqlens_k))]
    kw = {"block_sparse_tensors": varlen_lists_from_maps(maps, block, with_full)}
    if backward:
        kw["block_sparse_tensors_bwd"] = varlen_lists_from_maps([m.transpose(1, 2) for m in maps], block, with_full)
    return kw


def case_keep(name: str, kinds: torch.Tensor, seq: int, seqlen_q: int, seqlen_k: int,
              partial_keep: Optional[Callable] = None, causal: bool = False) -> torch.Tensor:
    """(1, h, sq, sk) attend mask of batch row `seq`; partial_keep(h, qi, ki) is a mask_mod's twin."""
    twin = None if partial_keep is None else (lambda b, h, qi, ki: partial_keep(h, qi, ki))
    return keep_from_map(kinds[seq:seq + 1], case_spec(name)[0], seqlen_q, seqlen_k, twin, causal)
