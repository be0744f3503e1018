"""Search SM120 forward configs: enumerate, prune on sm_120a codegen, time survivors, write winners.

The SM120 counterpart of upstream's sm90_config_search.py:

  1. enumerate (threads, tile_m, tile_n, stages, Q-in-registers) per head-dim bucket and mask that
     fit SM120's 99 KB per block (`--stage enumerate`, pure);
  2. prune (`--stage prune`, CPU only): compile each for sm_120a, drop any that spills or cannot
     be resident; results go to a JSON file that later stages read;
  3. time (`--stage time`, GPU): screen every survivor on the bucket's first problem (few reps), then
     gate the best `--finalists` per group for correctness against an fp32 reference with a
     NaN-poisoned output and time them on all the bucket's problems, next to upstream's SM120
     config padded the same way; results are appended to a JSONL file one candidate at a time, so
     an interrupted search resumes where it stopped. `--gpus 0,1,..` runs one worker process per GPU;
     `--compile-workers N` compiles the survivors in N processes first (persistent cache);
  4. write (`--stage write`): the winner of each (bucket, mask) into flash_attn_sm120/configs/sm120_fwd.toml with
     provenance (GPU, mode, date, TFLOPS, reference TFLOPS, command). Upstream's config wins ties
     unless a candidate beats it by more than the measured spread.

Examples:
  python scripts/config_search.py --stage prune --out configs/measurements/search
  FLASH_ATTN_SM120_EMULATE=1 python scripts/config_search.py --stage time --out ... --gpus 0
  python scripts/config_search.py --stage write --out configs/measurements/search
"""

from __future__ import annotations

import argparse
import datetime as _dt
import itertools
import json
import multiprocessing
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flash_attn_sm120 import progress  # noqa: E402
from flash_attn_sm120.bench import Problem, geomean  # noqa: E402
from flash_attn_sm120.config import HEAD_DIM_BUCKETS, FwdConfig, upstream_fwd_config  # noqa: E402

THREADS = (128, 256)
TILE_M = (64, 128, 256)  # 256 rows only with 8 warps (32 rows per warp)
TILE_N = (32, 64, 80, 96, 112, 128)
STAGES = (1, 2, 3)
FAMILIES = ("cpasync",)  # add "tma" with --grid '{"families": ["tma"]}'
MASKS = ("none", "causal")


def enumerate_candidates(head_dim: int, grid: dict | None = None) -> list[FwdConfig]:
    """All configs of the grid that are implementable on SM120 at this head dim (pure)."""
    g = dict(threads=THREADS, tile_m=TILE_M, tile_n=TILE_N, stages=STAGES, q_in_regs=(False, True),
             families=FAMILIES)
    g.update(grid or {})
    grid_points = itertools.product(g["families"], g["threads"], g["tile_m"], g["tile_n"], g["stages"], g["q_in_regs"])
    cands = (FwdConfig(t, m, n, s, qr, family=f) for f, t, m, n, s, qr in grid_points)
    return [c for c in cands if c.error(head_dim, head_dim) is None]


def keep_after_prune(row: dict, min_warps_per_sm: int = 4) -> bool:
    """Survives codegen pruning: no spills, resident on SM120, enough warps to hide latency."""
    return (
        row["spill_bytes"] == 0
        and row["local_loads"] == 0
        and row["local_stores"] == 0
        and row["ctas_per_sm"] >= 1
        and row["warps_per_sm"] >= min_warps_per_sm
    )


def problems_for(bucket: int, mask: str) -> list[Problem]:
    """Timing problems of a bucket: the seed shapes of that head dim, else a synthetic pair."""
    from flash_attn_sm120.bench import problem_set

    causal = mask == "causal"
    seed = [p for p in problem_set("seed") if p.head_dim == bucket and p.causal == causal]
    if seed:
        return seed
    heads = 16 if bucket <= 128 else 8
    return [Problem(2, 4096, 4096, heads, heads, bucket, causal=causal, tag="search")]


def _key(cfg: FwdConfig, bucket: int, mask: str) -> str:
    return f"{bucket}/{mask}/{cfg.name}"


# -------------------------------------------------------------------------------------- prune
def _prune_one(args):
    cfg_dict, bucket, mask = args
    from flash_attn_sm120.codegen import report_row

    cfg = FwdConfig(**cfg_dict)
    try:
        row = report_row(cfg, bucket, causal=mask == "causal").to_dict()
    except Exception as e:  # a config the DSL refuses is simply not a candidate
        row = {"error": f"{type(e).__name__}: {e}"[:300]}
    row.update(bucket=bucket, mask=mask, key=_key(cfg, bucket, mask), config=cfg_dict)
    return row


def stage_prune(out: Path, buckets, masks, jobs: int, grid: dict | None) -> None:
    path = out / "prune_sm120a.jsonl"
    done = _read_keys(path)
    todo, seen = [], set(done)
    for b in buckets:
        for m in masks:
            for cfg in [upstream_fwd_config(b)] + enumerate_candidates(b, grid):
                key = _key(cfg, b, m)
                if key not in seen and cfg.error(b, b) is None:
                    seen.add(key)
                    todo.append((cfg.to_dict(), b, m))
    print(f"prune: {len(todo)} compiles for sm_120a ({len(done)} already done)", flush=True)
    run_prune(path, todo, _prune_one, jobs,
              lambda row: f"regs={row['regs']} spill={row['spill_bytes']} ctas/SM={row['ctas_per_sm']}")


def run_prune(path: Path, todo: list, worker, jobs: int, status) -> None:
    """Compile `todo` for sm_120a in `jobs` spawned processes (worker(item) -> row with a "key"), appending
    one JSON row per compile to `path` as it lands (an interrupted prune resumes); status(row) is printed."""
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_120a")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool, open(path, "a") as f:
        for i, row in enumerate(progress.bar(pool.map(worker, todo), desc="sm_120a prune", total=len(todo),
                                             unit="kernel")):
            f.write(json.dumps(row) + "\n")
            f.flush()
            progress.write(f"[{i + 1}/{len(todo)}] {row['key']}: {row['error'][:80] if 'error' in row else status(row)}")


def survivors(out: Path, min_warps_per_sm: int = 4) -> dict:
    """(bucket, mask) -> list of FwdConfig that passed pruning (upstream's config always kept)."""
    res: dict = {}
    for row in read_rows(out / "prune_sm120a.jsonl"):
        if "error" in row:
            continue
        cfg = FwdConfig(**row["config"])
        if keep_after_prune(row, min_warps_per_sm) or cfg == upstream_fwd_config(row["bucket"]):
            res.setdefault((row["bucket"], row["mask"]), []).append(cfg)
    return res


# --------------------------------------------------------------------------------------- time
def _time_candidates(out: Path, jobs: list, gpu: int, reps: int, label: str, rnd: str) -> None:
    """Time (bucket, mask, cfg, role) jobs on one GPU; append rows to times*.jsonl.

    rnd="screen": first problem of the group only, few reps, no gate (cheap ranking).
    rnd="final": correctness gate, then every problem of the group.
    """
    import torch

    from flash_attn_sm120 import bench
    from flash_attn_sm120.device import device_info

    torch.cuda.set_device(gpu)
    info = device_info(gpu)
    if not info.uses_sm120_kernels:
        raise SystemExit(f"{info.label()}: set FLASH_ATTN_SM120_EMULATE=1 to time SM120 kernels on this GPU")
    path = out / f"times{label}.jsonl"
    inputs: dict = {}
    for bucket, mask, cfg, role in progress.bar(jobs, desc=f"timing ({rnd}{label})", unit="config"):
        row = dict(key=f"{rnd}/{_key(cfg, bucket, mask)}", round=rnd, bucket=bucket, mask=mask, config=cfg.to_dict(),
                   role=role, gpu=info.name, mode=info.mode, date=_dt.date.today().isoformat(), timing="queued")
        try:
            if rnd == "final":
                row["correct"], row["max_err"], row["ref_err"] = gate(cfg, bucket, mask == "causal", info)
            if row.get("correct", True):
                probs = problems_for(bucket, mask)[: 1 if rnd == "screen" else None]
                row["problems"] = []
                for p in probs:
                    if p.name not in inputs:
                        inputs.clear()  # one problem's inputs in memory at a time
                        n = bench.rotations_for(p)
                        inputs[p.name] = [bench.make_inputs(p, seed=i) for i in range(n)]
                    t = time_problem(p, cfg, info, reps, inputs[p.name])
                    row["problems"].append(dict(name=p.name, ms=t.median_ms, spread=t.spread,
                                                tflops=bench.attention_flops(p) / t.median_ms / 1e9))
                row["geomean_tflops"] = geomean([x["tflops"] for x in row["problems"]])
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:500]
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
        status = "" if row.get("correct", True) else "INCORRECT"
        progress.write(f"{row['key']:56s} {row.get('geomean_tflops', float('nan')):8.1f} TFLOPS {status} "
                       f"{row.get('error', '')[:80]}")


def gate(cfg: FwdConfig, head_dim: int, causal: bool, info) -> tuple[bool, float, float]:
    """Correct on random data vs fp32, with the output poisoned with NaN (upstream's 2x rule).

    Uses nheads == nheads_kv so the kernel compiled for timing is the one checked.
    """
    import torch

    from flash_attn_sm120 import bench, driver

    ok, worst, worst_ref = True, 0.0, 0.0
    for (b, sq, sk, h) in ((2, 333, 517, 2), (1, 128, 128, 2), (1, 1000, 1000, 1)):
        p = Problem(b, sq, sk, h, h, head_dim, causal=causal)
        x = bench.make_inputs(p, seed=sq)
        out = torch.full((b, sq, h, p.dv), float("nan"), dtype=x["q"].dtype, device=x["q"].device)
        driver.forward(x["q"], x["k"], x["v"], softmax_scale=None, causal=causal, window_size_left=None,
                       window_size_right=None, softcap=None, pack_gqa=None, need_lse=False,
                       emulate_host_smem=info.emulate_host_smem, out=out, config=cfg)
        ref, _ = bench.reference_attention(x["q"], x["k"], x["v"], causal=causal)
        low, _ = bench.reference_attention(x["q"], x["k"], x["v"], causal=causal, upcast=False)
        err, ref_err = bench.error_vs_reference(out, ref), bench.error_vs_reference(low, ref)
        worst, worst_ref = max(worst, err), max(worst_ref, ref_err)
        ok &= err <= 2 * ref_err + 1e-3
    return ok, worst, worst_ref


def time_problem(p: Problem, cfg: FwdConfig, info, reps: int, sets: list):
    from flash_attn_sm120 import bench, driver

    def run(i):
        x = sets[i]
        driver.forward(x["q"], x["k"], x["v"], softmax_scale=None, causal=p.causal, window_size_left=None,
                       window_size_right=None, softcap=None, pack_gqa=None, need_lse=False,
                       emulate_host_smem=info.emulate_host_smem, config=cfg)

    return bench.time_cuda(run, rotations=len(sets), reps=reps)


def _precompile(args):
    cfg_dict, bucket, mask, gpu = args
    import torch

    from flash_attn_sm120 import bench, driver
    from flash_attn_sm120.device import device_info

    torch.cuda.set_device(gpu)
    info = device_info(gpu)
    p = Problem(1, 128, 128, 2, 2, bucket, causal=mask == "causal")
    x = bench.make_inputs(p)
    t = time.time()
    name = _key(FwdConfig(**cfg_dict), bucket, mask)
    try:
        driver.forward(x["q"], x["k"], x["v"], softmax_scale=None, causal=p.causal, window_size_left=None,
                       window_size_right=None, softcap=None, pack_gqa=None, need_lse=False,
                       emulate_host_smem=info.emulate_host_smem, config=FwdConfig(**cfg_dict))
        return f"{name} {time.time() - t:.1f}s"
    except Exception as e:
        return f"{name} FAILED {type(e).__name__}: {e}"[:300]


def _groups(out: Path, buckets, masks, min_warps_per_sm: int = 4, extra=(), only=()) -> dict:
    """(bucket, mask) -> configs to screen: pruning survivors, upstream's config, `extra` configs that
    survived pruning at the default warp floor (known-good shapes kept despite a higher floor)."""
    cands = survivors(out, min_warps_per_sm)
    floor = survivors(out) if extra else {}
    groups = {}
    for b in buckets:
        for m in masks:
            ups = upstream_fwd_config(b)
            group = cands.get((b, m), []) + [c for c in extra if c in floor.get((b, m), []) and c not in cands.get((b, m), [])]
            if ups.error(b, b) is None and ups not in group:
                group = [ups] + group
            if only:
                group = [c for c in group if c in only or c == ups]
            groups[(b, m)] = group
    return groups


def _run_jobs(out, jobs, gpus, reps, rnd, compile_workers):
    if not jobs:
        return
    if compile_workers > 0:
        os.environ.setdefault("FLASH_ATTN_SM120_CACHE_DIR", str(out / "kernel_cache"))
        t = time.time()
        with ProcessPoolExecutor(max_workers=compile_workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            args = [(c.to_dict(), b, m, gpus[i % len(gpus)]) for i, (b, m, c, _) in enumerate(jobs)]
            for msg in pool.map(_precompile, args):
                if "FAILED" in msg:
                    print("compile", msg, flush=True)
        print(f"precompiled {len(jobs)} kernels in {time.time() - t:.0f}s", flush=True)
    if len(gpus) == 1:
        _time_candidates(out, jobs, gpus[0], reps, "", rnd)
        return
    procs = []
    for i, g in enumerate(gpus):
        shard = out / f"shard{g}.json"
        shard.write_text(json.dumps([(b, m, c.to_dict(), r) for b, m, c, r in jobs[i :: len(gpus)]]))
        procs.append(subprocess.Popen([sys.executable, __file__, "--stage", "time-shard", "--out", str(out),
                                       "--shard", str(shard), "--gpus", str(g), "--reps", str(reps),
                                       "--round", rnd]))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"worker exit codes {codes}")


def stage_time(out: Path, buckets, masks, gpus: list[int], reps: int, compile_workers: int,
               finalists: int, screen_reps: int, min_warps_per_sm: int = 4, extra=(), only=()) -> None:
    """Screen every survivor on one problem, then gate and fully time the best `finalists` per group."""
    groups = _groups(out, buckets, masks, min_warps_per_sm, extra, only)
    done = _read_keys(out.glob("times*.jsonl"))
    screen = [(b, m, c, "upstream" if c == upstream_fwd_config(b) else "candidate")
              for (b, m), group in groups.items() for c in group if f"screen/{_key(c, b, m)}" not in done]
    print(f"screen: {len(screen)} candidates on GPUs {gpus}", flush=True)
    _run_jobs(out, screen, gpus, screen_reps, "screen", compile_workers)
    rows = [r for r in read_rows(out.glob("times*.jsonl")) if r.get("round") == "screen" and "geomean_tflops" in r]
    final = []
    for (b, m), group in groups.items():
        ranked = sorted((r for r in rows if (r["bucket"], r["mask"]) == (b, m)), key=lambda r: -r["geomean_tflops"])
        picks = [FwdConfig(**r["config"]) for r in ranked[:finalists]]
        ups = upstream_fwd_config(b)
        if ups.error(b, b) is None and ups not in picks:
            picks.append(ups)
        final += [(b, m, c, "upstream" if c == ups else "candidate") for c in picks
                  if f"final/{_key(c, b, m)}" not in done]
    print(f"final: {len(final)} candidates", flush=True)
    _run_jobs(out, final, gpus, reps, "final", 0)


# -------------------------------------------------------------------------------------- write
def pick_winners(rows: list[dict], shippable=None) -> dict:
    """(bucket, mask) -> (winner row, upstream row) among correct final rows.

    `shippable(bucket, mask, config_dict) -> bool` (default: all) excludes configs that may not ship
    (those that spill on sm_120a). Among the rest the fastest wins, except that upstream's own config
    is kept when it is shippable and the best beats it by no more than the measured spread.
    """
    by_group: dict = {}
    for r in rows:
        if r.get("round", "final") == "final" and r.get("correct") and "geomean_tflops" in r:
            by_group.setdefault((r["bucket"], r["mask"]), []).append(r)
    winners = {}
    for key, group in by_group.items():
        ups = next((r for r in group if r["role"] == "upstream"), None)
        ok = [r for r in group if shippable is None or shippable(key[0], key[1], r["config"])]
        if not ok:
            continue
        best = max(ok, key=lambda r: r["geomean_tflops"])
        if ups is not None and ups in ok and best is not ups:
            spread = max(max(x["spread"] for x in best["problems"]), max(x["spread"] for x in ups["problems"]))
            if best["geomean_tflops"] <= ups["geomean_tflops"] * (1 + spread):
                best = ups
        winners[key] = (best, ups)
    return winners


def shippable_from_prune(out: Path):
    """No spills on sm_120a (stack, local loads/stores) according to the prune file."""
    clean = set()
    for row in read_rows(out / "prune_sm120a.jsonl"):
        if "error" not in row and row["spill_bytes"] == 0 and row["local_loads"] == 0 and row["local_stores"] == 0:
            clean.add((row["bucket"], row["mask"], json.dumps(row["config"], sort_keys=True)))
    return lambda b, m, cfg: (b, m, json.dumps(cfg, sort_keys=True)) in clean


def entry_text(best: dict, ups: dict | None, command: str) -> str:
    """One [[fwd]] table entry with provenance for a winning final row (pure)."""
    c = best["config"]
    return (
        f"[[fwd]]\nhead_dim = {best['bucket']}\nmask = \"{best['mask']}\"\nfamily = \"{c['family']}\"\n"
        f"num_threads = {c['num_threads']}\ntile_m = {c['tile_m']}\ntile_n = {c['tile_n']}\n"
        f"num_stages = {c['num_stages']}\nq_in_regs = {str(c['q_in_regs']).lower()}\n"
        + ("pingpong = true\n" if c.get("pingpong") else "")
        + ("" if c.get("lpt") is None else f"lpt = {str(c['lpt']).lower()}\n")
        + f"[fwd.provenance]\ngpu = \"{best['gpu']}\"\nmode = \"{best['mode']}\"\ndate = \"{best['date']}\"\n"
        f"tflops = {best['geomean_tflops']:.1f}\n"
        + (f"upstream_tflops = {ups['geomean_tflops']:.1f}\n" if ups else "")
        + f"problems = {json.dumps([p['name'] for p in best['problems']])}\n"
        f"command = \"{command}\"\n"
    )


def table_blocks(text: str) -> dict:
    """(bucket, mask) -> the [[fwd]] entry texts of that group, in table order (pure)."""
    groups: dict = {}
    for block in re.split(r"(?m)^(?=\[\[fwd\]\])", text)[1:]:
        hd = re.search(r"(?m)^head_dim = (\d+)", block)
        mk = re.search(r'(?m)^mask = "(\w+)"', block)
        groups.setdefault((int(hd.group(1)), mk.group(1)), []).append(block.rstrip() + "\n")
    return groups


def _block_family(block: str) -> str:
    m = re.search(r'(?m)^family = "(\w+)"', block)
    return m.group(1) if m else "cpasync"  # the table's default family


def merge_table(text: str, entries: dict) -> str:
    """The table text with the (bucket, mask) -> entry text(s) of `entries` replacing or adding those
    groups; every other entry (a bucket this search did not cover) is kept as it was (pure)."""
    header, kept = re.split(r"(?m)^(?=\[\[fwd\]\])", text)[0], table_blocks(text)
    kept.update({k: [v] if isinstance(v, str) else list(v) for k, v in entries.items()})
    return header.rstrip() + "\n\n" + "\n".join(b for k in sorted(kept) for b in kept[k])


def stage_write(out: Path, toml_path: Path, command: str) -> None:
    rows = [r for f in sorted(out.glob("times*.jsonl")) for r in read_rows(f)]
    shippable = shippable_from_prune(out)
    winners = pick_winners(rows, shippable)
    # a group won by another family also lists its best cp.async config, which the dispatcher uses
    # for the calls that family refuses (varlen, GQA ratios it cannot pack, other head dims)
    cpasync = pick_winners([r for r in rows if r["config"].get("family", "cpasync") == "cpasync"], shippable)
    old_text = toml_path.read_text()
    entries = {}
    for key, (best, ups) in winners.items():
        entries[key] = [entry_text(best, ups, command)]
        if best["config"].get("family", "cpasync") == "cpasync":
            continue
        if key in cpasync:
            entries[key].append(entry_text(cpasync[key][0], ups, command))
        else:  # no cp.async finalist this round: keep the table's cp.async entry (and its provenance)
            entries[key] += [b for b in table_blocks(old_text).get(key, []) if _block_family(b) == "cpasync"]
    toml_path.write_text(merge_table(old_text, entries))
    print(f"wrote {len(entries)} entries to {toml_path}: " + ", ".join(
        f"{b}/{m}={best['config']['family']}-w{best['config']['num_threads'] // 32}-"
        f"{best['config']['tile_m']}x{best['config']['tile_n']}-s{best['config']['num_stages']}"
        for (b, m), (best, _) in sorted(winners.items())))


# ------------------------------------------------------------------------------------- helpers
def read_rows(path):
    paths = [path] if isinstance(path, Path) else list(path)
    rows = []
    for p in paths:
        if Path(p).exists():
            for line in Path(p).read_text().splitlines():
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError:
                        pass  # a line cut by an interruption
    return rows


def _read_keys(path) -> set:
    return {r["key"] for r in read_rows(path) if "key" in r}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", choices=["enumerate", "prune", "time", "time-shard", "write", "bwd-enumerate",
                                        "bwd-prune", "bwd-candidates", "bwd-write"], required=True,
                    help="forward stages, or the backward's (scripts/search_bwd.py): bwd-enumerate, bwd-prune "
                         "(sm_120a, CPU), bwd-candidates (survivors -> --bwd-candidates JSON for prepare.py "
                         "--set bwd --bwd-configs), bwd-write (--bwd-result JSON -> flash_attn_sm120/configs/sm120_bwd.toml)")
    ap.add_argument("--bwd-candidates", type=Path, help="backward candidates JSON (bwd-candidates writes, bwd-write reads)")
    ap.add_argument("--bwd-result", type=Path, help="bwd-write: the prepare.py --set bwd --json output")
    ap.add_argument("--out", type=Path, default=ROOT / "configs" / "measurements" / "search")
    ap.add_argument("--buckets", type=int, nargs="*", default=list(HEAD_DIM_BUCKETS))
    ap.add_argument("--masks", nargs="*", default=list(MASKS))
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--gpus", default="0")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--compile-workers", type=int, default=0)
    ap.add_argument("--finalists", type=int, default=4, help="fully timed candidates per group")
    ap.add_argument("--screen-reps", type=int, default=10)
    ap.add_argument("--min-warps", type=int, default=4, help="prune configs with fewer resident warps per SM")
    ap.add_argument("--extra", type=json.loads, default=[], help='JSON list of FwdConfig dicts always screened')
    ap.add_argument("--only", type=json.loads, default=[], help="JSON list of FwdConfig dicts: screen just these")
    ap.add_argument("--round", default="final")
    ap.add_argument("--shard", type=Path)
    ap.add_argument("--toml", type=Path, default=ROOT / "flash_attn_sm120" / "configs" / "sm120_fwd.toml")
    ap.add_argument("--grid", type=json.loads, default=None, help='JSON overrides, e.g. {"threads": [256]}')
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    gpus = [int(g) for g in args.gpus.split(",") if g != ""]
    if args.stage == "enumerate":
        for b in args.buckets:
            cands = enumerate_candidates(b, args.grid)
            print(f"d{b}: {len(cands)} implementable configs")
    elif args.stage.startswith("bwd-"):
        _bwd_stage(args)
    elif args.stage == "prune":
        stage_prune(args.out, args.buckets, args.masks, args.jobs, args.grid)
    elif args.stage == "time":
        stage_time(args.out, args.buckets, args.masks, gpus, args.reps, args.compile_workers, args.finalists,
                   args.screen_reps, args.min_warps, [FwdConfig(**c) for c in args.extra],
                   [FwdConfig(**c) for c in args.only])
    elif args.stage == "time-shard":
        jobs = [(b, m, FwdConfig(**c), r) for b, m, c, r in json.loads(args.shard.read_text())]
        _time_candidates(args.out, jobs, gpus[0], args.reps, f"-gpu{gpus[0]}", args.round)
    else:
        cmd = "python scripts/config_search.py --stage time --out " + os.path.relpath(args.out, ROOT)
        stage_write(args.out, args.toml, cmd)


def _bwd_stage(args) -> None:
    import search_bwd

    dims = [d for d in args.buckets if d in search_bwd.BWD_HEAD_DIMS] or list(search_bwd.BWD_HEAD_DIMS)
    masks = [m for m in args.masks if m in search_bwd.BWD_MASKS]
    out = args.out if args.out != ROOT / "configs" / "measurements" / "search" else ROOT / "configs" / "measurements" / "search_bwd"
    if args.stage == "bwd-enumerate":
        for d in dims:
            print(f"d{d}: {len(search_bwd.enumerate_bwd_candidates(d, args.grid))} implementable backward configs")
    elif args.stage == "bwd-prune":
        search_bwd.stage_prune(out, dims, masks, args.jobs, args.grid)
    elif args.stage == "bwd-candidates":
        search_bwd.stage_candidates(out, dims, args.bwd_candidates or out / "candidates.json")
    else:
        search_bwd.stage_write(args.bwd_result, args.bwd_candidates, ROOT / "flash_attn_sm120" / "configs" / "sm120_bwd.toml")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "scripts"))
    main()
