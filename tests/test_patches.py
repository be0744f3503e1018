"""Upstream patches (scripts/make_patches.py, upstream_patches/): fresh, applicable, and compiling.

The patched upstream is checked the way a maintainer would meet it: the pinned FA4 package copied
to a temporary directory, the patches applied there with git, and a subprocess that imports that
copy in place of the installed one and compiles its SM120 forward for sm_120a on the CPU.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parent.parent
PATCH_DIR = ROOT / "upstream_patches"

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _load_make_patches():
    spec = importlib.util.spec_from_file_location("make_patches", ROOT / "scripts" / "make_patches.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_patches"] = module
    spec.loader.exec_module(module)
    return module


mp = _load_make_patches()

# A small table like the search writes: one 4-warp 2-stage entry, two 8-warp entries.
FIXTURE_TABLE = """
schema = 1
{entries}
"""
_ENTRY = """
[[fwd]]
head_dim = {d}
mask = "{mask}"
family = "cpasync"
num_threads = {threads}
tile_m = {tile_m}
tile_n = {tile_n}
num_stages = {stages}
q_in_regs = false
[fwd.provenance]
gpu = "NVIDIA H200"
mode = "emulated"
date = "2026-11-29"
tflops = {tflops}
upstream_tflops = 100.0
problems = ["fixture"]
command = "python scripts/config_search.py --stage time --out configs/measurements/search"
"""
FIXTURE_ENTRIES = [
    dict(d=128, mask="none", threads=256, tile_m=128, tile_n=96, stages=1, tflops=150.5),
    dict(d=128, mask="causal", threads=256, tile_m=128, tile_n=96, stages=1, tflops=121.0),
    dict(d=64, mask="causal", threads=128, tile_m=64, tile_n=64, stages=2, tflops=88.3),
]
COMPILE_CASES = [(d, mask == "causal") for d, mask in mp.CODEGEN_CASES]

# Runs inside the subprocess whose PYTHONPATH starts with the patched copy of flash_attn.
_PROBE = r"""
import json, sys
site, cases = sys.argv[1], json.loads(sys.argv[2])
import flash_attn.cute
assert flash_attn.cute.__file__.startswith(site), f"imported {flash_attn.cute.__file__}, not the patched copy"
import cutlass
from flash_attn.cute import flash_fwd_sm120_configs as configs
from flash_attn.cute.flash_fwd_sm120 import FlashAttentionForwardSm120
from flash_attn.cute.interface import _get_fwd_config
from flash_attn_sm120.codegen import compile_fwd_cubin, inspect_cubin
from flash_attn_sm120.config import FwdConfig

def interface_tiles(d, causal):
    cfg = _get_fwd_config(
        arch=120, head_dim=d, head_dim_v=d, max_seqlen_q=4096, max_seqlen_k=4096, num_head_kv=8,
        qhead_per_kvhead=1, pack_gqa=False, batch_size=2, causal=causal, local=False,
        window_size_left=None, window_size_right=None, num_splits=1, device=None,
    )
    return [cfg.m_block_size, cfg.n_block_size]

can = lambda d, m, n, stages, threads: FlashAttentionForwardSm120.can_implement(
    cutlass.BFloat16, d, d, m, n, stages, threads, False)
out = {"cases": [], "refusals": {
    "8 warps, tile_m 64": can(128, 64, 64, 1, 256),
    "over 99 KB": can(256, 128, 128, 2, 256),
    "fp32": FlashAttentionForwardSm120.can_implement(cutlass.Float32, 64, 64, 64, 64, 1, 128, False),
}}
# an explicit tile_mn keeps 4 warps and one stage unless it is the table's tiles
table_cfg = configs.sm120_fwd_config(128, 128, False, False)
out["tile_mn"] = {
    "other": configs.sm120_fwd_config(128, 128, False, False, tile_mn=(64, 32)).to_dict(),
    "table's": configs.sm120_fwd_config(128, 128, False, False, tile_mn=(table_cfg.tile_m, table_cfg.tile_n))
    == table_cfg,
}
for d, causal in cases:
    cfg = configs.sm120_fwd_config(d, d, causal, False)
    cubin, _ = compile_fwd_cubin(FwdConfig(**cfg.to_dict()), d, causal=causal, upstream_class=True)
    res, hist, _ = inspect_cubin(cubin)
    out["cases"].append(dict(
        d=d, causal=causal, config=cfg.to_dict(), interface_tiles=interface_tiles(d, causal),
        can_implement=can(d, cfg.tile_m, cfg.tile_n, cfg.num_stages, cfg.num_threads),
        empty_table=configs.select_fwd_config((), d, d, causal, False).to_dict(),
        regs=res["regs"], stack=res["stack"], ldl=hist.get("LDL", 0), stl=hist.get("STL", 0),
    ))
print("RESULT " + json.dumps(out))
"""


def _pristine_repo(tmp: Path) -> Path:
    dist = mp.check_upstream_version(mp.pinned_upstream()[1])
    repo = tmp / "flash-attention"
    mp.make_pristine_repo(repo, mp.pristine_files(dist), dist.version)
    return repo


def _patched_site(tmp: Path, patches: list[Path]) -> Path:
    """A copy of the installed flash_attn package with `patches` applied (git apply, in order)."""
    cute = Path(importlib.util.find_spec("flash_attn.cute").origin).parent
    site = tmp / "site"
    shutil.copytree(cute, site / "flash_attn" / "cute", ignore=shutil.ignore_patterns("__pycache__"))
    mp.git(site, "init", "-q")
    for patch in patches:
        mp.git(site, "apply", str(patch))
    return site


def _probe(site: Path, cases=None, script: str = _PROBE, gpu: bool = False):
    """Run `script` in a subprocess that imports the patched copy at `site` (argv: site, then the
    JSON of `cases` if given); returns the JSON of its last "RESULT " line.

    CPU probes run without SM120 emulation. GPU probes run upstream with `_arch=120` on the local GPU;
    upstream selects SM120 configs by SM count and refuses to guess it for an arch other than the
    local GPU's, so they name the local count (unless the caller's environment already does).
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if gpu:
        import torch

        env.setdefault("FLASH_ATTENTION_NUM_SMS", str(torch.cuda.get_device_properties(0).multi_processor_count))
    else:
        env.pop("FLASH_ATTN_SM120_EMULATE", None)
    argv = [sys.executable, "-c", script, str(site)] + ([json.dumps(cases)] if cases is not None else [])
    res = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=site, timeout=900)
    lines = [l for l in res.stdout.splitlines() if l.startswith("RESULT ")]
    assert res.returncode == 0 and lines, f"patched-upstream probe failed:\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def _assert_no_spills(case: dict) -> None:
    where = f"d={case['d']} causal={case['causal']} {case['config']}"
    assert case["stack"] == 0, f"{where}: {case['stack']} B of stack (register spills)"
    assert case["ldl"] == 0 and case["stl"] == 0, f"{where}: {case['ldl']} LDL / {case['stl']} STL in the SASS"


# ------------------------------------------------------------------------------------ freshness
def test_patches_are_fresh(capsys):
    rc = mp.main(["--check"])
    err = capsys.readouterr().err
    assert rc == 0, f"upstream_patches/ is stale, run `python scripts/make_patches.py`:\n{err}"


def test_check_reports_a_stale_patch(tmp_path, capsys):
    out = tmp_path / "patches"
    shutil.copytree(PATCH_DIR, out)
    patch = sorted(out.glob("*.patch"))[0]
    patch.write_bytes(patch.read_bytes().replace(b"SM120", b"SM121", 1))
    (out / "9999-left-over.patch").write_text("x")
    assert mp.main(["--check", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"differs: {patch.name}" in err and "not generated any more: 9999-left-over.patch" in err


def test_generation_is_deterministic(tmp_path):
    table = tmp_path / "table.toml"
    table.write_text(FIXTURE_TABLE.format(entries="".join(_ENTRY.format(**e) for e in FIXTURE_ENTRIES)))
    first = [p.read_bytes() for p in mp.generate(tmp_path / "a", table_path=table, prune_path=None)]
    second = [p.read_bytes() for p in mp.generate(tmp_path / "b", table_path=table, prune_path=None)]
    assert first == second
    text = first[0].decode()
    assert text.startswith("From 0000000000000000000000000000000000000000 ")
    assert f"From: {mp.AUTHOR_NAME} <{mp.AUTHOR_EMAIL}>" in text
    # the measurements come from the table's provenance, with their mode
    assert "150.5" in text and "121.0" in text and "88.3" in text and "emulated" in text
    assert "NVIDIA H200" in text


# ----------------------------------------------------------------------------------- applying
def test_patches_apply_in_order_to_pristine_source(tmp_path):
    patches = sorted(PATCH_DIR.glob("*.patch"))
    assert patches, "upstream_patches/ holds no patches"
    assert [p.name[:4] for p in patches] == [f"{i:04d}" for i in range(1, len(patches) + 1)]
    repo = _pristine_repo(tmp_path)
    for patch in patches:
        mp.git(repo, "apply", "--check", str(patch))
        mp.git(repo, "am", "-q", str(patch))
    log = mp.git(repo, "log", "--format=%an <%ae>%n%s").decode().splitlines()
    assert log[0] == f"{mp.AUTHOR_NAME} <{mp.AUTHOR_EMAIL}>"
    assert (repo / "flash_attn" / "cute" / "flash_fwd_sm120_configs.py").is_file()
    # every step's patch is there and applied, block sparsity (0006) last
    assert [p.name for p in patches] == [f"{i:04d}-{s.name}.patch" for i, s in enumerate(mp.STEPS, 1)]
    assert (repo / "flash_attn" / "cute" / "flash_bwd_sm120_mods.py").is_file()
    assert (repo / "flash_attn" / "cute" / "flash_bwd_sm120_block_sparse.py").is_file()


def test_missing_anchor_fails_loudly(tmp_path):
    interface = (_pristine_repo(tmp_path) / "flash_attn" / "cute" / "interface.py").read_text()
    moved = interface.replace("    # SM80/SM120: uses SM80 MMA, 128 threads (4 warps)\n", "")
    with pytest.raises(mp.AnchorError, match="num_threads = 128"):
        mp.apply_edits(moved, mp._INTERFACE_EDITS, "flash_attn/cute/interface.py")


# -------------------------------------------------------------------------------- version pin
def test_pin_matches_installed_upstream():
    dist, version = mp.pinned_upstream()
    assert dist == "flash-attn-4"
    assert importlib.metadata.version(dist) == version


def test_wrong_upstream_version_gives_one_clear_error(capsys):
    installed = importlib.metadata.version("flash-attn-4")
    with pytest.raises(mp.UpstreamVersionError) as e:
        mp.check_upstream_version("9.9.9")
    assert "flash-attn-4==9.9.9" in str(e.value) and f"flash-attn-4=={installed} is installed" in str(e.value)
    with pytest.raises(mp.UpstreamVersionError, match="flash-attn-4-missing==1.0, which is not installed"):
        mp.check_upstream_version("1.0", distribution="flash-attn-4-missing")

    assert mp.main(["--check"], pinned=("flash-attn-4", "9.9.9")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "flash-attn-4==9.9.9" in err[0]


# ------------------------------------------------------------------------ patched upstream codegen
def test_patched_upstream_compiles_table_defaults_without_spills(tmp_path):
    """Patches from a fixture table: the patched FA4 picks the table's configs and they don't spill."""
    table = tmp_path / "table.toml"
    table.write_text(FIXTURE_TABLE.format(entries="".join(_ENTRY.format(**e) for e in FIXTURE_ENTRIES)))
    patches = mp.generate(tmp_path / "patches", table_path=table, prune_path=None)
    result = _probe(_patched_site(tmp_path, patches), COMPILE_CASES)

    assert not any(result["refusals"].values()), result["refusals"]
    assert result["tile_mn"]["table's"]
    other = result["tile_mn"]["other"]
    assert (other["num_threads"], other["tile_m"], other["tile_n"], other["num_stages"]) == (128, 64, 32, 1)
    expected = {(e["d"], e["mask"] == "causal"): e for e in FIXTURE_ENTRIES}
    for case in result["cases"]:
        e, cfg = expected[(case["d"], case["causal"])], case["config"]
        assert (cfg["num_threads"], cfg["tile_m"], cfg["tile_n"], cfg["num_stages"]) == (
            e["threads"], e["tile_m"], e["tile_n"], e["stages"]
        ), f"patched selection ignored the table: {case}"
        assert case["interface_tiles"] == [e["tile_m"], e["tile_n"]], "interface._get_fwd_config ignored the table"
        assert case["can_implement"], f"patched can_implement refuses the table's config {cfg}"
        # with an empty table the selection is the package's spill-free fallback (config._FALLBACKS[0])
        empty = case["empty_table"]
        assert (empty["num_threads"], empty["tile_m"], empty["tile_n"], empty["num_stages"]) == (128, 64, 64, 1)
        _assert_no_spills(case)


def test_checked_in_patches_compile_for_sm120a(tmp_path):
    """The checked-in patches (the repo's table): its entries for the test cases compile without spills."""
    table = mp.load_table(mp.DEFAULT_TABLE)
    entries = {(e.head_dim, e.mask) for e in table}
    cases = [(d, c) for d, c in COMPILE_CASES if (d, "causal" if c else "none") in entries]
    site = _patched_site(tmp_path, sorted(PATCH_DIR.glob("*.patch")))
    result = _probe(site, cases or [(64, False)])
    for case in result["cases"]:
        if cases:
            _assert_no_spills(case)
        else:  # empty table: upstream's previous default, compiled but not spill-checked (it spills)
            assert case["config"]["num_threads"] == 128 and case["config"]["num_stages"] == 1
            assert case["regs"] > 0


# ---------------------------------------------------------------------------- patched upstream on GPU
_GPU_PROBE = r"""
import json, sys
site, cases = sys.argv[1], json.loads(sys.argv[2])
import torch
import flash_attn.cute
assert flash_attn.cute.__file__.startswith(site), f"imported {flash_attn.cute.__file__}, not the patched copy"
import inspect
from flash_attn.cute import interface
from flash_attn.cute.flash_fwd_sm120_configs import sm120_fwd_config

built = []
# test-only: record what the dispatch builds (the TMA class too, where patch 0003 is applied)
for name in ("FlashAttentionForwardSm120", "FlashAttentionForwardSm120Tma"):
    base = getattr(interface, name, None)
    if base is None:
        continue

    def init(self, *args, _base=base, **kwargs):
        built.append({k: kwargs[k] for k in ("tile_m", "tile_n", "num_stages", "num_threads", "Q_in_regs")})
        _base.__init__(self, *args, **kwargs)

    setattr(interface, name, type(name, (base,), {"__init__": init}))
# a dense MHA call is one the TMA family takes, where it exists
tma_kw = {"tma_ok": True} if "tma_ok" in inspect.signature(sm120_fwd_config).parameters else {}
out = []
for d, causal in cases:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 1000, 4, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    o = interface._flash_attn_fwd(q, k, v, causal=causal, _arch=120)[0]
    t = lambda x: x.transpose(1, 2)
    ref = t(torch.nn.functional.scaled_dot_product_attention(t(q.float()), t(k.float()), t(v.float()), is_causal=causal))
    pt = t(torch.nn.functional.scaled_dot_product_attention(t(q), t(k), t(v), is_causal=causal)).float()
    cfg = sm120_fwd_config(d, d, causal, False, **tma_kw)
    out.append(dict(
        d=d, causal=causal, err=(o.float() - ref).abs().max().item(), pt_err=(pt - ref).abs().max().item(),
        built=built[-1], expected=dict(tile_m=cfg.tile_m, tile_n=cfg.tile_n, num_stages=cfg.num_stages,
                                       num_threads=cfg.num_threads, Q_in_regs=cfg.q_in_regs),
    ))
print("RESULT " + json.dumps(out))
"""


@pytest.mark.gpu
@pytest.mark.parametrize("source", ["fixture", "repo"])
def test_patched_upstream_forward_matches_reference(tmp_path, source):
    """The patched FA4 interface, SM120 dispatch forced (_arch=120), against an fp32 reference.

    Runs upstream's SM120 class with the table's configs on any SM80+ GPU (the SM80 code path);
    shared memory is not padded here: this checks correctness of the patched dispatch, not speed.
    """
    if source == "fixture":
        table = tmp_path / "table.toml"
        table.write_text(FIXTURE_TABLE.format(entries="".join(_ENTRY.format(**e) for e in FIXTURE_ENTRIES)))
        patches = mp.generate(tmp_path / "patches", table_path=table, prune_path=None)
    else:
        if not mp.load_table(mp.DEFAULT_TABLE):
            pytest.skip("flash_attn_sm120/configs/sm120_fwd.toml is empty: the checked-in patch keeps upstream's defaults")
        patches = sorted(PATCH_DIR.glob("*.patch"))
    for case in _probe(_patched_site(tmp_path, patches), COMPILE_CASES, _GPU_PROBE, gpu=True):
        assert case["built"] == case["expected"], f"dispatch did not use the table's config: {case}"
        assert case["err"] <= 2 * case["pt_err"] + 1e-3, f"patched SM120 forward is wrong: {case}"


# ------------------------------------------------------------------- SplitKV / paged / decode patch
_SPLIT_PROBE = r"""
import json, sys
from types import SimpleNamespace
site, cases = sys.argv[1], json.loads(sys.argv[2])
import flash_attn.cute
assert flash_attn.cute.__file__.startswith(site), f"imported {flash_attn.cute.__file__}, not the patched copy"
from flash_attn.cute.flash_fwd_sm120_configs import sm120_fwd_config
from flash_attn.cute.flash_fwd_sm120_splitkv import FlashAttentionForwardSm120SplitKV
from flash_attn.cute.interface import _get_fwd_config
from flash_attn_sm120.codegen import compile_splitkv_cubin, inspect_cubin
from flash_attn_sm120.config import FwdConfig

out = {"plans": [], "codegen": None}
for c in cases:
    cfg = _get_fwd_config(
        arch=120, head_dim=128, head_dim_v=128, max_seqlen_q=1, max_seqlen_k=c["seqlen_k"], num_head_kv=8,
        qhead_per_kvhead=4, pack_gqa=True, batch_size=c["batch"], causal=False, local=False,
        window_size_left=None, window_size_right=None, num_splits=c["num_splits"], device=SimpleNamespace(index=0),
    )
    out["plans"].append(dict(c, tiles=[cfg.m_block_size, cfg.n_block_size], splits=cfg.num_splits))
decode = sm120_fwd_config(128, 128, False, False, max_seqlen_q=1)
cubin, _ = compile_splitkv_cubin(FwdConfig(**decode.to_dict()), 128, split=True, paged=True,
                                 kernel_cls=FlashAttentionForwardSm120SplitKV)
res, hist, _ = inspect_cubin(cubin)
out["codegen"] = dict(config=decode.to_dict(), regs=res["regs"], stack=res["stack"], ldl=hist.get("LDL", 0),
                      stl=hist.get("STL", 0), hmma=hist.get("HMMA", 0), ldgsts=hist.get("LDGSTS", 0))
print("RESULT " + json.dumps(out))
"""

SPLIT_PLAN_CASES = [
    dict(batch=b, seqlen_k=sk, num_splits=n)
    for b, sk in ((1, 4096), (1, 32768), (1, 131072), (8, 32768), (64, 4096))
    for n in (0, 1000)
]


def test_patched_upstream_splits_match_the_package_and_compile_for_sm120a(tmp_path, monkeypatch):
    """The SplitKV patch: upstream's _get_fwd_config gives the package's decode tiles and split counts
    (188 SMs), and the patched FlashAttentionForwardSm120SplitKV compiles for sm_120a without spills."""
    from flash_attn_sm120 import driver_splitkv

    monkeypatch.setenv("FLASH_ATTENTION_NUM_SMS", "188")
    result = _probe(_patched_site(tmp_path, sorted(PATCH_DIR.glob("*.patch"))), SPLIT_PLAN_CASES, _SPLIT_PROBE)

    chose_a_split = False
    for p in result["plans"]:
        ours = driver_splitkv.plan(
            head_dim=128, head_dim_v=128, causal=False, local=False, window_size_left=None, window_size_right=None,
            batch=p["batch"], max_seqlen_q=1, max_seqlen_k=p["seqlen_k"], num_heads=32, num_heads_kv=8,
            pack_gqa=True, num_splits=p["num_splits"], num_sms=188,
        )
        assert p["tiles"] == [ours.config.tile_m, ours.config.tile_n], f"decode tiles differ: {p} vs {ours}"
        assert p["splits"] == ours.num_splits, f"split count differs from the package's: {p} vs {ours}"
        if p["num_splits"] == 1000:  # explicit: clamped to the key blocks (and MAX_SPLITS)
            assert 1 < p["splits"] <= min(128, -(-p["seqlen_k"] // p["tiles"][1]))
        chose_a_split |= p["num_splits"] == 0 and p["splits"] > 1
    assert chose_a_split, "the chooser never split a b=1 decode: the patched rule is not the package's"

    cg = result["codegen"]
    assert (cg["config"]["num_threads"], cg["config"]["tile_m"]) == (128, 64), cg  # the decode table's entry
    assert cg["hmma"] > 0 and cg["ldgsts"] > 0, cg
    assert cg["stack"] == 0 and cg["ldl"] == 0 and cg["stl"] == 0, f"patched SplitKV kernel spills: {cg}"


def test_splitkv_patch_needs_every_anchor(tmp_path):
    """Each interface edit of the SplitKV step names its anchor when the upstream text moved."""
    interface = (_pristine_repo(tmp_path) / "flash_attn" / "cute" / "interface.py").read_text()
    after_step1 = mp.apply_edits(interface, mp._INTERFACE_EDITS, "interface.py")
    mp.apply_edits(after_step1, mp._SPLITKV_INTERFACE_EDITS, "interface.py")  # applies as is
    moved = after_step1.replace('        assert num_splits <= 1, "SM120 forward only supports num_splits=1"\n', "")
    with pytest.raises(mp.AnchorError, match="SM120 num_splits"):
        mp.apply_edits(moved, mp._SPLITKV_INTERFACE_EDITS, "interface.py")


def test_lifted_modules_have_no_package_references():
    for text in (mp.render_splitkv_module(), mp.render_splits_module()):
        mp.check_no_package_refs(text, "lifted module")
        compile(text, "lifted", "exec")  # valid Python
    with pytest.raises(mp.AnchorError, match="emulat"):
        mp.check_no_package_refs("# SM120 Emulation pads shared memory", "probe")


_GPU_SPLIT_PROBE = r"""
import json, sys
site = sys.argv[1]
import torch
import flash_attn.cute
assert flash_attn.cute.__file__.startswith(site), f"imported {flash_attn.cute.__file__}, not the patched copy"
from flash_attn.cute import interface
from flash_attn_sm120 import testing
from flash_attn_sm120.testing import AttnCase, AttnProblem

built = []


class Recording(interface.FlashAttentionForwardSm120SplitKV):  # test-only: see what the dispatch builds
    def __init__(self, *args, **kwargs):
        built.append({k: kwargs[k] for k in ("tile_m", "tile_n", "num_stages", "num_threads", "is_split_kv")})
        super().__init__(*args, **kwargs)


interface.FlashAttentionForwardSm120SplitKV = Recording
CASES = [
    ("decode, dense KV, chosen splits", dict(qhead_per_kvhead=4, return_lse=True),
     dict(seqlens_q=(1, 1), seqlens_k=(3000, 3000), nheads_kv=2, num_splits=0)),
    ("prefill, paged KV (64-token pages), causal, varlen Q", dict(head_dim=64, head_dim_v=64, mask="causal",
     q_layout="packed", k_layout="paged"), dict(seqlens_q=(200, 37), seqlens_k=(700, 300), nheads_kv=4, page_size=64)),
    ("decode, paged KV (16-token pages), 5 splits, left window", dict(qhead_per_kvhead=4, mask="local_l",
     q_layout="packed", k_layout="paged", return_lse=True),
     dict(seqlens_q=(4, 1, 3), seqlens_k=(1000, 17, 513), nheads_kv=2, page_size=16, num_splits=5, window_left=300)),
]
out = []
for name, case_kw, problem_kw in CASES:
    case, problem = AttnCase(**case_kw), AttnProblem(**problem_kw)
    inputs = testing.make_inputs(case, problem)
    kw = testing.api_kwargs(inputs, case, problem)
    left, right = kw.pop("window_size")
    o = torch.full(inputs.out_shape(case.head_dim_v), float("nan"), dtype=case.torch_dtype, device="cuda")
    lse = torch.full(inputs.lse_shape(), float("nan"), dtype=torch.float32, device="cuda") if case.return_lse else None
    before = len(built)
    o, lse = interface._flash_attn_fwd(
        inputs.q, inputs.k, inputs.v, window_size_left=left, window_size_right=right, out=o, lse=lse, _arch=120,
        **{k: v for k, v in kw.items() if k != "softcap"}, softcap=case.softcap or None,
    )[:2]
    torch.cuda.synchronize()
    error = None
    try:
        stats = testing.check_forward(inputs, case, problem, o, lse if case.return_lse else None)
    except AssertionError as e:
        stats, error = None, str(e)[:2000]
    out.append(dict(name=name, built=built[before:], error=error, stats=repr(stats)[:400]))

refusal = None
try:
    case, problem = AttnCase(q_layout="packed", k_layout="paged"), AttnProblem((3,), (40,), page_size=8)
    inputs = testing.make_inputs(case, problem)
    kw = testing.api_kwargs(inputs, case, problem)
    kw.pop("window_size"), kw.pop("softcap")
    interface._flash_attn_fwd(inputs.q, inputs.k, inputs.v, _arch=120, **kw)
except AssertionError as e:
    refusal = str(e)
print("RESULT " + json.dumps(dict(cases=out, refusal=refusal)))
"""


@pytest.mark.gpu
def test_patched_upstream_split_and_paged_match_reference(tmp_path):
    """The patched FA4 interface (SM120 dispatch forced, _arch=120): SplitKV, paged KV and both,
    against the fp32 reference, outputs poisoned with NaN; a bad page size is refused by name."""
    result = _probe(_patched_site(tmp_path, sorted(PATCH_DIR.glob("*.patch"))), script=_GPU_SPLIT_PROBE, gpu=True)
    for case in result["cases"]:
        assert case["error"] is None, f"{case['name']}: {case['error']}"
        assert case["built"], f"{case['name']}: the SplitKV class was not used"
    split_flags = [c["built"][0]["is_split_kv"] for c in result["cases"]]
    assert split_flags == [True, False, True], split_flags
    assert result["refusal"] and "page size" in result["refusal"], result["refusal"]
