"""CPU checks of scripts/sanitize.py: its cases come from the registry, fit each path, and its log parser."""

import importlib.util
from pathlib import Path

import pytest

from flash_attn_sm120.config import FwdConfig
from flash_attn_sm120.config_bwd import load_bwd_table, select_bwd_config
from flash_attn_sm120.paths import KernelPath, Supports, kernel_paths
from flash_attn_sm120.testing import AttnCase, make_inputs

_SPEC = importlib.util.spec_from_file_location(
    "sanitize_script", Path(__file__).resolve().parent.parent / "scripts" / "sanitize.py"
)
sanitize = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(sanitize)


def test_every_path_gets_every_shape_and_cases_fit_the_path():
    paths = kernel_paths()
    cases = sanitize.build_cases(paths)
    assert {c["path"] for c in cases} == {p.name for p in paths if p.head_dims()}
    first_of_family = {}
    for p in paths:
        if p.head_dims():
            first_of_family.setdefault(p.family, p.name)
    for p in paths:
        extra = {"splitkv"} if p.supports.splits else set()
        extra |= {"paged"} if p.supports.paged else set()
        extra |= {name for name, _, _ in sanitize.BWD_SHAPES} if p.family == "dispatch" else set()
        extra |= {name for name, _, _ in sanitize.SPARSE_SHAPES} if p.supports.block_sparse else set()
        # the sink fold and forward modifiers: once per kernel family
        extra |= {name for name, _, _ in sanitize.MOD_SHAPES} if first_of_family.get(p.family) == p.name else set()
        expected = {name for name, _, _ in sanitize.SHAPES} | extra if p.head_dims() else set()
        assert {c["shape"] for c in cases if c["path"] == p.name} == expected
    by_name = {p.name: p for p in paths}
    for c in cases:
        case, path = AttnCase(**c["case"]), by_name[c["path"]]
        assert path.error(case.head_dim, case.head_dim_v) is None
        assert c["family"] != "dispatch"


def test_adapt_respects_a_restricted_path_and_makes_runnable_problems():
    tma_like = KernelPath("tma-like", "cpasync", FwdConfig(128, 64, 64, 2),
                          Supports(head_dims=(64, 96, 128), mixed_head_dims=False, varlen=False, pack_gqa=False,
                                   local=False, softcap=False, splits=True, paged=True))
    cases = sanitize.build_cases([tma_like])
    assert {c["shape"] for c in cases} == ({name for name, _, _ in sanitize.SHAPES} | {"splitkv", "paged"}
                                           | {name for name, _, _ in sanitize.MOD_SHAPES})
    for c in cases:
        case = AttnCase(**c["case"])
        assert case.head_dim in (64, 96, 128) and case.softcap == 0.0 and not case.local
        assert case.pack_gqa in (None, False)
        if c["shape"] in ("splitkv", "paged"):
            assert c["api"] == "public"
        else:
            assert case.is_dense
            pd = dict(c["problem"])
            pd["seqlens_q"], pd["seqlens_k"] = tuple(pd["seqlens_q"]), tuple(pd["seqlens_k"])
            make_inputs(case, sanitize.AttnProblem(**pd), device="cpu")  # equal lengths where dense


def test_families_filter():
    assert sanitize.build_cases(kernel_paths(), families={"no-such-family"}) == []


@pytest.mark.parametrize("tool,log,expect", [
    ("memcheck", "========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n", (True, 0, 0)),
    ("memcheck", "========= Invalid __global__ read\n========= ERROR SUMMARY: 3 errors\n", (True, 3, 0)),
    ("racecheck", "========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)\n", (True, 1, 1)),
    ("racecheck", "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n", (True, 0, 0)),
    ("memcheck", "Traceback (most recent call last):\nRuntimeError: boom\n", (False, 0, 0)),
])
def test_parse_summary(tool, log, expect):
    s = sanitize.parse_summary(tool, log)
    assert (s["parsed"], s["errors"], s["warnings"]) == expect


def test_list_runs_without_a_gpu(capsys):
    assert sanitize.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "cpasync" in out and "dense-causal-gqa" in out


DET_SHAPES = {  # the deterministic backward's shapes and the dQ ordering each exercises
    "bwd-d128-det-none": "fixed",
    "bwd-d128-det-causal-gqa": "descending+reversed",
    "bwd-d64-det-local": "descending+reversed",
    "bwd-d128-det-causal-turns": "descending+reversed",
    "bwd-d128-det-none-turns": "rotated",
    "bwd-d64-det-varlen": "ascending",
    "bwd-d96-det-seqused-causal": "ascending",
    "bwd-d128-det-varlen-gqa": "fixed",
    "bwd-d96-det-causal-turns-entry": "descending+reversed",
    "bwd-d96-det-none-turns-entry": "rotated",
    "bwd-d128-det-local-turns": "descending+reversed",
    "bwd-d64-det-local-varlen": "ascending",
}


def _problem(c) -> sanitize.AttnProblem:
    pd = dict(c["problem"])
    pd["seqlens_q"], pd["seqlens_k"] = tuple(pd["seqlens_q"]), tuple(pd["seqlens_k"])
    return sanitize.AttnProblem(**pd)


def test_deterministic_backward_shapes_cover_the_dq_orderings_with_interleaving_blocks():
    from fuzz_cases import bwd_tile
    from flash_attn_sm120 import testing

    assert {name for name, _, _ in sanitize.BWD_SHAPES if "-det" in name} == set(DET_SHAPES)
    cases = [c for c in sanitize.build_cases(kernel_paths()) if c["shape"] in DET_SHAPES]
    assert sorted(c["shape"] for c in cases) == sorted(DET_SHAPES)  # once each, on the dispatcher's path
    gqa = False
    for c in cases:
        case, problem = AttnCase(**c["case"]), _problem(c)
        assert c["family"] == "bwd" and c["api"] == "public" and case.backward and case.deterministic
        assert case.label.endswith("-bwd-det")
        assert testing.deterministic_order(case, problem) == DET_SHAPES[c["shape"]], c["shape"]
        m, n = bwd_tile(case)
        if c["shape"].endswith("-turns-entry"):  # the table's turns entry, not the key's other one
            kinds = testing.bwd_routing(case, problem)[3]
            cfg = select_bwd_config(load_bwd_table(), 96, 96, case.mask == "causal", False, **kinds)
            turns = [e.config for e in load_bwd_table() if e.turns_only and e.head_dim == 96 and e.mask == case.mask]
            assert kinds["turns"] and turns == [cfg] and (cfg.m_block, cfg.n_block) == (64, 128)
            m, n = cfg.m_block, cfg.n_block
        # a sequence of 3+ m_blocks and 3+ n_blocks: several CTAs take turns at several m_blocks
        assert any(-(-sq // m) >= 3 and -(-sk // n) >= 3 for sq, sk in zip(problem.seqlens_q, problem.seqlens_k))
        assert problem.work(case) <= 700_000  # racecheck-sized, like the other backward shapes
        gqa |= case.qhead_per_kvhead > 1
        make_inputs(case, problem, device="cpu")
    assert gqa and {AttnCase(**c["case"]).dtype for c in cases} == {"bfloat16", "float16"}


def test_shapes_filter_lists_the_deterministic_cases(capsys):
    names = ",".join(DET_SHAPES)
    assert sanitize.main(["--list", "--shapes", names]) == 0
    out = capsys.readouterr().out
    assert f"bwd: {len(DET_SHAPES)} cases" in out and out.count("-bwd-det") == len(DET_SHAPES)
    for name in DET_SHAPES:
        assert name in out
    with pytest.raises(SystemExit, match="unknown shapes"):
        sanitize.main(["--list", "--shapes", "bwd-d128-det-nothing"])
