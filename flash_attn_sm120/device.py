"""Which kernels a device gets: this package's (real SM120, or SM120 emulation) or upstream FA4's.

* `sm120`:    compute capability 12.x. This package's kernels, no padding.
* `emulated`: any SM80+ GPU with FLASH_ATTN_SM120_EMULATE=1. This package's SM120 kernels, each
              CTA's shared memory padded so the GPU keeps no more CTAs per SM than an SM120 would
              (hardware.py), from the host driver's own numbers, and checked per compiled kernel
              with the CUDA occupancy API (occupancy.py). Timings in this mode are labelled
              *emulated*, never SM120. docs/emulation.md says what it models and what it cannot.
* `upstream`: any other CUDA GPU. Calls go to `flash_attn.cute` unchanged.

The variable is this package's own; FA4's FLASH_ATTENTION_ARCH / FLASH_ATTENTION_NUM_SMS are
neither read nor written here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Optional

import torch

from flash_attn_sm120 import hardware

EMULATE_ENV = "FLASH_ATTN_SM120_EMULATE"


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    capability: tuple[int, int]
    num_sms: int
    smem_per_sm: int
    smem_per_block_max: int
    mode: str  # "sm120" | "emulated" | "upstream"
    reserved_smem_per_cta: int = 0  # the driver's reservation per resident CTA (queried in emulation)

    @property
    def is_emulated(self) -> bool:
        return self.mode == "emulated"

    @property
    def uses_sm120_kernels(self) -> bool:
        return self.mode in ("sm120", "emulated")

    @cached_property  # read on every attention call: built once
    def emulate_host_smem(self) -> Optional[hardware.EmulationHost]:
        """What the SM120 kernels need to pad for (the host driver's numbers), or None on a real SM120."""
        if not self.is_emulated:
            return None
        return hardware.EmulationHost(self.smem_per_sm, self.smem_per_block_max, self.reserved_smem_per_cta)

    def label(self) -> str:
        cc = f"{self.capability[0]}.{self.capability[1]}"
        if self.mode == "emulated":
            return f"SM120 emulated on {self.name} (cc {cc}, {self.num_sms} SMs, smem padded to SM120 occupancy)"
        if self.mode == "sm120":
            return f"SM120 native: {self.name} (cc {cc}, {self.num_sms} SMs)"
        return f"upstream FA4 on {self.name} (cc {cc}, {self.num_sms} SMs)"


def emulation_requested() -> bool:
    return os.environ.get(EMULATE_ENV, "0").strip().lower() in ("1", "true", "yes", "on")


def mode_for_capability(capability: tuple[int, int], emulate: bool) -> str:
    """Pure dispatch rule (CPU-tested)."""
    major = capability[0]
    if major == 12:
        return "sm120"
    if emulate and major >= 8:
        return "emulated"
    return "upstream"


def device_info(device: torch.device | int | None = None, *, emulate: Optional[bool] = None) -> DeviceInfo:
    """Describe a CUDA device and the mode this package runs it in (memoized: called per attention call)."""
    if type(device) is torch.device and device.index is not None and device.type == "cuda":
        # a CUDA tensor's device: CUDA is there, skip the availability query (per-call host time)
        return _device_info(device.index, emulation_requested() if emulate is None else bool(emulate))
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device is available")
    if device is None:
        index = torch.cuda.current_device()
    elif isinstance(device, int):
        index = device
    else:
        index = device.index if device.index is not None else torch.cuda.current_device()
    return _device_info(index, emulation_requested() if emulate is None else bool(emulate))


@lru_cache(maxsize=None)
def _device_info(index: int, emulate: bool) -> DeviceInfo:
    props = torch.cuda.get_device_properties(index)
    cap = (props.major, props.minor)
    mode = mode_for_capability(cap, emulate)
    smem_per_sm = getattr(props, "shared_memory_per_multiprocessor", 0)
    smem_block = getattr(props, "shared_memory_per_block_optin", 0)
    reserved = 0
    if mode == "emulated":
        # padding uses only what this GPU's driver reports: no assumed host constants
        if not smem_per_sm or not smem_block:
            raise RuntimeError(f"SM120 emulation: {props.name} reports no shared memory per SM / per block")
        from flash_attn_sm120.occupancy import device_reserved_smem_per_cta

        reserved = device_reserved_smem_per_cta(index)
    elif cap[0] == 12:
        smem_per_sm, smem_block = hardware.SMEM_PER_SM, hardware.SMEM_PER_BLOCK_MAX
    return DeviceInfo(props.name, cap, props.multi_processor_count, smem_per_sm, smem_block, mode, reserved)


def execution_mode(device: torch.device | int | None = None) -> str:
    """'sm120', 'emulated' or 'upstream' for a device (default: the current one); 'cpu' without CUDA."""
    if not torch.cuda.is_available():
        return "cpu"
    return device_info(device).mode
