#!/usr/bin/env python3
"""What deterministic=True costs on sliding windows, side by side in one process (GPU).

A window with a user score_mod (here testing_mods.position_scale and its score_mod_bwd) has no fixed-point
bound, so its dQ takes turns counted from the window's edges (kernels/bwd_deterministic.dq_turn): descending
with the shortest-first launch on dense calls, ascending on varlen ones. Without a score_mod, dense windows take
the same descending turns (since session 39: 0.83-0.88x the default backward, fixed point 0.60-0.73x on the same
calls, w51b) and packed ones add dQ in 64-bit fixed point (kernels/bwd_fixed_point.py). Each problem is timed
up to four ways on this package's backward driver (driver_bwd.backward, the forward's out and LSE computed once
with the same modifiers):

  default / deterministic, with the score_mod pair; default / deterministic (the plan) / deterministic in fixed
  point (forced), without it on a dense call: what the turns win over fixed point on the same call.

Rows: ms and TFLOPS (the band's FLOPs, bench.backward_flops) of each, and deterministic / default per pair.
Every time is the mean of two CUDA-event medians taken in A B C C B A order (clock drift cancels).

  FLASH_ATTN_SM120_EMULATE=1 python scripts/bench_det_windows.py --json det_windows.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import prepare_bwd  # noqa: E402  (scripts/, beside this file)
from flash_attn_sm120 import bench, harness, progress  # noqa: E402
from flash_attn_sm120.bench import Problem  # noqa: E402

PROBLEMS = (
    Problem(1, 8192, 8192, 16, 16, 128, window=(1024, 0), tag="det_windows"),  # sliding window, dense: descending
    Problem(2, 4096, 4096, 16, 16, 128, window=(512, 512), tag="det_windows"),
    Problem(4, 2048, 2048, 32, 32, 64, window=(256, 0), tag="det_windows"),
    # packed documents: ascending turns from the window's left edge
    Problem(4, 0, 0, 16, 16, 128, window=(1024, 0), seqlens_q=(4096, 1024, 2048, 1000),
            seqlens_k=(4096, 1024, 2048, 1000), tag="det_windows"),
)


def main(argv=None) -> int:
    from flash_attn_sm120 import driver_bwd
    from flash_attn_sm120.device import device_info
    from flash_attn_sm120.testing_mods import position_scale, position_scale_bwd

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=None, help="write the rows here (prepare.py-style header)")
    ap.add_argument("--reps", type=int, default=10, help="timed repetitions per median (default 10)")
    args = ap.parse_args(argv)
    info = device_info()
    if not info.uses_sm120_kernels:
        raise SystemExit(f"{info.label()}: set FLASH_ATTN_SM120_EMULATE=1 to time the SM120 kernels here")
    rows = []
    for p in progress.bar(PROBLEMS, desc="problems", unit="problem"):
        for with_mod in (True, False):
            mods = dict(score_mod=position_scale, score_mod_bwd=position_scale_bwd) if with_mod else {}
            sets = [prepare_bwd.forward_state(p, info, seed=i, score_mod=mods.get("score_mod")) for i in range(2)]

            def call(i, det, x=sets, p=p, mods=mods):
                x = x[i]
                forced = (driver_bwd.force_deterministic_plan(dq_fixed_point=True) if det == "fixed"
                          else contextlib.nullcontext())
                with forced:
                    return driver_bwd.backward(x["q"], x["k"], x["v"], x["out"], x["dout"], x["lse"],
                                               softmax_scale=None, causal=False, window_size_left=p.window[0],
                                               window_size_right=p.window[1], emulate_host_smem=info.emulate_host_smem,
                                               deterministic=bool(det), **mods, **prepare_bwd._varlen_args(x))

            # (a packed call's plan is fixed point already; with a score_mod fixed point has no bound)
            variants = (False, True) if with_mod or p.is_varlen else (False, True, "fixed")
            ms = {v: [] for v in variants}
            for v in variants + variants[::-1]:
                ms[v].append(bench.time_cuda(lambda i, v=v: call(i, v), rotations=2, reps=args.reps).median_ms)
            plain, det = (sum(ms[v]) / 2 for v in (False, True))
            flops = bench.backward_flops(p)
            row = dict(problem=p.name, score_mod=with_mod, ms=plain, ms_deterministic=det,
                       tflops=flops / plain / 1e9, tflops_deterministic=flops / det / 1e9, ratio=plain / det)
            if "fixed" in ms:
                fixed = sum(ms["fixed"]) / 2
                row.update(ms_fixed_point=fixed, tflops_fixed_point=flops / fixed / 1e9, ratio_fixed_point=plain / fixed)
            rows.append(row)
            progress.write(f"[{info.mode}] {p.name:36s} {'score_mod' if with_mod else 'plain    '} "
                           f"{row['tflops']:7.1f} -> det {row['tflops_deterministic']:7.1f} TFLOPS  "
                           f"({row['ratio']:.3f}x)" + (f"  fixed point forced {row['tflops_fixed_point']:7.1f} "
                                                       f"({row['ratio_fixed_point']:.3f}x)" if "fixed" in ms else ""))
            if args.json:  # after every row: a run cut short keeps what it timed
                doc = harness.measurement_doc([], {}, info, "det_windows")
                doc["rows"] = rows  # (dicts: measurement_doc takes dataclass rows)
                args.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
