"""The timing harness shared by scripts/prepare.py (the research loop's fixed harness) and selftest.py.

An `Impl` is something to time; `evaluate` runs each implementation on each problem in one process:
first a correctness gate against an fp32 reference with a NaN-poisoned output (upstream's rule: at
most 2x the error of the same reference in the inputs' precision, plus 1e-3), then CUDA-event
timing over rotated inputs (bench.time_cuda). A wrong implementation is reported `incorrect` and
its time is not used. `measurement_doc` is the JSON every committed measurement has (command, GPU,
mode, date, commit, occupancy records, summary, rows). Lives in the package so that an installed
wheel (selftest) times exactly the way the repository's scripts do.
"""

from __future__ import annotations

import datetime as _dt
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

from flash_attn_sm120 import bench, occupancy, progress
from flash_attn_sm120.bench import Problem, geomean

ROOT = Path(__file__).resolve().parent.parent  # the repository root when run from a checkout


SUMMARY_KEYS = ("gpu", "mode", "correct", "fwd_tflops_peak", "fwd_tflops_geomean", "bwd_tflops_peak",
                "bwd_tflops_geomean", "peak_vram_mib")


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
             log=progress.write) -> list[Row]:
    import torch

    rows = []
    tick = progress.bar(total=len(problems) * len(impls), desc="forward benchmark", unit="run")
    for p in problems:
        n = bench.rotations_for(p)
        sets = [bench.make_inputs(p, seed=i) for i in range(n)]
        ref, bound = _reference(p, sets[0])
        for impl in impls:
            row = Row(impl.name, impl.kind, p.name, info.mode, "ok")
            if not impl.supports(p):
                row.status = "unsupported"
                rows.append(row)
                tick.update()
                continue
            try:
                out = _poisoned_out(p, sets[0]) if impl.writes_out else None
                res = impl.fwd(p, sets[0], out)
                res = out if impl.writes_out else res
                row.max_err, row.ref_err = bench.error_vs_reference(res, ref), bound
                if row.max_err > 2 * bound + 1e-3:
                    row.status = "incorrect"
                    rows.append(row)
                    tick.update()
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
            tick.update()
            log(_fmt(row))
    tick.close()
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


def _in_this_checkout() -> bool:
    """Whether this module runs from a checkout of this repository (not from site-packages)."""
    project = ROOT / "pyproject.toml"
    return (ROOT / ".git").exists() and project.is_file() and 'name = "flash-attn-sm120"' in project.read_text()


def git_commit() -> str:
    """The commit this run measures: FLASH_ATTN_SM120_COMMIT when set (a copied working tree whose .git is
    not the repository's, as on the lent GPU machine), else git's HEAD (+ "-dirty" with local changes)."""
    import subprocess

    if os.environ.get("FLASH_ATTN_SM120_COMMIT"):
        return os.environ["FLASH_ATTN_SM120_COMMIT"]
    if not _in_this_checkout():  # an installed wheel: its version, not the commit of whatever repo holds the venv
        from flash_attn_sm120 import __version__

        return f"flash_attn_sm120 {__version__} (installed)"
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except OSError:
        return "unknown"


def measurement_doc(rows: list, summary: dict, info, set_name: str, command: Optional[str] = None) -> dict:
    """The committed-measurement JSON: what ran, where, in which mode, at which commit, and the rows (dataclass
    rows, or dicts)."""
    return {
        "command": command or "python " + " ".join(sys.argv),
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "gpu": info.name, "capability": list(info.capability), "num_sms": info.num_sms, "mode": info.mode,
        "mode_label": info.label(), "set": set_name, "commit": git_commit(),
        # every SM120 kernel this run launched was checked with the CUDA occupancy API against SM120's
        # CTAs per SM (occupancy.py); the per-kernel records follow
        "occupancy_verified": occupancy.all_verified(),
        "occupancy": [r.to_dict() for r in occupancy.records()],
        "unchecked_kernels": occupancy.unchecked(),
        "summary": summary, "rows": [r if isinstance(r, dict) else asdict(r) for r in rows],
    }
