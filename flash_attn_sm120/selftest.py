"""First-run self-test for SM120 owners: `python -m flash_attn_sm120.selftest`.

What the first RTX PRO 6000 / RTX 5090 user runs, and what a GPU test runs in emulation:

  1. Correctness, one kernel family at a time, each in a child process under a watchdog (a
     timeout). A family whose child does not finish is reported as a hang, with the switch that
     keeps calls off it (FLASH_ATTN_SM120_FAMILIES). Each check is one small problem run through
     the correctness harness (testing.run_case): NaN-poisoned inputs padding and outputs, an fp32
     reference, upstream's tolerance rule; forward for every family, autograd's backward, and
     deterministic=True repeated for bitwise-identical gradients.
  2. Timing: the seed problems, the shipped config table against upstream's SM120 path (its
     kernel and default tiles, through the same driver; on a real SM120 also flash_attn.cute itself),
     side by side in this process (harness.evaluate, which gates each on the fp32 reference first).
  3. A prepare.py-format JSON (mode `sm120`, or `emulated` on another GPU) that can be committed
     under configs/measurements/, with the checks under "selftest".

  python -m flash_attn_sm120.selftest                        # checks + timing, JSON in the current dir
  python -m flash_attn_sm120.selftest --no-timing --out r.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from flash_attn_sm120.config import FAMILIES_ENV

# family -> (what disables it, if anything): the advice printed when its child hangs
ADVICE = {
    "tma": f"export {FAMILIES_ENV}=cpasync  (the table then keeps every forward on the cp.async family)",
    "cpasync": "no switch avoids it: the cp.async family is every other family's fallback; please report it",
    "splitkv": "decode-shaped calls and num_splits != 1 use it; call with num_splits=1 and seqlen_q > 16 "
               "to avoid it, and please report it",
    "backward": "autograd's backward has one family; please report it",
}


def _checks(family: str) -> list[tuple]:
    """(path name, api, AttnCase, AttnProblem) per check of one family: small, a few compiles each."""
    from flash_attn_sm120.testing import AttnCase, AttnProblem

    def Case(head_dim: int, **kw) -> AttnCase:  # q, k and v of one head dim
        return AttnCase(head_dim=head_dim, head_dim_v=head_dim, **kw)

    gqa = dict(qhead_per_kvhead=2)
    if family == "cpasync":
        return [
            ("upstream-config", "driver", Case(128, mask="causal", **gqa), AttnProblem((300,) * 2, (300,) * 2, 2)),
            ("cpasync-w8-128x96-s1", "driver", Case(64), AttnProblem((257,), (513,), 2)),
            ("cpasync-table", "public", Case(128, mask="causal", q_layout="packed", k_layout="packed",
                                                 return_lse=True, **gqa), AttnProblem((100, 37, 260), (100, 37, 260), 2)),
            ("cpasync-table", "public", Case(96, mask="local_lr"),
             AttnProblem((400,), (400,), 2, window_left=64, window_right=16)),
        ]
    if family == "tma":
        return [
            ("tma-w8-128x64-s2", "driver", Case(128, mask="causal", **gqa), AttnProblem((700,), (700,), 2)),
            ("tma-w8-128x64-s2", "driver", Case(64, mask="causal"), AttnProblem((513,) * 2, (513,) * 2, 2)),
            ("tma-w8-128x64-s2", "driver", Case(96), AttnProblem((300,), (450,), 2)),
        ]
    if family == "splitkv":
        return [
            ("splitkv-w4-64x64", "public", Case(128, qhead_per_kvhead=4, return_lse=True),
             AttnProblem((1, 1), (3000, 3000), 2, num_splits=0)),
            ("splitkv-w4-64x64", "public", Case(128, qhead_per_kvhead=4, q_layout="packed",
                                                    k_layout="paged"), AttnProblem((1, 1, 1), (900, 17, 2048), 2, num_splits=3)),
        ]
    if family == "backward":
        return [
            ("cpasync-table", "public", Case(128, mask="causal", backward=True, **gqa), AttnProblem((300,), (300,), 2)),
            ("cpasync-table", "public", Case(64, backward=True), AttnProblem((200,) * 2, (333,) * 2, 2)),
            ("cpasync-table", "public", Case(128, mask="causal", q_layout="packed", k_layout="packed",
                                                 backward=True), AttnProblem((100, 257), (100, 257), 2)),
        ]
    raise ValueError(f"unknown self-test family {family!r} (known: {', '.join(ADVICE)})")


def _deterministic_check() -> dict:
    """deterministic=True three times on GQA causal d128: the gradients must be identical bit for bit."""
    import torch

    from flash_attn_sm120 import flash_attn_func

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(s, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
               for s in ((2, 500, 8, 128), (2, 500, 2, 128), (2, 500, 2, 128)))
    dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    runs = []
    for _ in range(3):
        out, _ = flash_attn_func(q, k, v, causal=True, deterministic=True)
        runs.append(torch.autograd.grad(out, (q, k, v), dout))
    same = all(torch.equal(a, b) for r in runs[1:] for a, b in zip(runs[0], r))
    return {"check": "deterministic=True x3, GQA causal d128", "status": "ok" if same else "fail",
            "detail": "" if same else "gradients differ between runs"}


def run_child(family: str, result: Path) -> int:
    """One family's checks in this process; rows to `result` (JSON) as they finish."""
    from flash_attn_sm120 import testing

    rows = []
    for path, api, case, problem in _checks(family):
        row = {"check": f"{path} {case.label} {problem.seqlens_q}x{problem.seqlens_k}", "status": "ok", "detail": ""}
        t0 = time.perf_counter()
        try:
            stats = testing.run_case(path, api, case, problem)
            row["detail"] = json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in stats.items()})[:300]
        except Exception as e:  # a wrong result or a crash is this check's result
            row["status"], row["detail"] = "fail", f"{type(e).__name__}: {e}"[:500]
        row["seconds"] = round(time.perf_counter() - t0, 2)
        rows.append(row)
        result.write_text(json.dumps(rows))
    if family == "backward":
        try:
            rows.append(_deterministic_check())
        except Exception as e:  # a crash is this check's result, like the others'
            rows.append({"check": "deterministic=True x3, GQA causal d128", "status": "fail",
                         "detail": f"{type(e).__name__}: {e}"[:500]})
        result.write_text(json.dumps(rows))
    return 0 if all(r["status"] == "ok" for r in rows) else 1


def run_checks(families: list[str], timeout_s: float, log=print) -> list[dict]:
    """Each family in a child process; a child past timeout_s is killed and reported as a hang."""
    results = []
    for family in families:
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / "rows.json"
            cmd = [sys.executable, "-m", "flash_attn_sm120.selftest", "--child", family, "--result", str(result)]
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
                status, tail = ("ok" if proc.returncode == 0 else "fail"), proc.stderr or ""
            except subprocess.TimeoutExpired as e:  # keep what it printed before it was stopped
                status = "hang"
                tail = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
            rows = json.loads(result.read_text()) if result.exists() else []
        entry = {"family": family, "status": status, "seconds": round(time.perf_counter() - t0, 1), "checks": rows}
        if status == "hang":
            entry["advice"] = ADVICE[family]
        if status != "ok":  # a crash after passing checks leaves only this to say why
            entry["stderr_tail"] = tail[-1500:]
        results.append(entry)
        log(f"[{status:4s}] {family:9s} {entry['seconds']:7.1f} s  "
            + ", ".join(f"{r['status']}" for r in rows))
        for r in rows:
            if r["status"] != "ok":
                log(f"         {r['check']}: {r['detail']}")
        if status == "hang":
            log(f"         HANG after {timeout_s:.0f} s: {ADVICE[family]}")
    return results


def run_timing(info, reps: int, subset: str = "") -> tuple[list, dict]:
    """The seed problems: shipped table vs upstream's SM120 path (and flash_attn.cute on a real SM120)."""
    from flash_attn_sm120 import bench, harness
    from flash_attn_sm120.config import upstream_fwd_config

    impls = [harness.sm120_impl("sm120_table", lambda p: None, info),
             harness.sm120_impl("upstream_sm120", lambda p: upstream_fwd_config(max(p.head_dim, p.dv)), info,
                                "reference")]
    if info.mode == "sm120":  # upstream FA4's own call, which on SM120 is its SM120 class with its choices
        impls.append(harness.Impl("upstream_fa4", _upstream_fa4, "reference", writes_out=False))
    problems = [p for p in bench.problem_set("seed") if subset in p.name]
    rows = harness.evaluate(impls, problems, info, reps=reps)
    summary = harness.summarize(rows, info)
    by = {(r.impl, r.problem): r for r in rows if r.status == "ok"}
    ratios = [by[("sm120_table", p.name)].tflops / by[("upstream_sm120", p.name)].tflops for p in problems
              if ("sm120_table", p.name) in by and ("upstream_sm120", p.name) in by]
    summary["vs_upstream_sm120"] = {"geomean": bench.geomean(ratios), "min": min(ratios, default=float("nan"))}
    return rows, summary


def _upstream_fa4(p, x, out):
    import flash_attn.cute as fa4

    if p.is_varlen:
        return fa4.flash_attn_varlen_func(x["q"], x["k"], x["v"], cu_seqlens_q=x["cu_seqlens_q"],
                                          cu_seqlens_k=x["cu_seqlens_k"], causal=p.causal)[0]
    return fa4.flash_attn_func(x["q"], x["k"], x["v"], causal=p.causal)[0]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="Emulation on a non-SM120 GPU: FLASH_ATTN_SM120_EMULATE=1.")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON to write (default: selftest_<mode>_<date>.json in the current directory)")
    ap.add_argument("--families", default=",".join(ADVICE),
                    help=f"families to check, comma-separated (default {','.join(ADVICE)})")
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="seconds one family's checks may take, compiles included, before it counts as a hang")
    ap.add_argument("--no-timing", action="store_true", help="checks only, no seed-problem timing")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions per problem (default 20)")
    ap.add_argument("--subset", default="", help="time only seed problems whose name contains this")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: one family's checks
    ap.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return run_child(args.child, args.result)

    import torch

    if not torch.cuda.is_available():
        print("selftest: no CUDA GPU here (the CPU suite is `pytest`; this needs an SM120 GPU, or "
              "FLASH_ATTN_SM120_EMULATE=1 on an SM80+ GPU)", file=sys.stderr)
        return 2
    from flash_attn_sm120 import __version__, harness
    from flash_attn_sm120.device import device_info

    info = device_info()
    if not info.uses_sm120_kernels:
        print(f"selftest: {info.label()}: this GPU runs upstream FA4, not this package's kernels; set "
              "FLASH_ATTN_SM120_EMULATE=1 to test them in SM120 emulation", file=sys.stderr)
        return 2
    print(f"flash_attn_sm120 {__version__} self-test: {info.label()}")
    families = [f for f in args.families.split(",") if f]
    for f in families:
        _checks(f)  # unknown names fail here, before any child starts
    checks = run_checks(families, args.timeout)
    rows, summary = ([], {}) if args.no_timing else run_timing(info, args.reps, args.subset)
    passed = all(c["status"] == "ok" for c in checks) and (args.no_timing or summary.get("correct", False))
    doc = harness.measurement_doc(rows, summary, info, "seed", command="python -m flash_attn_sm120.selftest"
                                  + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:])))
    doc.update(package_version=__version__, selftest={"passed": passed, "families": checks})
    out = args.out or Path(f"selftest_{info.mode}_{time.strftime('%Y-%m-%d')}.json")
    out.write_text(json.dumps(doc, indent=1))
    if summary:
        r = summary["vs_upstream_sm120"]
        print(f"seed problems: table {summary['fwd_tflops_geomean']:.1f} TFLOPS geomean, "
              f"{r['geomean']:.3f}x upstream's SM120 path (min {r['min']:.3f}x) [{info.mode}]")
    print(f"{'PASSED' if passed else 'FAILED'}; wrote {out}")
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
