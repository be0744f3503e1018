"""SM120 emulation: pad a kernel's shared memory so that a bigger GPU holds no more CTAs per SM than SM120.

An sm_90a GPU (an H200: 228 KB of shared memory per SM) runs the SM120 kernels unchanged, but it
would fit more CTAs of a kernel per SM than SM120's 100 KB does, and occupancy drives the timing.
In emulation (`emulate_host_smem`: a hardware.EmulationHost, the host driver's shared-memory
numbers) every family's shared storage struct gets a trailing byte array, sized by
hardware.emulation_padded_smem, so that the host keeps exactly SM120's CTAs per SM. On SM120 the
struct is returned as is.

Every family calls `emulation_storage` from its `_get_shared_storage_cls`: the cp.async and
split-KV forwards (fwd_cpasync.py), the TMA forward (fwd_tma.py) and the backward (bwd_sm120.py).
It also records what the occupancy check, the codegen report and the tests read back: the
struct's size before and after padding and the threads it is launched with.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from flash_attn_sm120 import hardware


def emulation_storage(kernel, storage, num_threads: int):
    """Record `storage`'s size on `kernel` and, in SM120 emulation, return it padded.

    Sets kernel.smem_bytes_unpadded / smem_bytes_launched and kernel.launch_threads (read by the
    occupancy check, the codegen report and tests). With kernel.emulate_host_smem set (a
    hardware.EmulationHost), the struct gets a trailing pad so that the host GPU keeps no more CTAs
    of `num_threads` threads per SM than SM120 would (hardware.emulation_padded_smem).
    """
    kernel.smem_bytes_unpadded = storage.size_in_bytes()
    kernel.smem_bytes_launched = kernel.smem_bytes_unpadded
    kernel.launch_threads = num_threads
    if kernel.emulate_host_smem is None:
        return storage
    padded = hardware.emulation_padded_smem(kernel.smem_bytes_unpadded, num_threads, kernel.emulate_host_smem)
    if padded == kernel.smem_bytes_unpadded:
        return storage
    storage = _padded_struct(storage, padded)
    kernel.smem_bytes_launched = storage.size_in_bytes()
    return storage


def _padded_struct(storage, total_bytes: int):
    """A copy of a cute.struct with a trailing byte array so that its size is at least `total_bytes`.

    The struct's size is rounded to its alignment (1 KB here), so the pad is grown until it lands.
    """
    fields = dict(storage._annotations)
    pad = total_bytes - storage.size_in_bytes()
    for _ in range(4):
        fields["emulation_pad"] = cute.struct.MemRange[cutlass.Uint8, pad]
        padded = cute.struct(type("SharedStoragePadded", (), {"__annotations__": fields}))
        short = total_bytes - padded.size_in_bytes()
        if short <= 0:
            return padded
        pad += short
    raise RuntimeError(f"could not pad shared storage to {total_bytes} B")
