"""sm_120a codegen report for every shipped forward and backward config, on any machine (no GPU needed).

Compiles each entry of flash_attn_sm120/configs/sm120_fwd.toml, plus upstream's own SM120 default (4 warps,
128x64, d=128, the reference row), the TMA entries with GQA 4:1 packed (`gqa4/` rows) and those that take
varlen calls (`varlen/` rows: packed q and K/V, GQA 4:1 packed), and each entry of flash_attn_sm120/configs/sm120_bwd.toml and the backward's
fallbacks, plus upstream's own SM120 backward at d=128, and the block-sparse forward configs and backward walks
(`sparse/` rows), for sm_120a with fake tensors, then prints registers, spill
bytes, shared memory, CTAs per SM on SM120 (and what limits it) and a SASS opcode histogram.

  python scripts/sm120_report.py            # table
  python scripts/sm120_report.py --json     # list of objects (name, shipped, regs, spill_bytes,
                                            # smem_bytes, ctas_per_sm, sass, ...)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("CUTE_DSL_ARCH", "sm_120a")  # this process only: the compile target

SHOWN_OPCODES = ("HMMA", "LDSM", "LDGSTS", "UTMALDG", "UTMASTG", "SYNCS", "LDL", "STL", "BAR", "MUFU")


def rows(table_path: Path | None = None, include_upstream: bool = True) -> list[dict]:
    from flash_attn_sm120.codegen import report_row
    from flash_attn_sm120.config import load_fwd_table, upstream_fwd_config

    jobs = []
    if include_upstream:
        jobs.append(lambda: report_row(upstream_fwd_config(128), 128, name="upstream-sm120-default-d128",
                                       upstream_class=True, note="upstream FlashAttentionForwardSm120, its own default tiles"))
    for e in load_fwd_table(table_path):
        jobs.append(lambda e=e: report_row(e.config, e.head_dim, name=f"{e.head_dim}/{e.mask}/{e.config.name}",
                                           shipped=True, causal=e.mask != "none"))
        if e.config.family == "tma":
            # GQA 4:1 with the heads packed into the M tile (the default for GQA calls the tile can pack)
            jobs.append(lambda e=e: report_row(
                e.config, e.head_dim, name=f"gqa4/{e.head_dim}/{e.mask}/{e.config.name}", shipped=True,
                causal=e.mask != "none", qhead_per_kvhead=4, pack_gqa=True))
        if e.config.family == "tma" and e.config.varlen_error(e.head_dim) is None:
            # the entries varlen calls take: packed q and K/V, GQA 4:1 packed (ragged TMA descriptors)
            jobs.append(lambda e=e: report_row(
                e.config, e.head_dim, name=f"varlen/{e.head_dim}/{e.mask}/{e.config.name}", shipped=True,
                causal=e.mask != "none", varlen=("cu_seqlens_q", "cu_seqlens_k"), qhead_per_kvhead=4, pack_gqa=True))
    return _run(jobs, "sm_120a forward configs")


def _run(jobs: list, desc: str) -> list[dict]:
    """Each job compiles one config (a few seconds on a CPU): run them under a progress bar."""
    from flash_attn_sm120 import progress

    return [job().to_dict() for job in progress.bar(jobs, desc=desc, unit="kernel")]


def bwd_rows(include_upstream: bool = True) -> list[dict]:
    """The backward: every entry of flash_attn_sm120/configs/sm120_bwd.toml (at its bucket's head dim, with its mask), the
    fallbacks at the largest head dim each serves, and upstream's own SM120 backward at d=128."""
    from flash_attn_sm120.codegen import bwd_report_row, report_mods
    from flash_attn_sm120.config_bwd import BWD_FALLBACKS, load_bwd_table
    from flash_attn_sm120.kernels.bwd_tiling import bwd_config_error, upstream_bwd_config

    jobs = []
    if include_upstream:
        jobs.append(lambda: bwd_report_row(upstream_bwd_config(128), 128, name="bwd/upstream-sm120-default-d128",
                                           note="upstream FlashAttentionBackwardSm120, its own config"))
    for e in load_bwd_table():  # a modifier entry (modifiers = true) compiles the modifier step, with report_mods
        jobs.append(lambda e=e: bwd_report_row(
            e.config, e.head_dim, name=f"bwd/{e.head_dim}/{e.mask}{'/' + e.kind if e.kind else ''}/{e.config.name}",
            shipped=True, causal=e.mask == "causal", local=e.mask == "local", mods=report_mods() if e.modifiers else None,
            deterministic=e.turns_only))
    for i, cfg in enumerate(BWD_FALLBACKS):
        d = max(d for d in range(8, 257, 8) if bwd_config_error(d, d, cfg) is None)
        jobs.append(lambda i=i, cfg=cfg, d=d: bwd_report_row(cfg, d, name=f"bwd/fallback{i}/d{d}/{cfg.name}",
                                                             shipped=True))
    return _run(jobs, "sm_120a backward configs")


def sparse_rows() -> list[dict]:
    """Block sparsity: each forward config of block_sparse.CONFIGS and the backward walk on each head dim's
    table config (one Q/dO stage, block_sparse_bwd.plan), with mask and full lists of 128 x 128 blocks."""
    from dataclasses import replace

    from flash_attn_sm120 import block_sparse
    from flash_attn_sm120.codegen import bwd_report_row, report_row
    from flash_attn_sm120.config_bwd import load_bwd_table, select_bwd_config

    jobs = []
    for d, configs in block_sparse.CONFIGS.items():
        for cfg in configs:
            factors = (128 // cfg.tile_m, 128 // cfg.tile_n, True)
            jobs.append(lambda d=d, cfg=cfg, f=factors: report_row(cfg, d, name=f"sparse/{d}/{cfg.name}", shipped=True,
                                                                   block_sparse=f))
        bwd = replace(select_bwd_config(load_bwd_table(), d, d, False, False, modifiers=True), stages_q=1, stages_do=1,
                      v_in_regs=False)
        factors = (128 // bwd.m_block, 128 // bwd.n_block, True)
        jobs.append(lambda d=d, bwd=bwd, f=factors: bwd_report_row(bwd, d, name=f"sparse/bwd/{d}/{bwd.name}",
                                                                   shipped=True, block_sparse=f))
    return _run(jobs, "sm_120a block-sparse configs")


def format_table(rs: list[dict]) -> str:
    head = f"{'name':46s} {'ship':>4s} {'regs':>4s} {'spill':>5s} {'smem':>6s} {'CTA/SM':>6s} {'limit':>7s} {'warps':>5s}  sass"
    lines = [head, "-" * len(head)]
    for r in rs:
        sass = " ".join(f"{op}={r['sass'][op]}" for op in SHOWN_OPCODES if r["sass"].get(op))
        lines.append(
            f"{r['name']:46s} {'yes' if r['shipped'] else 'ref':>4s} {r['regs']:4d} {r['spill_bytes']:5d} "
            f"{r['smem_bytes']:6d} {r['ctas_per_sm']:6d} {r['ctas_limiter']:>7s} {r['warps_per_sm']:5d}  {sass}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--table", type=Path, default=None, help="config table (default flash_attn_sm120/configs/sm120_fwd.toml)")
    ap.add_argument("--no-upstream", action="store_true", help="skip upstream's reference row")
    args = ap.parse_args(argv)
    rs = rows(args.table, include_upstream=not args.no_upstream) + bwd_rows(not args.no_upstream) + sparse_rows()
    if args.json:
        print(json.dumps(rs, indent=1))
    else:
        print("sm_120a codegen (compiled on this machine, no GPU): bf16, fake tensors")
        print(format_table(rs))
        bad = [r["name"] for r in rs if r["shipped"] and (r["spill_bytes"] or r["local_loads"] or r["local_stores"])]
        if bad:
            print(f"\nSHIPPED CONFIGS THAT SPILL: {bad}")
        for ref in (r for r in rs if not r["shipped"] and r["spill_bytes"]):
            print(f"\n{ref['name']}: upstream's SM120 default spills {ref['spill_bytes']} B on sm_120a "
                  f"({ref['regs']} registers).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
