"""The fixed harness of the research loop: problem sets, timing, references, correctness gate.

Not edited by the loop (scripts/experiment.py is). Run directly for baselines:

  python scripts/prepare.py --set seed --baseline            # references only, table + summary
  python scripts/prepare.py --set seed --dry-run             # no GPU: problems + sm_120a report
  python scripts/prepare.py --set real --plot out.png        # shipped table vs references, plot

Every line states the mode: `sm120` (a real SM120 GPU) or `emulated` (SM120 kernels on another GPU,
shared memory padded to SM120 occupancy; set FLASH_ATTN_SM120_EMULATE=1 or pass --emulate). The
harness refuses to time a mode it cannot label. Each candidate is gated on every problem against
an fp32 reference with a NaN-poisoned output: a wrong candidate is reported `incorrect` and its
time is not used. The grep-able summary lines at the end are what the loop reads:

  mode: / correct: / fwd_tflops_peak: / fwd_tflops_geomean: / bwd_tflops_peak: / bwd_tflops_geomean:
  / peak_vram_mib:
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flash_attn_sm120 import bench, occupancy  # noqa: E402
from flash_attn_sm120.bench import Problem, geomean  # noqa: E402

SUMMARY_KEYS = ("gpu", "mode", "correct", "fwd_tflops_peak", "fwd_tflops_geomean", "bwd_tflops_peak",
                "bwd_tflops_geomean", "peak_vram_mib")


# ------------------------------------------------------------------------------- implementations
@dataclass
class Impl:
    """Something to time: fwd(x, out) runs the forward on inputs x (dict from bench.make_inputs),
    writing into `out` when it accepts one (gated with a NaN-poisoned out) or returning it."""

    name: str
    fwd: Callable
    kind: str = "candidate"  # "candidate" or "reference"
    writes_out: bool = True
    supports: Callable[[Problem], bool] = lambda p: True
    bwd: Optional[Callable] = None


def sm120_impl(name: str, config_for: Callable[[Problem], object], info, kind="candidate") -> Impl:
    """An implementation through this package's driver; config_for(problem) -> FwdConfig or None (table)."""
    from flash_attn_sm120 import driver

    def fwd(p, x, out):
        kw = {}
        if p.is_varlen:
            kw = dict(cu_seqlens_q=x["cu_seqlens_q"], cu_seqlens_k=x["cu_seqlens_k"])
        driver.forward(x["q"], x["k"], x["v"], softmax_scale=None, causal=p.causal, window_size_left=p.window[0],
                       window_size_right=p.window[1], softcap=None, pack_gqa=None, need_lse=False,
                       emulate_host_smem=info.emulate_host_smem, out=out, config=config_for(p), **kw)
        return out

    def bwd(p, x):
        from flash_attn_sm120 import flash_attn_func

        with driver.force_config(config_for(p)) if config_for(p) is not None else _null():
            out, _ = flash_attn_func(x["q"], x["k"], x["v"], causal=p.causal)
        return out

    return Impl(name, fwd, kind, True, bwd=bwd)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


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
@dataclass
class Row:
    impl: str
    kind: str
    problem: str
    mode: str
    status: str  # ok / incorrect / error / unsupported
    ms: float = float("nan")
    spread: float = float("nan")
    tflops: float = float("nan")
    max_err: float = float("nan")
    ref_err: float = float("nan")
    bwd_ms: float = float("nan")
    bwd_tflops: float = float("nan")
    peak_vram_mib: float = float("nan")
    detail: str = ""


def _poisoned_out(p: Problem, x):
    import torch

    q = x["q"]
    return torch.full((*q.shape[:-1], p.dv), float("nan"), dtype=q.dtype, device=q.device)


def _reference(p: Problem, x):
    """fp32 reference output and the low-precision torch error bound (per sequence for varlen)."""
    import torch

    if not p.is_varlen:
        ref, _ = bench.reference_attention(x["q"], x["k"], x["v"], causal=p.causal, window=p.window)
        low, _ = bench.reference_attention(x["q"], x["k"], x["v"], causal=p.causal, window=p.window, upcast=False)
        return ref, bench.error_vs_reference(low, ref)
    cq, ck = x["cu_seqlens_q"].tolist(), x["cu_seqlens_k"].tolist()
    ref = torch.zeros(x["q"].shape[0], x["q"].shape[1], p.dv, dtype=torch.float32, device=x["q"].device)
    bound = 0.0
    for i in range(len(cq) - 1):
        if cq[i + 1] == cq[i]:
            continue
        sl = lambda t, c: t[None, c[i]:c[i + 1]]
        r, _ = bench.reference_attention(sl(x["q"], cq), sl(x["k"], ck), sl(x["v"], ck), causal=p.causal, window=p.window)
        lo, _ = bench.reference_attention(sl(x["q"], cq), sl(x["k"], ck), sl(x["v"], ck), causal=p.causal,
                                          window=p.window, upcast=False)
        ref[cq[i]:cq[i + 1]] = r[0]
        bound = max(bound, bench.error_vs_reference(lo, r))
    return ref, bound


def evaluate(impls: list[Impl], problems: list[Problem], info, reps: int = 30, with_bwd: bool = False,
             log=print) -> list[Row]:
    import torch

    rows = []
    for p in problems:
        n = bench.rotations_for(p)
        sets = [bench.make_inputs(p, seed=i) for i in range(n)]
        ref, bound = _reference(p, sets[0])
        for impl in impls:
            row = Row(impl.name, impl.kind, p.name, info.mode, "ok")
            if not impl.supports(p):
                row.status = "unsupported"
                rows.append(row)
                continue
            try:
                out = _poisoned_out(p, sets[0]) if impl.writes_out else None
                res = impl.fwd(p, sets[0], out)
                res = out if impl.writes_out else res
                row.max_err, row.ref_err = bench.error_vs_reference(res, ref), bound
                if row.max_err > 2 * bound + 1e-3:
                    row.status = "incorrect"
                    rows.append(row)
                    log(_fmt(row))
                    continue
                outs = [_poisoned_out(p, s) if impl.writes_out else None for s in sets]
                torch.cuda.reset_peak_memory_stats()
                t = bench.time_cuda(lambda i: impl.fwd(p, sets[i], outs[i]), rotations=n, reps=reps)
                row.peak_vram_mib = torch.cuda.max_memory_allocated() / 2**20
                row.ms, row.spread = t.median_ms, t.spread
                row.tflops = bench.attention_flops(p) / t.median_ms / 1e9
                if with_bwd and impl.bwd is not None:
                    row.bwd_ms, row.bwd_tflops = _time_bwd(impl, p, reps)
            except Exception as e:  # a crashing candidate is reported, the run goes on
                row.status, row.detail = "error", f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
            log(_fmt(row))
    return rows


def _time_bwd(impl: Impl, p: Problem, reps: int):
    import torch

    x = bench.make_inputs(p, seed=99, requires_grad=True)
    out = impl.bwd(p, x)
    g = torch.randn_like(out)

    def step(i):
        for t in (x["q"], x["k"], x["v"]):
            t.grad = None
        o = impl.bwd(p, x)
        o.backward(g)

    t = bench.time_cuda(step, rotations=1, reps=max(5, reps // 3))
    fwd_t = bench.time_cuda(lambda i: impl.bwd(p, x), rotations=1, reps=max(5, reps // 3))
    bwd_ms = max(t.median_ms - fwd_t.median_ms, 1e-6)
    return bwd_ms, bench.backward_flops(p) / bwd_ms / 1e9


def _fmt(r: Row) -> str:
    t = f"{r.tflops:7.1f} TFLOPS {r.ms:8.3f} ms ±{100 * r.spread:4.1f}%" if r.status == "ok" else f"{r.status:>30s}"
    b = f" bwd {r.bwd_tflops:6.1f}" if r.bwd_tflops == r.bwd_tflops else ""
    e = f" err {r.max_err:.2e}" if r.max_err == r.max_err else ""
    return f"[{r.mode}] {r.problem:32s} {r.impl:26s} {t}{b}{e} {r.detail}"


def summarize(rows: list[Row], info, kind: str = "candidate") -> dict:
    mine = [r for r in rows if r.kind == kind]
    ok = [r for r in mine if r.status == "ok"]
    fwd = [r.tflops for r in ok]
    bwd = [r.bwd_tflops for r in ok if r.bwd_tflops == r.bwd_tflops]
    return {
        "gpu": info.name,
        "mode": info.mode,
        "correct": bool(mine) and all(r.status in ("ok", "unsupported") for r in mine),
        "fwd_tflops_peak": max(fwd, default=float("nan")),
        "fwd_tflops_geomean": geomean(fwd),
        "bwd_tflops_peak": max(bwd, default=float("nan")),
        "bwd_tflops_geomean": geomean(bwd),
        "peak_vram_mib": max((r.peak_vram_mib for r in ok), default=float("nan")),
        "max_spread": max((r.spread for r in ok), default=float("nan")),
    }


def format_summary(s: dict) -> str:
    lines = []
    for k in SUMMARY_KEYS + ("max_spread",):
        v = s[k]
        lines.append(f"{k}: {v:.2f}" if isinstance(v, float) else f"{k}: {v}")
    return "\n".join(lines)


def parse_summary(text: str) -> dict:
    """Read the summary lines back from a log (the loop's side of the contract)."""
    out = {}
    for line in text.splitlines():
        key, sep, val = line.partition(":")
        if sep and key in SUMMARY_KEYS + ("max_spread",):
            val = val.strip()
            if key in ("mode", "gpu"):
                out[key] = val
            elif key == "correct":
                out[key] = val == "True"
            else:
                try:
                    out[key] = float(val)
                except ValueError:
                    out[key] = float("nan")
    return out


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


def save(rows: list[Row], summary: dict, info, args, path: Path) -> None:
    from dataclasses import asdict

    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "command": "python " + " ".join(sys.argv),
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "gpu": info.name, "capability": list(info.capability), "num_sms": info.num_sms, "mode": info.mode,
        "mode_label": info.label(), "set": args.set, "commit": _git_commit(),
        # every SM120 kernel this run launched was checked with the CUDA occupancy API against SM120's
        # CTAs per SM (occupancy.py); the per-kernel records follow
        "occupancy_verified": occupancy.all_verified(),
        "occupancy": [r.to_dict() for r in occupancy.records()],
        "unchecked_kernels": occupancy.unchecked(),
        "summary": summary, "rows": [asdict(r) for r in rows],
    }
    path.write_text(json.dumps(doc, indent=1))


def _git_commit() -> str:
    """The commit this run measures: FLASH_ATTN_SM120_COMMIT when set (a copied working tree whose .git is
    not the repository's, as on the lent GPU machine), else git's HEAD (+ "-dirty" with local changes)."""
    import subprocess

    if os.environ.get("FLASH_ATTN_SM120_COMMIT"):
        return os.environ["FLASH_ATTN_SM120_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except OSError:
        return "unknown"


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
    ap.add_argument("--set", default="seed", help="seed | real | decode | bwd | all")
    ap.add_argument("--baseline", action="store_true", help="time the references only")
    ap.add_argument("--no-references", action="store_true", help="time the candidates only")
    ap.add_argument("--references", default="all", help="comma-separated reference names, or all")
    ap.add_argument("--emulate", action="store_true", help="SM120 emulation on a non-SM120 GPU")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: list problems, sm_120a report")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--subset", default="", help="only problems whose name contains this")
    ap.add_argument("--json", type=Path, default=None, help="write all rows and the summary here")
    ap.add_argument("--plot", type=Path, default=None, help="bar chart of TFLOPS per shape (matplotlib)")
    ap.add_argument("--bwd-configs", type=Path, default=None,
                    help="--set bwd: JSON file {name: BwdConfig fields [+ head_dims]} timed next to the table's")
    args = ap.parse_args(argv)
    problems = [p for p in bench.problem_set(args.set) if args.subset in p.name]
    if args.dry_run:
        dry_run(problems)
        return {}
    info = detect(args.emulate)
    print(f"mode: {info.mode} -- {info.label()}")
    if args.set == "bwd":
        return _run_bwd(args, problems, info)
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
    _print_table(rows)
    print(format_summary(summary))
    print(f"occupancy_verified: {occupancy.all_verified()} ({len(occupancy.records())} kernels checked)")
    if args.json:
        save(rows, summary, info, args, args.json)
    if args.plot:
        plot(rows, args.plot, f"{info.label()} -- {args.set} set")
    return summary


def _run_bwd(args, problems: list[Problem], info) -> dict:
    """--set bwd: the backward alone, candidates and references side by side (scripts/prepare_bwd.py)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import prepare_bwd

    from flash_attn_sm120.kernels.bwd_sm120 import BwdConfig

    impls = [] if args.baseline else prepare_bwd.table_candidate(info)
    if args.bwd_configs and not args.baseline:
        raw = json.loads(args.bwd_configs.read_text())
        configs = {n: (BwdConfig(**{k: v for k, v in c.items() if k != "head_dims"}), c.get("head_dims"))
                   for n, c in raw.items()}
        impls += prepare_bwd.config_candidates(info, configs)
    if not args.no_references or args.baseline:
        refs = prepare_bwd.reference_bwd_impls(info)
        impls += [r for r in refs if args.references == "all" or r.name in args.references.split(",")]
    rows = prepare_bwd.evaluate_bwd(impls, problems, info, reps=args.reps, row_cls=Row)
    summary = summarize(rows, info, "reference" if args.baseline else "candidate")
    summary["vs_upstream_sm120"] = prepare_bwd.summary_ratios(rows, "sm120_bwd_table")
    summary["deterministic_vs_table"] = prepare_bwd.summary_ratios(rows, "sm120_bwd_table_deterministic",
                                                                   "sm120_bwd_table")
    _print_table(rows, "bwd_tflops")
    print(format_summary(summary))
    ratios = summary["vs_upstream_sm120"]
    print(f"bwd_vs_upstream_sm120_geomean: {ratios['geomean']:.3f} (min {ratios['min']:.3f})")
    det = summary["deterministic_vs_table"]
    print(f"bwd_deterministic_vs_table_geomean: {det['geomean']:.3f} (min {det['min']:.3f})")
    print(f"occupancy_verified: {occupancy.all_verified()} ({len(occupancy.records())} kernels checked)")
    if args.json:
        save(rows, summary, info, args, args.json)
    return summary


def _print_table(rows: list[Row], field: str = "tflops") -> None:
    problems = list(dict.fromkeys(r.problem for r in rows))
    impls = list(dict.fromkeys(r.impl for r in rows))
    print(f"\n{'backward ' if field == 'bwd_tflops' else ''}TFLOPS (" + rows[0].mode + ")" if rows else "")
    print(f"{'problem':34s}" + "".join(f"{i[:18]:>19s}" for i in impls))
    for p in problems:
        cells = []
        for i in impls:
            r = next((r for r in rows if r.problem == p and r.impl == i), None)
            cells.append(f"{getattr(r, field):19.1f}" if r and r.status == "ok" else f"{(r.status if r else '-'):>19s}")
        print(f"{p:34s}" + "".join(cells))


def shipped_candidates(info) -> list[Impl]:
    """The shipped config table (the dispatcher's choice)."""
    return [sm120_impl("sm120_table", lambda p: None, info)]


if __name__ == "__main__":
    run(shipped_candidates)
