"""Shared-memory operand traffic of backward configs on sm_120a (CPU): ldmatrix bytes per mainloop pass.

Each backward mainloop pass (one m_block of one CTA) does 2 * m * n * (3 d + 2 dv) FLOPs whatever the
warp layout, while the bytes its warps read with ldmatrix depend on the layout, on V in registers and on
P/dS in registers. In emulation (mma.sync about 2.4x faster per SM-clock than SM120, shared memory the
same 128 B/clk) those bytes bound the kernel, so this is a cheap ranking before a GPU is lent.

    python scripts/bwd_ldsm_probe.py 96:bwd-w4-32x64-q1do1-a222 96:bwd-w4-32x64-q1do1-a222-vreg [--json F]

One JSON line per (head dim, config, mask): registers, stack, local loads, dynamic shared memory,
CTAs per SM on SM120, the mainloop's ldmatrix bytes per warp (from the SASS, and from
bwd_traffic.ldsm_elems_per_warp) and FLOPs per ldmatrix byte. With --variants local,gqa,fp16,det: one
line per (spec, variant), the registers and spills of the other calls a causal table entry serves.

    python scripts/bwd_ldsm_probe.py --fit RUN.json --candidates CANDIDATES.json [--clock-ghz 1.98]

With --fit, no compiling: each row of a `prepare.py --set bwd` run whose config is known (a candidate's,
or upstream_sm120's) against the shared-memory bound of bwd_traffic.smem_bound_tflops on that run's GPU
(mma.sync 640 TFLOPS, the measured H200 peak), grouped by warps per SM at SM120 occupancy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent


# --variants: the calls a table entry serves besides its own mask (a causal entry also serves windows,
# GQA, float16 and the deterministic path), each compiled with a causal mask (det_fixed: the deterministic
# path without a mask, fixed-point dQ)
VARIANTS = {
    "local": dict(causal=True, local=True),
    "gqa": dict(causal=True, qhead_per_kvhead=2),
    "fp16": dict(causal=True, dtype="float16"),
    "det": dict(causal=True, deterministic=True),
    "det_fixed": dict(causal=False, deterministic=True, ordering={"dq_fixed_point": True}),
    # a deterministic causal entry's other calls: GQA in turns, packed sequences in fixed point (varlen)
    "det_gqa": dict(causal=True, deterministic=True, qhead_per_kvhead=2),
    "det_fp16": dict(causal=True, deterministic=True, dtype="float16"),
    "det_rotated": dict(causal=False, deterministic=True, ordering={"dq_rotated": True, "fused_turns": True}),
    # a rotated turns entry's other calls (no mask): GQA, float16
    "det_rotated_gqa": dict(causal=False, deterministic=True, qhead_per_kvhead=4,
                            ordering={"dq_rotated": True, "fused_turns": True}),
    "det_rotated_fp16": dict(causal=False, deterministic=True, dtype="float16",
                             ordering={"dq_rotated": True, "fused_turns": True}),
    "det_fixed_causal": dict(causal=True, deterministic=True, ordering={"dq_fixed_point": True}),
    "det_fixed_varlen_gqa": dict(causal=True, deterministic=True, qhead_per_kvhead=4, varlen=True,
                                 ordering={"dq_fixed_point": True}),
    # a fixed-point entry without a mask (every tile masked: the runtime mask test's registers spill the d96
    # 64x128 tiles), and its other calls: GQA, float16, packed MHA
    "det_fixed_mask_always": dict(causal=False, deterministic=True,
                                  ordering={"dq_fixed_point": True, "mask_where_needed": False}),
    "det_fixed_mask_always_gqa": dict(causal=False, deterministic=True, qhead_per_kvhead=4,
                                      ordering={"dq_fixed_point": True, "mask_where_needed": False}),
    "det_fixed_mask_always_fp16": dict(causal=False, deterministic=True, dtype="float16",
                                       ordering={"dq_fixed_point": True, "mask_where_needed": False}),
    "det_fixed_mask_always_varlen": dict(causal=False, deterministic=True, varlen=True,
                                         ordering={"dq_fixed_point": True, "mask_where_needed": False}),
    "varlen": dict(causal=True, varlen=True),
    "varlen_gqa": dict(causal=True, qhead_per_kvhead=4, varlen=True),
}


def probe_variant(spec_variant: str) -> dict:
    """Registers and spills of HEAD_DIM:CONFIG@VARIANT (VARIANTS) on sm_120a."""
    os.environ.update(CUTE_DSL_ARCH="sm_120a", FLASH_ATTENTION_ARCH="sm_120", FLASH_ATTENTION_NUM_SMS="188")
    sys.path.insert(0, str(ROOT))
    from flash_attn_sm120 import codegen
    from flash_attn_sm120.config_bwd import bwd_config_from_name

    spec, variant = spec_variant.rsplit("@", 1)
    dim, name = spec.split(":", 1)
    try:
        cubin, smem = codegen.compile_bwd_cubin(bwd_config_from_name(name), int(dim), **VARIANTS[variant])
    except ValueError as e:  # not implementable (shared memory, tiling): a row, not the pool's failure
        return dict(head_dim=int(dim), config=name, variant=variant, error=str(e))
    usage, hist, _ = codegen.inspect_cubin(cubin)
    return dict(head_dim=int(dim), config=name, variant=variant, regs=usage["regs"], stack=usage["stack"],
                ldl=hist.get("LDL", 0), smem_dynamic=smem)


def probe(spec: str) -> list[dict]:
    os.environ.update(CUTE_DSL_ARCH="sm_120a", FLASH_ATTENTION_ARCH="sm_120", FLASH_ATTENTION_NUM_SMS="188")
    sys.path.insert(0, str(ROOT))
    from flash_attn_sm120 import bwd_traffic, codegen, hardware
    from flash_attn_sm120.config_bwd import bwd_config_from_name
    from flash_attn_sm120.kernels.bwd_tiling import bwd_config_error

    dim, name = spec.split(":", 1)
    d = int(dim)
    cfg = bwd_config_from_name(name)
    err = bwd_config_error(d, d, cfg)
    if err is not None:
        return [dict(head_dim=d, config=name, error=err)]
    rows = []
    for mask in ("none", "causal"):
        cubin, smem = codegen.compile_bwd_cubin(cfg, d, causal=mask == "causal")
        usage, hist, sass = codegen.inspect_cubin(cubin)
        per_warp = codegen.main_loop_ldsm_bytes(sass)
        flops = bwd_traffic.pass_flops(cfg, d, d)
        rows.append(dict(
            head_dim=d, config=name, mask=mask, regs=usage["regs"], stack=usage["stack"], ldl=hist.get("LDL", 0),
            smem_dynamic=smem, ctas_per_sm=hardware.sm120_occupancy(smem + hardware.DSL_STATIC_SMEM,
                                                                    cfg.num_threads).ctas_per_sm,
            loop_ldsm_bytes_per_warp=per_warp, formula_ldsm_bytes_per_warp=2 * bwd_traffic.ldsm_elems_per_warp(cfg, d, d),
            loop_ldsm_bytes_per_cta=per_warp * cfg.num_warps,
            flops_per_ldsm_byte=round(flops / (per_warp * cfg.num_warps), 3),
        ))
    return rows


TABLE = "sm120_bwd_table"  # a prepare.py --set bwd run's row of the shipped table


def fit(run: Path, candidates: Optional[Path], clock_ghz: float, mma_tflops: float = 640.0,
        table_from_repo: bool = False) -> list[dict]:
    """Measured backward TFLOPS of a prepare.py --set bwd run over the shared-memory bound, per row whose
    config is known (a candidate's, upstream_sm120's; with table_from_repo the table rows', as this
    checkout's table selects them)."""
    import re
    import statistics

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "scripts"))
    from prepare_bwd import read_bwd_candidates

    from flash_attn_sm120 import bwd_traffic, hardware
    from flash_attn_sm120.config_bwd import load_bwd_table, select_bwd_config
    from flash_attn_sm120.kernels.bwd_tiling import smem_bytes, upstream_bwd_config

    data = json.loads(run.read_text())
    configs = {n: c for n, (c, _, _) in read_bwd_candidates(candidates).items()} if candidates else {}
    rows = []
    for r in data["rows"]:
        tf = r.get("bwd_tflops")
        shape = re.match(r"b\d+s\d+h\d+d(\d+)(-causal)?$", r["problem"])
        if r.get("status") != "ok" or tf is None or tf != tf or shape is None:
            continue
        d = int(shape.group(1))
        cfg = upstream_bwd_config(d) if r["impl"] == "upstream_sm120" else configs.get(r["impl"])
        if r["impl"] == TABLE and table_from_repo:  # the run timed this checkout's table (`--table-is-current`)
            cfg = select_bwd_config(load_bwd_table(), d, d, bool(shape.group(2)), False, plain_mha=True)  # dense MHA
        if cfg is None:
            continue
        bound = bwd_traffic.smem_bound_tflops(cfg, d, d, data["num_sms"], clock_ghz, mma_tflops)
        ctas = hardware.sm120_occupancy(smem_bytes(d, d, cfg) + hardware.DSL_STATIC_SMEM, cfg.num_threads).ctas_per_sm
        rows.append(dict(problem=r["problem"], impl=r["impl"], config=cfg.name, bwd_tflops=round(tf, 1),
                         bound_tflops=round(bound, 1), of_bound=round(tf / bound, 3),
                         warps_per_sm=ctas * cfg.num_warps, causal=bool(shape.group(2))))
    for warps in sorted({r["warps_per_sm"] for r in rows}):
        for causal in (False, True):
            xs = [r["of_bound"] for r in rows if r["warps_per_sm"] == warps and r["causal"] == causal]
            if xs:
                print(f"# {warps} warps/SM, {'causal' if causal else 'non-causal'}: {len(xs)} rows, of bound "
                      f"mean {statistics.mean(xs):.3f} min {min(xs):.3f} max {max(xs):.3f}", file=sys.stderr)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("specs", nargs="*", help="HEAD_DIM:CONFIG_NAME (BwdConfig.name, e.g. bwd-w8-32x128-q1do1-a142-vreg)")
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--variants", default="",
                    help=f"comma list of {sorted(VARIANTS)}: registers and spills of each spec in those calls instead")
    ap.add_argument("--json", type=Path, help="also write the rows here (JSON lines)")
    ap.add_argument("--fit", type=Path, help="a prepare.py --set bwd JSON run: its rows against the bound")
    ap.add_argument("--candidates", type=Path, help="with --fit: the run's --bwd-configs file")
    ap.add_argument("--clock-ghz", type=float, default=1.98, help="with --fit: SM clock (H100/H200 boost: 1.98)")
    ap.add_argument("--table-is-current", action="store_true",
                    help="with --fit: the run timed this checkout's backward table (its sm120_bwd_table rows count)")
    args = ap.parse_args(argv)
    if args.fit:
        rows = fit(args.fit, args.candidates, args.clock_ghz, table_from_repo=args.table_is_current)
        text = "".join(json.dumps(r) + "\n" for r in rows)
        sys.stdout.write(text)
        if args.json:
            args.json.write_text(text)
        return 0
    if not args.specs:
        ap.error("give HEAD_DIM:CONFIG specs, or --fit RUN.json")
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variants {unknown} (known: {sorted(VARIANTS)})")
    with ProcessPoolExecutor(args.jobs) as pool:
        if variants:
            rows = list(pool.map(probe_variant, [f"{s}@{v}" for s in args.specs for v in variants]))
        else:
            rows = [r for rs in pool.map(probe, args.specs) for r in rs]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    sys.stdout.write(text)
    if args.json:
        args.json.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
