#!/usr/bin/env python3
"""Block-sparse speed on varlen calls against the dense varlen call, side by side in one process (GPU).

Packed documents (flash_attn_varlen_func with cu_seqlens_q / cu_seqlens_k), each with random ~10% of its
128 x 128 blocks listed, all full (no mask_mod: the cost of the sparse walk). The forward takes upstream's varlen
lists; the backward (--bwd) takes flash_attn_varlen_func's block_sparse_tensors_bwd, the same maps transposed, in
the packed form (block_sparse_bwd.py), and times autograd.grad of a kept forward. TFLOPS are counted on the
computed blocks (4 * h * d * visited blocks * 128 * 128, 2.5x for the backward), against the dense call's TFLOPS
over every block of every document. CUDA-event medians, dense and sparse timed A B B A (bench.time_cuda); --graph
times each call captured in a CUDA graph instead (the kernels' own time: a 0.2 ms sparse forward is close to its
host path's time, and the backward's packed lists are copied by a few torch ops each call), the backward's time
being that of a graph of forward + backward less the forward's own graph, as bench_block_sparse.py --graph does. The
dense-layout gate's numbers come from bench_block_sparse.py; this one shows what the varlen walk (upstream's
varlen grid, no longest-first launch order) gives on the same kind of lists.

  FLASH_ATTN_SM120_EMULATE=1 python scripts/bench_block_sparse_varlen.py --bwd --json bs_varlen_bwd.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flash_attn_sm120 import bench, harness, testing_sparse  # noqa: E402

# (heads, head_dim, document lengths): packed sequences of unequal lengths, 16K tokens each
PROBLEMS = ((16, 128, (4096, 2048, 6144, 1024, 3072)), (16, 64, (8192, 512, 2048, 4096, 1536)))
BLOCK = (128, 128)
DENSITY = 0.10


def main(argv=None) -> int:
    import torch

    from flash_attn_sm120 import flash_attn_varlen_func
    from flash_attn_sm120.device import device_info

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=None, help="write the rows here (prepare.py-style header)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--bwd", action="store_true", help="time the backward (autograd.grad) instead of the forward")
    ap.add_argument("--graph", action="store_true",
                    help="time each call captured in a CUDA graph (the kernels' time, no host path), not eagerly")
    args = ap.parse_args(argv)
    info = device_info()
    if not info.uses_sm120_kernels:
        raise SystemExit(f"{info.label()}: set FLASH_ATTN_SM120_EMULATE=1 to time the SM120 kernels here")
    rows = []
    for h, d, lens in PROBLEMS:
        g = torch.Generator(device="cuda").manual_seed(h + d)
        total = sum(lens)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        x = [[torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]
             for _ in range(2)]
        dout = torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
        maps = [testing_sparse.random_block_map(1, h, -(-n // BLOCK[0]), -(-n // BLOCK[1]), density=DENSITY,
                                                full_share=1.0, generator=g)[0] for n in lens]
        sparse = testing_sparse.varlen_lists_from_maps(maps, BLOCK)
        sparse_bwd = testing_sparse.varlen_lists_from_maps([m.transpose(1, 2).contiguous() for m in maps], BLOCK)
        visited_blocks = sum(int((m > 0).sum()) for m in maps)
        dense_blocks = sum(h * (-(-n // BLOCK[0])) * (-(-n // BLOCK[1])) for n in lens)
        scale = 2.5 if args.bwd else 1.0
        sparse_flops = 4 * d * visited_blocks * BLOCK[0] * BLOCK[1] * scale
        dense_flops = 4 * h * d * sum(n * n for n in lens) * scale
        index = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens))
        kept = {}
        graph_leaves = [[t.detach().requires_grad_() for t in x[i]] for i in range(2)]  # --graph --bwd's inputs

        def call(i, use_sparse, fwd_only=False, x=x, kept=kept, index=index, sparse=sparse, sparse_bwd=sparse_bwd,
                 dout=dout, graph_leaves=graph_leaves):
            # fwd_only: the forward of a graph-timed backward
            kw = dict(block_sparse_tensors=sparse, block_sparse_tensors_bwd=sparse_bwd) if use_sparse else {}
            if not args.bwd:
                return flash_attn_varlen_func(*x[i], **index, **kw)
            if args.graph:  # forward and backward in the same capture (autograd runs it on the forward's stream)
                out = flash_attn_varlen_func(*graph_leaves[i], **index, **kw)[0]
                return out if fwd_only else torch.autograd.grad(out, graph_leaves[i], dout)
            if (i, use_sparse) not in kept:
                leaves = [t.detach().requires_grad_() for t in x[i]]
                kept[i, use_sparse] = (leaves, flash_attn_varlen_func(*leaves, **index, **kw)[0])
            leaves, out = kept[i, use_sparse]
            return torch.autograd.grad(out, leaves, dout, retain_graph=True)

        ms = {False: [], True: []}
        for use in (False, True, True, False):
            ms[use].append(bench.time_direction_ms(lambda i, u=use: call(i, u), lambda i, u=use: call(i, u, True),
                                                   graph=args.graph, bwd=args.bwd, reps=args.reps))
        dense_ms, sparse_ms = (sum(ms[u]) / 2 for u in (False, True))
        dense_tf, sparse_tf = dense_flops / dense_ms / 1e9, sparse_flops / sparse_ms / 1e9
        problem = f"varlen{len(lens)}x{total}h{h}d{d}"
        direction = "bwd" if args.bwd else "fwd"
        rows.append(dict(problem=problem, direction=direction, lengths=list(lens), visited=visited_blocks / dense_blocks,
                         dense_ms=dense_ms, sparse_ms=sparse_ms, dense_tflops=dense_tf,
                         sparse_tflops_on_computed=sparse_tf, ratio=sparse_tf / dense_tf,
                         timer="cuda graph" if args.graph else "eager"))
        print(f"[{info.mode}] {direction} {problem:24s} visited {100 * rows[-1]['visited']:5.1f}%  dense "
              f"{dense_ms:7.3f} ms {dense_tf:6.1f} TF  sparse {sparse_ms:7.3f} ms {sparse_tf:6.1f} TF  "
              f"ratio {sparse_tf / dense_tf:.3f}", flush=True)
    if args.json:
        doc = harness.measurement_doc(rows, {"reference": "dense varlen call, same process"}, info, "block_sparse_varlen")
        args.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
