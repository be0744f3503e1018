"""Verified occupancy: how many CTAs of a compiled kernel really fit on one SM of this GPU.

SM120 emulation only means something if the host GPU runs each kernel at SM120's CTAs per SM.
Padding shared memory (hardware.emulation_padded_smem) is the means; this module is the proof. After a
kernel is compiled, its cubin is loaded through the CUDA driver and the occupancy API is asked how
many CTAs of that function fit per SM with the launch's block size and dynamic shared memory. That
count is compared with the SM120 model's (hardware.sm120_occupancy on the kernel's unpadded shared
memory plus the sm_120a static shared memory, its threads and its registers):

  * emulated: a mismatch raises RuntimeError naming the config and both counts; emulation never
    runs silently at another occupancy.
  * sm120:    a mismatch is a fault of the model, not of the launch: it is reported with a warning
    (the first real SM120 run settles what emulation assumed).

The same load gives the host's own facts for the padding: the function's static shared memory as
the driver counts it (CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES) and its registers. The driver's compile
path (driver.compile_verified) recompiles once when the static size differs from what the padding
assumed. Results are cached with the compiled kernel, so repeat calls pay nothing; `records()` lists
every verified launch of the process (prepare.py writes `"occupancy_verified"` from it).
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass
from typing import Optional

from flash_attn_sm120 import hardware


@dataclass(frozen=True)
class LaunchOccupancy:
    """One compiled kernel: the host's CTAs/SM from the occupancy API against the SM120 model's."""

    name: str  # config and problem statics, for messages
    threads: int
    dynamic_smem: int  # what the launch asks for (padded in emulation)
    unpadded_smem: int
    host_static_smem: int  # CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES on this GPU
    host_regs: int  # CU_FUNC_ATTRIBUTE_NUM_REGS on this GPU
    host_ctas_per_sm: int  # cuOccupancyMaxActiveBlocksPerMultiprocessor
    sm120_ctas_per_sm: int
    sm120_limiter: str
    sm120_regs: int  # the registers the SM120 count used
    sm120_regs_source: str  # "sm_120a cubin" where known, else "host cubin"
    mode: str  # "emulated" | "sm120" | "unpadded" (another GPU without padding: recorded, never judged)

    @property
    def matches(self) -> bool:
        return self.host_ctas_per_sm == self.sm120_ctas_per_sm

    def to_dict(self) -> dict:
        d = asdict(self)
        d["matches"] = self.matches
        return d


_RECORDS: list[LaunchOccupancy] = []
_UNCHECKED: set[str] = set()  # kernels launched next to ours that are not SM120 kernels of this package


def note_unchecked(name: str) -> None:
    """A kernel that runs unpadded and unchecked next to ours (upstream's split combine): listed apart."""
    _UNCHECKED.add(name)


def unchecked() -> list[str]:
    return sorted(_UNCHECKED)


def records() -> list[LaunchOccupancy]:
    """Every kernel verified in this process, in compile order."""
    return list(_RECORDS)


def all_verified() -> bool:
    """True when this package's SM120 kernels were launched, every one was checked at SM120's count and
    none ran unpadded. A refused kernel counts against the run although it never launched. Upstream's
    split combine is not one of them: `unchecked()` lists it, and the JSON writers record that list."""
    return bool(_RECORDS) and all(r.matches and r.mode != "unpadded" for r in _RECORDS)


def reset_records() -> None:
    _RECORDS.clear()
    _UNCHECKED.clear()


# ------------------------------------------------------------------------------------ CUDA driver
def _cu():
    from cuda.bindings import driver

    return driver


def _check(result, what: str):
    cu = _cu()
    err, *values = result
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"occupancy check: {what} failed with {err}")
    return values[0] if len(values) == 1 else values


def device_reserved_smem_per_cta(device_index: int) -> int:
    """The driver's shared memory reservation per resident CTA on a device (1 KB on Hopper/Blackwell)."""
    cu = _cu()
    _check(cu.cuInit(0), "cuInit")
    dev = _check(cu.cuDeviceGet(device_index), "cuDeviceGet")
    attr = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK
    return int(_check(cu.cuDeviceGetAttribute(attr, dev), "cuDeviceGetAttribute(RESERVED_SHARED_MEMORY_PER_BLOCK)"))


@dataclass(frozen=True)
class HostFunction:
    static_smem: int
    regs: int
    ctas_per_sm: int


def cubin_of(compiled) -> Optional[bytes]:
    """The cubin of a kernel compiled with --keep-cubin (None when the compile kept none)."""
    artifacts = getattr(compiled, "artifacts", None)
    cubin = getattr(artifacts, "CUBIN", None) if artifacts is not None else None
    if isinstance(cubin, str):  # some DSL builds return the dump path instead of bytes
        with open(cubin, "rb") as f:
            cubin = f.read()
    return cubin or None


def host_function(cubin: bytes, threads: int, dynamic_smem: int) -> HostFunction:
    """Load `cubin` (one kernel) in the current device's primary context and ask the driver about it."""
    import torch

    cu = _cu()
    # the device's primary context (torch's) made current on this thread for cuKernelGetFunction
    dev = _check(cu.cuDeviceGet(torch.cuda.current_device()), "cuDeviceGet")
    ctx = _check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    _check(cu.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
    try:
        return _query_cubin(cu, cubin, threads, dynamic_smem)
    finally:
        cu.cuCtxPopCurrent()
        cu.cuDevicePrimaryCtxRelease(dev)


def _query_cubin(cu, cubin: bytes, threads: int, dynamic_smem: int) -> HostFunction:
    lib = _check(cu.cuLibraryLoadData(cubin, None, None, 0, None, None, 0), "cuLibraryLoadData")
    try:
        count = _check(cu.cuLibraryGetKernelCount(lib), "cuLibraryGetKernelCount")
        if count != 1:
            raise RuntimeError(f"occupancy check: expected one kernel in the cubin, found {count}")
        kernel = _check(cu.cuLibraryEnumerateKernels(count, lib), "cuLibraryEnumerateKernels")[0]
        func = _check(cu.cuKernelGetFunction(kernel), "cuKernelGetFunction")
        fa = cu.CUfunction_attribute
        # what the DSL sets before its own launch: without it a launch above 48 KB cannot run
        _check(cu.cuFuncSetAttribute(func, fa.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, dynamic_smem),
               "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)")
        static = _check(cu.cuFuncGetAttribute(fa.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, func), "SHARED_SIZE_BYTES")
        regs = _check(cu.cuFuncGetAttribute(fa.CU_FUNC_ATTRIBUTE_NUM_REGS, func), "NUM_REGS")
        ctas = _check(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(func, threads, dynamic_smem),
                      "cuOccupancyMaxActiveBlocksPerMultiprocessor")
        return HostFunction(int(static), int(regs), int(ctas))
    finally:
        cu.cuLibraryUnload(lib)


# ------------------------------------------------------------------------------------- the check
def sm120_count(unpadded_smem: int, threads: int, regs: int) -> hardware.Occupancy:
    """The SM120 model's CTAs per SM for a kernel (sm_120a static shared memory added)."""
    return hardware.sm120_occupancy(unpadded_smem + hardware.DSL_STATIC_SMEM, threads, regs)


def compare(name: str, kernel, host: HostFunction, mode: str, sm120_regs: Optional[int] = None) -> LaunchOccupancy:
    """The record for a compiled `kernel` (its trace-time launch facts) and the host's answer."""
    threads, _ = _launch_size(kernel, name)
    regs = host.regs if sm120_regs is None else sm120_regs
    occ = sm120_count(kernel.smem_bytes_unpadded, threads, regs)
    return LaunchOccupancy(
        name=name, threads=threads, dynamic_smem=kernel.smem_bytes_launched, unpadded_smem=kernel.smem_bytes_unpadded,
        host_static_smem=host.static_smem, host_regs=host.regs, host_ctas_per_sm=host.ctas_per_sm,
        sm120_ctas_per_sm=occ.ctas_per_sm, sm120_limiter=occ.limiter, sm120_regs=regs,
        sm120_regs_source="host cubin" if sm120_regs is None else "sm_120a cubin", mode=mode,
    )


def measure(compiled, kernel) -> HostFunction:
    """The host driver's answer for a compiled kernel (kept cubin) at its launch size."""
    threads, dynamic_smem = _launch_size(kernel, "the kernel")
    cubin = cubin_of(compiled)
    if cubin is None:
        raise RuntimeError("occupancy check: the compile kept no cubin (compile with --keep-cubin)")
    return host_function(cubin, threads, dynamic_smem)


def _launch_size(kernel, name: str) -> tuple[int, int]:
    """(block threads, dynamic shared memory) the kernel recorded while its shared storage was built."""
    if kernel.launch_threads is None or kernel.smem_bytes_launched is None:
        raise RuntimeError(f"occupancy check: {name} recorded no launch size (its shared storage was never built)")
    return kernel.launch_threads, kernel.smem_bytes_launched


def check(name: str, kernel, host: HostFunction, mode: str, sm120_regs: Optional[int] = None) -> LaunchOccupancy:
    """Record a kernel's occupancy; in emulation a count other than SM120's raises RuntimeError."""
    rec = compare(name, kernel, host, mode, sm120_regs)
    _RECORDS.append(rec)
    if rec.matches or mode == "unpadded":
        return rec
    msg = (f"{name}: the GPU fits {rec.host_ctas_per_sm} CTAs per SM ({rec.threads} threads, "
           f"{rec.dynamic_smem} B dynamic + {rec.host_static_smem} B static shared memory, {rec.host_regs} "
           f"registers), SM120 fits {rec.sm120_ctas_per_sm} (limited by {rec.sm120_limiter})")
    if mode == "emulated":
        raise RuntimeError(f"SM120 emulation would run at another occupancy: {msg}")
    warnings.warn(f"SM120 occupancy model disagrees with this GPU's driver: {msg}", RuntimeWarning, stacklevel=3)
    return rec
