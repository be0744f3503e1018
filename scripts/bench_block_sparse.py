#!/usr/bin/env python3
"""Block-sparse forward speed against dense, side by side in one process (GPU).

The issue's gate: on a mask with about 10% of the blocks computed, TFLOPS counted on the computed
blocks >= 0.9x the dense TFLOPS. Per problem, the same q/k/v run dense (the shipped table's kernel,
no mask) and block-sparse (128 x 128 blocks) with:
  * random10:      a random 10% of the blocks, all full (no mask_mod): the cost of the sparse loop;
  * window+global: a sliding window of 512 keys each side plus 128 global tokens, lists from
                   PyTorch's create_block_mask, a mask_mod on the partial blocks.
--masks all adds the other masks the issue names, built the same way: causal, window (512 each side),
document (packed documents of 128-1280 tokens, the ids an aux tensor) and prefix-lm (1024 prefix keys
plus causal); their visited share is not 10%, each is compared with dense at its own share.
Computed FLOPs are 4 * b * h * d * (visited blocks * 128 * 128). Times are CUDA-event medians
(bench.time_cuda), the dense and sparse calls timed A B B A so that clock drift cancels. --bwd times
the backward instead (autograd.grad of a kept forward; the sparse call with the Q-direction lists,
block_sparse_tensors_bwd): FLOPs 2.5x the forward's, as upstream counts them. --bwd --deterministic
also times the sparse backward with deterministic=True (dQ in list order) next to it, for what the order costs.
--grid-order also times each sparse call with its tiles in grid order instead of longest first.
--graph times every call captured in a CUDA graph instead (bench.time_cuda_graph: the kernels' own time,
the host removed): a ~0.2 ms sparse forward is close to its host path's time, so eagerly timed calls
queued back to back can leave the GPU idle and measure the host (seen on 2026-12-04: the same random
10% d64 call at 0.18, 0.21 and 0.28 ms in three processes). The graph reuses the launch order cached by
the warm-up calls. With --bwd the forward and the backward are captured together (autograd runs the
backward on its forward's stream, so a forward kept from outside the capture cannot be used) and the
backward's time is that graph's minus the forward's own graph (written 2026-12-04, not yet run on a GPU).
Each row also reports the sparse call's host time per call (bench.host_us_per_call). --seqlens times the
problems at other sequence lengths: at s8192 a 10% tile walks about 6 of 64 blocks, so its fixed per-tile cost
(prologue, epilogue, the first loads' latency) weighs about 10x more than in the dense tile; longer rows show how
much of the gap that is. --heads does the same with head counts: at b1 s8192 d128 a head's K and V are 4 MB, so 4
heads fit an H100's 50 MB L2 whole and 16 do not (an RTX PRO 6000 has 128 MB), while a random 10% list uses each
K/V block in only ~6 of a head's 64 Q tiles: the ratio against --heads shows how much of the gap is L2 misses.

  FLASH_ATTN_SM120_EMULATE=1 python scripts/bench_block_sparse.py --json bs.json
"""

from __future__ import annotations

import argparse
import contextlib
from functools import partial
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flash_attn_sm120 import bench, harness, testing_sparse  # noqa: E402

PROBLEMS = ((1, 8192, 16, 128), (2, 8192, 16, 64), (2, 8192, 16, 96))  # (batch, seqlen, heads, head_dim)
BLOCK = (128, 128)
WINDOW, GLOBAL = 512, 128
PREFIX = 1024  # prefix-LM: keys before it are seen by every query
DOC_LENGTHS = (512, 1024, 256, 768, 384, 1280, 640, 128)  # packed documents, cycled to fill each row


def _window_global_mod():
    import cutlass.cute as cute

    @cute.jit
    def window_global(b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        w = cute.full_like(q_idx, WINDOW)
        near = (q_idx - kv_idx <= w) & (kv_idx - q_idx <= w)
        return near | (kv_idx < cute.full_like(kv_idx, GLOBAL)) | (q_idx < cute.full_like(q_idx, GLOBAL))

    def twin(b, h, qi, ki):
        return ((qi - ki).abs() <= WINDOW) | (ki < GLOBAL) | (qi < GLOBAL)

    return window_global, twin


def _issue_mods():
    """{name: (cute mask_mod, PyTorch twin (b, h, qi, ki) -> keep, needs the document ids)}: the masks issue 17
    names besides window + global tokens (causal, a sliding window, documents over packed sequences,
    prefix-LM), as FlexAttention mask_mods with their create_block_mask twins."""
    import cutlass.cute as cute

    from flash_attn_sm120.testing_mods import same_document  # document ids as aux_tensors[0], (batch, length)

    @cute.jit
    def causal(b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        return kv_idx <= q_idx

    @cute.jit
    def window(b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        w = cute.full_like(q_idx, WINDOW)
        return (q_idx - kv_idx <= w) & (kv_idx - q_idx <= w)

    @cute.jit
    def prefix_lm(b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        return (kv_idx <= q_idx) | (kv_idx < cute.full_like(kv_idx, PREFIX))

    return {
        "causal": (causal, lambda b, h, qi, ki: ki <= qi, False),
        "window": (window, lambda b, h, qi, ki: (qi - ki).abs() <= WINDOW, False),
        "document": (same_document, None, True),  # the twin reads the ids (_masks)
        "prefix-lm": (prefix_lm, lambda b, h, qi, ki: (ki <= qi) | (ki < PREFIX), False),
    }


def _document_ids(b: int, s: int):
    """(b, s) int32 document ids: packed documents of DOC_LENGTHS (cycled), the row's last one cut at s."""
    import torch

    ids, start, doc = torch.empty(b, s, dtype=torch.int32), 0, 0
    while start < s:
        n = DOC_LENGTHS[doc % len(DOC_LENGTHS)]
        ids[:, start:start + n] = doc
        start, doc = start + n, doc + 1
    ids = ids.cuda().contiguous()
    ids.__leading_dim__ = 1  # upstream's to_cute_aux_tensor: the contiguous mode
    return ids


def _masks(b, s, h, names=("random10", "window+global")):
    """[(name, BlockSparseTensorsTorch, its Q-direction twin, mask_mod, aux tensors, visited fraction)]."""
    import torch
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
    from torch.nn.attention.flex_attention import create_block_mask

    n = s // BLOCK[0]
    out = []
    mods = _issue_mods()
    for name in names:
        if name == "random10":
            g = torch.Generator(device="cuda").manual_seed(0)
            kinds = testing_sparse.random_block_map(b, h, n, n, density=0.1, full_share=1.0, generator=g)
            out.append((name, testing_sparse.lists_from_map(kinds, BLOCK),
                        testing_sparse.lists_from_map(kinds.transpose(2, 3).contiguous(), BLOCK), None, None,
                        testing_sparse.computed_fraction(kinds)))
            continue
        aux = None
        if name == "window+global":
            mod, twin = _window_global_mod()
        elif name in mods:
            mod, twin, needs_ids = mods[name]
            if needs_ids:
                aux = [_document_ids(b, s)]
                ids = aux[0]
                twin = lambda bi, hi, qi, ki, ids=ids: ids[bi, qi] == ids[bi, ki]  # noqa: E731
        else:
            raise SystemExit(f"unknown mask {name!r}; known: random10, window+global, {', '.join(mods)}")
        # every mask here is the same for each batch row and head: build one (1, 1) block mask and broadcast it
        # (create_block_mask materializes b * h * s * s elements: 128 GiB at s32768 h16)
        bm = create_block_mask(twin, 1, 1, s, s, device="cuda", BLOCK_SIZE=BLOCK)
        _, _, kv_cnt, kv_idx, full_cnt, full_idx, q_cnt, q_idx, fq_cnt, fq_idx, *_ = (
            t.expand(b, h, *t.shape[2:]).contiguous() if isinstance(t, torch.Tensor) else t
            for t in bm.as_tuple()[:10])
        visited = float((kv_cnt + full_cnt).sum()) / (b * h * n * n)
        out.append((name, BlockSparseTensorsTorch(kv_cnt, kv_idx, full_cnt, full_idx, block_size=BLOCK),
                    BlockSparseTensorsTorch(q_cnt, q_idx, fq_cnt, fq_idx, block_size=BLOCK), mod, aux, visited))
    return out


ALL_MASKS = ("random10", "window+global", "causal", "window", "document", "prefix-lm")


def main(argv=None) -> int:
    import torch

    from flash_attn_sm120 import flash_attn_func
    from flash_attn_sm120.device import device_info

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=None, help="write the rows here (prepare.py-style header)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--bwd", action="store_true", help="time the backward (autograd.grad) instead of the forward")
    ap.add_argument("--deterministic", action="store_true",
                    help="--bwd: also time the sparse backward with deterministic=True, side by side")
    ap.add_argument("--sparse-configs", default="",
                    help="forward: also time the sparse call with each of these configs forced (comma list of "
                         "FwdConfig names, e.g. tma-w4-64x64-s2-pers), side by side; a config the problem's head dim "
                         "refuses is skipped")
    ap.add_argument("--bwd-configs", default="",
                    help="--bwd: also time the sparse backward with each of these configs forced (comma list of "
                         "BwdConfig names, e.g. bwd-w8-64x64-q2do1-a242), side by side; one the head dim refuses "
                         "is skipped")
    ap.add_argument("--masks", default="random10,window+global",
                    help="comma list of masks, or 'all' (" + ", ".join(ALL_MASKS) + "); the default pair is the "
                         "issue's ~10%% gate set")
    ap.add_argument("--graph", action="store_true",
                    help="time each call captured in a CUDA graph (the kernels' time, no host path), not eagerly")
    ap.add_argument("--head-dims", default="",
                    help="comma list: only the problems of these head dims (default: all of " +
                         ", ".join(str(p[3]) for p in PROBLEMS) + ")")
    ap.add_argument("--head-groups", default="",
                    help="comma list of group sizes: also time each sparse call launched longest first within "
                         "groups of that many heads (block_sparse.head_groups: fewer heads' K/V at once, for L2), "
                         "side by side")
    ap.add_argument("--seqlens", default="",
                    help="comma list: time each problem at these sequence lengths instead of its own (multiples of "
                         "128), e.g. 8192,16384,32768: how the sparse-to-dense ratio grows as each tile's list gets "
                         "longer than its fixed per-tile cost")
    ap.add_argument("--heads", default="",
                    help="comma list: time each problem with these head counts instead of its own, e.g. 4,8,16: "
                         "fewer heads' K/V fit the L2 whole (H100 50 MB, RTX PRO 6000 128 MB), which shows how much of "
                         "the sparse-to-dense gap is the L2 (a random list reuses each K/V block across few Q tiles)")
    ap.add_argument("--grid-order", action="store_true",
                    help="also time each sparse call with its tiles launched in grid order instead of longest "
                         "first (block_sparse.grid_order), side by side (the backward's non-deterministic walk too)")
    args = ap.parse_args(argv)
    if args.deterministic and not args.bwd:
        raise SystemExit("--deterministic times a backward: add --bwd")
    from flash_attn_sm120 import block_sparse, driver, driver_bwd
    from flash_attn_sm120.config import config_from_name
    from flash_attn_sm120.config_bwd import bwd_config_from_name
    from flash_attn_sm120.kernels.bwd_tiling import bwd_config_error

    forced = [config_from_name(n) for n in args.sparse_configs.split(",") if n]
    if forced and args.bwd:
        raise SystemExit("--sparse-configs times forward configs: drop --bwd (--bwd-configs names backward ones)")
    if args.bwd_configs and not args.bwd:
        raise SystemExit("--bwd-configs times backward configs: add --bwd")
    forced += [bwd_config_from_name(n) for n in args.bwd_configs.split(",") if n]
    info = device_info()
    if not info.uses_sm120_kernels:
        raise SystemExit(f"{info.label()}: set FLASH_ATTN_SM120_EMULATE=1 to time the SM120 kernels here")
    timed = partial(bench.time_direction_ms, graph=args.graph, bwd=args.bwd, reps=args.reps)

    rows = []
    head_dims = {int(x) for x in args.head_dims.split(",") if x}
    if head_dims - {p[3] for p in PROBLEMS}:
        raise SystemExit(f"--head-dims {args.head_dims}: the problems have head dims {sorted({p[3] for p in PROBLEMS})}")
    groups = [int(x) for x in args.head_groups.split(",") if x]
    if any(g < 1 for g in groups):
        raise SystemExit(f"--head-groups {args.head_groups}: a group holds at least one head")
    orders = [("", None)] + ([(" grid order", block_sparse.grid_order)] if args.grid_order else []) + [
        (f" head groups of {g}", lambda g=g: block_sparse.head_groups(g)) for g in groups]
    seqlens = [int(x) for x in args.seqlens.split(",") if x]
    if any(s <= 0 or s % BLOCK[0] for s in seqlens):
        raise SystemExit(f"--seqlens {args.seqlens}: each must be a positive multiple of {BLOCK[0]}")
    heads = [int(x) for x in args.heads.split(",") if x]
    if any(h < 1 for h in heads):
        raise SystemExit(f"--heads {args.heads}: each must be at least 1")
    problems = [(b, s2, h2, d) for b, s, h, d in PROBLEMS if not head_dims or d in head_dims
                for s2 in seqlens or (s,) for h2 in heads or (h,)]
    for b, s, h, d in problems:
        x = [[torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)] for _ in range(2)]
        dense_flops = 4 * b * h * s * s * d * (2.5 if args.bwd else 1.0)
        dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
        graph_leaves = [[t.detach().requires_grad_() for t in x[i]] for i in range(2)]  # --graph --bwd's inputs
        names = ALL_MASKS if args.masks == "all" else tuple(m for m in args.masks.split(",") if m)
        for name, sparse, sparse_bwd, mod, aux, visited in _masks(b, s, h, names):
            kept = {}  # the backward's forward, once per (input set, dense or sparse)

            def call(i, use_sparse, fwd_only=False, x=x, sparse=sparse, sparse_bwd=sparse_bwd, mod=mod, aux=aux,
                     kept=kept, dout=dout, graph_leaves=graph_leaves):
                # use_sparse: False (dense), True (sparse) or "det" (sparse, deterministic=True); fwd_only: the
                # forward of a graph-timed backward
                kw = dict(block_sparse_tensors=sparse, block_sparse_tensors_bwd=sparse_bwd, mask_mod=mod) \
                    if use_sparse else {}
                if use_sparse and aux is not None:
                    kw["aux_tensors"] = aux
                if use_sparse == "det":
                    kw["deterministic"] = True
                if not args.bwd:
                    return flash_attn_func(*x[i], **kw)
                if args.graph:  # forward and backward in the same capture
                    out = flash_attn_func(*graph_leaves[i], **kw)[0]
                    return out if fwd_only else torch.autograd.grad(out, graph_leaves[i], dout)
                if (i, use_sparse) not in kept:
                    leaves = [t.detach().requires_grad_() for t in x[i]]
                    kept[i, use_sparse] = (leaves, flash_attn_func(*leaves, **kw)[0])
                leaves, out = kept[i, use_sparse]
                return torch.autograd.grad(out, leaves, dout, retain_graph=True)

            ms = {False: [], True: [], "det": []}
            order = (False, True, "det", "det", True, False) if args.deterministic else (False, True, True, False)
            for use in order:
                ms[use].append(timed(lambda i, u=use: call(i, u), lambda i, u=use: call(i, u, True)))
            host_us = bench.host_us_per_call(lambda i: call(i, True), rotations=2)
            forced_rows = {}
            for cfg in [None] + forced:
                if cfg is not None and (bwd_config_error(d, d, cfg) if args.bwd else cfg.error(d, d)) is not None:
                    continue
                for order_label, order_ctx in orders:
                    if cfg is None and order_ctx is None:
                        continue  # the default config, longest first: the row itself
                    label = (cfg.name if cfg is not None else "default config") + order_label
                    with contextlib.ExitStack() as stack:
                        if cfg is not None:
                            stack.enter_context((driver_bwd if args.bwd else driver).force_config(cfg))
                        if order_ctx is not None:
                            stack.enter_context(order_ctx())
                        try:
                            forced_rows[label] = timed(lambda i: call(i, True), lambda i: call(i, True, True))
                        except (ValueError, NotImplementedError) as e:
                            print(f"  {label}: {e}", flush=True)
            dense_ms, sparse_ms = (sum(ms[u]) / 2 for u in (False, True))
            det_ms = sum(ms["det"]) / 2 if args.deterministic else None
            dense_tf = dense_flops / dense_ms / 1e9
            sparse_tf = dense_flops * visited / sparse_ms / 1e9
            problem = f"b{b}s{s}h{h}d{d}"
            direction = "bwd" if args.bwd else "fwd"
            rows.append(dict(problem=problem, direction=direction, mask=name, visited=visited, dense_ms=dense_ms,
                             sparse_ms=sparse_ms, dense_tflops=dense_tf, sparse_tflops_on_computed=sparse_tf,
                             ratio=sparse_tf / dense_tf, sparse_host_us_per_call=host_us,
                             timer="cuda graph" if args.graph else "eager"))
            det = ""
            if det_ms is not None:
                rows[-1].update(deterministic_ms=det_ms, deterministic_vs_sparse=sparse_ms / det_ms)
                det = f"  deterministic {det_ms:7.3f} ms ({sparse_ms / det_ms:.3f}x the sparse speed)"
            print(f"[{info.mode}] {direction} {problem:18s} {name:14s} visited {100 * visited:5.1f}%  dense "
                  f"{dense_ms:7.3f} ms {dense_tf:6.1f} TF  sparse {sparse_ms:7.3f} ms {sparse_tf:6.1f} TF  "
                  f"ratio {sparse_tf / dense_tf:.3f}  host {host_us:5.0f} us/call{det}",
                  flush=True)
            for cname, fms in forced_rows.items():
                rows[-1].setdefault("forced", {})[cname] = dict(
                    ms=fms, tflops_on_computed=dense_flops * visited / fms / 1e9,
                    ratio=dense_flops * visited / fms / 1e9 / dense_tf, vs_default_sparse=sparse_ms / fms)
                print(f"    {cname}: {fms:7.3f} ms  ratio {dense_flops * visited / fms / 1e9 / dense_tf:.3f} "
                      f"({sparse_ms / fms:.3f}x the default sparse config)", flush=True)
    if args.json:
        doc = harness.measurement_doc(rows, {"reference": "dense shipped table, same process"}, info, "block_sparse")
        args.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
