"""Upstream patch 0005 (the SM120 backward with score_mod / score_mod_bwd / mask_mod / aux data).

CPU: the lifted module, the sm_120a compile of the patched class, the patched `_flash_attn_bwd` on fake
tensors, every anchor needed, the commit message's quoted record. GPU (`@pytest.mark.gpu`): the patched
upstream's modifier backward against fp32. The shared probe machinery is test_patches.py's.
"""

from __future__ import annotations

import shutil

import pytest

from test_patches import PATCH_DIR, _patched_site, _pristine_repo, _probe, mp

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


_MODS_PROBE = r"""
import json, sys, tempfile
site, cases = sys.argv[1], json.loads(sys.argv[2])
import flash_attn.cute
assert flash_attn.cute.__file__.startswith(site), f"imported {flash_attn.cute.__file__}, not the patched copy"
import cutlass
import cutlass.cute as cute
from quack.compile_utils import make_fake_tensor
from flash_attn.cute import interface  # the patched interface imports the new module
from flash_attn.cute import flash_bwd_sm120_configs as configs
from flash_attn.cute.flash_bwd_sm120_mods import FlashAttentionBackwardSm120Mods
from flash_attn.cute.flash_bwd_sm120_tuned import Sm120BwdConfig
from flash_attn.cute.utils import AuxData
from flash_attn_sm120.codegen import TARGET_ARCH, inspect_cubin
from flash_attn_sm120.driver_bwd import compile_kernel
from flash_attn_sm120.occupancy import cubin_of
from flash_attn_sm120.testing_mods import position_scale, position_scale_bwd, same_document

assert interface.FlashAttentionBackwardSm120Mods is FlashAttentionBackwardSm120Mods
out = []
for c in cases:
    gqa, det = c["qhead_per_kvhead"] > 1, c["deterministic"]
    doc = make_fake_tensor(cutlass.Int32, (cute.sym_int(), cute.sym_int())) if c["document"] else None
    kernel = FlashAttentionBackwardSm120Mods(
        cutlass.BFloat16, c["d"], c["d"], c["qhead_per_kvhead"], Sm120BwdConfig(**c["config"]), is_causal=c["causal"],
        score_mod=position_scale, score_mod_bwd=position_scale_bwd, mask_mod=same_document if doc else None,
        has_aux_tensors=doc is not None, deterministic=det,
        **(configs.sm120_bwd_deterministic_plan(188, Sm120BwdConfig(**c["config"]), c["causal"], 4096, 4096,
                                                modifier_step=True, flags=c.get("flags")) if det else {}))
    (q, k, v, _o, do, _dq, dk, dv, _lse, lse_log2, dpsum, dq_accum, dk_accum, dv_accum,
     _scale) = interface.make_fake_bwd_tensors(cutlass.BFloat16, has_gqa=gqa, varlen_q=False, varlen_k=False)
    sem = lambda: make_fake_tensor(cutlass.Int32, (cute.sym_int(), cute.sym_int(), cute.sym_int()))
    sems = (sem(), sem() if gqa else None) if det else (None, None)
    with tempfile.TemporaryDirectory() as tmp:
        compiled = compile_kernel(kernel, q, k, v, do, lse_log2, dpsum, dq_accum, dk_accum if gqa else dk,
                                  dv_accum if gqa else dv, None, None, None, None, None, None, *sems,
                                  options=f"--keep-cubin --dump-dir={tmp} --gpu-arch={TARGET_ARCH}",
                                  aux=AuxData([doc] if doc is not None else None, None))
        cubin = cubin_of(compiled)
    res, hist, _ = inspect_cubin(cubin)
    out.append(dict(c, regs=res["regs"], stack=res["stack"], ldl=hist.get("LDL", 0), stl=hist.get("STL", 0),
                    hmma=hist.get("HMMA", 0)))
print("RESULT " + json.dumps(out))
"""


def test_mods_patch_compiles_modifier_backward_for_sm120a(tmp_path):
    """Patch 0005: the patched upstream's FlashAttentionBackwardSm120Mods compiles for sm_120a on the CPU
    with a position-dependent score_mod pair and a document mask_mod over an aux tensor (the d128 entry
    a modifier call takes), and deterministic GQA causal with the score_mod pair (d64; the interface's ordering, and the
    late dQ adds of the modifier step, a given ordering), without register spills."""
    from flash_attn_sm120.config_bwd import load_bwd_table, select_bwd_config

    table = tuple(load_bwd_table())
    cases = [dict(d=d, causal=causal, config=select_bwd_config(table, d, d, causal, False, modifiers=True).to_dict(),
                  qhead_per_kvhead=qh, deterministic=det, document=doc)
             for d, causal, qh, det, doc in ((128, False, 1, False, True), (64, True, 2, True, False))]
    late = dict(dq_descending=True, reverse_n_blocks=True, barrier_release=True, release_deferred=True, late_dq_adds=True)
    cases.append(dict(cases[1], flags=late))
    result = _probe(_patched_site(tmp_path, sorted(PATCH_DIR.glob("*.patch"))), cases, script=_MODS_PROBE)
    assert len(result) == len(cases)
    for c in result:
        where = f"d={c['d']} causal={c['causal']} gqa={c['qhead_per_kvhead']} det={c['deterministic']} {c['config']}"
        assert c["hmma"] > 0, where
        assert c["stack"] == 0 and c["ldl"] == 0 and c["stl"] == 0, f"{where}: spills {c}"


_MODS_FAKE_PROBE = r"""
import json, sys, warnings
site = sys.argv[1]
warnings.filterwarnings("ignore")
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
import flash_attn.cute
assert flash_attn.cute.__file__.startswith(site), f"imported {flash_attn.cute.__file__}, not the patched copy"
from flash_attn.cute import interface, utils
from flash_attn_sm120.testing_mods import position_scale, position_scale_bwd, same_document

built = []
for name in ("FlashAttentionBackwardSm120Tuned", "FlashAttentionBackwardSm120Mods"):
    base = getattr(interface, name)

    def init(self, *args, _base=base, _name=name, **kwargs):  # test-only: see what the dispatch builds
        built.append(dict(cls=_name, causal=kwargs.get("is_causal"), mask_mod=getattr(kwargs.get("mask_mod"), "__name__", None),
                          has_aux=kwargs.get("has_aux_tensors"),
                          score_mod=getattr(kwargs.get("score_mod"), "__name__", None)))
        _base.__init__(self, *args, **kwargs)

    setattr(interface, name, type(name, (base,), {"__init__": init}))
CALLS = [
    ("position pair, document mask_mod, aux tensors, causal", dict(
        causal=True, score_mod=position_scale, score_mod_bwd=position_scale_bwd, mask_mod=same_document, doc=True)),
    ("position pair only", dict(causal=False, score_mod=position_scale, score_mod_bwd=position_scale_bwd)),
    ("softcap pair", dict(causal=True, softcap=30.0)),
    # the same callables' hashes as the softcap call's: only the key's class flag tells the compiles apart
    ("softcap's pair as a user score_mod", dict(causal=True, score_mod=utils.create_softcap_scoremod(30.0),
                                                score_mod_bwd=utils.create_softcap_scoremod_bwd(30.0))),
]
out = []
for name, kw in CALLS:
    with FakeTensorMode():
        q = torch.empty(2, 300, 4, 128, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(2, 300, 2, 128, dtype=torch.bfloat16, device="cuda")
        o = torch.empty_like(q)
        lse = torch.empty(2, 4, 300, dtype=torch.float32, device="cuda")
        if kw.pop("doc", False):
            kw["aux_tensors"] = [torch.empty(2, 300, dtype=torch.int32, device="cuda")]
        before, keys = len(built), len(interface._flash_attn_bwd.compile_cache.cache)
        dq, dk, dv = interface._flash_attn_bwd(q, k, k, o, o, lse, **kw)[:3]
        out.append(dict(name=name, built=built[before:], new_keys=len(interface._flash_attn_bwd.compile_cache.cache) - keys,
                        dq=list(dq.shape), dk=list(dk.shape), dv=list(dv.shape)))
print("RESULT " + json.dumps(out))
"""


def test_patched_upstream_mods_host_path_runs_on_fake_tensors(tmp_path, monkeypatch):
    """Patch 0005's edits to _flash_attn_bwd on the CPU with fake CUDA tensors, SM120 selected: score_mod +
    score_mod_bwd + mask_mod + aux_tensors build the modifier class with mask_mod and has_aux_tensors
    (and the mask_mod replaces causal), a score_mod pair alone builds it too, the softcap pair keeps the
    tuned class, and the same pair passed as a user score_mod gets its own compile of the modifier class
    (the compile key tells them apart); the grads have the inputs' shapes (GQA 2:1)."""
    monkeypatch.setenv("FLASH_ATTENTION_ARCH", "sm_120")
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_120a")
    monkeypatch.setenv("FLASH_ATTENTION_NUM_SMS", "188")
    result = _probe(_patched_site(tmp_path, sorted(PATCH_DIR.glob("*.patch"))), script=_MODS_FAKE_PROBE)
    full, pair, softcap, user_softcap = result
    for r in result:
        assert r["dq"] == [2, 300, 4, 128] and r["dk"] == r["dv"] == [2, 300, 2, 128], r
        assert r["new_keys"] == 1 and len(r["built"]) == 1, r
    assert full["built"][0] == dict(cls="FlashAttentionBackwardSm120Mods", causal=False, mask_mod="same_document",
                                    has_aux=True, score_mod="position_scale"), full
    assert pair["built"][0]["cls"] == "FlashAttentionBackwardSm120Mods" and pair["built"][0]["has_aux"] is False, pair
    assert softcap["built"][0]["cls"] == "FlashAttentionBackwardSm120Tuned" and softcap["built"][0]["causal"], softcap
    assert user_softcap["built"][0]["cls"] == "FlashAttentionBackwardSm120Mods", user_softcap


def test_mods_module_is_lifted_without_package_parts():
    import ast

    text = mp.render_mods_module()
    mp.check_no_package_refs(text, "flash_bwd_sm120_mods.py")
    for gone in ("bwd_mask", "bwd_sm120.py", "this package", "upstream"):
        assert gone not in text.lower(), gone
    for there in ("class FlashAttentionBackwardSm120Mods(FlashAttentionBackwardSm120Tuned)", "def mod_vec_size",
                  "def _one_m_block", "def _apply_mask_mod", "            apply_mask_any_layout(mask, acc_S,"):
        assert there in text, there
    imported = {n.module for n in ast.parse(text).body if isinstance(n, ast.ImportFrom)}
    assert "flash_attn.cute.flash_bwd_sm120_tuned" in imported  # patch 0004's module
    assert all(m.split(".")[0] in ("__future__", "typing", "cutlass", "flash_attn", "quack") for m in imported), imported


def test_mods_patch_needs_every_anchor(tmp_path):
    """Every anchor of the modifier step is needed: removing any one (interface edits on top of 0001-0004,
    module edits on the package's source, the quoted session record) fails with its name."""
    import inspect
    import re

    from flash_attn_sm120.kernels import bwd_mods
    from patchgen import step_mods

    repo = _pristine_repo(tmp_path)
    for patch in sorted(PATCH_DIR.glob("*.patch"))[:4]:
        mp.git(repo, "apply", str(patch))
    interface = (repo / "flash_attn" / "cute" / "interface.py").read_text()
    mp.apply_edits(interface, mp._MODS_INTERFACE_EDITS, "interface.py")  # applies as is
    for what, old, _new in mp._MODS_INTERFACE_EDITS:
        with pytest.raises(mp.AnchorError, match=re.escape(f"interface.py ({what})")):
            mp.apply_edits(interface.replace(old, "", 1), mp._MODS_INTERFACE_EDITS, "interface.py")
    source = inspect.getsource(bwd_mods)
    assert mp.render_mods_module(source) == mp.render_mods_module()
    for old, _new in step_mods._MODULE_EDITS:
        first = old.strip().splitlines()[0]
        with pytest.raises(mp.AnchorError, match=re.escape(repr(first))):
            mp.render_mods_module(source.replace(old, "", 1))
    record = step_mods.DEFAULT_SESSION_RECORD.read_text()
    assert step_mods.session_facts()["tests"] > 0
    for said in ("17 tests", "Run 2 after the fixes: 56 cases", "in SM120 emulation", "All pass"):
        assert said in record, said
        moved = tmp_path / "record.md"
        moved.write_text(record.replace(said, "", 1))
        with pytest.raises(mp.AnchorError, match="the record no longer says"):
            step_mods.session_facts(moved)


def test_mods_patch_commit_message_quotes_the_record():
    from patchgen import step_mods

    facts = step_mods.session_facts()
    text = " ".join(sorted(PATCH_DIR.glob("0005-*.patch"))[0].read_text().split("\n---\n")[0].split())
    assert f"tests/test_mods_bwd_gpu.py, {facts['tests']} tests" in text
    assert f"{facts['fuzz_cases']} cases, {facts['fuzz_failures']} failures" in text and facts["fuzz_failures"] == 0
    assert facts["fuzz_command"] in text and "configs/measurements/2026-12-01_session10.md" in text
    assert facts["gpu"] in text and "has not run on a GPU yet" in text


_GPU_MODS_PROBE = r"""
import json, math, sys
site = sys.argv[1]
import torch
import flash_attn.cute
assert flash_attn.cute.__file__.startswith(site), f"imported {flash_attn.cute.__file__}, not the patched copy"
from flash_attn.cute import interface
from flash_attn_sm120.testing_mods import position_scale, position_scale_bwd, same_document

built = []
base = interface.FlashAttentionBackwardSm120Mods


class Recording(base):  # test-only: see what the dispatch builds
    def __init__(self, *a, **k):
        built.append(a[4].__dict__)
        super().__init__(*a, **k)


interface.FlashAttentionBackwardSm120Mods = Recording
out = []
for d, causal, h, hkv, document in ((128, True, 4, 4, False), (64, False, 8, 2, True)):
    torch.manual_seed(0)
    b, s = 2, 777
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    doc = torch.cumsum(torch.rand(b, s, device="cuda") < 0.01, dim=1).to(torch.int32)  # document ids
    scale = 1.0 / math.sqrt(d)
    kr, vr = (x.repeat_interleave(h // hkv, dim=2) for x in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), kr.float()) * scale
    hi = torch.arange(h, device="cuda")[None, :, None, None]
    qi = torch.arange(s, device="cuda")[None, None, :, None]
    ki = torch.arange(s, device="cuda")[None, None, None, :]
    scores = scores * (1.0 + ((qi + 2 * ki + hi) % 4).float() / 4)  # position_scale's twin
    if causal:
        scores = scores.masked_fill(ki > qi, float("-inf"))
    if document:
        scores = scores.masked_fill(doc[:, None, :, None] != doc[:, None, None, :], float("-inf"))
    lse = scores.logsumexp(-1)
    o = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), vr.float())
    dout = torch.randn_like(q)
    o.backward(dout.float())
    ref = [x.grad.float() for x in (q, k, v)]
    kw = dict(mask_mod=same_document, aux_tensors=[doc]) if document else {}
    before = len(built)
    res = interface._flash_attn_bwd(q.detach(), k.detach(), v.detach(), o.to(q.dtype).detach(), dout, lse.detach(),
                                    softmax_scale=scale, causal=causal, score_mod=position_scale,
                                    score_mod_bwd=position_scale_bwd, **kw)
    torch.cuda.synchronize()
    errs = [((g.float() - r).abs().max() / r.abs().max()).item() for g, r in zip(res, ref)]  # relative
    out.append(dict(d=d, causal=causal, gqa=h // hkv, document=document, errs=errs, built=len(built) > before))
print("RESULT " + json.dumps(out))
"""


@pytest.mark.gpu
def test_patched_upstream_mods_bwd_matches_reference(tmp_path, monkeypatch):
    """Patch 0005 on a GPU (SM120 dispatch forced with FLASH_ATTENTION_ARCH): a position-dependent score_mod
    pair (causal MHA d128; GQA 4:1 d64 with a document mask_mod over an aux tensor) builds the modifier
    class and dq/dk/dv match fp32 autograd of the modified attention."""
    monkeypatch.setenv("FLASH_ATTENTION_ARCH", "sm_120")  # for the probe subprocess's environment
    results = _probe(_patched_site(tmp_path, sorted(PATCH_DIR.glob("*.patch"))), script=_GPU_MODS_PROBE, gpu=True)
    for r in results:
        assert r["built"], r
        assert max(r["errs"]) < 0.02, r  # relative to the largest gradient, as for patch 0004
