"""The backward stage of the SM120 config search: enumerate BwdConfigs, prune on sm_120a, time, write.

Called by scripts/config_search.py (`--stage bwd-enumerate|bwd-prune|bwd-time|bwd-write`).

  1. enumerate: per head dim, the grid of threads (4 or 8 warps), m/n tiles, Q and dO stages, warp
     atom layouts, one swapAB flag at a time, and V in registers, kept where
     `kernels.bwd_sm120.bwd_config_error` accepts it (layouts divide, <= 101,376 B of shared memory);
  2. prune (CPU): compile each for sm_120a and keep those with no spills (no stack, no LDL/STL) and at
     least one CTA per SM. Upstream's own SM120 config is always kept: it is the reference;
  3. time (GPU, emulation or SM120): each survivor's full backward (preprocess, main kernel,
     postprocess) on the bucket's problems, after an fp32 gradient check with poisoned outputs,
     next to upstream's config run the same way (`driver_bwd.backward` with `config=`);
  4. write: the fastest per (head dim, mask) into configs/sm120_bwd.toml with provenance.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from flash_attn_sm120.kernels.bwd_sm120 import BwdConfig, bwd_config_error, upstream_bwd_config

BWD_HEAD_DIMS = (64, 96, 128)
BWD_MASKS = ("none", "causal")
# A judged grid, not the full product (that is ~1,800-4,700 points per head dim, each a ~20 s compile):
# tiles that 99 KB can hold at d <= 128, FA2's warp atom layouts for the warp count (S/dP, dK/dV, dQ
# warps along M, N, M), Q/dO stages, V in registers; swapAB one flag at a time on the default atoms.
TILES = {128: ((64, 64), (64, 128), (128, 64)), 256: ((64, 64), (64, 128), (128, 64), (128, 128))}
ATOMS = {128: ((4, 4, 4), (2, 4, 2), (2, 2, 2)), 256: ((2, 4, 2), (4, 4, 4), (2, 8, 2), (4, 8, 4), (2, 4, 4))}
STAGES = ((1, 1), (2, 2), (2, 1))
SWAPS = ((True, False, False), (False, True, False), (False, False, True))


def enumerate_bwd_candidates(head_dim: int, grid: dict | None = None) -> list[BwdConfig]:
    """Every point of the grid SM120 can run at this head dim (pure), without duplicates."""
    g = dict(threads=(128, 256), tiles=TILES, atoms=ATOMS, stages=STAGES, swaps=SWAPS, v_in_regs=(False, True))
    g.update(grid or {})
    cands = []
    for t in g["threads"]:
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
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_120a")
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool, open(path, "a") as f:
        for i, row in enumerate(pool.map(_prune_one, todo)):
            f.write(json.dumps(row) + "\n")
            f.flush()
            status = row["error"][:80] if "error" in row else (
                f"regs={row['regs']} spill={row['spill_bytes']} smem={row['smem_bytes']} ctas/SM={row['ctas_per_sm']}")
            print(f"[{i + 1}/{len(todo)}] {row['key']}: {status}", flush=True)


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


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
