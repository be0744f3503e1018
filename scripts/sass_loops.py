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
import re
from dataclasses import dataclass

_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")
_BRANCH_TARGET = re.compile(r"\bBRA\S*\s.*?0x([0-9a-f]+)\s*$")
_PREDICATE = re.compile(r"^@!?U?P\w+\s+")


@dataclass(frozen=True)
class Loop:
    start: int  # address of the loop head (the backward branch's target)
    end: int  # address of the backward branch
    instructions: int
    hmma: int
    mov: int


def _opcode(text: str) -> str:
    return _PREDICATE.sub("", text).split()[0] if text.strip() else ""


def loops(sass: str) -> list[Loop]:
    """Every backward branch of `cuobjdump --dump-sass` text, as the loop it closes (head to branch, both in),
    but those whose span holds an unconditional EXIT (returns from out-of-line code)."""
    instructions = [(int(m.group(1), 16), m.group(2).strip()) for m in _INSTRUCTION.finditer(sass)]
    position = {address: i for i, (address, _) in enumerate(instructions)}
    found = []
    for i, (address, text) in enumerate(instructions):
        m = _BRANCH_TARGET.search(text)
        if m is None:
            continue
        target = int(m.group(1), 16)
        if target >= address or target not in position:
            continue
        span = instructions[position[target]:i + 1]
        if any(t == "EXIT" for _, t in span):
            # the return from out-of-line code placed after the kernel's end (a pipeline wait's retry), not a loop
            continue
        body = [_opcode(t) for _, t in span]
        found.append(Loop(target, address, len(body), sum(op.startswith("HMMA") for op in body),
                          sum(op == "MOV" or op.startswith("MOV.") for op in body)))
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
