"""Trace-time mma.sync GEMM helpers that load shared-memory operands with finer prefetch than sm80_utils.

FlashAttentionForwardSm80's helpers (flash_attn.cute.ampere_helpers: `gemm`, `gemm_rs`) load the
next whole k-slice of B (and A) while the current one is multiplied. At d=128 in a 32-row warp a
k-slice of V is 32 registers, and two of them next to the O accumulators and P push ptxas into
spills. These helpers issue the same ldmatrix and mma.sync instructions in a finer order:

  * `gemm_rs_by_ldmatrix`: A in registers (P), B (V) loaded one ldmatrix.x4 ahead of the MMAs
    that use it (the TMA forward's PV product at d > 96);
  * `gemm_ss_by_half_slices`: both from shared memory, B half a k-slice ahead, A at the start of
    its k (the QK^T product of masked blocks on 32-row warps with >= 64 keys).

Which MMA N tiles one ldmatrix fills depends on the tiled MMA's permutation, so
`_ldmatrix_to_mma_tiles` reads it from the two register views of one fragment at trace time.
"""

import cutlass
import cutlass.cute as cute
from cutlass import const_expr


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
