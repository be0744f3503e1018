"""Forward kernel families, one module each, registered here by name.

A family is a kernel class with upstream's SM80/SM120 forward call convention plus two pure
functions: why a config cannot run on SM120 (None if it can) and its dynamic shared memory.
`FwdConfig.family` names the family; the driver, the config table, the codegen report and the
test registry all look families up here.

  cpasync: upstream's SM120 forward (cp.async + mma.sync), any warps/tiles/stages (fwd_cpasync.py)
  tma:     TMA producer warp + 4/8 mma.sync consumer warps, mbarrier K/V ring (fwd_tma.py);
           num_threads = MMA-warp threads (the kernel adds its producer warp), num_stages = ring
           depth; no varlen / pack_gqa (fwd_tma.unsupported_reason names what it refuses)
  splitkv: the cp.async kernel with a split axis (fp32 partial O/LSE for upstream's combine) and
           paged K/V gathers (fwd_splitkv.py); same tiles and shared memory as cpasync
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from flash_attn_sm120.kernels import fwd_splitkv, fwd_tma
from flash_attn_sm120.kernels.fwd_cpasync import FlashAttentionForwardSm120CpAsync, sm120_config_error, smem_bytes


@dataclass(frozen=True)
class KernelFamily:
    name: str
    kernel_cls: type
    # (head_dim, head_dim_v, tile_m, tile_n, num_stages, num_threads, q_in_regs) -> reason | None
    config_error: Callable[..., Optional[str]]
    # same arguments minus num_threads -> dynamic shared memory bytes
    smem_bytes: Callable[..., int]


FAMILIES: dict[str, KernelFamily] = {
    "cpasync": KernelFamily("cpasync", FlashAttentionForwardSm120CpAsync, sm120_config_error, smem_bytes),
    "tma": KernelFamily("tma", fwd_tma.FlashAttentionForwardSm120Tma, fwd_tma.tma_config_error, fwd_tma.smem_bytes),
    # same tiles and shared memory as cpasync, so the same rules
    "splitkv": KernelFamily("splitkv", fwd_splitkv.FlashAttentionForwardSm120SplitKV, sm120_config_error, smem_bytes),
}
