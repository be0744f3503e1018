"""Monotone lineage for the research loop: keep an experiment only if it is correct and faster.

  python scripts/lineage.py run --desc "8 warps for d64 causal" [--timeout 900] [--emulate]
      runs scripts/experiment.py under a time limit (log in run.log), reads prepare.py's summary,
      and appends a row to results.tsv (untracked). keep: commits scripts/experiment.py. discard /
      incorrect / crash / timeout: restores the last kept scripts/experiment.py. Nothing logged is
      ever rewritten.
  python scripts/lineage.py record --log L --desc D [--exit-code N|timeout]
      the same decision for a run of the current experiment.py made elsewhere (a lent GPU machine)
  python scripts/lineage.py list       # the kept experiments, oldest first, with their metrics
  python scripts/lineage.py promote    # write the last kept OVERRIDES into flash_attn_sm120/configs/sm120_fwd.toml

A run is kept when it is correct and its target-set geomean beats the best kept run of the same
GPU, mode and set by more than the measured spread (the larger of the two runs' 10-90% spreads,
at least MIN_GAIN). The first correct run of a (GPU, mode, set) is kept as the baseline.
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
RESULTS = ROOT / "results.tsv"
EXPERIMENT = ROOT / "scripts" / "experiment.py"
COLUMNS = ["commit", "time", "gpu", "mode", "set", "fwd_tflops_peak", "fwd_tflops_geomean", "bwd_tflops_peak",
           "bwd_tflops_geomean", "peak_vram_mib", "max_spread", "correct", "status", "description"]
MIN_GAIN = 0.01


def decide(summary: dict | None, best: dict | None, exit_code: int | None) -> tuple[str, str]:
    """(status, reason) for a finished run; pure. exit_code None = killed by the time limit."""
    if exit_code is None:
        return "crash", "timed out"
    if summary is None or "fwd_tflops_geomean" not in summary or exit_code != 0:
        return "crash", f"exit code {exit_code}, no summary"
    if not summary.get("correct", False):
        return "incorrect", "correctness gate failed"
    g = summary["fwd_tflops_geomean"]
    if not math.isfinite(g):
        return "crash", "no timed problem"
    if best is None:
        return "keep", "first correct run (baseline)"
    spread = max(MIN_GAIN, _f(summary.get("max_spread")), _f(best.get("max_spread")))
    gain = g / _f(best["fwd_tflops_geomean"]) - 1
    if gain > spread:
        return "keep", f"+{100 * gain:.1f}% > spread {100 * spread:.1f}%"
    return "discard", f"{100 * gain:+.1f}% <= spread {100 * spread:.1f}%"


def _f(x) -> float:
    try:
        v = float(x)
        return v if math.isfinite(v) else 0.0
    except (TypeError, ValueError):
        return 0.0


def read_rows(path: Path = RESULTS) -> list[dict]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f, delimiter="\t"))


def append_row(row: dict, path: Path = RESULTS) -> None:
    new = not path.exists()
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, COLUMNS, delimiter="\t", extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerow(row)


def best_kept(rows: list[dict], gpu: str, mode: str, pset: str) -> dict | None:
    kept = [r for r in rows if r["status"] == "keep" and (r["gpu"], r["mode"], r["set"]) == (gpu, mode, pset)]
    return max(kept, key=lambda r: _f(r["fwd_tflops_geomean"]), default=None)


def _git(*args) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def _load_experiment():
    import importlib.util

    sys.path.insert(0, str(ROOT))
    spec = importlib.util.spec_from_file_location("experiment", EXPERIMENT)
    exp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(exp)
    return exp


def cmd_run(args) -> int:
    cmd = [sys.executable, str(EXPERIMENT)] + (["--emulate"] if args.emulate else [])
    log = ROOT / "run.log"
    try:
        with open(log, "w") as f:
            code = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
    except subprocess.TimeoutExpired:
        code = None
    return _record(log, code, args.desc)


def cmd_record(args) -> int:
    """Record a run made elsewhere (e.g. on a lent GPU machine) of the current experiment.py."""
    code = None if args.exit_code == "timeout" else int(args.exit_code)
    return _record(Path(args.log), code, args.desc)


def _record(log: Path, code, description: str) -> int:
    from prepare import parse_summary

    exp = _load_experiment()
    pset = exp.TARGET_SET + (f":{exp.SUBSET}" if getattr(exp, "SUBSET", "") else "")
    summary = parse_summary(log.read_text()) if log.exists() else None
    gpu = (summary or {}).get("gpu", "?")
    mode = (summary or {}).get("mode", "?")
    best = best_kept(read_rows(), gpu, mode, pset)
    status, reason = decide(summary, best, code)
    desc = f"{description} ({reason})"
    commit = _git("rev-parse", "--short", "HEAD")
    if status == "keep":
        _git("add", str(EXPERIMENT))
        if _git("diff", "--cached", "--name-only"):
            _git("commit", "-m", f"experiment: {description} [{mode}, {gpu}, {pset}: "
                                 f"{summary['fwd_tflops_geomean']:.1f} TFLOPS geomean]")
        commit = _git("rev-parse", "--short", "HEAD")
    else:
        _git("checkout", "--", str(EXPERIMENT))
    row = dict(commit=commit, time=_dt.datetime.now().isoformat(timespec="seconds"), gpu=gpu, mode=mode, set=pset,
               status=status, description=desc)
    for k in COLUMNS[5:12]:
        v = (summary or {}).get(k, "")
        row[k] = f"{v:.2f}" if isinstance(v, float) else v
    append_row(row)
    print(f"{status}: {desc}")
    return 0


def cmd_list(args) -> int:
    rows = read_rows()
    kept = [r for r in rows if r["status"] == "keep"]
    print(f"{len(rows)} experiments logged, {len(kept)} kept")
    for r in kept:
        print(f"{r['commit']:>9s} {r['time']} [{r['mode']}, {r['gpu']}, {r['set']}] "
              f"{_f(r['fwd_tflops_geomean']):7.1f} TFLOPS geomean  {r['description']}")
    return 0


def cmd_promote(args) -> int:
    """Merge the kept experiment's OVERRIDES into flash_attn_sm120/configs/sm120_fwd.toml with provenance."""
    exp = _load_experiment()
    rows = [r for r in read_rows() if r["status"] == "keep"]
    if not rows:
        raise SystemExit("promote: no kept experiment in results.tsv")
    last = rows[-1]
    from flash_attn_sm120.config import FWD_TABLE_PATH

    text = FWD_TABLE_PATH.read_text()
    text = promote_text(text, exp.OVERRIDES, last)
    FWD_TABLE_PATH.write_text(text)
    print(f"promoted {len(exp.OVERRIDES)} overrides from {last['commit']} into {FWD_TABLE_PATH}")
    return 0


def promote_text(text: str, overrides: dict, row: dict) -> str:
    """The table text with entries for `overrides` replaced/added (pure; keeps other entries)."""
    import re

    blocks = re.split(r"(?m)^(?=\[\[fwd\]\])", text)
    header, entries = blocks[0], blocks[1:]
    keep = []
    for e in entries:
        hd = re.search(r"(?m)^head_dim = (\d+)", e)
        mk = re.search(r'(?m)^mask = "(\w+)"', e)
        if hd and mk and (int(hd.group(1)), mk.group(1)) in overrides:
            continue
        keep.append(e.rstrip() + "\n")
    for (bucket, mask), c in sorted(overrides.items()):
        keep.append(
            f"[[fwd]]\nhead_dim = {bucket}\nmask = \"{mask}\"\nfamily = \"{c.family}\"\nnum_threads = {c.num_threads}\n"
            f"tile_m = {c.tile_m}\ntile_n = {c.tile_n}\nnum_stages = {c.num_stages}\n"
            f"q_in_regs = {str(c.q_in_regs).lower()}\n[fwd.provenance]\ngpu = \"{row['gpu']}\"\n"
            f"mode = \"{row['mode']}\"\ndate = \"{row['time'][:10]}\"\n"
            f"tflops = {_f(row['fwd_tflops_geomean']):.1f}\n"
            f"command = \"python scripts/lineage.py run (experiment {row['commit']}, set {row['set']})\"\n"
        )
    return header.rstrip() + "\n\n" + "\n".join(keep)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--desc", required=True)
    r.add_argument("--timeout", type=int, default=900)
    r.add_argument("--emulate", action="store_true")
    rec = sub.add_parser("record", help="record a log of the current experiment.py run elsewhere")
    rec.add_argument("--log", required=True)
    rec.add_argument("--desc", required=True)
    rec.add_argument("--exit-code", default="0", help="the run's exit code, or 'timeout'")
    sub.add_parser("list")
    sub.add_parser("promote")
    args = ap.parse_args(argv)
    return {"run": cmd_run, "record": cmd_record, "list": cmd_list, "promote": cmd_promote}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
