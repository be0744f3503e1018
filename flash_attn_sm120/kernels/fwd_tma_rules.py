"""The TMA forward family's rules: which configs it takes, their shared memory and register budgets.

Pure Python (no CuTe DSL import), so the config table, the driver's routing and the search can ask
without building a kernel; the kernel class (fwd_tma.py) applies the same functions.

  * `tma_config_error`: why a (head dims, tile, stages, MMA threads) config cannot run, or None;
    `fp16_register_error`, `pack_gqa_error`, `pingpong_error` and `persistent_error` refuse a dtype,
    a GQA packing, the ping-pong schedule or the persistent order on a tile that could otherwise run.
  * `smem_bytes`: the CTA's dynamic shared memory: sQ[q_stages] (the retiring slot reused as sO),
    sK[num_stages] and sV[num_stages], each 1 KB aligned, then the full/empty mbarriers of the Q
    slots and both rings. `q_stages_error` says when a second Q slot is allowed.
  * `register_split`: the setmaxnreg budget. ptxas gives every thread the same registers at launch;
    the producer warpgroup then drops to PRODUCER_REGS and the MMA warps take what it released
    (up to MAX_MMA_REGS), within the CTA's launch allocation.
  * `use_intra_warp_overlap`: which tiles issue block j's QK^T next to block j-1's PV.
  * `unsupported_reason`: the driver's question, for a whole compile key (dtype, varlen, GQA
    packing, stride-0 inputs on top of the config).
"""

from dataclasses import dataclass
from typing import Optional

from flash_attn_sm120 import hardware

SUPPORTED_HEAD_DIMS = (64, 96, 128)
SUPPORTED_NUM_THREADS = (128, 256)  # MMA warps: 4 or 8
# The producer is a whole warpgroup (setmaxnreg acts on warpgroups): warp 0 of it issues the
# TMA loads, the other three exit at once. ptxas sizes registers per 128 threads anyway, so the
# idle warps cost no registers that a single producer warp would not.
PRODUCER_THREADS = 128
PRODUCER_REGS = 24  # after setmaxnreg.dec; the producer only computes coordinates
# A persistent producer keeps its tile loop's state too (pipeline states, the scheduler, a block-sparse
# walk's lists): at 24 registers the 8-warp d128 block-sparse tile spilled 32 B in the producer (sm_120a).
# `producer_regs` gives 8-warp persistent kernels 32 (their MMA warps keep 232); 4-warp ones keep 24 (at two
# CTAs per SM their MMA warps would drop to 224, where the d64 128x64 block-sparse walk spills 8 B).
PERSISTENT_PRODUCER_REGS = 32
MAX_MMA_REGS = 240
WARPGROUP_THREADS = 128
_SMEM_ALIGN = 1024
_MBARRIER_BYTES = 8


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def num_mbarriers(num_stages: int, q_stages: int = 1) -> int:
    """full+empty for each Q slot and for each of the K and V rings."""
    return 2 * (q_stages + 2 * num_stages)


def smem_bytes(
    head_dim: int,
    head_dim_v: int,
    tile_m: int,
    tile_n: int,
    num_stages: int,
    q_in_regs: bool = False,
    elem_bytes: int = 2,
    q_stages: int = 1,
) -> int:
    """Dynamic shared memory of one CTA (unpadded), as `_get_shared_storage_cls` lays it out.

    sQ[q_stages] (one slot also sO), sK, sV, each 1 KB aligned, then the mbarriers; the struct is
    1 KB aligned so its size rounds up to a multiple of 1 KB.
    """
    hd, hdv = _round_up(head_dim, 16), _round_up(head_dim_v, 16)
    q = _round_up(tile_m * max(hd, hdv) * elem_bytes * q_stages, _SMEM_ALIGN)
    k = _round_up(tile_n * hd * num_stages * elem_bytes, _SMEM_ALIGN)
    v = _round_up(tile_n * hdv * num_stages * elem_bytes, _SMEM_ALIGN)
    return _round_up(q + k + v + num_mbarriers(num_stages, q_stages) * _MBARRIER_BYTES, _SMEM_ALIGN)


@dataclass(frozen=True)
class RegisterSplit:
    """How one CTA's registers are shared between the producer warpgroup and the MMA warps."""

    ctas_per_sm: int  # on SM120, from shared memory and threads (ptxas is told this)
    launch_regs: int  # per thread, what ptxas gives every thread at launch
    producer_regs: Optional[int]  # after setmaxnreg.dec, None without rebalancing
    mma_regs: Optional[int]  # after setmaxnreg.inc, None without rebalancing


def register_split(smem_total: int, num_mma_threads: int, producer_regs: int = PRODUCER_REGS) -> RegisterSplit:
    """setmaxnreg budget: give the MMA warps what the producer warpgroup does not need.

    ptxas caps a thread at 64K / (CTAs per SM * threads rounded up to 128), rounded down to a
    multiple of 8, and at 255.
    setmaxnreg.inc only succeeds with registers another warpgroup released, so the rebalanced
    total must stay within the launch allocation (launch_regs * threads).
    """
    threads = num_mma_threads + PRODUCER_THREADS
    ctas = max(1, hardware.sm120_occupancy(smem_total, threads).ctas_per_sm)
    per_cta = hardware.REGS_PER_SM // ctas
    launch = min(hardware.MAX_REGS_PER_THREAD, per_cta // _round_up(threads, 128) // 8 * 8)
    mma = min(MAX_MMA_REGS, (launch * threads - PRODUCER_THREADS * producer_regs) // num_mma_threads // 8 * 8)
    if mma <= launch:
        return RegisterSplit(ctas, launch, None, None)
    return RegisterSplit(ctas, launch, producer_regs, mma)


def producer_regs(persistent: bool, num_mma_threads: int) -> int:
    """The producer warpgroup's setmaxnreg.dec target (PERSISTENT_PRODUCER_REGS's comment says why)."""
    return PERSISTENT_PRODUCER_REGS if persistent and num_mma_threads == 2 * WARPGROUP_THREADS else PRODUCER_REGS


def rows_per_warp(tile_m: int, num_threads: int) -> int:
    """Rows of the M tile each MMA warp owns (warps are stacked along M)."""
    return tile_m // (num_threads // 32)


def use_intra_warp_overlap(tile_m: int, num_threads: int) -> bool:
    """Overlap keeps S_j and P_{j-1} live together. Warps with 32 rows (R=2) hold twice the
    accumulators and spill with it at d=128 on sm_120a (8 warps at the 240-register cap, 4 warps at
    255), so they run the plain FA2 order; 16-row warps overlap."""
    return rows_per_warp(tile_m, num_threads) == 16


def tma_config_error(
    head_dim: int,
    head_dim_v: int,
    tile_m: int,
    tile_n: int,
    num_stages: int,
    num_threads: int,
    q_in_regs: bool = False,
    q_stages: int = 1,
) -> Optional[str]:
    """Why a TMA-family config cannot run on SM120, or None if it can."""
    if num_threads not in SUPPORTED_NUM_THREADS:
        return (
            f"num_threads={num_threads}: the TMA family takes 128 or 256 MMA-warp threads "
            f"(4 or 8 MMA warps; the kernel adds its own producer warpgroup)"
        )
    if head_dim != head_dim_v:
        return f"head dims ({head_dim}, {head_dim_v}) must be equal in the TMA family"
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head_dim={head_dim}: the TMA family supports {SUPPORTED_HEAD_DIMS}"
    rows_per_step = (num_threads // 32) * 16  # warps stacked along M, 16 rows each
    if tile_m <= 0 or tile_m % rows_per_step:
        return f"tile_m={tile_m} must be a positive multiple of {rows_per_step} for {num_threads // 32} MMA warps"
    if tile_m > 256:
        return f"tile_m={tile_m} must be at most 256 (TMA box limit)"
    if tile_n <= 0 or tile_n % 16 or tile_n > 256:
        return f"tile_n={tile_n} must be a multiple of 16 in [16, 256]"
    if not 1 <= num_stages <= 4:
        return f"num_stages={num_stages}: the K and V rings take 1 to 4 stages"
    smem = smem_bytes(head_dim, head_dim_v, tile_m, tile_n, num_stages, q_stages=q_stages) + hardware.DSL_STATIC_SMEM
    if smem > hardware.SMEM_PER_BLOCK_MAX:
        q_slots = f" with {q_stages} Q slots" if q_stages > 1 else ""
        return f"needs {smem} B of shared memory{q_slots}, SM120 allows {hardware.SMEM_PER_BLOCK_MAX} B per block"
    return None


def _at_register_edge(head_dim: int, tile_m: int, tile_n: int, num_threads: int, above_head_dim: int) -> bool:
    """The tiles at the edge of the MMA warps' 240-register budget: warps of 32 rows with more than 48
    keys per block, at head dims above `above_head_dim`. Anything that adds live registers (fp16's
    conversions, varlen's loaded lengths) makes them spill."""
    return head_dim > above_head_dim and rows_per_warp(tile_m, num_threads) == 32 and tile_n > 48


def fp16_register_error(head_dim: int, tile_m: int, tile_n: int, num_threads: int) -> Optional[str]:
    """Why fp16 cannot run this tile without spills, or None. fp16 takes more registers than bf16 in
    this kernel: at d=128, warps of 32 rows with more than 48 keys per block spill on sm_120a in fp16
    (256x64: 24-40 B of stack) while bf16 fits the 240-register budget; 256x48 fits both since the PV
    product loads V one ldmatrix ahead (tests/test_fwd_tma_codegen.py compiles both dtypes against
    this rule)."""
    if _at_register_edge(head_dim, tile_m, tile_n, num_threads, above_head_dim=96):
        return (
            f"float16 at head_dim={head_dim} with 32 rows per warp and tile_n={tile_n} > 48 "
            "spills on sm_120a in the TMA family (bfloat16 does not)"
        )
    return None


def varlen_register_error(head_dim: int, tile_m: int, tile_n: int, num_threads: int) -> Optional[str]:
    """Why a varlen call cannot run this tile without spills, or None. The sequence lengths and
    offsets, read from cu_seqlens / seqused, take registers that a dense call reads as kernel
    parameters: the edge tiles (32-row warps with more than 48 keys, at d > 64) spill 8-16 B in the
    softmax on sm_120a with varlen (tests/test_fwd_tma_varlen.py compiles every TMA table entry with
    varlen against this rule)."""
    if _at_register_edge(head_dim, tile_m, tile_n, num_threads, above_head_dim=64):
        return (
            f"varlen at head_dim={head_dim} with 32 rows per warp and tile_n={tile_n} > 48 spills on "
            "sm_120a in the TMA family (the dense call does not)"
        )
    return None


def pingpong_error(num_threads: int) -> Optional[str]:
    """Why the ping-pong schedule cannot run with this many MMA threads, or None: it alternates
    exactly two MMA warpgroups."""
    if num_threads != 2 * WARPGROUP_THREADS:
        return f"pingpong needs two MMA warpgroups (num_threads=256), got num_threads={num_threads}"
    return None


def persistent_error(pingpong: bool) -> Optional[str]:
    """Why the persistent tile order cannot run with this schedule, or None. Ping-pong's named-barrier
    turns start over at every tile; they are not built to run on across tiles."""
    if pingpong:
        return "persistent and pingpong together are not implemented (the ping-pong turns start at each tile)"
    return None


def dynamic_error(dynamic: bool, persistent: bool) -> Optional[str]:
    """Why the dynamic tile order cannot run, or None: it is an order for persistent CTAs."""
    if dynamic and not persistent:
        return "dynamic needs persistent=True (one CTA per tile has no tile loop to feed)"
    return None


def q_stages_error(q_stages: int, persistent: bool) -> Optional[str]:
    """Why this many Q slots cannot run, or None. A second slot lets a persistent CTA's producer load the
    next tile's Q under the current tile's main loop (the epilogue's sO takes the retiring slot); one
    CTA per tile loads Q once, so the slot would sit unused."""
    if q_stages not in (1, 2):
        return f"q_stages={q_stages}: the Q ring takes 1 or 2 slots"
    if q_stages == 2 and not persistent:
        return "q_stages=2 needs persistent=True (one CTA per tile loads a single Q)"
    return None


def pack_gqa_error(tile_m: int, qhead_per_kvhead: int) -> Optional[str]:
    """Why this family cannot pack `qhead_per_kvhead` query heads into a tile_m tile, or None."""
    if qhead_per_kvhead > 1 and tile_m % qhead_per_kvhead:
        return (
            f"pack_gqa with {qhead_per_kvhead} query heads per KV head needs tile_m={tile_m} to be a "
            f"multiple of {qhead_per_kvhead} in the TMA family (the Q/O TMA box holds whole head groups)"
        )
    return None


def varlen_error(cu_seqlens_q: bool, cu_seqlens_k: bool, seqused_q: bool, seqused_k: bool) -> Optional[str]:
    """Why this family cannot serve a varlen call, or None. Packed K/V (cu_seqlens_k) load through
    ragged TMA descriptors that end at each sequence's seqlen_k, with or without seqused_k; seqused_k
    alone would have TMA read the rows between seqused_k and the tensor's seqlen_k (a cache's unused
    rows, which may hold NaN). Varlen q (cu_seqlens_q / seqused_q, GQA packed or not) stores O
    through a ragged descriptor."""
    if seqused_k and not cu_seqlens_k:
        return "seqused_k without cu_seqlens_k is not supported by the TMA family"
    return None


def unsupported_reason(statics) -> Optional[str]:
    """Why the TMA family cannot serve a driver.FwdStatics compile key, or None if it can.

    The driver routes a refused key to the cp.async family.
    """
    cfg = statics.config
    err = tma_config_error(
        statics.head_dim, statics.head_dim_v, cfg.tile_m, cfg.tile_n, cfg.num_stages, cfg.num_threads, cfg.q_in_regs,
        q_stages=cfg.q_stages,
    )
    if err is not None:
        return err
    if statics.dtype not in ("float16", "bfloat16"):
        return f"dtype {statics.dtype} (float16 / bfloat16 only)"
    if statics.dtype == "float16":
        err = fp16_register_error(max(statics.head_dim, statics.head_dim_v), cfg.tile_m, cfg.tile_n, cfg.num_threads)
        if err is not None:
            return err
    flags = (statics.has_cu_seqlens_q, statics.has_cu_seqlens_k, statics.has_seqused_q, statics.has_seqused_k)
    err = varlen_error(*flags)
    if err is None and any(flags):
        err = varlen_register_error(max(statics.head_dim, statics.head_dim_v), cfg.tile_m, cfg.tile_n,
                                    cfg.num_threads)
    if err is not None:
        return err
    if statics.pack_gqa:
        err = pack_gqa_error(cfg.tile_m, statics.qhead_per_kvhead)
        if err is not None:
            return err
    if any(any(dims) for dims in statics.broadcast):
        return "stride-0 (expanded) q/k/v are not supported by the TMA family (TMA descriptors need real strides)"
    return None


