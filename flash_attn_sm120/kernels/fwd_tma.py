"""SM120 forward, TMA family: a producer warp streams Q/K/V with TMA, mma.sync warps run FlashAttention-2.

SM120 has no wgmma and no tcgen05, but it does have TMA (`cp.async.bulk.tensor`) and
transaction mbarriers. This kernel uses them the way FA3 does on Hopper, with SM80-style math:

  warps 0 .. W-1     consumers ("MMA warps", W = FwdConfig.num_threads / 32, 4 or 8)
  warps W .. W+3     producer warpgroup: warp W issues every TMA load of the CTA, the other
                     three exit at once; the warpgroup exists because setmaxnreg acts per
                     warpgroup: it drops to 24 registers and the MMA warps rise to up to 240

Pipeline (one CTA = one (m_block, head, batch) tile; mbarriers through cutlass' PipelineTmaAsync):

  producer:  Q once            -> pipeline_q (1 stage)
             for n_block = n_block_max-1 down to n_block_min:
                 acquire K slot s -> TMA K[n_block] into sK[s]      (pipeline_k, num_stages slots)
                 acquire V slot s -> TMA V[n_block] into sV[s]      (pipeline_v, num_stages slots)
  consumers: wait Q (optionally copy it to registers once: q_in_regs); per n_block:
                 wait K[s];  S = Q K^T   (ldmatrix + mma.sync m16n8k16, fp32 acc)   release K[s]
                 score_mod, masks (seqlen / causal / local / mask_mod), online softmax in registers,
                 rescale O; P = bf16/fp16(S) stays in registers as the A operand of the next MMA
                 wait V[s];  O += P V    (ldmatrix.trans on V)                        release V[s]
             epilogue: O /= rowsum, O -> smem (stmatrix, reusing sQ) -> one TMA store; LSE from
             registers. TMA clips the last tile's rows, so rows past seqlen_q are never written.

K and V have separate full/empty mbarrier rings of `num_stages` (1 to 4) slots, so the producer
runs up to `num_stages` blocks ahead and a K slot is refilled while the same block's PV product
still reads its V slot. With one slot each the two rings still alternate: K_{j+1} lands behind
block j's softmax and PV, V_{j+1} behind block j+1's QK^T (cp.async's one-stage schedule); that
frees the shared memory for wider tiles (256x48 at d=128). Rows past seqlen_k arrive zero-filled
from TMA and are masked to -inf. A consumer fences the async proxy (`fence.proxy.async.shared::cta`)
before it releases a slot that it read with ldmatrix, so the next TMA write into that slot cannot
overtake those generic-proxy reads.

Intra-warp overlap (use_intra_warp_overlap: warps of 16 rows): after the first n_block the
consumers wait for K_j and V_{j-1}, then issue S_j = Q K_j^T and O += P_{j-1} V_{j-1} back to back
and run block j's softmax; the loop body is one basic block, so ptxas interleaves the PV mma.sync
with the exp2/max/sum (FA3's intra-warpgroup overlap in mma.sync form). O is rescaled after the
PV product; P_{j-1} waits in registers. Warps of 32 rows keep the plain order (registers).

Warps are stacked along M (each warp owns 16 rows per MMA row step, tile_m / (16 W) steps), K/V are
shared by all warps. FwdConfig fields for this family: num_threads = MMA-warp threads (the kernel
adds its producer warpgroup: 128 more threads), num_stages = depth of the K and V rings,
q_in_regs = the MMA warps load their Q fragments once instead of per n_block (sQ stays allocated
as the epilogue's sO). Shared memory: sQ (reused as sO), sK[num_stages], sV[num_stages], each
1 KB aligned and TMA-swizzled (128 B swizzle for head dim 64/128, 64 B for 96), then the
mbarriers (the struct rounds up to 1 KB). `register_split` computes the setmaxnreg budget and the
CTAs per SM that ptxas is told (min_blocks_per_mp); configs of <= 41 KB run 2 CTAs per SM, whose
independent tiles interleave their softmax and MMA phases on the SM.

GQA packing (pack_gqa, FA3's PackGQA): the qhead_per_kvhead query heads that share a KV head are
folded into the M dimension, so one CTA serves a whole head group from one stream of K/V and the
grid has nheads_kv heads. Packed row r of an M tile is query head r % qhead_per_kvhead of the group
at position r // qhead_per_kvhead. Q and O keep their TMA boxes: `make_packgqa_tiled_tma_atom`
(flash_attn.cute.pack_gqa) views (head, seqlen) as one mode and boxes (qhead_per_kvhead,
tile_m / qhead_per_kvhead) of it, so tile_m must be a multiple of qhead_per_kvhead; the masks,
block ranges and score_mod/mask_mod take packed rows through qhead_per_kvhead_packgqa.

Supported: fp16/bf16 (fp16 not on d=128 tiles of 32-row warps wider than 48 keys, which spill:
`fp16_register_error`), head_dim == head_dim_v in {64, 96, 128}, causal, local windows, GQA/MQA
packed or not, softcap and score_mod (applied as in FlashAttentionForwardSm80, through
`apply_score_mod`), mask_mod, LSE output, learnable sinks (one more term in the final softmax's row
sums, sink_fold.load_row_sinks), block sparsity (the producer and the MMA warps walk the listed K/V
tiles instead of the n_block range: fwd_block_sparse.py). Refused with NotImplementedError (the
driver routes these to the cp.async family): varlen (cu_seqlens / seqused), pack_gqa when tile_m is
not a multiple of qhead_per_kvhead, paged KV. `unsupported_reason(statics)` states
the rule for the driver.

RISK: cutlass PR #3189 reported a TMA `cute.copy` hang on sm_120 with the CuTe DSL (its author
later traced it to tile modes left ungrouped before `tma_partition`; this kernel partitions
through quack's `tma_get_copy_fn`, which groups them). SM120 emulation on an H200 (sm_90a) cannot
show an SM120-only hang, so the first runs on a real SM120 must use a timeout
(scripts/smoke_tma.py guards every call). The shipped table chooses this family for causal d64/d96/d128
on emulated measurements, with a cp.async entry after each TMA entry as the fallback;
FLASH_ATTN_SM120_FAMILIES=cpasync restricts the table to the cp.async family (fwd_cpasync.py) until
the family has run on a real SM120.
"""

from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as cpipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warp
from cutlass.tensor_utils import LayoutEnum
from flash_attn.cute import ampere_helpers as sm80_utils
from flash_attn.cute import utils
from flash_attn.cute.block_info import BlockInfo
from flash_attn.cute.block_sparsity import BlockSparseTensors
from flash_attn.cute.cute_dsl_utils import assume_tensor_aligned
from flash_attn.cute.flash_fwd_sm120 import FlashAttentionForwardSm120
from flash_attn.cute.mask import AttentionMask
from flash_attn.cute.pack_gqa import make_packgqa_tiled_tma_atom, pack_gqa_layout
from flash_attn.cute.seqlen_info import SeqlenInfoQK
from flash_attn.cute.softmax import Softmax
from flash_attn.cute.tile_scheduler import SingleTileLPTScheduler, SingleTileScheduler, TileSchedulerArguments
from flash_attn.cute.utils import AuxData
from quack import copy_utils, layout_utils
from quack import sm90_utils as quack_sm90_utils

from flash_attn_sm120 import hardware
from flash_attn_sm120.kernels import fwd_block_sparse, sink_fold
from flash_attn_sm120.kernels.fwd_cpasync import emulation_storage

SUPPORTED_HEAD_DIMS = (64, 96, 128)
SUPPORTED_NUM_THREADS = (128, 256)  # MMA warps: 4 or 8
# The producer is a whole warpgroup (setmaxnreg acts on warpgroups): warp 0 of it issues the
# TMA loads, the other three exit at once. ptxas sizes registers per 128 threads anyway, so the
# idle warps cost no registers that a single producer warp would not.
PRODUCER_THREADS = 128
PRODUCER_REGS = 24  # after setmaxnreg.dec; the producer only computes coordinates
MAX_MMA_REGS = 240
INTRA_WARP_OVERLAP = True
_SMEM_ALIGN = 1024
_MBARRIER_BYTES = 8
# named barrier among the MMA warps (id 0 is __syncthreads; upstream's fwd ids are not used here)
_EPILOGUE_BARRIER_ID = 1
# ping-pong: warpgroup g waits on barrier _PINGPONG_BARRIER_ID + g before its MMA burst
_PINGPONG_BARRIER_ID = 2
WARPGROUP_THREADS = 128


# Configs proposed for measurement, per head dim: (num_threads, tile_m, tile_n, num_stages,
# q_in_regs) and the mask kinds they compile for without spills on sm_120a in bf16 and fp16
# (tests/test_fwd_tma_codegen.py checks them). R = rows per warp / 16. R=1 tiles (8 warps x 16
# rows) run the intra-warp overlap; R=2 tiles halve the ldmatrix traffic per mma.sync (shared
# memory bandwidth bounds R=1 on an H200 in emulation) at the price of registers, so they run the
# plain FA2 order (use_intra_warp_overlap).
ALL_MASKS = ("none", "causal", "local")
PROPOSED_CONFIGS: dict[int, tuple] = {
    128: (
        ((256, 128, 64, 2, False), ALL_MASKS),
        ((256, 128, 64, 2, True), ("none", "causal")),  # bf16 local spills with Q in registers
        ((256, 256, 32, 2, False), ("none",)),  # R=2
        ((256, 256, 48, 1, False), ("none", "causal")),  # R=2, one K and one V slot: 48 keys fit 99 KB
        # R=2, one slot each, 96 KB: causal only (non-causal bf16 spills 16 B); bf16 only (fp16_register_error)
        ((256, 256, 64, 1, False), ("causal",)),
        ((128, 128, 32, 2, False), ALL_MASKS),  # R=2, 4 warps
    ),
    96: (
        ((256, 128, 64, 3, True), ALL_MASKS),
        ((256, 128, 64, 2, True), ALL_MASKS),
        ((256, 256, 32, 2, False), ALL_MASKS),  # R=2
    ),
    64: (
        ((256, 128, 128, 2, True), ALL_MASKS),
        ((256, 128, 64, 3, True), ALL_MASKS),
        ((256, 256, 64, 2, False), ALL_MASKS),  # R=2
        ((128, 64, 64, 2, True), ALL_MASKS),  # 2 CTAs/SM (41 KB each): two tiles interleave per SM
    ),
}


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def num_mbarriers(num_stages: int) -> int:
    """full+empty for Q (1 slot) and for each of the K and V rings."""
    return 2 * (1 + 2 * num_stages)


def smem_bytes(
    head_dim: int,
    head_dim_v: int,
    tile_m: int,
    tile_n: int,
    num_stages: int,
    q_in_regs: bool = False,
    elem_bytes: int = 2,
) -> int:
    """Dynamic shared memory of one CTA (unpadded), as `_get_shared_storage_cls` lays it out.

    sQ (also sO), sK, sV, each 1 KB aligned, then the mbarriers; the struct is 1 KB aligned so
    its size rounds up to a multiple of 1 KB.
    """
    hd, hdv = _round_up(head_dim, 16), _round_up(head_dim_v, 16)
    q = _round_up(tile_m * max(hd, hdv) * elem_bytes, _SMEM_ALIGN)
    k = _round_up(tile_n * hd * num_stages * elem_bytes, _SMEM_ALIGN)
    v = _round_up(tile_n * hdv * num_stages * elem_bytes, _SMEM_ALIGN)
    return _round_up(q + k + v + num_mbarriers(num_stages) * _MBARRIER_BYTES, _SMEM_ALIGN)


@dataclass(frozen=True)
class RegisterSplit:
    """How one CTA's registers are shared between the producer warpgroup and the MMA warps."""

    ctas_per_sm: int  # on SM120, from shared memory and threads (ptxas is told this)
    launch_regs: int  # per thread, what ptxas gives every thread at launch
    producer_regs: Optional[int]  # after setmaxnreg.dec, None without rebalancing
    mma_regs: Optional[int]  # after setmaxnreg.inc, None without rebalancing


def register_split(smem_total: int, num_mma_threads: int) -> RegisterSplit:
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
    mma = min(MAX_MMA_REGS, (launch * threads - PRODUCER_THREADS * PRODUCER_REGS) // num_mma_threads // 8 * 8)
    if mma <= launch:
        return RegisterSplit(ctas, launch, None, None)
    return RegisterSplit(ctas, launch, PRODUCER_REGS, mma)


def rows_per_warp(tile_m: int, num_threads: int) -> int:
    """Rows of the M tile each MMA warp owns (warps are stacked along M)."""
    return tile_m // (num_threads // 32)


def use_intra_warp_overlap(tile_m: int, num_threads: int) -> bool:
    """Overlap keeps S_j and P_{j-1} live together. Warps with 32 rows (R=2) hold twice the
    accumulators and spill with it at d=128 on sm_120a (8 warps at the 240-register cap, 4 warps at
    255), so they run the plain FA2 order; 16-row warps overlap."""
    return INTRA_WARP_OVERLAP and rows_per_warp(tile_m, num_threads) == 16


def tma_config_error(
    head_dim: int,
    head_dim_v: int,
    tile_m: int,
    tile_n: int,
    num_stages: int,
    num_threads: int,
    q_in_regs: bool = False,
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
    smem = smem_bytes(head_dim, head_dim_v, tile_m, tile_n, num_stages) + hardware.DSL_STATIC_SMEM
    if smem > hardware.SMEM_PER_BLOCK_MAX:
        return f"needs {smem} B of shared memory, SM120 allows {hardware.SMEM_PER_BLOCK_MAX} B per block"
    return None


def fp16_register_error(head_dim: int, tile_m: int, tile_n: int, num_threads: int) -> Optional[str]:
    """Why fp16 cannot run this tile without spills, or None. fp16 takes more registers than bf16 in
    this kernel: at d=128, warps of 32 rows with more than 48 keys per block spill on sm_120a in fp16
    (256x64: 24-40 B of stack) while bf16 fits the 240-register budget; 256x48 fits both since the PV
    product loads V one ldmatrix ahead (tests/test_fwd_tma_codegen.py compiles both dtypes against
    this rule)."""
    rows = rows_per_warp(tile_m, num_threads)
    if head_dim > 96 and rows == 32 and tile_n > 48:
        return (
            f"float16 at head_dim={head_dim} with {rows} rows per warp and tile_n={tile_n} > 48 "
            "spills on sm_120a in the TMA family (bfloat16 does not)"
        )
    return None


def pingpong_error(num_threads: int) -> Optional[str]:
    """Why the ping-pong schedule cannot run with this many MMA threads, or None: it alternates
    exactly two MMA warpgroups."""
    if num_threads != 2 * WARPGROUP_THREADS:
        return f"pingpong needs two MMA warpgroups (num_threads=256), got num_threads={num_threads}"
    return None


def pack_gqa_error(tile_m: int, qhead_per_kvhead: int) -> Optional[str]:
    """Why this family cannot pack `qhead_per_kvhead` query heads into a tile_m tile, or None."""
    if qhead_per_kvhead > 1 and tile_m % qhead_per_kvhead:
        return (
            f"pack_gqa with {qhead_per_kvhead} query heads per KV head needs tile_m={tile_m} to be a "
            f"multiple of {qhead_per_kvhead} in the TMA family (the Q/O TMA box holds whole head groups)"
        )
    return None


def unsupported_reason(statics) -> Optional[str]:
    """Why the TMA family cannot serve a driver.FwdStatics compile key, or None if it can.

    The driver routes a refused key to the cp.async family.
    """
    cfg = statics.config
    err = tma_config_error(
        statics.head_dim, statics.head_dim_v, cfg.tile_m, cfg.tile_n, cfg.num_stages, cfg.num_threads, cfg.q_in_regs
    )
    if err is not None:
        return err
    if statics.dtype not in ("float16", "bfloat16"):
        return f"dtype {statics.dtype} (float16 / bfloat16 only)"
    if statics.dtype == "float16":
        err = fp16_register_error(max(statics.head_dim, statics.head_dim_v), cfg.tile_m, cfg.tile_n, cfg.num_threads)
        if err is not None:
            return err
    varlen = [
        name
        for name, flag in (
            ("cu_seqlens_q", statics.has_cu_seqlens_q),
            ("cu_seqlens_k", statics.has_cu_seqlens_k),
            ("seqused_q", statics.has_seqused_q),
            ("seqused_k", statics.has_seqused_k),
        )
        if flag
    ]
    if varlen:
        return f"varlen ({', '.join(varlen)}) is not supported by the TMA family"
    if statics.pack_gqa:
        err = pack_gqa_error(cfg.tile_m, statics.qhead_per_kvhead)
        if err is not None:
            return err
    if any(any(dims) for dims in statics.broadcast):
        return "stride-0 (expanded) q/k/v are not supported by the TMA family (TMA descriptors need real strides)"
    return None


def _ldmatrix_to_mma_tiles(frag: cute.Tensor, frag_copy_view: cute.Tensor) -> list[list[int]]:
    """For each ldmatrix of a B-operand fragment (mode 1 of its copy view), the MMA N tiles it fills.

    Trace-time, from the register offsets that the two views of one fragment give at k = 0 (an
    ldmatrix.x4 of B fills two n8 tiles; which two depends on the tiled MMA's permutation)."""

    def offsets(layout, n_size, v_size):
        return [{cute.crd2idx((v, n, 0), layout) for v in range(v_size)} for n in range(n_size)]

    mma_regs = offsets(frag.layout, cute.size(frag, mode=[1]), cute.size(frag, mode=[0]))
    copy_regs = offsets(frag_copy_view.layout, cute.size(frag_copy_view, mode=[1]), cute.size(frag_copy_view, mode=[0]))
    tiles = [[n for n, regs in enumerate(mma_regs) if regs <= c] for c in copy_regs]
    assert sorted(n for t in tiles for n in t) == list(range(len(mma_regs))), "ldmatrix / MMA tiles do not match"
    return tiles


@cute.jit
def _mma_tiles(tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor, tiles, k: int):
    """acc[:, :, n] += A[:, :, k] B[:, n, k] for the N tiles `tiles` (every M tile of the warp)."""
    for n in cutlass.range_constexpr(len(tiles)):
        acc_n = cute.append_ones(acc[None, None, tiles[n]])  # (V, M, 1)
        cute.gemm(tiled_mma, acc_n, tCrA[None, None, k], cute.append_ones(tCrB[None, tiles[n], k]), acc_n)


@cute.jit
def gemm_rs_by_ldmatrix(
    tiled_mma: cute.TiledMma,
    acc: cute.Tensor,
    tCrA: cute.Tensor,
    tCrB: cute.Tensor,
    tCsB: cute.Tensor,
    smem_thr_copy_B: cute.TiledCopy,
):
    """acc += A B with A in registers (P) and B (V) loaded one ldmatrix ahead of the MMAs that use it.

    sm80_utils.gemm_rs loads the next whole k-slice of B while the current one is multiplied: at
    d=128 that is 2 x 32 registers of V fragments next to O (128) and P (32) in a 32-row warp, and
    ptxas spills or stops overlapping. One ldmatrix (two n8 tiles, 4 registers) ahead keeps the
    loads in flight with a fraction of the registers: 8 warps 256x48 at d=128 ran 3.5% faster with
    it, and fit in fp16 too."""
    tCrB_copy_view = smem_thr_copy_B.retile(tCrB)
    tiles = _ldmatrix_to_mma_tiles(tCrB, tCrB_copy_view)
    steps = [(k, c) for k in range(cute.size(tCrB, mode=[2])) for c in range(len(tiles))]
    cute.copy(smem_thr_copy_B, tCsB[None, 0, 0], tCrB_copy_view[None, 0, 0])
    for i in cutlass.range_constexpr(len(steps)):
        k, c = steps[i]
        if const_expr(i + 1 < len(steps)):
            k_next, c_next = steps[i + 1]
            cute.copy(smem_thr_copy_B, tCsB[None, c_next, k_next], tCrB_copy_view[None, c_next, k_next])
        _mma_tiles(tiled_mma, acc, tCrA, tCrB, tiles[c], k)


@cute.jit
def gemm_ss_by_half_slices(
    tiled_mma: cute.TiledMma,
    acc: cute.Tensor,
    tCrA: cute.Tensor,
    tCrB: cute.Tensor,
    tCsA: cute.Tensor,
    tCsB: cute.Tensor,
    smem_thr_copy_A: cute.TiledCopy,
    smem_thr_copy_B: cute.TiledCopy,
):
    """acc += A B, both from shared memory, B loaded half a k-slice ahead, A at the start of its k.

    The QK^T product of blocks that are also masked (causal diagonal) needs fewer registers this
    way than sm80_utils.gemm's whole-slice prefetch of A and B; 8 warps 256x64 at d=128 are
    spill-free with it in bf16 (tests/test_fwd_tma_codegen.py)."""
    tCrA_copy_view = smem_thr_copy_A.retile(tCrA)
    tCrB_copy_view = smem_thr_copy_B.retile(tCrB)
    tiles = _ldmatrix_to_mma_tiles(tCrB, tCrB_copy_view)
    half = (len(tiles) + 1) // 2
    ranges = [(0, half), (half, len(tiles))]
    steps = [(k, h) for k in range(cute.size(tCrB, mode=[2])) for h in range(2)]
    cute.copy(smem_thr_copy_A, tCsA[None, None, 0], tCrA_copy_view[None, None, 0])
    for c in cutlass.range_constexpr(*ranges[0]):
        cute.copy(smem_thr_copy_B, tCsB[None, c, 0], tCrB_copy_view[None, c, 0])
    for i in cutlass.range_constexpr(len(steps)):
        k, h = steps[i]
        if const_expr(i + 1 < len(steps)):
            k_next, h_next = steps[i + 1]
            for c in cutlass.range_constexpr(*ranges[h_next]):
                cute.copy(smem_thr_copy_B, tCsB[None, c, k_next], tCrB_copy_view[None, c, k_next])
        if const_expr(h == 0 and k > 0):
            cute.copy(smem_thr_copy_A, tCsA[None, None, k], tCrA_copy_view[None, None, k])
        for c in cutlass.range_constexpr(*ranges[h]):
            _mma_tiles(tiled_mma, acc, tCrA, tCrB, tiles[c], k)


class FlashAttentionForwardSm120Tma(FlashAttentionForwardSm120):
    """SM120 forward with a TMA producer warp and 4 or 8 mma.sync consumer warps (module docstring).

    Constructor: the same as FlashAttentionForwardSm120CpAsync. `num_threads` counts the MMA warps'
    threads; the launch adds a producer warpgroup (128 threads). `emulate_host_smem`: a hardware.EmulationHost
    (the host driver's shared-memory numbers) of a non-SM120 GPU running the kernel in SM120
    emulation (shared memory is padded so it fits no more CTAs per SM than SM120); None on SM120.
    """

    family = "tma"

    def __init__(
        self,
        dtype,
        head_dim: int,
        head_dim_v: Optional[int] = None,
        qhead_per_kvhead: int = 1,
        *,
        is_causal: bool = False,
        is_local: bool = False,
        pack_gqa: bool = False,
        tile_m: int = 128,
        tile_n: int = 64,
        num_stages: int = 2,
        num_threads: int = 256,
        Q_in_regs: bool = False,
        score_mod=None,
        mask_mod=None,
        has_aux_tensors: bool = False,
        emulate_host_smem: Optional[hardware.EmulationHost] = None,
        q_subtile_factor: int = 1,
        kv_subtile_factor: int = 1,
        pingpong: bool = False,
        lpt: Optional[bool] = None,
    ):
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        if dtype not in (cutlass.Float16, cutlass.BFloat16):
            raise TypeError(f"SM120 TMA forward takes Float16 or BFloat16, got {dtype}")
        error = tma_config_error(head_dim, head_dim_v, tile_m, tile_n, num_stages, num_threads, Q_in_regs)
        if error is None and pingpong:
            error = pingpong_error(num_threads)
        if error is not None:
            raise ValueError(f"SM120 TMA forward config not implementable: {error}")
        pack_gqa = pack_gqa and qhead_per_kvhead > 1
        if pack_gqa:
            error = pack_gqa_error(tile_m, qhead_per_kvhead)
            if error is not None:
                raise NotImplementedError(f"SM120 TMA forward: {error}; pass pack_gqa=False or use the cpasync family")
        super().__init__(
            dtype,
            head_dim,
            head_dim_v,
            qhead_per_kvhead,
            is_causal=is_causal,
            is_local=is_local,
            pack_gqa=pack_gqa,
            tile_m=tile_m,
            tile_n=tile_n,
            num_stages=num_stages,
            num_threads=num_threads,
            Q_in_regs=Q_in_regs,
            score_mod=score_mod,
            mask_mod=mask_mod,
            has_aux_tensors=has_aux_tensors,
        )
        self.num_mma_threads = num_threads
        self.qhead_per_kvhead_packgqa = qhead_per_kvhead if pack_gqa else 1
        self.num_mma_warps = num_threads // 32
        self.producer_warp_idx = self.num_mma_warps  # first warp of the producer warpgroup
        self.num_threads_total = num_threads + PRODUCER_THREADS
        smem_total = smem_bytes(head_dim, head_dim_v, tile_m, tile_n, num_stages) + hardware.DSL_STATIC_SMEM
        self.registers = register_split(smem_total, num_threads)
        # issue the next block's QK^T next to the previous block's PV (see mma_one_n_block)
        self.intra_warp_overlap = use_intra_warp_overlap(tile_m, num_threads)
        # causal/local diagonal blocks of 32-row warps with >= 64 keys: QK^T by half k-slices (registers)
        self.qk_half_slices_when_masked = rows_per_warp(tile_m, num_threads) == 32 and tile_n >= 64 and not Q_in_regs
        # PV with V one ldmatrix ahead where its k-slices are widest (d=128: 32 registers each); at
        # d <= 96 the whole-slice prefetch is spill-free and measured (d96 256x32 local spills otherwise)
        self.pv_by_ldmatrix = head_dim_v > 96
        self.has_sink = False  # set at trace time by __call__
        # block sparsity (fwd_block_sparse.py): K/V and Q tiles per sparse block
        self.q_subtile_factor = q_subtile_factor
        self.kv_subtile_factor = kv_subtile_factor
        self.emulate_host_smem = emulate_host_smem
        # two MMA warpgroups take turns at the tensor pipe (pingpong_error, mma_one_n_block)
        self.pingpong = pingpong
        # longest-processing-time tile order; None: for causal (not local) masks, where tiles differ in work
        self.lpt = lpt
        # filled in at trace time, read by the codegen report and the tests
        self.smem_bytes_unpadded: Optional[int] = None
        self.smem_bytes_launched: Optional[int] = None
        self.launch_threads: Optional[int] = None

    # ------------------------------------------------------------------------------------------
    # host side
    # ------------------------------------------------------------------------------------------

    @staticmethod
    def can_implement(
        dtype, head_dim, head_dim_v, tile_m, tile_n, num_stages, num_threads, is_causal, Q_in_regs=False
    ) -> bool:
        if dtype not in (cutlass.Float16, cutlass.BFloat16):
            return False
        return tma_config_error(head_dim, head_dim_v, tile_m, tile_n, num_stages, num_threads, Q_in_regs) is None

    @staticmethod
    def unsupported_reason(statics) -> Optional[str]:
        return unsupported_reason(statics)

    @classmethod
    def supports(cls, statics) -> bool:
        return unsupported_reason(statics) is None

    def _refuse_unsupported_args(self, **args) -> None:
        """Trace-time refusal of call arguments this kernel does not implement."""
        given = [name for name, value in args.items() if value is not None]
        if given:
            raise NotImplementedError(
                f"SM120 TMA forward does not support {', '.join(given)}; use the cpasync family"
            )

    def _setup_smem_layouts(self) -> None:
        """TMA-compatible swizzled layouts (the same atoms wgmma uses; ldmatrix reads them too)."""
        make = quack_sm90_utils.make_smem_layout
        self.sQ_layout = make(self.dtype, LayoutEnum.ROW_MAJOR, (self.tile_m, self.tile_hdim))
        self.sK_layout = make(self.dtype, LayoutEnum.ROW_MAJOR, (self.tile_n, self.tile_hdim), self.num_stages)
        self.sV_layout = make(self.dtype, LayoutEnum.ROW_MAJOR, (self.tile_n, self.tile_hdimv), self.num_stages)
        self.sO_layout = make(self.dtype, LayoutEnum.ROW_MAJOR, (self.tile_m, self.tile_hdimv))

    def _get_shared_storage_cls(self):
        sQ_struct, sK_struct, sV_struct = [
            cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layout)], _SMEM_ALIGN]
            for layout in (self.sQO_layout_for_size(), self.sK_layout, self.sV_layout)
        ]
        mbar_q = cute.struct.MemRange[cutlass.Int64, 2]
        mbar_k = cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
        mbar_v = cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]

        @cute.struct
        class SharedStorageTma:
            sQ: sQ_struct
            sK: sK_struct
            sV: sV_struct
            mbar_Q: mbar_q
            mbar_K: mbar_k
            mbar_V: mbar_v

        return emulation_storage(self, SharedStorageTma, self.num_threads_total)

    def sQO_layout_for_size(self):
        """sQ doubles as sO: the buffer must hold the larger of the two."""
        return self.sQ_layout if cute.cosize(self.sQ_layout) >= cute.cosize(self.sO_layout) else self.sO_layout

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        softmax_scale: Float32,
        mCuSeqlensQ: Optional[cute.Tensor] = None,
        mCuSeqlensK: Optional[cute.Tensor] = None,
        mSeqUsedQ: Optional[cute.Tensor] = None,
        mSeqUsedK: Optional[cute.Tensor] = None,
        mPageTable: Optional[cute.Tensor] = None,
        window_size_left: Int32 | int | None = None,
        window_size_right: Int32 | int | None = None,
        learnable_sink: Optional[cute.Tensor] = None,
        blocksparse_tensors: Optional[BlockSparseTensors] = None,
        aux_data: AuxData = AuxData(),
        mCuTotalMBlocks: Optional[cute.Tensor] = None,
        mCuTotalSplitsMBlocks: Optional[cute.Tensor] = None,
        # Always keep stream as the last parameter (EnvStream: obtained implicitly via TVM FFI).
        stream: cuda.CUstream = None,
    ):
        """Same call convention as upstream's FlashAttentionForwardSm80.__call__.

        mQ/mK/mV/mO: (batch, seqlen, nheads, head_dim), head_dim contiguous; mLSE: (batch, nheads,
        seqlen_q) fp32 or None.
        """
        self._refuse_unsupported_args(
            cu_seqlens_q=mCuSeqlensQ,
            cu_seqlens_k=mCuSeqlensK,
            seqused_q=mSeqUsedQ,
            seqused_k=mSeqUsedK,
            page_table=mPageTable,
        )
        self.has_sink = learnable_sink is not None
        self._check_type(
            *(t.element_type if t is not None else None for t in (mQ, mK, mV, mO, mLSE, None, None, None, None))
        )
        mQ, mK, mV, mO = [assume_tensor_aligned(t) for t in (mQ, mK, mV, mO)]
        # (b, s, h, d) -> (s, d, h, b): seqlen and head_dim lead, as the TMA boxes want them
        mQ, mK, mV, mO = [layout_utils.select(t, [1, 3, 2, 0]) for t in (mQ, mK, mV, mO)]
        if const_expr(mLSE is not None):
            mLSE = layout_utils.select(mLSE, [2, 1, 0])  # (s, h, b)

        tiled_mma_qk, tiled_mma_pv = self._get_tiled_mma()
        self._setup_smem_layouts()
        SharedStorage = self._get_shared_storage_cls()

        self.tma_copy_bytes = {
            name: cute.size_in_bytes(self.dtype, cute.select(layout, mode=[0, 1]))
            for name, layout in (("Q", self.sQ_layout), ("K", self.sK_layout), ("V", self.sV_layout))
        }
        # packed GQA: Q/O boxes of (qhead_per_kvhead, tile_m / qhead_per_kvhead) (head, position) rows;
        # the returned coordinate tensors are ((qhead_per_kvhead, seqlen), d, nheads_kv, b)
        make_tma_QO = (
            partial(make_packgqa_tiled_tma_atom, qhead_per_kvhead=self.qhead_per_kvhead, head_idx=2)
            if const_expr(self.pack_gqa)
            else cpasync.make_tiled_tma_atom
        )
        tma_load = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_Q, tma_tensor_Q = make_tma_QO(tma_load, mQ, self.sQ_layout, (self.tile_m, self.tile_hdim))
        tma_atom_K, tma_tensor_K = cpasync.make_tiled_tma_atom(
            tma_load, mK, cute.select(self.sK_layout, mode=[0, 1]), (self.tile_n, self.tile_hdim), 1
        )
        tma_atom_V, tma_tensor_V = cpasync.make_tiled_tma_atom(
            tma_load, mV, cute.select(self.sV_layout, mode=[0, 1]), (self.tile_n, self.tile_hdimv), 1
        )
        tma_atom_O, tma_tensor_O = make_tma_QO(
            cpasync.CopyBulkTensorTileS2GOp(), mO, self.sO_layout, (self.tile_m, self.tile_hdimv)
        )
        # the M tiles the grid covers: packed rows per KV head, or positions per query head
        mQ_rows = mQ
        if const_expr(self.pack_gqa):
            nheads_kv = mK.shape[2]
            mQ_rows = pack_gqa_layout(mQ, self.qhead_per_kvhead, nheads_kv, head_idx=2)
            if const_expr(mLSE is not None):
                mLSE = pack_gqa_layout(mLSE, self.qhead_per_kvhead, nheads_kv, head_idx=1)

        # causal tiles differ in work: longest first, with heads grouped for L2 reuse (as upstream sm90)
        use_lpt = (self.is_causal and not self.is_local) if self.lpt is None else self.lpt
        TileScheduler = SingleTileLPTScheduler if const_expr(use_lpt) else SingleTileScheduler
        tile_sched_args = TileSchedulerArguments(
            num_block=cute.ceil_div(cute.size(mQ_rows.shape[0]), self.tile_m),
            num_head=cute.size(mQ_rows.shape[2]),
            num_batch=cute.size(mQ_rows.shape[3]),
            num_splits=1,
            seqlen_k=cute.size(mK.shape[0]),
            headdim=mQ.shape[1],
            headdim_v=mV.shape[1],
            total_q=cute.size(mQ_rows.shape[0]) * cute.size(mQ_rows.shape[3]),
            tile_shape_mn=(self.tile_m, self.tile_n),
            qhead_per_kvhead_packgqa=self.qhead_per_kvhead_packgqa,
            element_size=self.dtype.width // 8,
            is_persistent=False,
            lpt=use_lpt,
        )
        tile_sched_params = TileScheduler.to_underlying_arguments(tile_sched_args)
        grid_dim = TileScheduler.get_grid_shape(tile_sched_params)

        softmax_scale_log2, softmax_scale = utils.compute_softmax_scale_log2(softmax_scale, self.score_mod)
        window_size_left = Int32(window_size_left) if window_size_left is not None else None
        window_size_right = Int32(window_size_right) if window_size_right is not None else None
        fastdiv_mods = utils.compute_fastdiv_mods(mQ, mK, self.qhead_per_kvhead, False, aux_data.tensors)
        aux_data = sink_fold.with_sink(aux_data, learnable_sink)  # the sink rides with the aux tensors

        self.kernel(
            tma_tensor_Q,
            tma_tensor_K,
            tma_tensor_V,
            tma_tensor_O,
            mLSE,
            tma_atom_Q,
            tma_atom_K,
            tma_atom_V,
            tma_atom_O,
            softmax_scale_log2,
            softmax_scale,
            window_size_left,
            window_size_right,
            self.sQ_layout,
            self.sK_layout,
            self.sV_layout,
            self.sO_layout,
            tiled_mma_qk,
            tiled_mma_pv,
            SharedStorage,
            tile_sched_params,
            TileScheduler,
            aux_data,
            fastdiv_mods,
            blocksparse_tensors,
        ).launch(
            grid=grid_dim,
            block=[self.num_threads_total, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=self.registers.ctas_per_sm,
            # all of the SM's memory as shared memory when CTAs share an SM; set here, the DSL
            # would otherwise query the device at compile time for it
            preferred_smem_carveout=100 if self.registers.ctas_per_sm > 1 else None,
        )

    # ------------------------------------------------------------------------------------------
    # device side
    # ------------------------------------------------------------------------------------------

    def _tma_pipeline(self, barriers, num_stages: int, operand: str, producer, consumers):
        """One mbarrier ring (trace-time helper): full barriers expect one TMA arrive plus the
        operand's transaction bytes, empty barriers one arrive per MMA warp. Barrier init is
        deferred to the kernel's single pipeline_init_arrive / pipeline_init_wait."""
        return cpipeline.PipelineTmaAsync.create(
            barrier_storage=barriers.data_ptr(),
            num_stages=num_stages,
            producer_group=producer,
            consumer_group=consumers,
            tx_count=self.tma_copy_bytes[operand],
            defer_sync=True,
        )

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        tma_atom_Q: cute.CopyAtom,
        tma_atom_K: cute.CopyAtom,
        tma_atom_V: cute.CopyAtom,
        tma_atom_O: cute.CopyAtom,
        softmax_scale_log2: Float32,
        softmax_scale: Optional[Float32],
        window_size_left: Optional[Int32],
        window_size_right: Optional[Int32],
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
        tile_sched_params,
        TileScheduler: cutlass.Constexpr[Callable],
        aux_data: AuxData = AuxData(),
        fastdiv_mods=None,
        blocksparse_tensors: Optional[BlockSparseTensors] = None,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == self.producer_warp_idx:
            for tma_atom in (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O):
                cpasync.prefetch_descriptor(tma_atom)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)

        # full barriers: one TMA arrive + transaction bytes; empty barriers: one arrive per MMA warp
        producer = cpipeline.CooperativeGroup(cpipeline.Agent.Thread, 1)
        consumers = cpipeline.CooperativeGroup(cpipeline.Agent.Thread, self.num_mma_warps)
        pipeline_q = self._tma_pipeline(storage.mbar_Q, 1, "Q", producer, consumers)
        pipeline_k = self._tma_pipeline(storage.mbar_K, self.num_stages, "K", producer, consumers)
        pipeline_v = self._tma_pipeline(storage.mbar_V, self.num_stages, "V", producer, consumers)
        # make the mbarrier inits visible to the async proxy, then sync the CTA once
        cpipeline.pipeline_init_arrive()
        cpipeline.pipeline_init_wait()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sO = storage.sQ.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)

        tile_scheduler = TileScheduler.create(tile_sched_params)
        work_tile = tile_scheduler.initial_work_tile_info()
        if work_tile.is_valid_tile:
            m_block, head_idx, batch_idx, _ = work_tile.tile_idx
            seqlen_q_static = mQ.shape[0][1] if const_expr(self.pack_gqa) else mQ.shape[0]
            seqlen = SeqlenInfoQK.create(batch_idx, seqlen_q_static=seqlen_q_static, seqlen_k_static=mK.shape[0])
            block_info = BlockInfo(
                self.tile_m,
                self.tile_n,
                self.is_causal,
                self.is_local,
                False,  # is_split_kv
                window_size_left,
                window_size_right,
                qhead_per_kvhead_packgqa=self.qhead_per_kvhead_packgqa,
            )
            n_block_min, n_block_max = block_info.get_n_block_min_max(seqlen, m_block)
            # with block sparsity, each role reads this Q tile's lists after its first wait or load
            lists = partial(
                fwd_block_sparse.tile_lists, blocksparse_tensors, batch_idx, head_idx, m_block, seqlen, self.tile_n,
                self.qhead_per_kvhead_packgqa, self.q_subtile_factor, self.kv_subtile_factor,
            ) if const_expr(blocksparse_tensors is not None) else None
            if warp_idx >= self.producer_warp_idx:
                if const_expr(self.registers.producer_regs is not None):
                    cute.arch.setmaxregister_decrease(self.registers.producer_regs)
                if warp_idx == self.producer_warp_idx:
                    self.load(
                        mQ, mK, mV, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V,
                        pipeline_q, pipeline_k, pipeline_v,
                        m_block, head_idx, batch_idx, n_block_min, n_block_max, lists,
                    )
            else:
                if const_expr(self.registers.mma_regs is not None):
                    cute.arch.setmaxregister_increase(self.registers.mma_regs)
                tidx, _, _ = cute.arch.thread_idx()
                self.mma(
                    mO, mLSE, sQ, sK, sV, sO, tma_atom_O, pipeline_q, pipeline_k, pipeline_v,
                    tiled_mma_qk, tiled_mma_pv, tidx, warp_idx,
                    softmax_scale_log2, softmax_scale, block_info, seqlen,
                    window_size_left, window_size_right,
                    m_block, head_idx, batch_idx, n_block_min, n_block_max,
                    aux_data, fastdiv_mods, lists,
                )

    @cute.jit
    def load(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        tma_atom_Q: cute.CopyAtom,
        tma_atom_K: cute.CopyAtom,
        tma_atom_V: cute.CopyAtom,
        pipeline_q: cpipeline.PipelineAsync,
        pipeline_k: cpipeline.PipelineAsync,
        pipeline_v: cpipeline.PipelineAsync,
        m_block: Int32,
        head_idx: Int32,
        batch_idx: Int32,
        n_block_min: Int32,
        n_block_max: Int32,
        lists: Optional[Callable] = None,
    ):
        """Producer warp: Q once, then K and V of each n_block (descending; with block sparsity the
        listed tiles, fwd_block_sparse.py) into the rings."""
        # packed GQA: the grid's head index is already the KV head
        head_idx_kv = head_idx if const_expr(self.pack_gqa) else head_idx // self.qhead_per_kvhead
        gQ = cute.local_tile(mQ[None, None, head_idx, batch_idx], (self.tile_m, self.tile_hdim), (m_block, 0))
        gK = cute.local_tile(mK[None, None, head_idx_kv, batch_idx], (self.tile_n, self.tile_hdim), (None, 0))
        gV = cute.local_tile(mV[None, None, head_idx_kv, batch_idx], (self.tile_n, self.tile_hdimv), (None, 0))
        load_Q, _, _ = copy_utils.tma_get_copy_fn(tma_atom_Q, 0, cute.make_layout(1), gQ, sQ, single_stage=True)
        load_K, _, _ = copy_utils.tma_get_copy_fn(tma_atom_K, 0, cute.make_layout(1), gK, sK)
        load_V, _, _ = copy_utils.tma_get_copy_fn(tma_atom_V, 0, cute.make_layout(1), gV, sV)
        load_K = copy_utils.tma_producer_copy_fn(load_K, pipeline_k)
        load_V = copy_utils.tma_producer_copy_fn(load_V, pipeline_v)

        q_state = cpipeline.make_pipeline_state(cpipeline.PipelineUserType.Producer, 1)
        pipeline_q.producer_acquire(q_state)
        load_Q(tma_bar_ptr=pipeline_q.producer_get_barrier(q_state))

        kv_state = cpipeline.make_pipeline_state(cpipeline.PipelineUserType.Producer, self.num_stages)
        if const_expr(lists is not None):  # read under the Q load
            kv_state = fwd_block_sparse.load_tiles(lists(), kv_state, load_K, load_V, pipeline_k, pipeline_v,
                                                   self.kv_subtile_factor)
        else:
            for i in cutlass.range(n_block_max - n_block_min, unroll=1):
                n_block = n_block_max - 1 - i
                pipeline_k.producer_acquire(kv_state)
                load_K(src_idx=n_block, producer_state=kv_state)
                pipeline_v.producer_acquire(kv_state)
                load_V(src_idx=n_block, producer_state=kv_state)
                kv_state.advance()

    @cute.jit
    def mma(
        self,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        sO: cute.Tensor,
        tma_atom_O: cute.CopyAtom,
        pipeline_q: cpipeline.PipelineAsync,
        pipeline_k: cpipeline.PipelineAsync,
        pipeline_v: cpipeline.PipelineAsync,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        tidx: Int32,
        warp_idx: Int32,
        softmax_scale_log2: Float32,
        softmax_scale: Optional[Float32],
        block_info: BlockInfo,
        seqlen: SeqlenInfoQK,
        window_size_left: Optional[Int32],
        window_size_right: Optional[Int32],
        m_block: Int32,
        head_idx: Int32,
        batch_idx: Int32,
        n_block_min: Int32,
        n_block_max: Int32,
        aux_data: AuxData,
        fastdiv_mods,
        lists: Optional[Callable] = None,
    ):
        """MMA warps: the FA2 loop over n_blocks (or the block-sparse tiles), then the epilogue."""
        aux_data, sink = sink_fold.split_sink(aux_data, self.has_sink)
        sVt = layout_utils.transpose_view(sV)  # (head_dim_v, tile_n, stage) for the PV B operand
        thr_mma_qk = tiled_mma_qk.get_slice(tidx)
        thr_mma_pv = tiled_mma_pv.get_slice(tidx)
        tSrQ = thr_mma_qk.make_fragment_A(thr_mma_qk.partition_A(sQ))
        tSrK = thr_mma_qk.make_fragment_B(thr_mma_qk.partition_B(sK[None, None, 0]))
        tOrVt = thr_mma_pv.make_fragment_B(thr_mma_pv.partition_B(sVt[None, None, 0]))
        acc_O = cute.make_rmem_tensor(thr_mma_pv.partition_shape_C((self.tile_m, self.tile_hdimv)), Float32)
        acc_O.fill(0.0)

        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype)
        smem_thr_copy_Q = utils.make_tiled_copy_A(ldsm, tiled_mma_qk).get_slice(tidx)
        smem_thr_copy_K = utils.make_tiled_copy_B(ldsm, tiled_mma_qk).get_slice(tidx)
        smem_thr_copy_V = utils.make_tiled_copy_B(ldsm_t, tiled_mma_pv).get_slice(tidx)
        tSsQ = smem_thr_copy_Q.partition_S(sQ)
        tSsK = smem_thr_copy_K.partition_S(sK)
        tOsVt = smem_thr_copy_V.partition_S(sVt)

        softmax = Softmax.create(
            softmax_scale_log2, num_rows=acc_O.shape[0][0] * acc_O.shape[1], softmax_scale=softmax_scale
        )
        softmax.reset()
        mask = AttentionMask(
            self.tile_m, self.tile_n, seqlen, window_size_left, window_size_right, self.qhead_per_kvhead_packgqa
        )

        # P of the last processed n_block, bf16/fp16 in registers, the A operand of O += P V
        rP = cute.make_rmem_tensor(thr_mma_qk.partition_shape_C((self.tile_m, self.tile_n)), self.dtype)
        tOrP = layout_utils.reshape_acc_to_frgA(rP)

        q_state = cpipeline.make_pipeline_state(cpipeline.PipelineUserType.Consumer, 1)
        pipeline_q.consumer_wait(q_state)
        if const_expr(self.Q_in_regs):
            # this warp's Q rows, once; sQ stays allocated for the epilogue's sO
            cute.copy(smem_thr_copy_Q, tSsQ, smem_thr_copy_Q.retile(tSrQ))
        # K and V rings advance in lockstep; with the overlap, V trails K by one n_block
        kv_k = cpipeline.make_pipeline_state(cpipeline.PipelineUserType.Consumer, self.num_stages)
        kv_v = cpipeline.make_pipeline_state(cpipeline.PipelineUserType.Consumer, self.num_stages)
        mma_wg = warp_idx // 4  # this warp's MMA warpgroup (the ping-pong turn it takes)
        if const_expr(self.pingpong):
            if mma_wg == 1:
                # warpgroup 0 takes the first turn
                cute.arch.barrier_arrive(barrier_id=_PINGPONG_BARRIER_ID, number_of_threads=2 * WARPGROUP_THREADS)

        common = dict(
            pipeline_k=pipeline_k, pipeline_v=pipeline_v, thr_mma_qk=thr_mma_qk,
            tiled_mma_qk=tiled_mma_qk, tiled_mma_pv=tiled_mma_pv, tSrQ=tSrQ, tSrK=tSrK, tOrVt=tOrVt,
            tSsQ=tSsQ, tSsK=tSsK, tOsVt=tOsVt, smem_thr_copy_Q=smem_thr_copy_Q,
            smem_thr_copy_K=smem_thr_copy_K, smem_thr_copy_V=smem_thr_copy_V, acc_O=acc_O, rP=rP,
            tOrP=tOrP, softmax=softmax, mask=mask, seqlen=seqlen, m_block=m_block, head_idx=head_idx,
            batch_idx=batch_idx, aux_data=aux_data, fastdiv_mods=fastdiv_mods, mma_wg=mma_wg,
        )
        # one n_block: S = QK^T (+ the previous block's PV when overlapping), mask, softmax
        block = partial(self.mma_one_n_block, overlap=self.intra_warp_overlap, **common)

        if const_expr(lists is not None):
            sparse = lists()
            # causal/local masks (when the call has them) apply to every visited tile
            kv_k, kv_v = fwd_block_sparse.consume_tiles(
                sparse, partial(block, mask_causal_local=True), kv_k, kv_v, self.intra_warp_overlap,
                self.kv_subtile_factor,
            )
            if fwd_block_sparse.total_tiles(sparse) > 0:
                if const_expr(self.intra_warp_overlap):
                    self.mma_pv(kv_v, pipeline_v, tiled_mma_pv, acc_O, tOrP, tOrVt, tOsVt, smem_thr_copy_V)
                    kv_v.advance()
                else:
                    self._pingpong_arrive(mma_wg)  # the turn taken by the last block's PV
        elif n_block_max > n_block_min:
            # the last n_block first: it holds the seqlen_k boundary and the causal diagonal
            block(kv_k, kv_v, n_block_max - 1, is_first=True, mask_seqlen=True, mask_causal_local=True)
            kv_k.advance()
            if const_expr(not self.intra_warp_overlap):
                kv_v.advance()
            n_block_hi = n_block_max - 1
            if const_expr(self.is_causal or self.is_local):
                n_block_causal = block_info.get_n_block_min_causal_local_mask(seqlen, m_block, n_block_min)
                for n_tile in cutlass.range(n_block_hi - n_block_causal, unroll=1):
                    block(kv_k, kv_v, n_block_hi - 1 - n_tile, is_first=False, mask_seqlen=False, mask_causal_local=True)
                    kv_k.advance()
                    kv_v.advance()
                n_block_hi = cutlass.min(n_block_hi, n_block_causal)
            n_block_local = block_info.get_n_block_min_before_local_mask(seqlen, m_block, n_block_min)
            for n_tile in cutlass.range(n_block_hi - n_block_local, unroll=1):
                block(kv_k, kv_v, n_block_hi - 1 - n_tile, is_first=False, mask_seqlen=False, mask_causal_local=False)
                kv_k.advance()
                kv_v.advance()
            if const_expr(self.is_local and block_info.window_size_left is not None):
                n_block_hi = cutlass.min(n_block_hi, n_block_local)
                for n_tile in cutlass.range(n_block_hi - n_block_min, unroll=1):
                    block(kv_k, kv_v, n_block_hi - 1 - n_tile, is_first=False, mask_seqlen=False, mask_causal_local=True)
                    kv_k.advance()
                    kv_v.advance()
            if const_expr(self.intra_warp_overlap):
                # the PV product of the last n_block is still due
                self.mma_pv(kv_v, pipeline_v, tiled_mma_pv, acc_O, tOrP, tOrVt, tOsVt, smem_thr_copy_V)
                kv_v.advance()
            else:
                self._pingpong_arrive(mma_wg)  # the turn taken by the last block's PV

        # with a sink, the final softmax counts it (one more column per row, no value)
        row_sinks = None
        if const_expr(self.has_sink):
            row_sinks = sink_fold.load_row_sinks(sink, thr_mma_pv, self.tile_m, self.tile_hdimv, m_block, head_idx,
                                                 self.qhead_per_kvhead, self.pack_gqa)
        row_scale = softmax.finalize(sink_val=row_sinks)
        softmax.rescale_O(acc_O, row_scale)
        self.store_output(
            acc_O, softmax.row_sum, mO, mLSE, sO, tma_atom_O, thr_mma_pv, tiled_mma_pv, tidx, warp_idx,
            seqlen, m_block, head_idx, batch_idx,
        )

    @cute.jit
    def mma_one_n_block(
        self,
        kv_k: cpipeline.PipelineState,
        kv_v: cpipeline.PipelineState,
        n_block: Int32,
        pipeline_k: cpipeline.PipelineAsync,
        pipeline_v: cpipeline.PipelineAsync,
        thr_mma_qk: cute.ThrMma,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        tSrQ: cute.Tensor,
        tSrK: cute.Tensor,
        tOrVt: cute.Tensor,
        tSsQ: cute.Tensor,
        tSsK: cute.Tensor,
        tOsVt: cute.Tensor,
        smem_thr_copy_Q: cute.TiledCopy,
        smem_thr_copy_K: cute.TiledCopy,
        smem_thr_copy_V: cute.TiledCopy,
        acc_O: cute.Tensor,
        rP: cute.Tensor,
        tOrP: cute.Tensor,
        softmax: Softmax,
        mask: AttentionMask,
        seqlen: SeqlenInfoQK,
        m_block: Int32,
        head_idx: Int32,
        batch_idx: Int32,
        aux_data: AuxData,
        fastdiv_mods,
        mma_wg: Int32,
        overlap: cutlass.Constexpr[bool],
        is_first: cutlass.Constexpr[bool],
        mask_seqlen: cutlass.Constexpr[bool],
        mask_causal_local: cutlass.Constexpr[bool],
        use_mask_mod: cutlass.Constexpr[bool] = True,
    ):
        """One n_block. Without overlap: S = Q K^T, softmax, O = O * scale + P V (same block).

        With overlap (not for the first block): S_j = Q K_j^T and O += P_{j-1} V_{j-1} are issued
        back to back after both waits, then softmax_j; the straight-line body lets ptxas interleave
        the PV mma.sync of block j-1 with the exp2/max/sum of block j. O is rescaled after the
        PV product: P_{j-1} was taken against max_{j-1}, the scale moves all of O to max_j.

        Ping-pong (self.pingpong): each MMA burst is one turn, taken after the other warpgroup's
        turn ends, so one warpgroup's softmax runs under the other's mma.sync (FA3's scheduler
        barrier). With overlap the burst is QK^T_j + PV_{j-1} (the first block's QK^T runs
        untaken, as FA3's first half-block); without it the burst is PV_{j-1} + QK^T_j: the first
        block takes a turn before its QK^T, every block ends the turn after its QK^T and takes one
        before its PV, and the caller ends the last.
        """
        do_pv_first = const_expr(overlap and not is_first)
        acc_S = cute.make_rmem_tensor(thr_mma_qk.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        acc_S.fill(0.0)
        pipeline_k.consumer_wait(kv_k, pipeline_k.consumer_try_wait(kv_k))
        if const_expr(do_pv_first):
            pipeline_v.consumer_wait(kv_v, pipeline_v.consumer_try_wait(kv_v))
        if const_expr(do_pv_first or (is_first and not overlap)):
            self._pingpong_sync(mma_wg)
        apply_causal_local = const_expr(mask_causal_local and (self.is_causal or self.is_local))
        if const_expr(apply_causal_local and self.qk_half_slices_when_masked):
            gemm_ss_by_half_slices(
                thr_mma_qk, acc_S, tSrQ, tSrK, tSsQ, tSsK[None, None, None, kv_k.index], smem_thr_copy_Q, smem_thr_copy_K
            )
        else:
            sm80_utils.gemm(
                thr_mma_qk, acc_S, tSrQ, tSrK, tSsQ, tSsK[None, None, None, kv_k.index], smem_thr_copy_Q, smem_thr_copy_K,
                A_in_regs=self.Q_in_regs,
            )
        if const_expr(do_pv_first):
            sm80_utils.gemm_rs(tiled_mma_pv, acc_O, tOrP, tOrVt, tOsVt[None, None, None, kv_v.index], smem_thr_copy_V)
        if const_expr(do_pv_first or not overlap):
            self._pingpong_arrive(mma_wg)
        if const_expr(not overlap):
            self._release(pipeline_k, kv_k)

        if const_expr(self.score_mod is not None):
            self.apply_score_mod(
                thr_mma_qk, batch_idx, head_idx, m_block, acc_S, n_block,
                softmax_scale=softmax.softmax_scale, seqlen=seqlen, aux_data=aux_data, fastdiv_mods=fastdiv_mods,
            )
        mask_mod = self.mask_mod if const_expr(use_mask_mod) else None  # block sparsity's full tiles: none
        if const_expr(mask_seqlen or apply_causal_local or mask_mod is not None):
            mask.apply_mask(
                acc_S,
                batch_idx=batch_idx,
                head_idx=head_idx,
                m_block=m_block,
                n_block=n_block,
                thr_mma=thr_mma_qk,
                mask_seqlen=mask_seqlen,
                mask_causal=self.is_causal and apply_causal_local,
                mask_local=self.is_local and apply_causal_local,
                mask_mod=mask_mod,
                aux_data=aux_data,
                fastdiv_mods=fastdiv_mods if const_expr(mask_mod is not None) else None,
            )
        # a row max of -inf needs a causal/local mask, a mask_mod or a score_mod: with only the
        # seqlen_k mask, the first block (the last n_block) has a valid key in every row, so the
        # guard (a compare and select per row and block) is skipped
        may_be_inf = const_expr(
            self.is_causal or self.is_local or self.score_mod is not None or self.mask_mod is not None
        )
        row_scale = softmax.online_softmax(acc_S, is_first=is_first, check_inf=may_be_inf)
        if const_expr(not is_first):
            softmax.rescale_O(acc_O, row_scale)
        rP.store(acc_S.load().to(self.dtype))

        if const_expr(overlap):
            self._release(pipeline_k, kv_k)
            if const_expr(do_pv_first):
                self._release(pipeline_v, kv_v)
        else:
            self.mma_pv(kv_v, pipeline_v, tiled_mma_pv, acc_O, tOrP, tOrVt, tOsVt, smem_thr_copy_V, mma_wg)

    @cute.jit
    def _pingpong_sync(self, mma_wg: Int32):
        """Ping-pong: wait for this warpgroup's turn at the tensor pipe (no-op without it)."""
        if const_expr(self.pingpong):
            cute.arch.barrier(barrier_id=_PINGPONG_BARRIER_ID + mma_wg, number_of_threads=2 * WARPGROUP_THREADS)

    @cute.jit
    def _pingpong_arrive(self, mma_wg: Int32):
        """Ping-pong: end this warpgroup's turn, handing it to the other (no-op without it)."""
        if const_expr(self.pingpong):
            cute.arch.barrier_arrive(barrier_id=_PINGPONG_BARRIER_ID + 1 - mma_wg,
                                     number_of_threads=2 * WARPGROUP_THREADS)

    @cute.jit
    def mma_pv(
        self,
        kv_v: cpipeline.PipelineState,
        pipeline_v: cpipeline.PipelineAsync,
        tiled_mma_pv: cute.TiledMma,
        acc_O: cute.Tensor,
        tOrP: cute.Tensor,
        tOrVt: cute.Tensor,
        tOsVt: cute.Tensor,
        smem_thr_copy_V: cute.TiledCopy,
        pingpong_wg: Optional[Int32] = None,
    ):
        """O += P V for the V slot of `kv_v`, then hand the slot back. `pingpong_wg`: take the
        warpgroup's ping-pong turn first (the plain order's PV; the overlap's last PV takes none)."""
        pipeline_v.consumer_wait(kv_v, pipeline_v.consumer_try_wait(kv_v))
        if const_expr(pingpong_wg is not None):
            self._pingpong_sync(pingpong_wg)
        if const_expr(self.pv_by_ldmatrix):
            gemm_rs_by_ldmatrix(tiled_mma_pv, acc_O, tOrP, tOrVt, tOsVt[None, None, None, kv_v.index], smem_thr_copy_V)
        else:
            sm80_utils.gemm_rs(tiled_mma_pv, acc_O, tOrP, tOrVt, tOsVt[None, None, None, kv_v.index], smem_thr_copy_V)
        self._release(pipeline_v, kv_v)

    @cute.jit
    def _release(self, pipeline: cpipeline.PipelineAsync, state: cpipeline.PipelineState):
        """Hand a K or V slot back to the producer after this warp's last ldmatrix from it.

        The slot was read through the generic proxy and the next TMA writes it through the async
        proxy: fence between them; one lane per warp arrives, so converge the warp first.
        """
        cute.arch.fence_view_async_shared()
        cute.arch.sync_warp()
        pipeline.consumer_release(state)

    @cute.jit
    def store_output(
        self,
        acc_O: cute.Tensor,
        lse: cute.Tensor,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        sO: cute.Tensor,
        tma_atom_O: cute.CopyAtom,
        thr_mma_pv: cute.ThrMma,
        tiled_mma_pv: cute.TiledMma,
        tidx: Int32,
        warp_idx: Int32,
        seqlen: SeqlenInfoQK,
        m_block: Int32,
        head_idx: Int32,
        batch_idx: Int32,
    ):
        """O: registers -> sO (stmatrix) -> one TMA store (clipped at seqlen_q); LSE from registers."""
        rO = cute.make_fragment_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        # sO aliases sQ: every MMA warp must be past its last ldmatrix of Q
        cute.arch.barrier(barrier_id=_EPILOGUE_BARRIER_ID, number_of_threads=self.num_mma_threads)
        stsm = cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        smem_thr_copy_O = cute.make_tiled_copy_C(stsm, tiled_mma_pv).get_slice(tidx)
        cute.copy(smem_thr_copy_O, smem_thr_copy_O.retile(rO), smem_thr_copy_O.partition_D(sO))
        # generic-proxy smem writes must be visible to the TMA store (async proxy)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=_EPILOGUE_BARRIER_ID, number_of_threads=self.num_mma_threads)
        if warp_idx == 0:
            gO = cute.local_tile(mO[None, None, head_idx, batch_idx], (self.tile_m, self.tile_hdimv), (m_block, 0))
            store_O, _, _ = copy_utils.tma_get_copy_fn(tma_atom_O, 0, cute.make_layout(1), sO, gO, single_stage=True)
            store_O()
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)

        if const_expr(mLSE is not None):
            # (rows,) of this head (packed: ((qhead_per_kvhead, seqlen),) of this KV head, where the
            # flat row index m_block * tile_m + row is exactly the packed order)
            mLSE_cur = mLSE[None, head_idx, batch_idx]
            cO = cute.make_identity_tensor((self.tile_m, self.tile_hdimv))
            taccOcO = layout_utils.reshape_acc_to_mn(thr_mma_pv.partition_C(cO))
            assert cute.size(taccOcO, mode=[0]) == cute.size(lse)
            rows_left = seqlen.seqlen_q * self.qhead_per_kvhead_packgqa - m_block * self.tile_m
            # the four threads of a quad hold the same rows; the one holding column 0 writes
            if taccOcO[0][1] == 0:
                for r in cutlass.range(cute.size(lse), unroll_full=True):
                    row = taccOcO[r, 0][0]
                    if row < rows_left:
                        mLSE_cur[m_block * self.tile_m + row] = lse[r]
