#!/usr/bin/env python3
"""compute-sanitizer (memcheck, racecheck) over a handful of shapes of every kernel family in the registry.

Each family of flash_attn_sm120.paths (the dispatcher's path counts under the family of the config
it resolves to) runs SHAPES, each adapted to what the path supports: a dense causal GQA problem,
a varlen local-window softcap problem with an empty sequence, a seqused (padded) problem with
NaN padding, a large-head-dim sliding window, and a window with a negative right side. The
dispatcher's path also runs the backward kernels (BWD_SHAPES, through autograd). Paths that support SplitKV or paged K/V also
run a split and a paged problem through the public API.

Steps:
  1. warm-up, no sanitizer: every case compiled into a persistent cache directory
     (FLASH_ATTN_SM120_CACHE_DIR) and checked against the fp32 reference with NaN-poisoned
     outputs (flash_attn_sm120.testing.check_forward);
  2. per family and tool, one `compute-sanitizer --tool <tool> --report-api-errors no` run of
     the same cases (kernels load from the cache). `--report-api-errors no` hides the CUTLASS
     DSL's cuGetProcAddress probing, which memcheck otherwise reports as host API errors;
  3. a summary table; exit status 1 on any sanitizer error or hazard, failed case, or a run
     whose summary line is missing.

On a GPU that is not SM120 the children run in SM120 emulation (FLASH_ATTN_SM120_EMULATE=1).
A small memcheck run takes ~20 s on an H200.

  python scripts/sanitize.py                            # memcheck + racecheck, every family
  python scripts/sanitize.py --tools memcheck --paths cpasync-table,cpasync-w4-64x64-s2
  python scripts/sanitize.py --list                     # the cases, no GPU needed
  python scripts/sanitize.py --shapes bwd-d128-mods-varlen,sink-alibi-gqa   # some shapes only
  python scripts/sanitize.py --shapes bwd-d128-det-none,bwd-d128-det-causal-gqa,bwd-d64-det-local,bwd-d128-det-causal-turns,bwd-d128-det-none-turns,bwd-d64-det-varlen,bwd-d96-det-seqused-causal,bwd-d128-det-varlen-gqa,bwd-d96-det-causal-turns-entry,bwd-d96-det-none-turns-entry
  python scripts/sanitize.py --child cases.json         # internal: what the sanitizer wraps
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flash_attn_sm120.paths import KernelPath, get_path, kernel_paths  # noqa: E402
from flash_attn_sm120.testing import AttnCase, AttnProblem  # noqa: E402

TOOLS = ("memcheck", "racecheck")
SHAPES = (
    ("dense-causal-gqa", AttnCase("bfloat16", 128, 128, 2, None, "causal", 0.0, True, "dense", "dense"),
     AttnProblem((150, 150), (193, 193), nheads_kv=2, pad_k=8, seed=1)),
    ("varlen-local-softcap", AttnCase("float16", 64, 64, 4, True, "local_lr", 30.0, True, "packed", "packed"),
     AttnProblem((0, 77, 130), (50, 1, 257), nheads_kv=1, window_left=32, window_right=8, seed=2)),
    ("seqused-padded", AttnCase("bfloat16", 96, 96, 1, None, "none", 0.0, False, "padded", "padded"),
     AttnProblem((65, 1), (129, 200), nheads_kv=2, pad_q=7, pad_k=13, seed=3)),
    ("large-d-window", AttnCase("bfloat16", 256, 256, 1, None, "causal_l", 0.0, True, "dense", "dense"),
     AttnProblem((130,), (130,), nheads_kv=1, window_left=50, seed=4)),
    # upstream's one-sided negative bound: keys >= 70 before the diagonal, the first rows empty
    ("negative-window", AttnCase("bfloat16", 128, 128, 2, None, "local_lr", 0.0, True, "dense", "dense"),
     AttnProblem((200,), (333,), nheads_kv=2, window_left=300, window_right=-70, seed=5)),
)
# The backward kernels (driver_bwd: the table's configs and its fallbacks), run by the dispatcher's path
# through the public API's autograd: one case per backward table entry kind plus varlen GQA and d192, the modifier
# step, and the deterministic backward's orderings.
BWD_SHAPES = (
    ("bwd-d64-causal-gqa", AttnCase("bfloat16", 64, 64, 2, None, "causal", 0.0, False, "dense", "dense", True),
     AttnProblem((150, 150), (193, 193), nheads_kv=2, seed=11)),
    ("bwd-d96-none", AttnCase("float16", 96, 96, 1, None, "none", 0.0, True, "dense", "dense", True),
     AttnProblem((130,), (200,), nheads_kv=2, seed=12)),
    ("bwd-d128-varlen-gqa-local", AttnCase("bfloat16", 128, 128, 2, None, "local_lr", 0.0, False, "packed", "packed",
                                           True),
     AttnProblem((77, 150), (90, 160), nheads_kv=1, window_left=50, window_right=-3, seed=13)),
    ("bwd-d192-causal", AttnCase("bfloat16", 192, 192, 1, None, "causal", 0.0, False, "dense", "dense", True),
     AttnProblem((100,), (130,), nheads_kv=1, seed=14)),
    # d128 without a mask: the 8-warp 32x128 entry (10 m_blocks, 3 n_blocks); d224: the 4-warp 64x32 fallback
    ("bwd-d128-none-gqa", AttnCase("bfloat16", 128, 128, 2, None, "none", 0.0, False, "dense", "dense", True),
     AttnProblem((300,), (270,), nheads_kv=2, seed=18)),
    # d128 causal GQA: the plain_only entry (8 warps 32x128, V in registers; 10 m_blocks, 3 n_blocks)
    ("bwd-d128-causal-gqa", AttnCase("bfloat16", 128, 128, 2, None, "causal", 0.0, False, "dense", "dense", True),
     AttnProblem((300,), (300,), nheads_kv=2, seed=20)),
    # the same entry on packed sequences (cu_seqlens: a plain call too)
    ("bwd-d128-causal-gqa-varlen", AttnCase("bfloat16", 128, 128, 2, None, "causal", 0.0, False, "packed", "packed",
                                            True),
     AttnProblem((300, 77), (300, 77), nheads_kv=2, seed=21)),
    ("bwd-d224-gqa", AttnCase("bfloat16", 224, 224, 2, None, "none", 0.0, False, "dense", "dense", True),
     AttnProblem((100,), (130,), nheads_kv=1, seed=19)),
    # the modifier step (kernels/bwd_mods.py): a mask_mod over an aux tensor with a score_mod pair, varlen
    ("bwd-d128-mods-varlen", AttnCase("bfloat16", 128, 128, 2, None, "none", 0.0, False, "packed", "packed", True,
                                      mods="prefix+position"),
     AttnProblem((77, 150), (90, 160), nheads_kv=1, seed=15)),
    ("bwd-d64-document-sink", AttnCase("bfloat16", 64, 64, 4, None, "causal", 0.0, True, "dense", "dense", True,
                                       sink=True, mods="document"),
     AttnProblem((150,), (150,), nheads_kv=2, seed=16)),
    # deterministic=True, several m_blocks and n_blocks so that the CTAs' additions interleave; the backward
    # runs twice, compared bit for bit. Without a modifier: no mask (d128's 32x128 tile, 10 m_blocks, 3 n_blocks:
    # fixed point, kernels/bwd_fixed_point.py), causal GQA (descending turns, ordered dK/dV); a window: descending
    # turns from the band's edge.
    ("bwd-d128-det-none", AttnCase("float16", 128, 128, 1, None, "none", 0.0, False, "dense", "dense", True,
                                   deterministic=True),
     AttnProblem((300,), (300,), nheads_kv=2, seed=20)),
    ("bwd-d128-det-causal-gqa", AttnCase("bfloat16", 128, 128, 2, None, "causal", 0.0, True, "dense", "dense", True,
                                         deterministic=True),
     AttnProblem((280,), (300,), nheads_kv=2, seed=21)),
    ("bwd-d64-det-local", AttnCase("bfloat16", 64, 64, 2, None, "local_lr", 0.0, False, "dense", "dense", True,
                                   deterministic=True),
     AttnProblem((400,), (450,), nheads_kv=1, window_left=100, window_right=30, seed=24)),
    # the d96 turns entries (8 warps 64x128, V in registers: config_bwd turns_only): causal GQA, descending
    # turns; no mask, the rotated turns (6 m_blocks, 4 n_blocks; GQA: ROTATED_ENTRIES_SERVE_GQA)
    ("bwd-d96-det-causal-turns-entry", AttnCase("bfloat16", 96, 96, 2, None, "causal", 0.0, False, "dense", "dense",
                                                True, deterministic=True),
     AttnProblem((330,), (300,), nheads_kv=1, seed=27)),
    ("bwd-d96-det-none-turns-entry", AttnCase("float16", 96, 96, 2, None, "none", 0.0, False, "dense", "dense",
                                              True, deterministic=True),
     AttnProblem((330,), (400,), nheads_kv=1, seed=28)),
    # the turn orders (kernels/bwd_deterministic.py) with a user score_mod: one per dQ ordering of
    # driver_bwd.deterministic_plan. Causal dense: descending turns, the shortest-first launch, GQA dK/dV
    ("bwd-d128-det-causal-turns", AttnCase("bfloat16", 128, 128, 2, None, "causal", 0.0, False, "dense", "dense",
                                           True, mods="position", deterministic=True),
     AttnProblem((280,), (300,), nheads_kv=2, seed=25)),
    # no mask, dense, n_blocks <= m_blocks: rotated
    ("bwd-d128-det-none-turns", AttnCase("float16", 128, 128, 1, None, "none", 0.0, False, "dense", "dense", True,
                                         mods="position", deterministic=True),
     AttnProblem((300,), (260,), nheads_kv=2, seed=26)),
    # varlen (cu_seqlens): ascending; up to 5 m_blocks and 4 n_blocks, an empty sequence, GQA
    ("bwd-d64-det-varlen", AttnCase("bfloat16", 64, 64, 2, None, "causal", 0.0, False, "packed", "packed", True,
                                    mods="position", deterministic=True),
     AttnProblem((260, 0, 130), (400, 70, 300), nheads_kv=1, seed=22)),
    # packed GQA documents without a score_mod: fixed-point dQ (its scales kernel and postprocess)
    ("bwd-d128-det-varlen-gqa", AttnCase("bfloat16", 128, 128, 2, None, "causal", 0.0, False, "packed", "packed", True,
                                         deterministic=True),
     AttnProblem((300, 0, 200), (300, 64, 250), nheads_kv=1, seed=24)),
    # a window with a user score_mod (no fixed point): descending turns from the band's right edge (dense), ascending
    # from its left edge (varlen; an empty sequence)
    ("bwd-d128-det-local-turns", AttnCase("bfloat16", 128, 128, 2, None, "local_lr", 0.0, False, "dense", "dense",
                                          True, mods="position", deterministic=True),
     AttnProblem((330,), (400,), nheads_kv=1, window_left=100, window_right=30, seed=29)),
    ("bwd-d64-det-local-varlen", AttnCase("bfloat16", 64, 64, 2, None, "causal_l", 0.0, False, "packed", "packed",
                                          True, mods="alibi", deterministic=True),
     AttnProblem((260, 0, 200), (300, 70, 200), nheads_kv=1, window_left=90, seed=30)),
    # seqused, causal: ascending turns (descending ones, counted from the used keys, would miss the grid's
    # n_blocks past them)
    ("bwd-d96-det-seqused-causal", AttnCase("float16", 96, 96, 2, None, "causal", 0.0, False, "padded", "padded",
                                            True, mods="position", deterministic=True),
     AttnProblem((200, 90), (260, 150), nheads_kv=1, pad_q=5, pad_k=9, seed=23)),
)
# the sink fold and the forward modifiers, on the first path of each family (public API, forward only)
MOD_SHAPES = (
    ("sink-alibi-gqa", AttnCase("bfloat16", 128, 128, 4, None, "causal", 0.0, True, "dense", "dense", sink=True,
                                mods="alibi"),
     AttnProblem((150, 150), (193, 193), nheads_kv=2, seed=17)),
)
# block-sparse lists (testing_sparse.CASES) on the paths that draw them (the dispatcher's): the TMA forward's
# list walk with a mask_mod over an aux tensor and GQA, and the backward's walk with Q subtiles
SPARSE_SHAPES = (
    ("bs-fwd-d128-document-gqa", AttnCase("bfloat16", 128, 128, 2, None, "none", 0.0, True, "dense", "dense",
                                          mods="document", block_sparse="random"),
     AttnProblem((300, 300), (520, 520), nheads_kv=2, seed=18)),
    # upstream's varlen lists (packed q and k/v, cu_total_m_blocks / cu_block_idx_offsets): an empty sequence and
    # one with fewer keys than a block, GQA unpacked
    ("bs-fwd-d64-varlen-gqa", AttnCase("bfloat16", 64, 64, 2, None, "causal", 0.0, True, "packed", "packed",
                                       block_sparse="random"),
     AttnProblem((300, 0, 150), (520, 64, 200), nheads_kv=2, seed=21)),
    ("bs-bwd-d64-prefix-q256", AttnCase("bfloat16", 64, 64, 1, None, "none", 0.0, True, "dense", "dense", True,
                                        mods="prefix", block_sparse="q256"),
     AttnProblem((300,), (400,), nheads_kv=2, seed=19)),
    # the backward walk with a causal mask inside its tiles, deterministic: fixed-point dQ (GQA: the dK/dV
    # epilogue in head order too)
    ("bs-bwd-d128-causal-det-gqa", AttnCase("bfloat16", 128, 128, 2, None, "causal", 0.0, False, "dense", "dense",
                                            True, block_sparse="random", deterministic=True),
     AttnProblem((300, 300), (520, 520), nheads_kv=2, seed=20)),
    # the varlen backward walk (flash_attn_varlen_func's block_sparse_tensors_bwd, packed form copied per sequence;
    # rows_end): an empty sequence, one with fewer keys than a block, GQA, a mask_mod on the partial blocks
    ("bs-bwd-d128-varlen-prefix-gqa", AttnCase("bfloat16", 128, 128, 2, None, "none", 0.0, False, "packed", "packed",
                                               True, mods="prefix", block_sparse="random"),
     AttnProblem((300, 0, 150), (520, 64, 200), nheads_kv=2, seed=22)),
)
# "========= ERROR SUMMARY: 0 errors" (memcheck and others);
# "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)" (racecheck)
ERROR_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) errors?")
RACECHECK_SUMMARY = re.compile(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)")


# ------------------------------------------------------------------------------------------------
# plan (pure)
# ------------------------------------------------------------------------------------------------


def adapt(path: KernelPath, case: AttnCase) -> AttnCase:
    """The shape's case within what the path supports (head dim, dtype, mask, layout, GQA, softcap)."""
    s = path.supports
    dims = path.head_dims()
    d = case.head_dim if case.head_dim in dims else min(dims, key=lambda x: (abs(x - case.head_dim), -x))
    mask = case.mask
    if mask != "none" and mask != "causal" and not s.local:
        mask = "causal" if s.causal else "none"
    if mask == "causal" and not s.causal:
        mask = "none"
    layout = (case.q_layout, case.k_layout) if s.allows_layout(case.q_layout, case.k_layout) else ("dense", "dense")
    pack = case.pack_gqa if s.pack_gqa else (False if case.qhead_per_kvhead > 1 else None)
    if pack and not path.packs(case.qhead_per_kvhead, d, d):
        pack = None  # the path cannot pack this call: the driver decides
    return replace(
        case, head_dim=d, head_dim_v=d, dtype=case.dtype if case.dtype in s.dtypes else s.dtypes[0], mask=mask,
        q_layout=layout[0], k_layout=layout[1], softcap=case.softcap if s.softcap else 0.0, pack_gqa=pack,
    )


def _dense(problem: AttnProblem) -> AttnProblem:
    """Equal lengths per sequence (for paths without varlen)."""
    return replace(problem, seqlens_q=(max(problem.seqlens_q),) * problem.batch,
                   seqlens_k=(max(problem.seqlens_k),) * problem.batch, pad_q=0, pad_k=0)


def build_cases(paths, families=None) -> list[dict]:
    """Every (path, shape) case to sanitize, as JSON-ready dicts, grouped by `family`."""
    cases, mod_families = [], set()
    for path in paths:
        if not path.head_dims():
            continue
        for name, case, problem in SHAPES:
            c = adapt(path, case)
            p = problem if c.q_layout != "dense" or case.q_layout == "dense" else _dense(problem)
            cases.append(_case(path, name, c, p, "driver"))
        if path.family not in mod_families:  # the first path of each kernel family
            mod_families.add(path.family)
            for name, case, problem in MOD_SHAPES:  # a SplitKV path splits (the fold is split 0's)
                p = replace(problem, num_splits=3) if path.supports.splits else problem
                cases.append(_case(path, name, adapt(path, case), p, "public"))
        if path.supports.block_sparse:
            for name, case, problem in SPARSE_SHAPES:
                c = _case(path, name, case, problem, "public")
                c["family"] = "bwd" if case.backward else "tma"
                cases.append(c)
        if path.family == "dispatch":
            for name, case, problem in BWD_SHAPES:
                c = _case(path, name, case, problem, "public")
                c["family"] = "bwd"
                cases.append(c)
        base = adapt(path, SHAPES[0][1])
        if path.supports.splits:
            cases.append(_case(path, "splitkv", base, replace(SHAPES[0][2], num_splits=3), "public"))
        if path.supports.paged:
            paged = replace(base, k_layout="paged", q_layout="dense")
            cases.append(_case(path, "paged", paged, replace(SHAPES[0][2], seqlens_k=(193, 100), page_size=64),
                               "public"))
    if families:
        cases = [c for c in cases if c["family"] in families]
    return cases


def _case(path: KernelPath, shape: str, case: AttnCase, problem: AttnProblem, api: str) -> dict:
    family = path.family
    if family == "dispatch":  # the family of the config the dispatcher picks for this problem
        family = path.resolved_config(case.head_dim, case.head_dim_v, case.causal, case.local).family
    return dict(path=path.name, family=family, shape=shape, api=api, case=asdict(case), problem=asdict(problem))


def parse_summary(tool: str, output: str) -> dict:
    """Errors (racecheck: error-level hazards) and warnings from a log; parsed=False if no summary line."""
    races = RACECHECK_SUMMARY.findall(output)
    if tool == "racecheck" and races:
        return {"parsed": True, "errors": sum(int(r[1]) for r in races), "warnings": sum(int(r[2]) for r in races)}
    errors = ERROR_SUMMARY.findall(output)
    return {"parsed": bool(errors), "errors": sum(int(n) for n in errors), "warnings": 0}


# ------------------------------------------------------------------------------------------------
# child: run the cases
# ------------------------------------------------------------------------------------------------


def run_child(cases_file: str) -> int:
    from flash_attn_sm120 import testing

    cases = json.loads(Path(cases_file).read_text())
    failed = 0
    for c in cases:
        label = f"{c['path']}/{c['shape']}"
        case = AttnCase(**c["case"])
        pd = dict(c["problem"])
        pd["seqlens_q"], pd["seqlens_k"] = tuple(pd["seqlens_q"]), tuple(pd["seqlens_k"])
        problem = AttnProblem(**pd)
        try:
            stats = testing.run_case(c["path"], c["api"], case, problem)
            det = ", 2 backward runs bitwise equal" if "bitwise" in stats else ""
            print(f"SANITIZE-CASE ok {label} ({case.label}) out err {stats['out']['err']:.2e}{det}", flush=True)
        except Exception as e:  # report every case, then fail
            failed += 1
            print(f"SANITIZE-CASE FAIL {label} ({case.label}): {type(e).__name__}: {e}", flush=True)
    print(f"SANITIZE-CHILD done cases={len(cases)} failed={failed}", flush=True)
    return 1 if failed else 0


# ------------------------------------------------------------------------------------------------
# parent
# ------------------------------------------------------------------------------------------------


def find_sanitizer(explicit: str | None) -> str:
    for candidate in (explicit, shutil.which("compute-sanitizer"), "/usr/local/cuda/bin/compute-sanitizer",
                      *sorted(Path("/usr/local").glob("cuda*/bin/compute-sanitizer"), reverse=True)):
        if candidate and Path(candidate).exists():
            return str(candidate)
    raise SystemExit("compute-sanitizer not found: pass --sanitizer PATH")


def _run(cmd: list[str], env: dict, log: Path, timeout: float) -> tuple[int, str, float]:
    start = time.time()
    try:
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout)
        rc, out = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as e:
        partial = e.stdout or ""
        rc, out = 124, (partial.decode(errors="replace") if isinstance(partial, bytes) else partial)
        out += f"\nTIMEOUT after {timeout:.0f} s (a hang?)\n"
    log.write_text(out)
    return rc, out, time.time() - start


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tools", default=",".join(TOOLS), help="comma list of compute-sanitizer tools")
    ap.add_argument("--families", default="", help="comma list of kernel families (default: all)")
    ap.add_argument("--paths", default="", help="comma list of registry paths (default: all)")
    ap.add_argument("--shapes", default="", help="comma list of shape names, e.g. bwd-d128-mods-varlen (default: all)")
    ap.add_argument("--sanitizer", default=None, help="compute-sanitizer binary")
    ap.add_argument("--log-dir", default=None, help="where the logs go (default: a temporary directory)")
    ap.add_argument("--timeout", type=float, default=480, help="seconds per run (a hang is reported as such)")
    ap.add_argument("--no-warmup", action="store_true", help="skip the uninstrumented compile/check run")
    ap.add_argument("--list", action="store_true", help="print the cases and exit")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return run_child(args.child)

    paths = kernel_paths()
    if args.paths:
        wanted = args.paths.split(",")
        paths = [get_path(n) for n in wanted]
    families = set(args.families.split(",")) if args.families else None
    cases = build_cases(paths, families)
    if args.shapes:
        shapes = set(args.shapes.split(","))
        known = {name for name, _, _ in SHAPES + BWD_SHAPES + MOD_SHAPES + SPARSE_SHAPES} | {"splitkv", "paged"}
        if shapes - known:
            raise SystemExit(f"unknown shapes {sorted(shapes - known)}; known: {sorted(known)}")
        cases = [c for c in cases if c["shape"] in shapes]
    groups: dict[str, list] = {}
    for c in cases:
        groups.setdefault(c["family"], []).append(c)
    if args.list or not cases:
        for fam, cs in groups.items():
            print(f"{fam}: {len(cs)} cases")
            for c in cs:
                print(f"  {c['path']:<28} {c['shape']:<22} {c['api']:<7} {AttnCase(**c['case']).label}")
        return 0 if cases else 1

    tools = [t for t in args.tools.split(",") if t]
    sanitizer = find_sanitizer(args.sanitizer)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="sanitize-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("FLASH_ATTN_SM120_EMULATE", "1")  # ignored on a real SM120
    env.setdefault("FLASH_ATTN_SM120_CACHE_DIR", tempfile.mkdtemp(prefix="sanitize-kernels-"))  # not in the logs
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    me = [sys.executable, str(Path(__file__).resolve())]
    rows, bad = [], 0
    for fam, cs in groups.items():
        cases_file = log_dir / f"{fam}.cases.json"
        cases_file.write_text(json.dumps(cs))
        if not args.no_warmup:
            rc, out, secs = _run(me + ["--child", str(cases_file)], env, log_dir / f"{fam}.warmup.log", args.timeout)
            ok = rc == 0 and "SANITIZE-CHILD done" in out
            rows.append((fam, "warm-up", len(cs), "ok" if ok else f"FAILED rc={rc}", secs))
            if not ok:
                bad += 1
                print(out[-4000:])
                continue  # a case that fails uninstrumented is reported as such, not sanitized
        for tool in tools:
            cmd = [sanitizer, "--tool", tool, "--report-api-errors", "no", "--print-limit", "50"] + me
            rc, out, secs = _run(cmd + ["--child", str(cases_file)], env, log_dir / f"{fam}.{tool}.log", args.timeout)
            s = parse_summary(tool, out)
            done = "SANITIZE-CHILD done" in out
            ok = s["parsed"] and s["errors"] == 0 and done and rc == 0
            found = f"{s['errors']} errors" + (f", {s['warnings']} warnings" if s["warnings"] else "")
            status = ("ok" if ok else "FAILED") + (f" ({found})" if s["parsed"] else " (no summary line)")
            if not ok:
                status += f" rc={rc}" + ("" if done else ", child did not finish")
            rows.append((fam, tool, len(cs), status, secs))
            if not ok:
                bad += 1
                print(out[-6000:])
    print(f"\ncompute-sanitizer summary (logs: {log_dir})")
    print(f"{'family':<12} {'run':<10} {'cases':>5}  {'seconds':>7}  result")
    for fam, tool, n, status, secs in rows:
        print(f"{fam:<12} {tool:<10} {n:>5}  {secs:>7.0f}  {status}")
    print("SANITIZE " + ("FAILED" if bad else "PASSED"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
