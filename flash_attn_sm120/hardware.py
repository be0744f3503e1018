"""SM120 resource model: how many CTAs of a kernel fit on one SM, and what limits it.

Numbers are those of compute capability 12.0 (RTX PRO 6000 Blackwell, RTX 5090) as the CUDA
occupancy calculator models them: 100 KB of shared memory per SM of which at most 99 KB
(101376 B) may go to one block, 1 KB reserved by the driver per resident CTA, 1536 threads and
64K 32-bit registers per SM, registers allocated per warp in units of 256, at most 32 CTAs.

The same model drives three things: the codegen report (CTAs per SM on SM120), config pruning,
and SM120 emulation, which pads each CTA's shared memory on a bigger GPU (an H200 has 228 KB
per SM) so that no more CTAs are resident per SM than on SM120.
"""

from __future__ import annotations

from dataclasses import dataclass

SMEM_PER_SM = 102400
SMEM_PER_BLOCK_MAX = 101376  # 99 KB, cudaDevAttrMaxSharedMemoryPerBlockOptin on SM120
SMEM_RESERVED_PER_CTA = 1024
THREADS_PER_SM = 1536
REGS_PER_SM = 65536
REG_ALLOC_UNIT_PER_WARP = 256
MAX_CTAS_PER_SM = 32
MAX_REGS_PER_THREAD = 255
# static shared memory the CuTe DSL adds to every kernel of this family (cuobjdump SHARED:1024 on
# sm_120a and sm_90a); the codegen report reads the real value from each cubin
DSL_STATIC_SMEM = 1024
DEFAULT_NUM_SMS = 188  # RTX PRO 6000 Blackwell; an RTX 5090 has 170


@dataclass(frozen=True)
class Occupancy:
    ctas_per_sm: int
    limiter: str  # "smem", "threads", "regs" or "ctas"
    by_smem: int
    by_threads: int
    by_regs: int


def regs_per_cta(regs_per_thread: int, num_threads: int) -> int:
    """Registers one CTA takes: allocated per warp, rounded up to 256."""
    per_warp = regs_per_thread * 32
    per_warp = -(-per_warp // REG_ALLOC_UNIT_PER_WARP) * REG_ALLOC_UNIT_PER_WARP
    return per_warp * (-(-num_threads // 32))


def sm120_occupancy(smem_bytes: int, num_threads: int, regs_per_thread: int | None = None) -> Occupancy:
    """CTAs per SM on SM120 for a kernel using `smem_bytes` of dynamic+static shared memory."""
    if smem_bytes > SMEM_PER_BLOCK_MAX:
        return Occupancy(0, "smem", 0, 0, 0)
    by_smem = SMEM_PER_SM // (smem_bytes + SMEM_RESERVED_PER_CTA)
    by_threads = THREADS_PER_SM // num_threads
    by_regs = REGS_PER_SM // regs_per_cta(regs_per_thread, num_threads) if regs_per_thread else MAX_CTAS_PER_SM
    limits = {"smem": by_smem, "threads": by_threads, "regs": by_regs, "ctas": MAX_CTAS_PER_SM}
    limiter = min(limits, key=lambda k: (limits[k], list(limits).index(k)))
    return Occupancy(limits[limiter], limiter, by_smem, by_threads, by_regs)


def emulation_padded_smem(
    smem_bytes: int,
    num_threads: int,
    *,
    static_smem: int = 0,
    host_smem_per_sm: int,
    host_smem_per_block_max: int,
    host_reserved_per_cta: int = SMEM_RESERVED_PER_CTA,
    regs_per_thread: int | None = None,
) -> int:
    """Shared memory size to launch with on a bigger GPU so it fits no more CTAs than SM120.

    `smem_bytes` is the dynamic size the launch asks for, `static_smem` what the cubin adds.
    Returns a dynamic size >= smem_bytes such that floor(host_smem_per_sm / (size + static +
    reserved)) equals the SM120 CTA count (or is below it only where the host's own limits already
    are). The host's
    threads and registers per SM are not modelled: Hopper has the same 64K registers and more
    threads (2048) than SM120, so shared memory is the knob that brings it down to SM120's count.
    """
    target = sm120_occupancy(smem_bytes + static_smem, num_threads, regs_per_thread).ctas_per_sm
    if target <= 0:
        raise ValueError(f"{smem_bytes + static_smem} B of shared memory does not fit one SM120 CTA")
    per_cta_extra = static_smem + host_reserved_per_cta
    host_fit = host_smem_per_sm // (smem_bytes + per_cta_extra)
    if host_fit <= target:
        return smem_bytes
    # smallest size in 1 KB granules (the shared-storage struct's alignment) that leaves room for
    # no more than `target` CTAs: floor(host / (size + static + reserved)) == target
    size = host_smem_per_sm // (target + 1) - per_cta_extra + 1
    size = -(-size // 1024) * 1024
    size = max(size, smem_bytes)
    if size > host_smem_per_block_max:
        raise ValueError(
            f"cannot pad {smem_bytes} B to {size} B: the host GPU allows {host_smem_per_block_max} B per block"
        )
    assert host_smem_per_sm // (size + per_cta_extra) == target
    return size
