"""The backward stage of the SM120 config search: enumerate BwdConfigs, prune on sm_120a, time, write.

Called by scripts/config_search.py (`--stage bwd-enumerate|bwd-prune|bwd-time|bwd-write`).

  1. enumerate: per head dim, the grid of threads (4 or 8 warps), m/n tiles, Q and dO stages, warp
     atom layouts, one swapAB flag at a time, and V in registers, kept where
     `kernels.bwd_tiling.bwd_config_error` accepts it (layouts divide, <= 101,376 B of shared memory);
  2. prune (CPU): compile each for sm_120a and keep those with no spills (no stack, no LDL/STL) and at
     least one CTA per SM. Upstream's own SM120 config is always kept: it is the reference;
  3. time (GPU, emulation or SM120): each survivor's full backward (preprocess, main kernel,
     postprocess) on the bucket's problems, after an fp32 gradient check with poisoned outputs,
     next to upstream's config run the same way (`driver_bwd.backward` with `config=`);
  4. write: the fastest per (head dim, mask) into flash_attn_sm120/configs/sm120_bwd.toml with provenance.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from config_search import read_rows, run_prune
from prepare_bwd import read_bwd_candidates

from flash_attn_sm120.kernels.bwd_tiling import BwdConfig, bwd_config_error, upstream_bwd_config

ROOT = Path(__file__).resolve().parent.parent

BWD_HEAD_DIMS = (64, 96, 128)
TABLE = "sm120_bwd_table"  # the shipped table's own row in a prepare.py --set bwd run
BWD_MASKS = ("none", "causal")
# A judged grid, not the full product (that is ~1,800-4,700 points per head dim, each a ~20 s compile):
# tiles that 99 KB can hold at d <= 128, FA2's warp atom layouts for the warp count (S/dP, dK/dV, dQ
# warps along M, N, M), Q/dO stages, V in registers; swapAB one flag at a time on the default atoms.
TILES = {128: ((64, 64), (64, 128), (128, 64)), 256: ((64, 64), (64, 128), (128, 64), (128, 128))}
ATOMS = {128: ((4, 4, 4), (2, 4, 2), (2, 2, 2)), 256: ((2, 4, 2), (4, 4, 4), (2, 8, 2), (4, 8, 4), (2, 4, 4))}
STAGES = ((1, 1), (2, 2), (2, 1))
SWAPS = ((True, False, False), (False, True, False), (False, False, True))
# P/dS in registers (BwdConfig.pds_in_regs): S/dP swapped, every warp along the keys; dQ atoms free
RS_ATOMS = {128: ((1, 4, 2), (1, 4, 4)), 256: ((1, 8, 2), (1, 8, 4))}


def enumerate_bwd_candidates(head_dim: int, grid: dict | None = None) -> list[BwdConfig]:
    """Every point of the grid SM120 can run at this head dim (pure), without duplicates."""
    g = dict(threads=(128, 256), tiles=TILES, atoms=ATOMS, stages=STAGES, swaps=SWAPS, v_in_regs=(False, True),
             rs_atoms=RS_ATOMS)
    g.update(grid or {})
    cands = []
    for t in g["threads"]:
        for (m, n), (sq, sdo), atoms in itertools.product(g["tiles"][t], g["stages"], g["rs_atoms"].get(t, ())):
            cands.append(BwdConfig(t, m, n, sq, sdo, True, False, False, *atoms, False))
        for (m, n), (sq, sdo), vreg, atoms in itertools.product(g["tiles"][t], g["stages"], g["v_in_regs"],
                                                                 g["atoms"][t]):
            cands.append(BwdConfig(t, m, n, sq, sdo, False, False, False, *atoms, vreg))
            if atoms == g["atoms"][t][0] and (sq, sdo) == (1, 1) and not vreg:
                cands += [BwdConfig(t, m, n, 1, 1, *sw, *atoms, False) for sw in g["swaps"]]
    out = []
    for c in cands:
        if c not in out and bwd_config_error(head_dim, head_dim, c) is None:
            out.append(c)
    return out


def keep_after_prune(row: dict) -> bool:
    return (row["spill_bytes"] == 0 and row["local_loads"] == 0 and row["local_stores"] == 0
            and row["ctas_per_sm"] >= 1)


def _key(cfg: BwdConfig, head_dim: int, mask: str) -> str:
    return f"{head_dim}/{mask}/{cfg.name}"


def _prune_one(args):
    cfg_dict, head_dim, mask = args
    from flash_attn_sm120.codegen import bwd_report_row

    cfg = BwdConfig(**cfg_dict)
    try:
        row = bwd_report_row(cfg, head_dim, causal=mask == "causal").to_dict()
    except Exception as e:  # a config the DSL refuses is not a candidate
        row = {"error": f"{type(e).__name__}: {e}"[:300]}
    row.update(head_dim=head_dim, mask=mask, key=_key(cfg, head_dim, mask), config=cfg_dict)
    return row


def prune_todo(head_dims, masks, grid: dict | None, done: set, limit: int | None = None) -> list:
    todo, seen = [], set(done)
    for d in head_dims:
        for m in masks:
            cands = [upstream_bwd_config(d)] + enumerate_bwd_candidates(d, grid)
            for cfg in cands[:limit] if limit else cands:
                key = _key(cfg, d, m)
                if key not in seen:
                    seen.add(key)
                    todo.append((cfg.to_dict(), d, m))
    return todo


def stage_prune(out: Path, head_dims, masks, jobs: int, grid: dict | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bwd_prune_sm120a.jsonl"
    done = {r["key"] for r in read_rows(path)}
    todo = prune_todo(head_dims, masks, grid, done)
    print(f"bwd prune: {len(todo)} compiles for sm_120a ({len(done)} already done)", flush=True)
    run_prune(path, todo, _prune_one, jobs,
              lambda row: f"regs={row['regs']} spill={row['spill_bytes']} smem={row['smem_bytes']} "
                          f"ctas/SM={row['ctas_per_sm']}")


def survivors(out: Path) -> dict:
    """(head_dim, mask) -> BwdConfigs that passed pruning (upstream's config always kept, first)."""
    res: dict = {}
    for row in read_rows(out / "bwd_prune_sm120a.jsonl"):
        if "error" in row:
            continue
        cfg = BwdConfig(**row["config"])
        if keep_after_prune(row) or cfg == upstream_bwd_config(row["head_dim"]):
            res.setdefault((row["head_dim"], row["mask"]), []).append(cfg)
    return res


# ------------------------------------------------------------------------- candidates and write
def stage_candidates(out: Path, head_dims, path: Path, per_dim: int = 6) -> dict:
    """The survivors, as the JSON `prepare.py --set bwd --bwd-configs` reads: per head dim, the
    `per_dim` with the fewest registers among distinct (warps, tile, stages) shapes first."""
    from dataclasses import asdict

    surv = survivors(out)
    doc = {}
    for d in head_dims:
        cfgs = [c for c in surv.get((d, "none"), []) if c != upstream_bwd_config(d)]
        seen, picked = set(), []
        for c in cfgs:  # one per shape first, then the rest in prune order
            shape = (c.num_threads, c.m_block, c.n_block, c.stages_q, c.stages_do)
            if shape not in seen:
                seen.add(shape)
                picked.append(c)
        picked += [c for c in cfgs if c not in picked]
        for i, c in enumerate(picked[:per_dim]):
            doc[f"d{d}-{i}"] = dict(asdict(c), head_dims=[d])
    path.write_text(json.dumps(doc, indent=0))
    print(f"{len(doc)} candidates -> {path}")
    return doc


def pick_bwd_winners(doc: dict, candidates: dict) -> dict:
    """(bucket, mask) -> (BwdConfig, name, [(problem, tflops, upstream_tflops)]) from a prepare.py --set bwd JSON,
    or None where the shipped table's own row ("sm120_bwd_table") is at least as fast (its entry stays).

    A candidate must be correct on every problem of its key; the best geomean wins, and upstream's
    own config, or the table's entry, is kept unless the winner beats it by more than the larger
    timing spread. Deterministic rows (`<name>_det`) are not table candidates."""
    from flash_attn_sm120.bench import geomean
    from flash_attn_sm120.config import head_dim_bucket

    ok = [r for r in doc["rows"] if r["status"] == "ok"]
    problems: dict = {}
    for r in ok:
        name, prob = r["impl"], r["problem"]
        d = int(prob.split("d")[-1].split("-")[0])
        key = (head_dim_bucket(d, d), "causal" if prob.endswith("-causal") else "none")
        problems.setdefault(key, {}).setdefault(prob, {})[name] = r
    winners = {}
    for key, by_prob in problems.items():
        names = set.intersection(*(set(v) for v in by_prob.values()))
        names = {n for n in names if n in candidates or n in ("upstream_sm120", TABLE)}
        score = {n: geomean([by_prob[p][n]["bwd_tflops"] for p in by_prob]) for n in names}
        best = max(score, key=score.get)
        for incumbent in (TABLE, "upstream_sm120"):
            if best not in (TABLE, "upstream_sm120") and incumbent in score:
                spread = max(max(by_prob[p][best]["spread"], by_prob[p][incumbent]["spread"]) for p in by_prob)
                if score[best] <= score[incumbent] * (1 + spread):
                    best = incumbent
        if best == TABLE:
            winners[key] = None
            continue
        cfg = upstream_bwd_config(key[0]) if best == "upstream_sm120" else candidates[best]
        rows = [(p, by_prob[p][best]["bwd_tflops"], by_prob[p].get("upstream_sm120", {}).get("bwd_tflops"))
                for p in sorted(by_prob)]
        winners[key] = (cfg, best, rows)
    return winners


def entry_text(bucket: int, mask: str, cfg: BwdConfig, name: str, rows, gpu: str, mode: str, date: str,
               command: str) -> str:
    from dataclasses import asdict

    lines = ["[[bwd]]", f"head_dim = {bucket}", f'mask = "{mask}"']
    lines += [f"{k} = {str(v).lower() if isinstance(v, bool) else v}" for k, v in asdict(cfg).items()]
    fmt = lambda xs: ", ".join(f"{x:.1f}" if isinstance(x, float) else f'"{x}"' for x in xs)  # noqa: E731
    lines += ["[bwd.provenance]", f'gpu = "{gpu}"', f'mode = "{mode}"', f'date = "{date}"',
              f"tflops = [{fmt([r[1] for r in rows])}]", f"upstream_tflops = [{fmt([r[2] for r in rows])}]",
              f"problems = [{fmt([r[0] for r in rows])}]", f'candidate = "{name}"', f'command = "{command}"']
    return "\n".join(lines)


def stage_write(result: Path, candidates_path: Path, toml_path: Path) -> None:
    """Write the winners of a prepare.py --set bwd JSON into the backward table (header kept). Entries
    of keys the run did not time, or where the table's own row won, stay as they are."""
    doc = json.loads(result.read_text())
    cands = {n: cfg for n, (cfg, _, _) in read_bwd_candidates(candidates_path).items()}
    winners = pick_bwd_winners(doc, cands)
    text = toml_path.read_text()
    header, *old_blocks = text.split("\n[[bwd]]")
    blocks = {}
    for b in old_blocks:
        b = "[[bwd]]" + b.rstrip()
        entry = tomllib.loads(b)["bwd"][0]
        # modifier, plain-MHA, plain and turns entries stay
        key = (entry["head_dim"], entry["mask"], entry.get("modifiers", False), entry.get("plain_mha_only", False),
               entry.get("plain_only", False), entry.get("turns_only", False))
        blocks[key] = b
    # the run's own command, with the files it read and wrote as committed in the repository
    command = re.sub(r"--bwd-configs \S+", f"--bwd-configs {os.path.relpath(candidates_path, ROOT)}", doc["command"])
    command = re.sub(r"--json \S+", f"--json {os.path.relpath(result, ROOT)}", command)
    for (b, m), won in winners.items():
        if won is not None:
            blocks[(b, m, False, False, False, False)] = entry_text(b, m, *won, doc["gpu"], doc["mode"], doc["date"][:10], command)
    order = sorted(blocks, key=lambda k: (k[0], {"causal": 0, "none": 1}.get(k[1], 2), k[1], k[2], not k[3]))
    toml_path.write_text(header.rstrip() + "\n\n" + "\n\n".join(blocks[k] for k in order) + "\n")
    for (b, m), won in sorted(winners.items()):
        print(f"d{b} {m}: " + ("the table's entry stays" if won is None else f"{won[1]} {won[0].name}"))
