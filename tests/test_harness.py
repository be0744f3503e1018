"""CPU tests of the research harness: problem sets, FLOP counts, summary parsing, lineage decisions,
config-search enumeration / pruning / winner selection, and the no-GPU behaviour of prepare.py."""

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest

from flash_attn_sm120 import bench
from flash_attn_sm120.bench import Problem
from flash_attn_sm120.config import FwdConfig, upstream_fwd_config

ROOT = Path(__file__).resolve().parent.parent


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "scripts"))
    sys.modules[name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


prepare = _load("prepare")
lineage = _load("lineage")
search = _load("config_search")


# ------------------------------------------------------------------------------------ problem sets
def test_seed_set_is_the_issue_list():
    names = [p.name for p in bench.problem_set("seed")]
    for base in ("b1s8192h16d128", "b2s4096h16d128", "b2s4096h16d96", "b4s2048h32d64"):
        assert base in names and base + "-causal" in names
    assert len(names) == 8


def test_sets_cover_their_promises():
    real = bench.problem_set("real")
    assert any(p.nheads // p.nheads_kv == 8 for p in real) and any(p.nheads // p.nheads_kv == 4 for p in real)
    assert {p.head_dim for p in real} >= {64, 128, 256}
    assert min(p.seqlen_q for p in real if not p.is_varlen) == 512
    assert max(p.seqlen_q for p in real if not p.is_varlen) == 32768
    assert any(p.is_varlen for p in real)
    decode = bench.problem_set("decode")
    assert {p.seqlen_q for p in decode} <= set(range(1, 17)) and max(p.seqlen_k for p in decode) == 131072
    assert all(p.nheads_kv < p.nheads for p in decode)
    assert len(bench.problem_set("all")) == sum(len(bench.problem_set(s)) for s in ("seed", "real", "decode", "bwd"))
    with pytest.raises(ValueError, match="unknown problem set"):
        bench.problem_set("nope")


def test_flops():
    p = Problem(2, 1024, 1024, 8, 8, 128)
    assert bench.attention_flops(p) == 4 * 2 * 8 * 1024 * 1024 * 128
    causal = Problem(2, 1024, 1024, 8, 8, 128, causal=True)
    assert bench.attention_flops(causal) == bench.attention_flops(p) / 2  # causal counted as half
    assert bench.backward_flops(p) == 2.5 * bench.attention_flops(p)
    # window (0, 0): one key per query
    diag = Problem(1, 64, 64, 1, 1, 64, window=(0, 0))
    assert bench.attention_flops(diag) == 2 * 1 * (64 + 64) * 64
    # varlen sums its sequences
    v = Problem(2, 0, 0, 4, 4, 64, seqlens_q=(10, 20), seqlens_k=(10, 20))
    assert bench.attention_flops(v) == 2 * 4 * 128 * (100 + 400)
    assert bench.kv_bytes(Problem(1, 1, 4096, 32, 8, 128)) == 4096 * 8 * 256 * 2


def test_timing_summary_and_geomean():
    t = bench.summarize_times([1.0] * 8 + [2.0, 0.5])
    assert t.median_ms == 1.0 and t.reps == 10 and t.spread > 0
    assert math.isclose(bench.geomean([2, 8]), 4)
    assert math.isnan(bench.geomean([]))
    assert bench.rotations_for(Problem(1, 128, 128, 1, 1, 64)) == 8  # tiny inputs: many copies
    assert bench.rotations_for(Problem(1, 8192, 8192, 16, 16, 128)) == 2


# -------------------------------------------------------------------------------- summary parsing
def test_summary_round_trip():
    class Info:
        name, mode = "NVIDIA H200", "emulated"

    rows = [prepare.Row("experiment", "candidate", "p1", "emulated", "ok", ms=1.0, spread=0.02, tflops=100.0,
                        peak_vram_mib=10.0),
            prepare.Row("experiment", "candidate", "p2", "emulated", "ok", ms=1.0, spread=0.01, tflops=400.0,
                        peak_vram_mib=20.0),
            prepare.Row("upstream_sm120", "reference", "p1", "emulated", "ok", tflops=50.0)]
    s = prepare.summarize(rows, Info)
    assert s["fwd_tflops_geomean"] == pytest.approx(200.0) and s["fwd_tflops_peak"] == 400.0
    assert s["correct"] is True and s["peak_vram_mib"] == 20.0 and s["max_spread"] == 0.02
    back = prepare.parse_summary("noise\n" + prepare.format_summary(s) + "\ntrailing: x\n")
    assert back["gpu"] == "NVIDIA H200" and back["mode"] == "emulated" and back["correct"] is True
    assert back["fwd_tflops_geomean"] == pytest.approx(200.0) and math.isnan(back["bwd_tflops_geomean"])
    rows[1].status = "incorrect"
    assert prepare.summarize(rows, Info)["correct"] is False


def test_prepare_without_gpu_exits_with_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "prepare.py"), "--set", "seed"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode != 0
    assert "no CUDA GPU" in r.stderr.strip().splitlines()[-1]


# ------------------------------------------------------------------------------------- lineage
BEST = {"fwd_tflops_geomean": 100.0, "max_spread": 0.02}


@pytest.mark.parametrize("summary,code,status", [
    ({"correct": True, "fwd_tflops_geomean": 105.0, "max_spread": 0.01}, 0, "keep"),
    ({"correct": True, "fwd_tflops_geomean": 101.5, "max_spread": 0.01}, 0, "discard"),  # within spread
    ({"correct": True, "fwd_tflops_geomean": 90.0, "max_spread": 0.01}, 0, "discard"),
    ({"correct": False, "fwd_tflops_geomean": 500.0, "max_spread": 0.01}, 0, "incorrect"),
    ({"correct": True, "fwd_tflops_geomean": 500.0}, 1, "crash"),
    (None, 0, "crash"),
    ({"correct": True, "fwd_tflops_geomean": float("nan")}, 0, "crash"),
    ({"correct": True, "fwd_tflops_geomean": 500.0}, None, "crash"),  # timed out
])
def test_decide(summary, code, status):
    assert lineage.decide(summary, BEST, code)[0] == status


def test_decide_first_run_is_baseline_and_spread_is_the_larger():
    assert lineage.decide({"correct": True, "fwd_tflops_geomean": 1.0}, None, 0)[0] == "keep"
    noisy = {"correct": True, "fwd_tflops_geomean": 104.0, "max_spread": 0.05}
    assert lineage.decide(noisy, BEST, 0)[0] == "discard"  # +4% inside the candidate's 5% spread


def test_best_kept_and_rows(tmp_path):
    path = tmp_path / "results.tsv"
    for g, status, pset in [(100, "keep", "seed"), (120, "discard", "seed"), (110, "keep", "seed"), (500, "keep", "real")]:
        lineage.append_row(dict(commit="c", time="t", gpu="G", mode="emulated", set=pset, fwd_tflops_geomean=g,
                                status=status, description="d"), path)
    rows = lineage.read_rows(path)
    assert len(rows) == 4
    assert float(lineage.best_kept(rows, "G", "emulated", "seed")["fwd_tflops_geomean"]) == 110
    assert lineage.best_kept(rows, "G", "sm120", "seed") is None


def test_promote_text_replaces_only_overridden_entries():
    text = ('schema = 1\n\n[[fwd]]\nhead_dim = 64\nmask = "none"\nnum_threads = 128\n\n'
            '[[fwd]]\nhead_dim = 128\nmask = "causal"\nnum_threads = 128\n')
    row = dict(gpu="G", mode="emulated", time="2026-11-29T00:00:00", fwd_tflops_geomean="123.4", commit="abc", set="seed")
    out = lineage.promote_text(text, {(128, "causal"): FwdConfig(256, 128, 96, 1)}, row)
    assert out.count("[[fwd]]") == 2 and "num_threads = 256" in out and 'head_dim = 64' in out
    assert 'mode = "emulated"' in out and "tflops = 123.4" in out
    from flash_attn_sm120.config import parse_fwd_table, tomllib

    doc = tomllib.loads(out.replace('[[fwd]]\nhead_dim = 64\nmask = "none"\nnum_threads = 128\n', ""))
    assert parse_fwd_table(doc)[0].config == FwdConfig(256, 128, 96, 1)


# ------------------------------------------------------------------------------- config search
def test_enumeration_is_exactly_the_implementable_grid():
    cands = search.enumerate_candidates(128)
    assert all(c.error(128, 128) is None for c in cands)
    assert FwdConfig(256, 128, 96, 1) in cands and FwdConfig(128, 64, 64, 1, True) in cands
    assert not any(c.q_in_regs and c.num_stages > 1 for c in cands)
    assert FwdConfig(128, 128, 128, 2) not in cands  # 128 KB of shared memory
    assert len(search.enumerate_candidates(256)) < len(search.enumerate_candidates(64))


def test_enumeration_covers_256_row_tiles_and_other_families():
    cands = search.enumerate_candidates(128)
    assert FwdConfig(256, 256, 32, 1) in cands  # 8 warps x 32 rows: spill-free on sm_120a
    assert FwdConfig(256, 256, 64, 2) not in cands  # 112 KB of shared memory at d=128
    tma = search.enumerate_candidates(128, {"families": ["tma"], "threads": [256]})
    assert tma and all(c.family == "tma" and c.error(128, 128) is None for c in tma)
    assert FwdConfig(256, 256, 32, 2, family="tma") in tma


def test_write_merges_winners_into_the_table_and_keeps_other_buckets():
    prov = '[fwd.provenance]\ngpu = "G"\nmode = "emulated"\ndate = "2026-11-29"\ncommand = "c"\n'
    text = (
        "# header\nschema = 1\n\n[[fwd]]\nhead_dim = 256\nmask = \"causal\"\nnum_threads = 128\n"
        "tile_m = 64\ntile_n = 64\n" + prov + "\n[[fwd]]\nhead_dim = 128\nmask = \"none\"\nnum_threads = 128\n"
        "tile_m = 128\ntile_n = 48\nnum_stages = 2\n" + prov
    )
    best = dict(_final(128, FwdConfig(256, 256, 32, 2), 380.0), gpu="G", mode="emulated", date="2026-11-29")
    best["problems"] = [dict(name="b1s8192h16d128", spread=0.01)]
    out = search.merge_table(text, {(128, "none"): search.entry_text(best, None, "cmd")})
    from flash_attn_sm120.config import parse_fwd_table, tomllib

    entries = {(e.head_dim, e.mask): e.config for e in parse_fwd_table(tomllib.loads(out))}
    assert entries[(128, "none")] == FwdConfig(256, 256, 32, 2)
    assert entries[(256, "causal")] == FwdConfig(128, 64, 64, 1)  # not searched: kept
    assert out.startswith("# header") and out.count("[[fwd]]") == 2 and 'command = "cmd"' in out


def test_prune_rule():
    row = dict(spill_bytes=0, local_loads=0, local_stores=0, ctas_per_sm=1, warps_per_sm=4)
    assert search.keep_after_prune(row)
    assert not search.keep_after_prune(dict(row, spill_bytes=8))
    assert not search.keep_after_prune(dict(row, local_stores=2))
    assert not search.keep_after_prune(dict(row, ctas_per_sm=0))
    assert not search.keep_after_prune(row, min_warps_per_sm=8)


def _final(bucket, cfg, tflops, role="candidate", spread=0.01):
    return dict(round="final", bucket=bucket, mask="none", config=cfg.to_dict(), role=role, correct=True,
                geomean_tflops=tflops, problems=[dict(spread=spread)])


def test_pick_winners_rules():
    ups, a, b = upstream_fwd_config(128), FwdConfig(256, 128, 96), FwdConfig(128, 128, 48, 2)
    rows = [_final(128, ups, 100.0, "upstream"), _final(128, a, 100.5), _final(128, b, 95.0),
            dict(_final(128, FwdConfig(128, 64, 64), 999.0), correct=False)]
    best, up = search.pick_winners(rows)[(128, "none")]
    assert best["config"] == ups.to_dict()  # +0.5% is inside the spread: upstream stays
    rows[1]["geomean_tflops"] = 110.0
    assert search.pick_winners(rows)[(128, "none")][0]["config"] == a.to_dict()
    # upstream's tile spills: it cannot ship, the best shippable config wins even if slower
    shippable = lambda bucket, mask, cfg: cfg != ups.to_dict() and cfg != a.to_dict()
    assert search.pick_winners(rows, shippable)[(128, "none")][0]["config"] == b.to_dict()


def test_search_resumes_from_logged_keys(tmp_path):
    f = tmp_path / "times.jsonl"
    f.write_text('{"key": "screen/128/none/x"}\n{"key": "final/128/none/x"}\n{"broken json\n')
    assert search._read_keys(f) == {"screen/128/none/x", "final/128/none/x"}


def test_write_keeps_a_cpasync_fallback_after_a_tma_winner(tmp_path):
    """A group won by the TMA family gets a cp.async entry after it: this round's best cp.async
    finalist, or else the table's previous cp.async entry; a cp.async winner stands alone."""
    import json

    tma = FwdConfig(256, 128, 64, 2, True, family="tma")
    cp_a, cp_b = FwdConfig(128, 64, 64, 1, True), FwdConfig(128, 128, 48, 2)
    prov = '[fwd.provenance]\ngpu = "G"\nmode = "emulated"\ndate = "2026-11-28"\ncommand = "old"\n'
    toml = tmp_path / "t.toml"
    toml.write_text('schema = 1\n\n[[fwd]]\nhead_dim = 128\nmask = "causal"\nnum_threads = 128\ntile_m = 64\n'
                    'tile_n = 64\nq_in_regs = true\n' + prov)
    prune = [dict(bucket=128, mask=m, config=c.to_dict(), spill_bytes=0, local_loads=0, local_stores=0)
             for m, c in (("causal", tma), ("none", tma), ("none", cp_b))]
    (tmp_path / "prune_sm120a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prune))

    def final(mask, cfg, tflops):
        return dict(_final(128, cfg, tflops), mask=mask, gpu="H", mode="emulated", date="2026-11-29",
                    problems=[dict(name="p", spread=0.01)])

    rows = [final("causal", tma, 340.0), final("none", tma, 380.0), final("none", cp_b, 360.0)]
    (tmp_path / "times.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    search.stage_write(tmp_path, toml, "cmd")
    from flash_attn_sm120.config import parse_fwd_table, tomllib

    got = [(e.head_dim, e.mask, e.config) for e in parse_fwd_table(tomllib.loads(toml.read_text()))]
    # causal: no cp.async finalist this round, the old cp.async entry is kept after the TMA winner
    assert got[:2] == [(128, "causal", tma), (128, "causal", cp_a)]
    # none: the round's cp.async finalist follows the TMA winner
    assert got[2:] == [(128, "none", tma), (128, "none", cp_b)]


def test_bwd_write_merges_and_keeps_an_entry_the_table_wins(tmp_path):
    """Backward bwd-write: a candidate that beats the table's own row (by more than the spread) replaces
    that key's entry; where the table's row is as fast, and for keys the run did not time, the entry
    stays byte for byte; deterministic rows (<name>_det) are never candidates."""
    import json
    import shutil

    search_bwd = _load("search_bwd")
    from flash_attn_sm120.config_bwd import BWD_TABLE_PATH, parse_bwd_table, tomllib
    from flash_attn_sm120.kernels.bwd_tiling import BwdConfig

    toml = tmp_path / "bwd.toml"
    shutil.copy(BWD_TABLE_PATH, toml)
    key = lambda e: (e.head_dim, e.mask, e.modifiers)  # noqa: E731
    before = {key(e): e.config for e in parse_bwd_table(tomllib.loads(toml.read_text()))}
    fast = BwdConfig(256, 32, 64, 1, 1, atom_m_sdp=2, atom_n_dkv=4, atom_m_dq=2)
    assert fast != before[(128, "none", False)]
    (tmp_path / "c.json").write_text(json.dumps({"fast": dict(fast.to_dict(), head_dims=[128], deterministic=True)}))

    def row(impl, problem, tflops):
        return dict(impl=impl, problem=problem, status="ok", bwd_tflops=tflops, spread=0.01)

    rows = [row("sm120_bwd_table", "b1s8192h16d128", 250.0), row("fast", "b1s8192h16d128", 280.0),
            row("fast_det", "b1s8192h16d128", 400.0), row("upstream_sm120", "b1s8192h16d128", 210.0),
            row("sm120_bwd_table", "b1s8192h16d128-causal", 250.0), row("fast", "b1s8192h16d128-causal", 251.0),
            row("fast_det", "b1s8192h16d128-causal", 400.0), row("upstream_sm120", "b1s8192h16d128-causal", 210.0)]
    result = tmp_path / "r.json"
    result.write_text(json.dumps(dict(rows=rows, gpu="G", mode="emulated", date="2026-12-02T00:00",
                                      command="prepare --bwd-configs X --json Y")))
    search_bwd.stage_write(result, tmp_path / "c.json", toml)
    after = {key(e): e.config for e in parse_bwd_table(tomllib.loads(toml.read_text()))}
    assert after[(128, "none", False)] == fast
    # every other entry stays, a modifier entry of the written key (modifiers = true) included
    assert {k: v for k, v in after.items() if k != (128, "none", False)} == {
        k: v for k, v in before.items() if k != (128, "none", False)}
    assert list(after) == list(before)  # the table's order is kept


def test_time_direction_ms_composes_the_timers(monkeypatch):
    """Eager: time_cuda of fn; graph: time_cuda_graph of fn, less that of fwd only for a backward."""
    seen = []

    def fake(kind, ms):
        def timer(fn, rotations, reps):
            seen.append((kind, fn, rotations, reps))
            return bench.Timing(median_ms=ms[fn], p10_ms=ms[fn], p90_ms=ms[fn], reps=reps)
        return timer

    ms = {"fn": 5.0, "fwd": 2.0}
    monkeypatch.setattr(bench, "time_cuda", fake("eager", ms))
    monkeypatch.setattr(bench, "time_cuda_graph", fake("graph", ms))
    assert bench.time_direction_ms("fn", "fwd", graph=False, bwd=True, reps=7) == 5.0
    assert bench.time_direction_ms("fn", "fwd", graph=True, bwd=False, reps=7) == 5.0
    assert bench.time_direction_ms("fn", "fwd", graph=True, bwd=True, reps=7) == 3.0
    assert seen == [("eager", "fn", 2, 7), ("graph", "fn", 2, 7), ("graph", "fn", 2, 7), ("graph", "fwd", 2, 7)]
