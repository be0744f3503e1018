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


def per_call_times(events, calls: int) -> dict[str, float]:
    """Mean microseconds per call of each CUDA kernel name among profiler events (name, device_type and
    device_time, or cuda_time in older torch), longest first."""
    import torch

    times: dict[str, float] = defaultdict(float)
    for event in events:
        if event.device_type == torch.autograd.DeviceType.CUDA:
            us = getattr(event, "device_time", None)
            times[event.name[:90]] += (event.cuda_time if us is None else us) / calls
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


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
    return per_call_times(prof.events(), calls)


def select_problems(names: str, problem_set: str = "bwd") -> list:
    """The bwd set's problems named in a comma list (all for ""); SystemExit naming the unknown ones."""
    from flash_attn_sm120 import bench

    problems = bench.problem_set(problem_set)
    wanted = [n for n in names.split(",") if n]
    unknown = sorted(set(wanted) - {p.name for p in problems})
    if unknown:
        raise SystemExit(f"bwd_kernel_times.py: unknown problems {unknown}; the {problem_set} set has "
                         f"{[p.name for p in problems]}")
    return [p for p in problems if not wanted or p.name in wanted]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--emulate", action="store_true", help="SM120 kernels in emulation (FLASH_ATTN_SM120_EMULATE)")
    ap.add_argument("--set", default="bwd", help="the problem set: bwd (the seed problems) or bwd_real (GQA training shapes)")
    ap.add_argument("--problems", default="", help="comma-separated names of that set (default: all)")
    ap.add_argument("--det-variants", default="", help="prepare_bwd.DET_VARIANTS names, comma-separated")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.emulate:
        os.environ["FLASH_ATTN_SM120_EMULATE"] = "1"  # this package's switch, this process only
    import prepare_bwd

    from flash_attn_sm120.device import device_info
    from flash_attn_sm120.harness import git_commit

    problems = select_problems(args.problems, args.set)  # (names checked before any device work)
    variants = set(filter(None, args.det_variants.split(",")))
    unknown = sorted(variants - set(prepare_bwd.DET_VARIANTS))
    if unknown:
        raise SystemExit(f"bwd_kernel_times.py: unknown --det-variants {unknown}; known: {list(prepare_bwd.DET_VARIANTS)}")
    info = device_info()
    impls = prepare_bwd.table_candidate(info)
    if variants:
        impls += prepare_bwd.deterministic_variants(info, variants)
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
