"""flash_attn_sm120: FlashAttention-4 (CuTe DSL) kernels tuned for SM120 GPUs.

    from flash_attn_sm120 import flash_attn_func
    out, lse = flash_attn_func(q, k, v, causal=True)

On compute capability 12.x the calls run this package's kernels; on any other GPU they call
upstream FA4 unchanged, unless FLASH_ATTN_SM120_EMULATE=1 selects SM120 emulation
(see `execution_mode`). `explain(q, k, v, ...)` tells what a call would run on SM120 (route, kernel
family and config, split count, shared memory and CTAs per SM) without a GPU.
"""

from flash_attn_sm120.device import EMULATE_ENV, device_info, execution_mode
from flash_attn_sm120.compile_ops import register_mod
from flash_attn_sm120.interface import flash_attn_func, flash_attn_varlen_func

__version__ = "0.1.0"
__all__ = ["flash_attn_func", "flash_attn_varlen_func", "register_mod", "explain", "execution_mode", "device_info", "EMULATE_ENV"]


def __getattr__(name: str):
    # explain is imported on first use: `python -m flash_attn_sm120.explain` then runs a module that the
    # package import has not loaded yet (no runpy warning)
    if name == "explain":
        from flash_attn_sm120.explain import explain

        return explain
    raise AttributeError(f"module 'flash_attn_sm120' has no attribute {name!r}")
