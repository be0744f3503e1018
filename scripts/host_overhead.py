#!/usr/bin/env python3
"""Host (CPU) time per call of the SplitKV / decode dispatch path, with the GPU work stubbed out.

Decode calls are short on the GPU (tens of microseconds), so the Python work per call decides
their speed once it exceeds the kernel time: with calls queued back to back, CUDA events then
measure host time. This runs the real `driver_splitkv.forward` (split planner, compile-key
building, cache lookup, allocation of the fp32 partials) on CPU tensors, with the compiled
kernels, the combine kernel and the device query replaced by no-ops, and prints microseconds
per call and the top of a cProfile. Needs no GPU.

  python scripts/host_overhead.py                      # b=1, seqlen_k 32k, GQA 32:8, d=128
  python scripts/host_overhead.py --batch 8 --seqlen-k 4096 --profile 0
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402


def stub_gpu_work() -> None:
    """Replace the device query, kernel construction/compilation and the combine with no-ops."""
    import flash_attn_sm120.device as devmod
    from flash_attn_sm120 import driver, driver_splitkv
    from flash_attn_sm120.device import DeviceInfo

    info = DeviceInfo("stub SM120", (12, 0), 188, 101376, 101376, "sm120")
    devmod.device_info = lambda device=None, **kw: info
    launch = lambda *a, **k: None  # noqa: E731
    for mod, make, compile_ in ((driver_splitkv, "make_splitkv_kernel", "compile_splitkv_kernel"),
                                (driver, "make_kernel", "compile_kernel")):
        setattr(mod, make, lambda *a, **k: None)
        setattr(mod, compile_, lambda *a, **k: launch)
        mod.to_cute_tensor = lambda *a, **k: None
    driver_splitkv.combine_kernel = lambda key: launch
    # compile + occupancy check (occupancy.py needs the CUDA driver): the stubbed launch
    driver.compile_verified = lambda make, compile_fn, host, device, name: launch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seqlen-q", type=int, default=1)
    ap.add_argument("--seqlen-k", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--heads-kv", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--num-splits", type=int, default=0)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--profile", type=int, default=15, help="cProfile rows to print (0: none)")
    args = ap.parse_args(argv)

    stub_gpu_work()
    from flash_attn_sm120 import driver_splitkv

    q = torch.zeros(args.batch, args.seqlen_q, args.heads, args.head_dim, dtype=torch.bfloat16)
    k = torch.zeros(args.batch, args.seqlen_k, args.heads_kv, args.head_dim, dtype=torch.bfloat16)
    kw = dict(softmax_scale=None, causal=False, window_size_left=None, window_size_right=None, softcap=None,
              pack_gqa=None, need_lse=False, num_splits=args.num_splits, emulate_host_smem=None)
    driver_splitkv.forward(q, k, k, **kw)  # first call fills the caches
    t = time.perf_counter()
    for _ in range(args.calls):
        driver_splitkv.forward(q, k, k, **kw)
    us = (time.perf_counter() - t) / args.calls * 1e6
    print(f"host time per call (GPU work stubbed): {us:.1f} us  [b={args.batch} sq={args.seqlen_q} "
          f"sk={args.seqlen_k} h={args.heads}:{args.heads_kv} d={args.head_dim} num_splits={args.num_splits}]")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(500):
            driver_splitkv.forward(q, k, k, **kw)
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
