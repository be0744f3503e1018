"""Where a backward call's GPU time goes: per-kernel CUDA time of each implementation, one process.

prepare.py --set bwd times a whole backward call (CUDA events around it). This runs the same calls
(prepare_bwd's implementations: the table, its deterministic plan, DET_VARIANTS orderings) under
torch.profiler and prints, per problem and implementation, each kernel's mean time per call and the
sum, so that a slower call can be split into its main kernel and the small kernels around it
(pre/postprocess, fixed point's scales, zeroing and dequantization).

    python scripts/bwd_kernel_times.py --emulate --problems b4s2048h32d64-causal,b2s4096h16d128 \
        --det-variants det_fused --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def kernel_times(run, calls: int) -> dict[str, float]:
    """Mean CUDA microseconds per call of each kernel name over `calls` calls of run()."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run()
        torch.cuda.synchronize()
    times: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            us = getattr(event, "device_time", None)
            times[event.name[:90]] += (event.cuda_time if us is None else us) / calls
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--emulate", action="store_true", help="SM120 kernels in emulation (FLASH_ATTN_SM120_EMULATE)")
    ap.add_argument("--problems", default="", help="comma-separated names of the bwd set (default: all)")
    ap.add_argument("--det-variants", default="", help="prepare_bwd.DET_VARIANTS names, comma-separated")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.emulate:
        os.environ["FLASH_ATTN_SM120_EMULATE"] = "1"  # this package's switch, this process only
    import prepare_bwd

    from flash_attn_sm120 import bench
    from flash_attn_sm120.device import device_info
    from flash_attn_sm120.harness import git_commit

    info = device_info()
    impls = prepare_bwd.table_candidate(info)
    if args.det_variants:
        impls += prepare_bwd.deterministic_variants(info, set(args.det_variants.split(",")))
    wanted = set(filter(None, args.problems.split(",")))
    problems = [p for p in bench.problem_set("bwd") if not wanted or p.name in wanted]
    out = {"command": "python scripts/bwd_kernel_times.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "gpu": info.name, "mode": info.mode, "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "commit": git_commit(),
           "calls": args.calls, "problems": {}}
    for p in problems:
        x = prepare_bwd.forward_state(p, info)
        out["problems"][p.name] = row = {}
        for impl in impls:
            if not impl.supports(p):
                continue
            times = kernel_times(lambda: impl.run(p, x, False), args.calls)
            row[impl.name] = {"total_us": sum(times.values()), "kernels_us": times}
            print(f"{p.name:28s} {impl.name:30s} total {sum(times.values()):9.1f} us")
            for name, us in list(times.items())[:6]:
                print(f"{'':60s}{us:9.1f} us  {name}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
