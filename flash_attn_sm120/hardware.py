"""SM120 resource model: how many CTAs of a kernel fit on one SM, and what limits it.

Numbers are those of compute capability 12.0 (RTX PRO 6000 Blackwell, RTX 5090) as the CUDA
occupancy calculator models them: 100 KB of shared memory per SM of which at most 99 KB
(101376 B) may go to one block, 1 KB reserved by the driver per resident CTA, 1536 threads and
64K 32-bit registers per SM, registers allocated per warp in units of 256, at most 32 CTAs.

The same model drives three things: the codegen report (CTAs per SM on SM120), config pruning,
and SM120 emulation, which pads each CTA's shared memory on a bigger GPU (an H200 has 228 KB
per SM) so that no more CTAs are resident per SM than on SM120.

Two sides, two sources of truth (docs/emulation.md has the whole model):
  * the SM120 side uses sm_120a facts: the cubin's static shared memory (`DSL_STATIC_SMEM`, what
    cuobjdump reports for these kernels) and, where known, its registers;
  * the host side of emulation uses only what the host reports: shared memory per SM and per
    block, the driver's reservation per CTA, and the compiled kernel's own static shared memory
    (`EmulationHost`). `occupancy.py` then asks the CUDA occupancy API how many CTAs of the
    compiled function really fit, and refuses a launch whose count differs from SM120's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

SMEM_PER_SM = 102400
SMEM_PER_BLOCK_MAX = 101376  # 99 KB, cudaDevAttrMaxSharedMemoryPerBlockOptin on SM120
SMEM_RESERVED_PER_CTA = 1024
THREADS_PER_SM = 1536
REGS_PER_SM = 65536
REG_ALLOC_UNIT_PER_WARP = 256
MAX_CTAS_PER_SM = 32
MAX_REGS_PER_THREAD = 255
# SM120 side only: the static shared memory an sm_120a cubin of these kernels declares (cuobjdump
# SHARED:1024, a 1 KB `.nv.shared.<kernel>` section); the codegen report reads it from each cubin.
# The host side never assumes it: on an H200 the driver counts 0 B static for the same kind of cubin
# (Nsight Compute, 2026-12-01), so emulation pads with the compiled kernel's own driver-reported value.
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


class EmulationHost(NamedTuple):
    """The GPU that runs SM120 kernels in emulation, as its driver reports it.

    `static_smem` is the compiled kernel's static shared memory on this host
    (CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES): 0 until a compile has measured it, after which the
    driver recompiles with the measured value if it differs (occupancy.py).
    """

    smem_per_sm: int  # CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR
    smem_per_block_max: int  # CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
    reserved_per_cta: int  # CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK
    static_smem: int = 0

    def with_static(self, static_smem: int) -> "EmulationHost":
        return self._replace(static_smem=static_smem)


def emulation_padded_smem(
    smem_bytes: int,
    num_threads: int,
    host: EmulationHost,
    *,
    sm120_static_smem: int = DSL_STATIC_SMEM,
    regs_per_thread: int | None = None,
) -> int:
    """Dynamic shared memory to launch with on `host` so that it fits no more CTAs than SM120.

    `smem_bytes` is the dynamic size the kernel needs. The SM120 count comes from the SM120 model
    (dynamic + the sm_120a cubin's static shared memory, threads, registers if known); the host count
    from the host's own numbers: floor(smem_per_sm / (size + static + reserved)). Returns a dynamic
    size >= smem_bytes for which the host count equals the SM120 count (or stays below it where the
    host's shared memory already allows fewer). Threads and registers of the host are not padded
    for: an H200 has the same 64K registers and more threads (2048) per SM than SM120, so shared
    memory is the knob that brings it down; occupancy.py checks the result on the compiled kernel.
    """
    if not isinstance(host, EmulationHost):
        raise TypeError(f"host must be an EmulationHost (the host driver's numbers), got {host!r}")
    target = sm120_occupancy(smem_bytes + sm120_static_smem, num_threads, regs_per_thread).ctas_per_sm
    if target <= 0:
        raise ValueError(f"{smem_bytes + sm120_static_smem} B of shared memory does not fit one SM120 CTA")
    per_cta_extra = host.static_smem + host.reserved_per_cta
    host_fit = host.smem_per_sm // (smem_bytes + per_cta_extra)
    if host_fit <= target:
        return smem_bytes
    # smallest size in 1 KB granules (the shared-storage struct's alignment) that leaves room for
    # no more than `target` CTAs: floor(host / (size + static + reserved)) == target
    size = host.smem_per_sm // (target + 1) - per_cta_extra + 1
    size = -(-size // 1024) * 1024
    size = max(size, smem_bytes)
    if size + host.static_smem > host.smem_per_block_max:
        raise ValueError(
            f"cannot pad {smem_bytes} B to {size} B: the host GPU allows {host.smem_per_block_max} B per block"
        )
    assert host.smem_per_sm // (size + per_cta_extra) == target
    return size
