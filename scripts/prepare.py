"""The fixed harness of the research loop: problem sets, timing, references, correctness gate.

Not edited by the loop (scripts/experiment.py is). Run directly for baselines:

  python scripts/prepare.py --set seed --baseline            # references only, table + summary
  python scripts/prepare.py --set seed --dry-run             # no GPU: problems + sm_120a report
  python scripts/prepare.py --set real --plot out.png        # shipped table vs references, plot
  python scripts/prepare.py --set seed --no-ceiling          # skip the GEMM ceiling (scripts/gemm_ceiling.py)

Every line states the mode: `sm120` (a real SM120 GPU) or `emulated` (SM120 kernels on another GPU,
shared memory padded to SM120 occupancy; set FLASH_ATTN_SM120_EMULATE=1 or pass --emulate). The
harness refuses to time a mode it cannot label. Each candidate is gated on every problem against
an fp32 reference with a NaN-poisoned output: a wrong candidate is reported `incorrect` and its
time is not used. The grep-able summary lines at the end are what the loop reads:

  mode: / correct: / fwd_tflops_peak: / fwd_tflops_geomean: / bwd_tflops_peak: / bwd_tflops_geomean:
  / peak_vram_mib:

The same-class ceiling (--ceiling, on by default): quack's SM120 GEMM (mma.sync, the instruction
class of the SM120 kernels) timed once per run at 8192^3 in a child process (scripts/gemm_ceiling.py),
labelled in the same modes. The JSON gets `ceiling` at the top level and `of_ceiling` (TFLOPS /
ceiling TFLOPS; NaN without a ceiling) and `bwd_of_ceiling` in every row; the table an "of ceiling"
column per implementation. A failed ceiling is reported (status, error) and the run goes on.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flash_attn_sm120 import bench, occupancy  # noqa: E402
from flash_attn_sm120.bench import Problem  # noqa: E402
from flash_attn_sm120.harness import (  # noqa: E402,F401  (names the loop and the tests use)
    SUMMARY_KEYS, Impl, Row, _fmt, _null, _poisoned_out, _reference, evaluate, format_summary, git_commit,
    parse_summary, sm120_impl, summarize,
)



# ------------------------------------------------------------------------------- implementations






def _cpasync_table_config(p: Problem):
    """The shipped table restricted to its cp.async entries: the best config of upstream's kernel
    family, the yardstick of a new kernel family."""
    from flash_attn_sm120.config import family_entries, select_fwd_config

    return select_fwd_config(family_entries("cpasync"), p.head_dim, p.dv, p.causal, p.window != (None, None))


def reference_impls(info) -> list[Impl]:
    """References timed in the same run as the candidates."""
    import torch

    from flash_attn_sm120.config import upstream_fwd_config

    refs = [sm120_impl("upstream_sm120", lambda p: upstream_fwd_config(max(p.head_dim, p.dv)), info, "reference"),
            sm120_impl("sm120_cpasync_table", _cpasync_table_config, info, "reference")]
    if info.is_emulated:
        # upstream's SM120 kernel without padding: what an H200 shows and SM120 would not. Never timed
        # unless named (--references upstream_sm120_unpadded): a run with it is not occupancy_verified
        unpadded = type(info)(info.name, info.capability, info.num_sms, info.smem_per_sm, info.smem_per_block_max,
                              "sm120")
        refs.append(sm120_impl("upstream_sm120_unpadded", lambda p: upstream_fwd_config(max(p.head_dim, p.dv)),
                               unpadded, "reference"))
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backends = [("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
                    ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION)]
        for name, backend in backends:
            refs.append(Impl(name, _sdpa_fwd(backend, sdpa_kernel), "reference", writes_out=False,
                             supports=lambda p: not p.is_varlen and p.window == (None, None)))
    except ImportError:
        pass
    if info.capability[0] != 12:
        refs.append(Impl("fa4_native_not_sm120", _fa4_native_fwd, "reference", writes_out=False,
                         supports=lambda p: p.window == (None, None)))
    try:
        import flashinfer  # noqa: F401

        refs.append(Impl("flashinfer", _flashinfer_fwd, "reference", writes_out=False,
                         supports=lambda p: not p.is_varlen and p.window == (None, None)))
    except ImportError:
        pass
    return refs


def _sdpa_fwd(backend, sdpa_kernel):
    import torch

    def fwd(p, x, out):
        q, k, v = (t.transpose(1, 2) for t in (x["q"], x["k"], x["v"]))
        with sdpa_kernel(backend):
            o = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=p.causal, enable_gqa=p.nheads != p.nheads_kv)
        return o.transpose(1, 2)

    return fwd


def _fa4_native_fwd(p, x, out):
    import flash_attn.cute as fa4

    if p.is_varlen:
        return fa4.flash_attn_varlen_func(x["q"], x["k"], x["v"], cu_seqlens_q=x["cu_seqlens_q"],
                                          cu_seqlens_k=x["cu_seqlens_k"], causal=p.causal)[0]
    return fa4.flash_attn_func(x["q"], x["k"], x["v"], causal=p.causal)[0]


def _flashinfer_fwd(p, x, out):
    import flashinfer

    outs = []
    for b in range(p.batch):
        outs.append(flashinfer.single_prefill_with_kv_cache(x["q"][b], x["k"][b], x["v"][b], causal=p.causal))
    import torch

    return torch.stack(outs)


# ------------------------------------------------------------------------------------ evaluate


















# -------------------------------------------------------------------------------------- device
def detect(emulate: bool):
    """The device and its mode; exits with one line when it cannot be labelled."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("prepare.py: no CUDA GPU here; timing needs one (use --dry-run on a CPU)")
    if emulate:
        os.environ["FLASH_ATTN_SM120_EMULATE"] = "1"  # this package's switch, this process only
    from flash_attn_sm120.device import device_info

    info = device_info()
    if info.mode == "upstream":
        raise SystemExit(f"prepare.py: {info.name} is not an SM120 GPU; pass --emulate (or set "
                         "FLASH_ATTN_SM120_EMULATE=1) to time the SM120 kernels in emulation")
    return info


def dry_run(problems: list[Problem], configs=None) -> None:
    print(f"problem set: {len(problems)} problems")
    for p in problems:
        print(f"  {p.name:40s} {bench.attention_flops(p) / 1e12:8.3f} TFLOP")
    sys.path.insert(0, str(ROOT / "scripts"))
    import sm120_report

    print()
    rs = sm120_report.rows()
    if configs:
        from flash_attn_sm120.codegen import report_row

        for (bucket, mask), cfg in configs.items():
            rs.append(report_row(cfg, bucket, causal=mask != "none", note="experiment").to_dict())
    print(sm120_report.format_table(rs))


def save(rows: list[Row], summary: dict, info, args, path: Path, ceiling: dict | None = None) -> None:
    from flash_attn_sm120.harness import measurement_doc

    path.parent.mkdir(parents=True, exist_ok=True)
    doc = with_ceiling(measurement_doc(rows, summary, info, args.set), ceiling)
    path.write_text(json.dumps(doc, indent=1))


# ------------------------------------------------------------------------------------- ceiling
CEILING_KEYS = ("status", "tflops", "ms", "spread", "size", "tile", "pingpong", "class")


def ceiling_tflops(ceiling: dict | None) -> float:
    """The ceiling's TFLOPS when it was measured and checked (status ok), else NaN."""
    if not ceiling or ceiling.get("status") != "ok":
        return float("nan")
    t = ceiling.get("tflops")
    return float(t) if isinstance(t, (int, float)) and t > 0 and math.isfinite(t) else float("nan")


def of_ceiling(tflops: float, ceiling: dict | None) -> float:
    """A row's TFLOPS as a fraction of the ceiling; NaN without a ceiling or a time."""
    c = ceiling_tflops(ceiling)
    return tflops / c if c == c and tflops == tflops else float("nan")


def skipped_ceiling() -> dict:
    return {"status": "skipped", "tflops": float("nan"), "ms": float("nan"), "spread": float("nan"),
            "size": None, "tile": None, "pingpong": None, "class": None}


def with_ceiling(doc: dict, ceiling: dict | None) -> dict:
    """A measurement_doc with the ceiling at the top level and `of_ceiling` / `bwd_of_ceiling` in
    every row (NaN without a ceiling). Existing keys are kept as they are."""
    doc["ceiling"] = dict(ceiling) if ceiling else skipped_ceiling()
    for k in CEILING_KEYS:
        doc["ceiling"].setdefault(k, None)
    for r in doc.get("rows", []):
        r["of_ceiling"] = of_ceiling(r.get("tflops", float("nan")), ceiling)
        r["bwd_of_ceiling"] = of_ceiling(r.get("bwd_tflops", float("nan")), ceiling)
    return doc


def run_ceiling(args, info) -> dict:
    """The run's ceiling (scripts/gemm_ceiling.py, in a child process); never raises."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import gemm_ceiling

    c = gemm_ceiling.measure_ceiling(size=args.ceiling_size)
    if c.get("mode") and c["mode"] != info.mode:
        c["note"] = f"the ceiling ran as {c['mode']}, the attention run as {info.mode}"
    print(gemm_ceiling.format_result(c))
    if c.get("status") != "ok" and c.get("stderr_tail"):
        print("gemm ceiling stderr (tail):\n" + c["stderr_tail"][-1200:])
    return c


def format_ceiling_summary(ceiling: dict | None, rows: list[Row], kind: str, field: str = "tflops") -> str:
    """Grep-able lines after the summary: the ceiling and the kind's best / geomean fraction of it."""
    c = ceiling_tflops(ceiling)
    fr = [of_ceiling(getattr(r, field), ceiling) for r in rows if r.kind == kind and r.status == "ok"]
    fr = [x for x in fr if x == x]
    return "\n".join([f"ceiling_tflops: {c:.2f}",
                      f"{'bwd' if field == 'bwd_tflops' else 'fwd'}_of_ceiling_peak: {max(fr, default=float('nan')):.3f}",
                      f"{'bwd' if field == 'bwd_tflops' else 'fwd'}_of_ceiling_geomean: {bench.geomean(fr):.3f}"])


def plot(rows: list[Row], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    problems = list(dict.fromkeys(r.problem for r in rows))
    impls = list(dict.fromkeys(r.impl for r in rows))
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(problems)), 5))
    width = 0.8 / max(1, len(impls))
    for i, impl in enumerate(impls):
        ys = [next((r.tflops for r in rows if r.impl == impl and r.problem == p and r.status == "ok"), 0)
              for p in problems]
        ax.bar([j + i * width for j in range(len(problems))], ys, width, label=impl)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(problems))])
    ax.set_xticklabels(problems, rotation=35, ha="right", fontsize=7)
    ax.set_ylabel("TFLOPS")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(candidates: Callable[[object], list[Impl]], argv=None, description: str = "") -> dict:
    """Entry point for prepare.py itself and for experiment.py: parse args, time, print, save."""
    ap = argparse.ArgumentParser(description=description or __doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", default="seed", help="seed | real | decode | bwd | bwd_real | all")
    ap.add_argument("--baseline", action="store_true", help="time the references only")
    ap.add_argument("--no-references", action="store_true", help="time the candidates only")
    ap.add_argument("--references", default="all", help="comma-separated reference names, or all")
    ap.add_argument("--emulate", action="store_true", help="SM120 emulation on a non-SM120 GPU")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: list problems, sm_120a report")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--subset", default="", help="only problems whose name contains this")
    ap.add_argument("--json", type=Path, default=None, help="write all rows and the summary here")
    ap.add_argument("--plot", type=Path, default=None, help="bar chart of TFLOPS per shape (matplotlib)")
    ap.add_argument("--ceiling", action=argparse.BooleanOptionalAction, default=True,
                    help="time the same-class GEMM ceiling (quack's SM120 GEMM, scripts/gemm_ceiling.py) once "
                         "in this run and report each row's of_ceiling (default on; --no-ceiling skips it)")
    ap.add_argument("--ceiling-size", type=int, default=8192, help="the ceiling GEMM's M = N = K (default 8192)")
    ap.add_argument("--bwd-configs", type=Path, default=None,
                    help="--set bwd: JSON file {name: BwdConfig fields [+ head_dims] [+ deterministic]} timed next to the "
                         "table's (deterministic: true also times it deterministic, as <name>_det)")
    ap.add_argument("--det-variants", default="",
                    help="--set bwd: also time these deterministic orderings (comma-separated names of "
                         "prepare_bwd.DET_VARIANTS, or all), on the problems whose name contains --det-subset")
    ap.add_argument("--det-subset", default="", help="--det-variants: only problems whose name contains this")
    ap.add_argument("--launch-variants", default="",
                    help="--set bwd: also time the table with these launch plans forced (comma-separated names of "
                         "prepare_bwd.LAUNCH_VARIANTS, or all)")
    args = ap.parse_args(argv)
    problems = [p for p in bench.problem_set(args.set) if args.subset in p.name]
    if args.dry_run:
        dry_run(problems)
        return {}
    info = detect(args.emulate)
    print(f"mode: {info.mode} -- {info.label()}")
    ceiling = run_ceiling(args, info) if args.ceiling else None
    if args.set in ("bwd", "bwd_real"):
        return _run_bwd(args, problems, info, ceiling)
    impls = [] if args.baseline else candidates(info)
    if not args.no_references or args.baseline:
        refs = reference_impls(info)
        if args.references != "all":
            wanted = set(args.references.split(","))
            refs = [r for r in refs if r.name in wanted]
        else:
            refs = [r for r in refs if r.name != "upstream_sm120_unpadded"]
        impls += refs
    rows = evaluate(impls, problems, info, reps=args.reps, with_bwd=args.set in ("bwd", "all"))
    kind = "reference" if args.baseline else "candidate"
    summary = summarize(rows, info, kind)
    _print_table(rows, ceiling=ceiling)
    print(format_summary(summary))
    print(format_ceiling_summary(ceiling, rows, kind))
    print(f"occupancy_verified: {occupancy.all_verified()} ({len(occupancy.records())} kernels checked)")
    if args.json:
        save(rows, summary, info, args, args.json, ceiling)
    if args.plot:
        plot(rows, args.plot, f"{info.label()} -- {args.set} set")
    return summary


def _run_bwd(args, problems: list[Problem], info, ceiling: dict | None = None) -> dict:
    """--set bwd: the backward alone, candidates and references side by side (scripts/prepare_bwd.py)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import prepare_bwd

    impls = [] if args.baseline else prepare_bwd.table_candidate(info)
    if args.bwd_configs and not args.baseline:
        cands = prepare_bwd.read_bwd_candidates(args.bwd_configs)
        impls += prepare_bwd.config_candidates(info, {n: (cfg, dims) for n, (cfg, dims, det) in cands.items()
                                                      if det != "only"})
        # entries with "deterministic": true are also timed deterministic, as "<name>_det"; with "only",
        # deterministic alone (a tile for the deterministic path)
        plans = {f"{n}_det": plan for n, plan in prepare_bwd.read_det_plans(args.bwd_configs).items()}
        impls += prepare_bwd.config_candidates(info, {f"{n}_det": (cfg, dims) for n, (cfg, dims, det) in cands.items()
                                                      if det}, deterministic=True, det_plans=plans)
    if args.det_variants and not args.baseline:
        names = None if args.det_variants == "all" else set(args.det_variants.split(","))
        for impl in prepare_bwd.deterministic_variants(info, names):
            impl.supports = (lambda p, _s=impl.supports: _s(p) and args.det_subset in p.name)
            impls.append(impl)
    if args.launch_variants and not args.baseline:
        names = None if args.launch_variants == "all" else set(args.launch_variants.split(","))
        impls += prepare_bwd.launch_variants(info, names)
    if not args.no_references or args.baseline:
        refs = prepare_bwd.reference_bwd_impls(info)
        impls += [r for r in refs if args.references == "all" or r.name in args.references.split(",")]
    rows = prepare_bwd.evaluate_bwd(impls, problems, info, reps=args.reps, row_cls=Row)
    summary = summarize(rows, info, "reference" if args.baseline else "candidate")
    summary["vs_upstream_sm120"] = prepare_bwd.summary_ratios(rows, "sm120_bwd_table")
    summary["deterministic_vs_table"] = prepare_bwd.summary_ratios(rows, "sm120_bwd_table_deterministic",
                                                                   "sm120_bwd_table")
    _print_table(rows, "bwd_tflops", ceiling)
    print(format_summary(summary))
    print(format_ceiling_summary(ceiling, rows, "reference" if args.baseline else "candidate", "bwd_tflops"))
    ratios = summary["vs_upstream_sm120"]
    print(f"bwd_vs_upstream_sm120_geomean: {ratios['geomean']:.3f} (min {ratios['min']:.3f})")
    det = summary["deterministic_vs_table"]
    print(f"bwd_deterministic_vs_table_geomean: {det['geomean']:.3f} (min {det['min']:.3f})")
    for name in (*prepare_bwd.DET_VARIANTS, *prepare_bwd.LAUNCH_VARIANTS):
        if any(r.impl == name and r.status == "ok" for r in rows):
            summary[f"{name}_vs_table"] = v = prepare_bwd.summary_ratios(rows, name, "sm120_bwd_table")
            print(f"bwd_{name}_vs_table_geomean: {v['geomean']:.3f} (min {v['min']:.3f})")
    print(f"occupancy_verified: {occupancy.all_verified()} ({len(occupancy.records())} kernels checked)")
    if args.json:
        save(rows, summary, info, args, args.json, ceiling)
    return summary


def _print_table(rows: list[Row], field: str = "tflops", ceiling: dict | None = None) -> None:
    """TFLOPS per problem (rows) and implementation (columns); with a measured ceiling, each
    implementation's column is followed by an "of ceiling" column (its TFLOPS / the ceiling's)."""
    problems = list(dict.fromkeys(r.problem for r in rows))
    impls = list(dict.fromkeys(r.impl for r in rows))
    c = ceiling_tflops(ceiling)
    title = f"\n{'backward ' if field == 'bwd_tflops' else ''}TFLOPS (" + rows[0].mode + ")" if rows else ""
    print(title + (f"; of ceiling = / {c:.1f} TFLOPS GEMM ceiling" if rows and c == c else ""))
    print(f"{'problem':34s}" + "".join(f"{i[:18]:>19s}" + (f"{'of ceiling':>11s}" if c == c else "") for i in impls))
    for p in problems:
        cells = []
        for i in impls:
            r = next((r for r in rows if r.problem == p and r.impl == i), None)
            ok = r is not None and r.status == "ok"
            cells.append(f"{getattr(r, field):19.1f}" if ok else f"{(r.status if r else '-'):>19s}")
            if c == c:
                frac = of_ceiling(getattr(r, field), ceiling) if ok else float("nan")
                cells.append(f"{100 * frac:10.1f}%" if frac == frac else f"{'-':>11s}")
        print(f"{p:34s}" + "".join(cells))


def shipped_candidates(info) -> list[Impl]:
    """The shipped config table (the dispatcher's choice)."""
    return [sm120_impl("sm120_table", lambda p: None, info)]


if __name__ == "__main__":
    run(shipped_candidates)
