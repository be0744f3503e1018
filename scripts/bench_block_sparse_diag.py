#!/usr/bin/env python3
"""Where block-sparse time goes (GPU, one process): dense, the block-sparse config forced dense, and the
block-sparse kernel at densities 1.0 / 0.5 / 0.25 / 0.1 / 0.0 (all full blocks), per head dim.

A line through the densities' times splits each call into a part per computed block (the slope) and a
fixed part (the intercept: launch, per-CTA prologue / epilogue, the walk's idle list positions and, in
the backward, the pre/post-process kernels). --kernels also prints each kernel's share of the call at
density 0.1 (torch.profiler), so that the fixed part can be told apart from the main kernel's.

  FLASH_ATTN_SM120_EMULATE=1 python scripts/bench_block_sparse_diag.py [--bwd] [--kernels]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flash_attn_sm120 import bench, block_sparse, driver, testing_sparse  # noqa: E402

DENSITIES = (1.0, 0.5, 0.25, 0.1, 0.0)


def _kernel_table(fn) -> str:
    """Each CUDA kernel's time over 5 calls of fn (torch.profiler), longest first."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t > 0:
            rows.append((t / 5, ev.count // 5, ev.key[:90]))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows) or 1.0
    return "\n".join(f"      {t:9.1f} us {100 * t / total:5.1f}%  x{n}  {name}" for t, n, name in rows[:8])


def _host_profile(fn, rows: int = 18) -> str:
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(10):
        fn()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(rows)
    return out.getvalue()


def _fit(points):
    """Least-squares (slope, intercept) of ms over computed fraction."""
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    sxx = sum((p[0] - mx) ** 2 for p in points) or 1.0
    slope = sum((p[0] - mx) * (p[1] - my) for p in points) / sxx
    return slope, my - slope * mx


def main(argv=None) -> int:
    import torch

    from flash_attn_sm120 import flash_attn_func

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bwd", action="store_true", help="time the backward (autograd.grad of a kept forward)")
    ap.add_argument("--kernels", action="store_true", help="per-kernel times at density 0.1 (torch.profiler)")
    ap.add_argument("--host", action="store_true",
                    help="also the host time per call (calls launched back to back) and, at density 0.1, a cProfile")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    mult = 2.5 if args.bwd else 1.0
    for b, s, h, d in ((1, 8192, 16, 128), (2, 8192, 16, 64)):
        x = [[torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)] for _ in range(2)]
        dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
        flops = 4 * b * h * s * s * d * mult

        kept = {}  # the backward's forward, once per input set (cleared before each density)

        def call(i, **kw):
            if not args.bwd:
                return flash_attn_func(*x[i], **kw)
            key = (i, "block_sparse_tensors" in kw)
            if key not in kept:
                leaves = [t.detach().requires_grad_() for t in x[i]]
                kept[key] = (leaves, flash_attn_func(*leaves, **kw)[0])
            leaves, out = kept[key]
            return torch.autograd.grad(out, leaves, dout, retain_graph=True)

        t = bench.time_cuda(lambda i: call(i), rotations=2, reps=args.reps).median_ms
        host = f"  host {bench.host_us_per_call(lambda i: call(0)):7.1f} us/call" if args.host else ""
        print(f"b{b}s{s}h{h}d{d} {'bwd' if args.bwd else 'fwd'} dense shipped  {t:7.3f} ms {flops / t / 1e9:6.1f} TF"
              f"{host}", flush=True)
        if args.kernels:
            print(_kernel_table(lambda: call(0)), flush=True)
        n = s // 128
        points = []
        for density in DENSITIES:
            kept.clear()
            g = torch.Generator(device="cuda").manual_seed(0)
            kinds = testing_sparse.random_block_map(b, h, n, n, density=density, full_share=1.0, generator=g)
            kw = dict(block_sparse_tensors=testing_sparse.lists_from_map(kinds, (128, 128)))
            if args.bwd:
                kw["block_sparse_tensors_bwd"] = testing_sparse.lists_from_map(
                    kinds.transpose(2, 3).contiguous(), (128, 128))
            frac = testing_sparse.computed_fraction(kinds)
            t = bench.time_cuda(lambda i: call(i, **kw), rotations=2, reps=args.reps).median_ms
            points.append((frac, t))
            tf = flops * frac / t / 1e9 if frac else 0.0
            host = f"  host {bench.host_us_per_call(lambda i: call(0, **kw)):7.1f} us/call" if args.host else ""
            print(f"  sparse density {frac:5.3f} {t:7.3f} ms {tf:6.1f} TF{host}", flush=True)
            if args.host and abs(density - 0.1) < 1e-9:
                print(_host_profile(lambda: call(0, **kw)), flush=True)
            if args.kernels and abs(density - 0.1) < 1e-9:
                print(_kernel_table(lambda: call(0, **kw)), flush=True)
        slope, icpt = _fit(points[:-1])
        print(f"  fit over densities > 0: {slope:7.3f} ms per unit density + {icpt:6.3f} ms fixed "
              f"(empty lists: {points[-1][1]:6.3f} ms)", flush=True)
        if not args.bwd:
            for cfg in block_sparse.CONFIGS[d][:1]:
                with driver.force_config(cfg):
                    t = bench.time_cuda(lambda i: call(i), rotations=2, reps=args.reps).median_ms
                print(f"  dense with the sparse config {cfg.name:24s} {t:7.3f} ms {flops / t / 1e9:6.1f} TF", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
