"""The main loops of one forward kernel's sm_120a SASS: instructions, HMMA and MOV per loop (CPU, no GPU).

A kernel's per-K/V-tile cost shows in its loop bodies. ptxas sometimes keeps O (the output accumulator)
in two sets of registers across a loop and copies it back with a MOV per register on every iteration:
64-81 MOVs per K/V tile in the block-sparse walk's two list loops at d128, against 2 in the dense loop
of the same config (configs/measurements/2026-12-08_session41.md). This script compiles one forward
kernel for sm_120a on fake tensors (codegen.compile_fwd_cubin), disassembles it (cuobjdump + nvdisasm,
found as codegen finds them) and prints every loop, a loop being the span of a backward branch that holds
no unconditional EXIT (a pipeline wait's out-of-line retry, placed after the kernel's end, branches back
across it), with its instruction, HMMA and MOV counts. Inner loops (pipeline waits, a few instructions) are left out
unless --all.

  CUTE_DSL_ARCH=sm_120a FLASH_ATTENTION_ARCH=sm_120 FLASH_ATTENTION_NUM_SMS=188 \\
      python scripts/sass_loops.py --config tma-w8-128x64-s2 --head-dim 128 --block-sparse full
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

@dataclass(frozen=True)
class Loop:
    start: int  # address of the loop head (the backward branch's target)
    end: int  # address of the backward branch
    instructions: int
    hmma: int
    mov: int


def loops(sass: str) -> list[Loop]:
    """Every backward branch of `cuobjdump --dump-sass` text (codegen.backward_branches), as the loop it closes
    (head to branch, both in), but those whose span holds an unconditional EXIT (returns from out-of-line code)."""
    from flash_attn_sm120 import codegen

    lines = codegen.sass_instructions(sass)
    position = {addr: i for i, (addr, *_) in enumerate(lines)}
    found = []
    for target, addr in codegen.backward_branches(lines):
        if target not in position:
            continue
        span = lines[position[target]:position[addr] + 1]
        if any(op == "EXIT" and predicate is None for _, predicate, op, _ in span):
            # the return from out-of-line code placed after the kernel's end (a pipeline wait's retry), not a loop
            continue
        found.append(Loop(target, addr, len(span), sum(op.startswith("HMMA") for _, _, op, _ in span),
                          sum(op == "MOV" or op.startswith("MOV.") for _, _, op, _ in span)))
    return found


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="a FwdConfig name, e.g. tma-w8-128x64-s2")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--block-sparse", choices=("none", "mask", "full"), default="none",
                    help="compile the block-sparse walk (TMA family; 128 x 128 sparse blocks): mask lists only, "
                         "or mask and full lists")
    ap.add_argument("--all", action="store_true", help="also print loops without HMMA (pipeline waits)")
    args = ap.parse_args(argv)

    from flash_attn_sm120 import codegen
    from flash_attn_sm120.config import config_from_name

    cfg = config_from_name(args.config)
    block_sparse = None
    if args.block_sparse != "none":
        block_sparse = (128 // cfg.tile_m, 128 // cfg.tile_n, args.block_sparse == "full")
    cubin, _ = codegen.compile_fwd_cubin(cfg, args.head_dim, causal=args.causal, block_sparse=block_sparse)
    resources, histogram, sass = codegen.inspect_cubin(cubin)
    print(f"{cfg.name} d{args.head_dim}{' causal' if args.causal else ''} block_sparse={args.block_sparse}: "
          f"{resources['regs']} registers, {resources['stack']} B stack, {sum(histogram.values())} instructions")
    for loop in loops(sass):
        if loop.hmma or args.all:
            print(f"  loop {loop.start:#07x}-{loop.end:#07x}: {loop.instructions:5d} instructions, "
                  f"{loop.hmma:4d} HMMA, {loop.mov:4d} MOV")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
