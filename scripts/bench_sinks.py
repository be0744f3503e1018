#!/usr/bin/env python3
"""What a learnable sink costs: the same call with and without one, side by side in one process (GPU).

Prefill: the 8 seed problems through the public API, CUDA-event medians (bench.time_cuda). Decode
(seqlen_q 1, GQA 32:8, d128, SplitKV automatic): eager and in a CUDA graph (bench.time_cuda_graph: the
GPU time with the host removed, how engines run decode). Each row: ms without and with the sink, and
the overhead (with / without - 1). The issue's bound is 3%. The sink is folded into each kernel's output
tile before its epilogue (kernels/sink_fold.py; SplitKV: split 0 only).

  FLASH_ATTN_SM120_EMULATE=1 python scripts/bench_sinks.py --json sinks.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flash_attn_sm120 import bench, harness, progress  # noqa: E402

DECODE = ((1, 32768), (8, 8192), (64, 4096))  # (batch, seqlen_k), GQA 32:8 d128


def _pair(call, rot: int, graph: bool, reps: int):
    """(ms without, ms with the sink), each the mean of two medians timed in A B B A order, so that a
    drift of the GPU's clocks over the pair cancels (timed A then B, the second ran 5-8% faster)."""
    timer = bench.time_cuda_graph if graph else bench.time_cuda
    ms = {False: [], True: []}
    for s in (False, True, True, False):
        ms[s].append(timer(lambda i, s=s: call(i, s), rotations=rot, reps=reps).median_ms)
    return [sum(ms[s]) / 2 for s in (False, True)]


def main(argv=None) -> int:
    import torch

    from flash_attn_sm120 import flash_attn_func
    from flash_attn_sm120.device import device_info

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=None, help="write the rows here (prepare.py-style header)")
    ap.add_argument("--reps", type=int, default=30, help="timed repetitions per measurement (default 30)")
    args = ap.parse_args(argv)
    info = device_info()
    if not info.uses_sm120_kernels:
        raise SystemExit(f"{info.label()}: set FLASH_ATTN_SM120_EMULATE=1 to time the SM120 kernels here")
    rows = []
    seed = bench.problem_set("seed")
    for p in progress.bar(seed, desc="prefill", unit="problem"):
        rot = bench.rotations_for(p)
        sets = [bench.make_inputs(p, seed=i) for i in range(rot)]
        sink = torch.randn(p.nheads, device="cuda")

        def call(i, with_sink, x=sets, p=p, sink=sink):
            return flash_attn_func(x[i]["q"], x[i]["k"], x[i]["v"], causal=p.causal,
                                   learnable_sink=sink if with_sink else None)

        plain, sinked = _pair(call, rot, False, args.reps)
        rows.append(dict(problem=p.name, kind="prefill", ms=plain, ms_sink=sinked, overhead=sinked / plain - 1))
        progress.write(f"[{info.mode}] {p.name:28s} {plain:8.3f} ms  sink {sinked:8.3f} ms  {100 * (sinked / plain - 1):+5.1f}%")
    for b, sk in progress.bar(DECODE, desc="decode", unit="shape"):
        q = [torch.randn(b, 1, 32, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        k = [torch.randn(b, sk, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        sink = torch.randn(32, device="cuda")

        def step(i, with_sink, q=q, k=k, sink=sink):
            return flash_attn_func(q[i], k[i], k[i], num_splits=0, learnable_sink=sink if with_sink else None)

        for graph in (False, True):
            plain, sinked = _pair(step, 2, graph, args.reps)
            name = f"decode b{b} sk{sk} h32:8 d128" + (" (CUDA graph)" if graph else " (eager)")
            rows.append(dict(problem=name, kind="decode-graph" if graph else "decode-eager", ms=plain, ms_sink=sinked,
                             overhead=sinked / plain - 1))
            progress.write(f"[{info.mode}] {name:40s} {plain:8.4f} ms  sink {sinked:8.4f} ms  "
                           f"{100 * (sinked / plain - 1):+5.1f}%")
    worst = {kind: max(r["overhead"] for r in rows if r["kind"] == kind) for kind in {r["kind"] for r in rows}}
    print("worst overhead: " + ", ".join(f"{k} {100 * v:+.1f}%" for k, v in sorted(worst.items())))
    if args.json:
        doc = harness.measurement_doc(rows, {"worst_overhead": worst}, info, "sinks")
        args.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
