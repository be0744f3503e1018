"""Upstream patch 0006 (block sparsity on SM120: the TMA forward walks the lists, the backward its
Q-direction lists), and the block-sparse walk that patch 0003 lifts for the TMA forward.

CPU: the lifted modules, the sm_120a compile of the patched classes, the patched `_flash_attn_fwd` /
`_flash_attn_bwd` on fake tensors, every anchor needed, the commit message's quoted record. GPU
(`@pytest.mark.gpu`): the patched upstream's block sparsity against fp32 on random lists. The
shared probe machinery is test_patches.py's.
"""

from __future__ import annotations

import shutil

import pytest

from test_patches import PATCH_DIR, _patched_site, _pristine_repo, _probe, mp

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")

_CPU_ENV = dict(FLASH_ATTENTION_ARCH="sm_120", CUTE_DSL_ARCH="sm_120a", FLASH_ATTENTION_NUM_SMS="188")


def _cpu_sm120(monkeypatch):
    for name, value in _CPU_ENV.items():
        monkeypatch.setenv(name, value)


# ------------------------------------------------------------------------------ sm_120a codegen
_BS_COMPILE_PROBE = r"""
import dataclasses, json, sys, tempfile
site = sys.argv[1]
import flash_attn.cute
assert flash_attn.cute.__file__.startswith(site), f"imported {flash_attn.cute.__file__}, not the patched copy"
import cutlass
import cutlass.cute as cute
from quack.compile_utils import make_fake_tensor
from flash_attn.cute import interface  # the patched interface imports the new modules
from flash_attn.cute import flash_bwd_sm120_configs as bwd_configs
from flash_attn.cute import flash_fwd_sm120_configs as fwd_configs
from flash_attn.cute.block_sparsity import BlockSparseTensors
from flash_attn.cute.flash_bwd_sm120_block_sparse import FlashAttentionBackwardSm120BlockSparse
from flash_attn.cute.flash_fwd_sm120_tma import FlashAttentionForwardSm120Tma
from flash_attn.cute.interface import make_fake_bwd_tensors
from flash_attn.cute.utils import AuxData
from flash_attn_sm120 import driver, driver_bwd
from flash_attn_sm120.codegen import TARGET_ARCH, inspect_cubin
from flash_attn_sm120.occupancy import cubin_of
from flash_attn_sm120.testing_mods import prefix_lm

assert interface.FlashAttentionBackwardSm120BlockSparse is FlashAttentionBackwardSm120BlockSparse
BLOCK = (128, 128)


def lists(full, shapes):
    return BlockSparseTensors(*[make_fake_tensor(cutlass.Int32, s, divisibility=1) for s in shapes * (2 if full else 1)])


def facts(compiled, **case):
    res, hist, _ = inspect_cubin(cubin_of(compiled))
    return dict(case, regs=res["regs"], stack=res["stack"], ldl=hist.get("LDL", 0), stl=hist.get("STL", 0),
                hmma=hist.get("HMMA", 0), utmaldg=hist.get("UTMALDG", 0))


out = {"configs": {str(d): [dataclasses.asdict(c) for c in cs] for d, cs in fwd_configs.SM120_BLOCK_SPARSE_CONFIGS.items()},
       "fwd": [], "bwd": []}
fwd_cases = [(d, cfg, False, None) for d, cfgs in fwd_configs.SM120_BLOCK_SPARSE_CONFIGS.items() for cfg in cfgs]
first128 = fwd_configs.sm120_block_sparse_config(128, 128, BLOCK)
fwd_cases += [(128, first128, True, None), (128, first128, False, prefix_lm)]
for d, cfg, causal, mask_mod in fwd_cases:
    kernel = FlashAttentionForwardSm120Tma(
        cutlass.BFloat16, d, d, 1, is_causal=causal, is_local=False, pack_gqa=False, tile_m=cfg.tile_m,
        tile_n=cfg.tile_n, num_stages=cfg.num_stages, num_threads=cfg.num_threads, Q_in_regs=cfg.q_in_regs,
        mask_mod=mask_mod, q_subtile_factor=BLOCK[0] // cfg.tile_m, kv_subtile_factor=BLOCK[1] // cfg.tile_n)
    b, sq, sk, h, m, n = (cute.sym_int() for _ in range(6))
    q, o = (make_fake_tensor(cutlass.BFloat16, (b, sq, h, d), divisibility=8) for _ in range(2))
    k, v = (make_fake_tensor(cutlass.BFloat16, (b, sk, h, d), divisibility=8) for _ in range(2))
    lse = make_fake_tensor(cutlass.Float32, (b, h, sq), divisibility=1)
    with tempfile.TemporaryDirectory() as tmp:
        compiled = driver.compile_kernel(
            kernel, q, k, v, o, lse, None, None, None, None, None, None, AuxData(None, None),
            options=f"--keep-cubin --dump-dir={tmp} --gpu-arch={TARGET_ARCH}",
            blocksparse=lists(True, ((b, h, m), (b, h, m, n))))
        out["fwd"].append(facts(compiled, d=d, config=dataclasses.asdict(cfg), causal=causal,
                                mask_mod=mask_mod is not None, kv_subtile=kernel.kv_subtile_factor,
                                q_subtile=kernel.q_subtile_factor))
for d, block, full, mask_mod in ((128, BLOCK, True, prefix_lm), (64, (128, 64), False, None)):
    cfg = bwd_configs.sm120_bwd_block_sparse_config(bwd_configs.sm120_bwd_config(d, d, False, False, modifiers=True),
                                                    d, d, block)  # the list walk takes the modifier entries
    kernel = FlashAttentionBackwardSm120BlockSparse(
        cutlass.BFloat16, d, d, 1, cfg, is_causal=False, mask_mod=mask_mod, has_aux_tensors=False,
        q_subtile_factor=block[0] // cfg.m_block, kv_subtile_factor=block[1] // cfg.n_block, has_full=full)
    (q, k, v, _o, do, _dq, dk, dv, _lse, lse_log2, dpsum, dq_accum, _dka, _dva,
     _scale) = make_fake_bwd_tensors(cutlass.BFloat16, has_gqa=False, varlen_q=False, varlen_k=False)
    b, h, n, m = (cute.sym_int() for _ in range(4))
    with tempfile.TemporaryDirectory() as tmp:
        compiled = driver_bwd.compile_kernel(
            kernel, q, k, v, do, lse_log2, dpsum, dq_accum, dk, dv, None, None, None, None, None, None,
            options=f"--keep-cubin --dump-dir={tmp} --gpu-arch={TARGET_ARCH}",
            blocksparse=lists(full, ((b, h, n), (b, h, n, m))))
        out["bwd"].append(facts(compiled, d=d, config=dataclasses.asdict(cfg), block=list(block), full=full,
                                mask_mod=mask_mod is not None))
print("RESULT " + json.dumps(out))
"""


def test_block_sparse_patch_compiles_for_sm120a(tmp_path):
    """Patches 0003 + 0006 on the CPU for sm_120a: the patched TMA class with mask and full lists compiles
    spill-free for every SM120_BLOCK_SPARSE_CONFIGS entry (two K/V tiles per 128-key block at tile_n 64),
    and for d128's first entry with causal and with a mask_mod; the block-sparse backward compiles
    spill-free with full lists and a mask_mod (d128) and with mask lists only on a 64-key block (d64,
    the 4-warp 64x64 fallback). The patched config table is the package's."""
    from dataclasses import asdict

    from flash_attn_sm120 import block_sparse

    result = _probe(_patched_site(tmp_path, sorted(PATCH_DIR.glob("*.patch"))), script=_BS_COMPILE_PROBE)
    assert result["configs"] == {str(d): [asdict(c) for c in cs] for d, cs in block_sparse.CONFIGS.items()}
    assert len(result["fwd"]) == sum(map(len, block_sparse.CONFIGS.values())) + 2 and len(result["bwd"]) == 2
    for c in result["fwd"] + result["bwd"]:
        assert c["hmma"] > 0, c
        assert c["stack"] == 0 and c["ldl"] == 0 and c["stl"] == 0, f"patched block-sparse kernel spills: {c}"
    for c in result["fwd"]:
        assert c["utmaldg"] > 0 and c["kv_subtile"] == 128 // c["config"]["tile_n"], c
    assert [(c["config"]["m_block"], c["config"]["n_block"], c["config"]["stages_q"]) for c in result["bwd"]] == [
        (64, 64, 1), (64, 64, 1)], result["bwd"]
    assert result["bwd"][1]["config"]["num_threads"] == 128  # d64: the table's 64x128 tile does not divide 64 keys


# ----------------------------------------------------------------------------- fake host path
_BS_FAKE_PROBE = r"""
import json, sys, warnings
site = sys.argv[1]
warnings.filterwarnings("ignore")
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
import flash_attn.cute
assert flash_attn.cute.__file__.startswith(site), f"imported {flash_attn.cute.__file__}, not the patched copy"
from flash_attn.cute import interface
from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
from flash_attn_sm120.testing_mods import prefix_lm

built = []
for name in ("FlashAttentionForwardSm120Tma", "FlashAttentionForwardSm120", "FlashAttentionForwardSm120SplitKV",
             "FlashAttentionBackwardSm120BlockSparse", "FlashAttentionBackwardSm120Mods",
             "FlashAttentionBackwardSm120Tuned"):
    base = getattr(interface, name)

    def init(self, *args, _base=base, _name=name, **kwargs):  # test-only: see what the dispatch builds
        cfg = args[4] if len(args) > 4 else None
        built.append(dict(
            cls=_name, pack_gqa=kwargs.get("pack_gqa"), tile=[kwargs.get("tile_m"), kwargs.get("tile_n")],
            threads=kwargs.get("num_threads"), causal=kwargs.get("is_causal"),
            subtiles=[kwargs.get("q_subtile_factor"), kwargs.get("kv_subtile_factor")], has_full=kwargs.get("has_full"),
            mask_mod=getattr(kwargs.get("mask_mod"), "__name__", None), deterministic=kwargs.get("deterministic"),
            fused_turns=kwargs.get("fused_turns"), ordered_tiles=kwargs.get("ordered_tiles"),
            bwd=None if cfg is None else [cfg.num_threads, cfg.m_block, cfg.n_block, cfg.stages_q, cfg.stages_do]))
        _base.__init__(self, *args, **kwargs)

    setattr(interface, name, type(name, (base,), {"__init__": init}))


def lists(b, h, m, n, block, full=True):
    cnt = torch.empty(b, h, m, dtype=torch.int32, device="cuda")
    idx = torch.empty(b, h, m, n, dtype=torch.int32, device="cuda")
    return BlockSparseTensorsTorch(cnt, idx, cnt.clone() if full else None, idx.clone() if full else None,
                                   block_size=block)


def qkv(b, sq, sk, h, hk, d, dtype=torch.bfloat16):
    return (torch.empty(b, sq, h, d, dtype=dtype, device="cuda"), torch.empty(b, sk, hk, d, dtype=dtype, device="cuda"),
            torch.empty(b, sk, hk, d, dtype=dtype, device="cuda"))


def run(name, fn):
    before, keys = len(built), (len(interface._flash_attn_fwd.compile_cache.cache),
                                len(interface._flash_attn_bwd.compile_cache.cache))
    row = dict(name=name, error=None)
    try:
        res = fn()
        row["shapes"] = [list(t.shape) for t in res[:3] if t is not None]
    except Exception as e:  # the refusals
        row["error"] = f"{type(e).__name__}: {e}"
    row["built"] = built[before:]
    row["new_keys"] = [len(interface._flash_attn_fwd.compile_cache.cache) - keys[0],
                       len(interface._flash_attn_bwd.compile_cache.cache) - keys[1]]
    out.append(row)


out = []
fwd, bwd = interface._flash_attn_fwd, interface._flash_attn_bwd
with FakeTensorMode():
    q, k, v = qkv(2, 517, 700, 4, 4, 128)
    o = torch.empty_like(q)
    lse = torch.empty(2, 4, 517, dtype=torch.float32, device="cuda")
    sparse = lists(2, 4, 5, 6, (128, 128))
    run("d128 128x128 lists, mask_mod", lambda: fwd(q, k, v, mask_mod=prefix_lm, block_sparse_tensors=sparse,
                                                    return_lse=True))
    run("the same with num_splits=4", lambda: fwd(q, k, v, mask_mod=prefix_lm, block_sparse_tensors=sparse,
                                                  return_lse=True, num_splits=4))
    run("d128 causal", lambda: fwd(q, k, v, causal=True, block_sparse_tensors=sparse))
    qg, kg, vg = qkv(2, 300, 520, 8, 2, 64)
    run("d64 GQA 4:1, 64x128 blocks shared by the heads", lambda: fwd(
        qg, kg, vg, block_sparse_tensors=lists(2, 1, 5, 5, (64, 128), full=False)))
    q3, k3, v3 = qkv(1, 300, 520, 6, 2, 96)
    run("d96 GQA 3:1, shared lists: 128-row tiles cannot pack 3", lambda: fwd(
        q3, k3, v3, block_sparse_tensors=lists(1, 1, 3, 5, (128, 128))))
    q192, k192, v192 = qkv(1, 256, 256, 2, 2, 192)
    run("d192", lambda: fwd(q192, k192, v192, block_sparse_tensors=lists(1, 2, 2, 2, (128, 128))))
    run("96-row blocks", lambda: fwd(q, k, v, block_sparse_tensors=lists(2, 4, 6, 6, (96, 128))))
    run("no block_size, ambiguous", lambda: fwd(q, k, v, block_sparse_tensors=sparse._replace(block_size=None)))
    qv_, kv_ = torch.empty(517, 4, 128, dtype=torch.bfloat16, device="cuda"), torch.empty(700, 4, 128, dtype=torch.bfloat16, device="cuda")
    cu_q = torch.empty(2, dtype=torch.int32, device="cuda")
    cu_k = torch.empty(2, dtype=torch.int32, device="cuda")
    run("varlen, dense-form lists", lambda: fwd(qv_, kv_, kv_, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=517,
                                                max_seqlen_k=700, block_sparse_tensors=lists(1, 4, 5, 6, (128, 128))))
    cu3 = torch.empty(3, dtype=torch.int32, device="cuda")
    vcnt = torch.empty(4, 6, dtype=torch.int32, device="cuda")
    vidx = torch.empty(4, 30, dtype=torch.int32, device="cuda")
    varlen_lists = BlockSparseTensorsTorch(vcnt, vidx, vcnt.clone(), vidx.clone(), cu_total_m_blocks=cu3,
                                           cu_block_idx_offsets=cu3.clone(), block_size=(128, 128))
    run("varlen lists", lambda: fwd(qv_, kv_, kv_, cu_seqlens_q=cu3, cu_seqlens_k=cu3, max_seqlen_q=400,
                                    max_seqlen_k=500, block_sparse_tensors=varlen_lists))
    run("varlen lists, 256-row blocks", lambda: fwd(qv_, kv_, kv_, cu_seqlens_q=cu3, cu_seqlens_k=cu3, max_seqlen_q=400,
                                                    max_seqlen_k=500,
                                                    block_sparse_tensors=varlen_lists._replace(block_size=(256, 128))))
    run("seqused_k alone", lambda: fwd(q, k, v, seqused_k=cu_q, block_sparse_tensors=sparse))
    kp = torch.empty(8, 128, 4, 128, dtype=torch.bfloat16, device="cuda")
    pages = torch.empty(2, 4, dtype=torch.int32, device="cuda")
    run("paged", lambda: fwd(q, kp, kp, page_table=pages, block_sparse_tensors=lists(2, 4, 5, 4, (128, 128))))
    # backward: the Q-direction lists, (b, h, kv blocks) counts
    bsparse = lists(2, 4, 6, 5, (128, 128))
    run("bwd d128 128x128 lists, mask_mod", lambda: bwd(q, k, v, o, o, lse, mask_mod=prefix_lm,
                                                        block_sparse_tensors=bsparse))
    og, lseg = torch.empty_like(qg), torch.empty(2, 8, 300, dtype=torch.float32, device="cuda")
    run("bwd d64 GQA 4:1, 128x64 blocks, mask lists only", lambda: bwd(
        qg, kg, vg, og, og, lseg, block_sparse_tensors=lists(2, 8, 9, 3, (128, 64), full=False)))
    run("bwd causal", lambda: bwd(q, k, v, o, o, lse, causal=True, block_sparse_tensors=bsparse))
    run("bwd deterministic", lambda: bwd(q, k, v, o, o, lse, deterministic=True, block_sparse_tensors=bsparse))
    run("bwd no block_size", lambda: bwd(q, k, v, o, o, lse, block_sparse_tensors=bsparse._replace(block_size=None)))
    run("bwd 96-row blocks", lambda: bwd(q, k, v, o, o, lse, block_sparse_tensors=lists(2, 4, 8, 6, (128, 96))))
print("RESULT " + json.dumps(out))
"""


def test_patched_upstream_block_sparse_host_path_runs_on_fake_tensors(tmp_path, monkeypatch):
    """Patch 0006's edits to _flash_attn_fwd / _flash_attn_bwd on the CPU with fake CUDA tensors, SM120
    selected: block-sparse forwards build the TMA class with the package's config for the sparse block and
    upstream's subtile factors (num_splits stays a hint, packed GQA only where the tile holds whole head
    groups), block-sparse backwards the block-sparse class with one Q/dO stage on a tile dividing the
    block, its K/V tiles longest first unless deterministic; what neither takes is refused by name."""
    _cpu_sm120(monkeypatch)
    result = {r["name"]: r for r in _probe(_patched_site(tmp_path, sorted(PATCH_DIR.glob("*.patch"))),
                                           script=_BS_FAKE_PROBE)}

    def one(name, cls, new_keys):
        r = result[name]
        assert r["error"] is None and len(r["built"]) == 1 and r["built"][0]["cls"] == cls, r
        assert r["new_keys"] == new_keys, r
        return r["built"][0]

    tma = "FlashAttentionForwardSm120Tma"
    first = one("d128 128x128 lists, mask_mod", tma, [1, 0])
    assert (first["tile"], first["threads"], first["subtiles"], first["mask_mod"]) == (
        [128, 64], 256, [1, 2], "prefix_lm"), first
    assert first["ordered_tiles"] is True  # dense q: the tiles launch longest list first
    assert result["d128 128x128 lists, mask_mod"]["shapes"] == [[2, 517, 4, 128], [2, 4, 517]]
    split = result["the same with num_splits=4"]  # unsplit: the same compile key, so the same kernel
    assert split["error"] is None and split["new_keys"] == [0, 0] and not split["built"], split
    assert one("d128 causal", tma, [1, 0])["causal"] is True
    assert one("bwd causal", "FlashAttentionBackwardSm120BlockSparse", [0, 1])["causal"] is True  # inside listed tiles
    det = one("bwd deterministic", "FlashAttentionBackwardSm120BlockSparse", [0, 1])  # turns from the lists
    assert det["deterministic"] is True and det["fused_turns"] is True, det
    assert det["ordered_tiles"] is False  # the deterministic walk keeps the grid order (no deadlock)
    gqa = one("d64 GQA 4:1, 64x128 blocks shared by the heads", tma, [1, 0])
    assert gqa["ordered_tiles"] is True  # packed rows: tile m reads sparse row m // (4 x subtiles)
    assert (gqa["tile"], gqa["threads"], gqa["subtiles"], gqa["pack_gqa"]) == ([64, 64], 128, [1, 2], True), gqa
    varlen = one("varlen lists", tma, [1, 0])  # upstream's varlen lists: one Q tile per sparse block
    assert (varlen["tile"], varlen["subtiles"], varlen["pack_gqa"]) == ([128, 64], [1, 2], False), varlen
    assert varlen["ordered_tiles"] is False  # varlen q keeps its own scheduler
    odd = one("d96 GQA 3:1, shared lists: 128-row tiles cannot pack 3", tma, [1, 0])
    assert (odd["tile"], odd["pack_gqa"]) == ([128, 32], False), odd  # d96: the first entry, 4w 128x32
    for name, error in (("d192", "NotImplementedError: block sparsity on SM120 runs in the TMA family: head dims"),
                        ("96-row blocks", "ValueError: block sparsity: sparse block size (96, 128) is not a multiple"),
                        ("no block_size, ambiguous", "ValueError: block_sparse_tensors: cannot infer the sparse block"),
                        # upstream's own rule for packed q
                        ("varlen, dense-form lists", "AssertionError: Varlen block sparsity requires "
                                                     "block_sparse_tensors.cu_total_m_blocks"),
                        ("varlen lists, 256-row blocks", "ValueError: varlen block sparsity needs the sparse Q block "
                                                         "to be one kernel tile"),
                        ("seqused_k alone", "NotImplementedError: block sparsity on SM120 runs in the TMA family, "
                                            "which does not take seqused_k without cu_seqlens_k"),
                        ("paged", "NotImplementedError: block sparsity on SM120 runs in the TMA family, which does "
                                  "not take paged KV"),
                        ("bwd no block_size", "ValueError: the SM120 block-sparse backward needs block_sparse_tensors."
                                              "block_size"),
                        ("bwd 96-row blocks", "ValueError: block_sparse_tensors: sparse block (128, 96) is not a "
                                              "multiple of an SM120 backward tile")):
        r = result[name]
        assert r["error"] is not None and r["error"].startswith(error), r
        assert r["new_keys"] == [0, 0] and not r["built"], r
    bs = "FlashAttentionBackwardSm120BlockSparse"
    mha = one("bwd d128 128x128 lists, mask_mod", bs, [0, 1])
    # the walk's own d128 config (sm120_bwd_block_sparse_preferred): 32x128, before the table's 64x64
    assert (mha["bwd"], mha["subtiles"], mha["has_full"], mha["mask_mod"]) == (
        [256, 32, 128, 1, 1], [4, 1], True, "prefix_lm"), mha
    assert mha["ordered_tiles"] is True  # the K/V tiles launch longest list first
    assert result["bwd d128 128x128 lists, mask_mod"]["shapes"] == [[2, 517, 4, 128], [2, 700, 4, 128], [2, 700, 4, 128]]
    gqa_bwd = one("bwd d64 GQA 4:1, 128x64 blocks, mask lists only", bs, [0, 1])
    assert (gqa_bwd["bwd"], gqa_bwd["subtiles"], gqa_bwd["has_full"], gqa_bwd["mask_mod"]) == (
        [128, 64, 64, 1, 1], [2, 1], False, None), gqa_bwd
    assert gqa_bwd["ordered_tiles"] is True
    assert result["bwd d64 GQA 4:1, 128x64 blocks, mask lists only"]["shapes"] == [
        [2, 300, 8, 64], [2, 520, 2, 64], [2, 520, 2, 64]]


# ---------------------------------------------------------------------------- lifted modules
def _imports(text: str) -> set:
    import ast

    return {n.module for n in ast.parse(text).body if isinstance(n, ast.ImportFrom)}


def test_block_sparse_modules_are_lifted_without_package_parts():
    from patchgen import step_block_sparse, step_tma

    allowed = ("__future__", "typing", "functools", "cutlass", "cuda", "flash_attn")
    walk = step_tma.render_block_sparse_module()
    mp.check_no_package_refs(walk, "flash_fwd_sm120_block_sparse.py")
    for there in ("class SparseTiles(NamedTuple)", "def tile_lists(", "def load_tiles(", "def consume_tiles(",
                  "def _tiles_in_list("):
        assert there in walk, there
    assert all(m.split(".")[0] in allowed for m in _imports(walk)), _imports(walk)
    tma = mp.render_tma_module()
    assert "from flash_attn.cute import flash_fwd_sm120_block_sparse as fwd_block_sparse\n" in tma
    assert "fwd_block_sparse.py" not in tma and tma.count("flash_fwd_sm120_block_sparse.py") == 3

    bwd = mp.render_bwd_block_sparse_module()
    mp.check_no_package_refs(bwd, "flash_bwd_sm120_block_sparse.py")
    for gone in ("bwd_mods.py", "bwd_sm120.py", "fwd_block_sparse.py", "upstream"):
        assert gone not in bwd.lower(), gone
    assert "class FlashAttentionBackwardSm120BlockSparse(FlashAttentionBackwardSm120Mods)" in bwd
    imported = _imports(bwd)
    assert {"flash_attn.cute.flash_bwd_sm120_mods", "flash_attn.cute.flash_bwd_sm120_tuned",
            "flash_attn.cute.flash_fwd_sm120_block_sparse"} <= imported  # patches 0005, 0004, 0003
    assert all(m.split(".")[0] in allowed for m in imported), imported

    fwd_cfg, bwd_cfg = step_block_sparse.render_fwd_block_sparse_configs(), step_block_sparse.render_bwd_block_sparse_configs()
    for text in (fwd_cfg, bwd_cfg):
        mp.check_no_package_refs(text, "configs")
    for there in ("SM120_BLOCK_SPARSE_CONFIGS: dict[int, tuple[Sm120FwdConfig, ...]]", "def sm120_sparse_block_size(",
                  "def sm120_block_sparse_config(", "sm120_block_sparse_candidates(head_dim, head_dim_v, block_size, varlen_q=varlen_q)"):
        assert there in fwd_cfg, there
    assert "def sm120_check_block_sparse_bwd(" in bwd_cfg and "SM120_BWD_BLOCK_SPARSE_DEFAULT = Sm120BwdConfig(" in bwd_cfg


class _Tree:
    """A step's view of one file (Context.read / write)."""

    def __init__(self, files: dict):
        self.files = dict(files)

    def read(self, rel):
        return self.files[rel]

    def write(self, rel, text):
        self.files[rel] = text


def test_block_sparse_patch_needs_every_anchor(tmp_path, monkeypatch):
    """Every anchor is needed: the interface and config-module edits on top of 0001-0005, the module edits
    on the package's sources (the walk 0003 lifts, the TMA module's block-sparse parts, the backward 0006
    lifts), the lifted host rules, and the quoted session record."""
    import inspect
    import re

    from flash_attn_sm120 import block_sparse_bwd
    from flash_attn_sm120.kernels import bwd_block_sparse, fwd_block_sparse, fwd_tma
    from patchgen import step_block_sparse, step_tma

    repo = _pristine_repo(tmp_path)
    for patch in sorted(PATCH_DIR.glob("*.patch"))[:5]:
        mp.git(repo, "apply", str(patch))
    interface = (repo / "flash_attn" / "cute" / "interface.py").read_text()
    mp.apply_edits(interface, mp._BS_INTERFACE_EDITS, "interface.py")  # applies as is
    for what, old, _new in mp._BS_INTERFACE_EDITS:
        with pytest.raises(mp.AnchorError, match=re.escape(f"interface.py ({what})")):
            mp.apply_edits(interface.replace(old, "", 1), mp._BS_INTERFACE_EDITS, "interface.py")

    rels = (step_block_sparse.FWD_CONFIGS_REL, step_block_sparse.BWD_CONFIGS_REL)
    files = {rel: (repo / rel).read_text() for rel in rels}
    tree = _Tree(files)
    step_block_sparse.patch_fwd_configs(tree)
    step_block_sparse.patch_bwd_configs(tree)
    assert "def sm120_block_sparse_config(" in tree.files[rels[0]] and "SM120_BWD_BLOCK_SPARSE_DEFAULT" in tree.files[rels[1]]
    fwd_anchors = [old for _what, old, _new in step_block_sparse._FWD_CONFIGS_EDITS] + ["\n\n\nDECODE_MAX_SEQLEN_Q = 16\n"]
    for rel, patch_fn, anchors in ((rels[0], step_block_sparse.patch_fwd_configs, fwd_anchors),
                                   (rels[1], step_block_sparse.patch_bwd_configs,
                                    ["from dataclasses import dataclass, field\n"])):
        for old in anchors:
            with pytest.raises(mp.AnchorError, match=re.escape(rel)):
                patch_fn(_Tree({rel: files[rel].replace(old, "", 1)}))

    def without(render, source, edits, fixed=()):
        assert render(source) == render()
        for old in [e[0] for e in edits] + list(fixed):
            first = old.strip().splitlines()[0]
            with pytest.raises(mp.AnchorError, match=re.escape(repr(first)) + "|" + re.escape(first)):
                render(source.replace(old, "", 1))

    without(step_tma.render_block_sparse_module, inspect.getsource(fwd_block_sparse), step_tma._BLOCK_SPARSE_MODULE_EDITS)
    with pytest.raises(mp.AnchorError, match="imports"):
        step_tma.render_block_sparse_module(inspect.getsource(fwd_block_sparse).replace(
            "from flash_attn.cute.seqlen_info import SeqlenInfoQK\n",
            "from flash_attn.cute.seqlen_info import SeqlenInfoQK\nfrom flash_attn_sm120 import hardware\n"))
    tma = inspect.getsource(fwd_tma)

    def render_tma(text=None):  # the TMA module lifted with fwd_tma.py's text replaced
        return mp.render_tma_module(None if text is None else {"fwd_tma": text})

    block_sparse_anchors = [old for old, _new in step_tma._TMA_DOC_EDITS if "block" in old]
    assert len(block_sparse_anchors) == 1  # the docstring's sentence
    without(render_tma, tma, [(old,) for old in block_sparse_anchors])
    with pytest.raises(mp.AnchorError, match="fwd_block_sparse.py"):  # each comment naming the walk's module
        render_tma(tma.replace("# block sparsity (fwd_block_sparse.py)", "# block sparsity", 1))
    # the walk's import becomes upstream's module (the folded modules import it from the package)
    upstream_imports = step_tma._UPSTREAM_IMPORTS
    monkeypatch.setattr(step_tma, "_UPSTREAM_IMPORTS", {
        k: v for k, v in upstream_imports.items() if k != ("flash_attn_sm120.kernels", "fwd_block_sparse")})
    with pytest.raises(mp.AnchorError, match="import fwd_block_sparse` has no upstream counterpart"):
        render_tma()
    monkeypatch.setattr(step_tma, "_UPSTREAM_IMPORTS", upstream_imports)
    without(mp.render_bwd_block_sparse_module, inspect.getsource(bwd_block_sparse), step_block_sparse._MODULE_EDITS)

    plan = inspect.getsource(block_sparse_bwd.plan)
    for said in step_block_sparse._PLAN_RULE:
        with pytest.raises(mp.AnchorError, match="plan no longer has"):
            step_block_sparse.render_bwd_block_sparse_configs(plan.replace(said, "", 1))
    real = step_block_sparse.top_level_source
    for old, _new in step_block_sparse._FWD_LIFT_EDITS:
        monkeypatch.setattr(step_block_sparse, "top_level_source", lambda m, n: real(m, n).replace(old, ""))
        with pytest.raises(mp.AnchorError, match=re.escape(old.splitlines()[0])):
            step_block_sparse.render_fwd_block_sparse_configs()
    monkeypatch.setattr(step_block_sparse, "top_level_source", real)

    record = step_block_sparse.DEFAULT_SESSION_RECORD.read_text()
    assert step_block_sparse.session_facts()["tests"] > 0
    for said in ("one NVIDIA H200 in SM120 emulation", "30 passed", "`tests/test_block_sparse_gpu.py`", "They cover"):
        assert said in record, said
        moved = tmp_path / "record.md"
        moved.write_text(record.replace(said, "", 1))
        with pytest.raises(mp.AnchorError, match="the record no longer says"):
            step_block_sparse.session_facts(moved)
    with pytest.raises(mp.AnchorError, match="is missing"):  # refused before the step writes anything
        step_block_sparse.step_sm120_block_sparse(None, tmp_path / "absent.md")


def test_block_sparse_patch_commit_message_quotes_the_record():
    from patchgen import step_block_sparse

    facts = step_block_sparse.session_facts()
    message = sorted(PATCH_DIR.glob("0006-*.patch"))[0].read_text().split("\n---\n")[0]
    text = " ".join(message.replace("-\n  ", "-").split())  # lines wrapped at a hyphen ("per-head") rejoined
    assert f"{facts['test_file']}, {facts['tests']} tests" in text and facts["tests"] == 30
    assert f"all passed ({facts['log']}, recorded in configs/measurements/2026-12-01_session11.md)" in text
    assert facts["gpu"] in text and f"They cover {facts['cover']}." in text
    assert "has not run on a GPU yet" in text and "upstream's compute_block_sparsity" not in text


# ------------------------------------------------------------------------------------ GPU
_GPU_BS_PROBE = r"""
import json, sys
site = sys.argv[1]
import torch
import flash_attn.cute
assert flash_attn.cute.__file__.startswith(site), f"imported {flash_attn.cute.__file__}, not the patched copy"
from flash_attn.cute import interface
from flash_attn_sm120 import testing, testing_sparse
from flash_attn_sm120.testing_mods import spec
from flash_attn_sm120.testing_ref import attention_ref

built = []
for name in ("FlashAttentionForwardSm120Tma", "FlashAttentionBackwardSm120BlockSparse"):
    base = getattr(interface, name)

    def init(self, *a, _base=base, _name=name, **k):  # test-only: see what the dispatch builds
        tile = [k.get("tile_m"), k.get("tile_n")] if len(a) < 5 else [a[4].m_block, a[4].n_block]
        built.append(dict(cls=_name, tile=tile, subtiles=[k.get("q_subtile_factor"), k.get("kv_subtile_factor")]))
        _base.__init__(self, *a, **k)

    setattr(interface, name, type(name, (base,), {"__init__": init}))


def ref(q, k, v, keep, upcast):
    outs, lses = [], []
    for i in range(q.shape[0]):  # keep is per batch row; attention_ref's keep_fn is per sequence
        kb = keep[i:i + 1]
        o, lse = attention_ref(q[i:i + 1], k[i:i + 1], v[i:i + 1], upcast=upcast, keep_fn=lambda h, qi, ki: kb)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def grads(fn, q, k, v, dout):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o, lse = fn(q, k, v)
    o.backward(dout)
    return o.detach(), lse.detach(), q.grad, k.grad, v.grad


def checked(name, fn):
    try:
        fn()
    except testing.CheckFailure as e:
        return f"{name}: {e}"[:2000]
    return None


CASES = [  # name, (b, h, hk, sq, sk, d), sparse block, full lists, mask_mod on partial blocks, heads of the lists
    ("d128 MHA, 128x128 blocks, prefix mask_mod", (2, 4, 4, 517, 700, 128), (128, 128), True, "prefix", 4),
    ("d64 GQA 4:1, 64x128 blocks shared by the heads", (2, 8, 2, 300, 520, 64), (64, 128), True, None, 1),
    ("d96, 128x256 blocks, mask lists only", (1, 3, 3, 640, 1000, 96), (128, 256), False, None, 3),
]
out = []
nan = float("nan")
for i, (name, (b, h, hk, sq, sk, d), block, with_full, mod, heads) in enumerate(CASES):
    g = torch.Generator(device="cuda").manual_seed(100 + i)
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    dout = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    kinds = testing_sparse.random_block_map(b, heads, -(-sq // block[0]), -(-sk // block[1]), density=0.4,
                                            full_share=0.5, generator=g)
    fwd_lists = testing_sparse.lists_from_map(kinds, block, with_full)
    bwd_lists = testing_sparse.lists_from_map(kinds.transpose(2, 3).contiguous(), block, with_full)
    mask_mod = twin = None
    if mod is not None:
        mask_mod = spec(mod).mask_mod
        twin = lambda bi, hi, qi, ki, _s=spec(mod): _s.keep_twin(bi, hi, qi, ki, None)
    if not with_full:  # the lists put full blocks among the mask ones: the mask_mod (if any) applies to all
        kinds = torch.where(kinds > 0, testing_sparse.PARTIAL, testing_sparse.SKIP).to(torch.int32)
    keep = testing_sparse.keep_from_map(kinds, block, sq, sk, twin).expand(b, h, sq, sk)

    before = len(built)
    o = torch.full((b, sq, h, d), nan, device="cuda", dtype=torch.bfloat16)  # poisoned: every element written
    lse = torch.full((b, h, sq), nan, device="cuda", dtype=torch.float32)
    o, lse = interface._flash_attn_fwd(q, k, v, mask_mod=mask_mod, block_sparse_tensors=fwd_lists, return_lse=True,
                                       out=o, lse=lse)[:2]
    dq, dk, dv = (torch.full_like(t, nan) for t in (q, k, v))
    dq, dk, dv = interface._flash_attn_bwd(q, k, v, o, dout, lse, mask_mod=mask_mod, block_sparse_tensors=bwd_lists,
                                           dq=dq, dk=dk, dv=dv)[:3]
    torch.cuda.synchronize()
    reference = grads(lambda *t: ref(*t, keep, True), q.float(), k.float(), v.float(), dout.float())
    pytorch = grads(lambda *t: ref(*t, keep, False), q, k, v, dout)  # the input precision's own error
    errors = [checked("lse", lambda: testing.assert_lse_close(lse, reference[1], pytorch[1], 1e-2, 1e-3))]
    errors += [checked(n, lambda a=a, r=r, p=p, n=n: testing.assert_close_to_ref(n, a, r, p, q.dtype))
               for n, a, r, p in zip(("out", "dq", "dk", "dv"), (o, dq, dk, dv), reference[:1] + reference[2:],
                                     pytorch[:1] + pytorch[2:])]
    out.append(dict(name=name, d=d, block=list(block), built=built[before:], errors=[e for e in errors if e],
                    visited=float(testing_sparse.computed_fraction(kinds))))
print("RESULT " + json.dumps(out))
"""


@pytest.mark.gpu
def test_patched_upstream_block_sparse_matches_reference(tmp_path, monkeypatch):
    """Patch 0006 on a GPU (SM120 dispatch forced with FLASH_ATTENTION_ARCH): random partial/full/skipped
    lists (MHA d128 with a mask_mod on the partial blocks; GQA 4:1 d64 with lists shared by the heads on
    64x128 blocks; d96 on 128x256 blocks without full lists) run the TMA forward and the block-sparse
    backward with the subtile factors of the sparse block, and out, LSE and dq/dk/dv match fp32 autograd of
    the dense mask the lists mean (upstream's tolerance rule; outputs and gradients NaN-poisoned)."""
    from flash_attn_sm120 import block_sparse

    monkeypatch.setenv("FLASH_ATTENTION_ARCH", "sm_120")  # for the probe subprocess's environment
    results = _probe(_patched_site(tmp_path, sorted(PATCH_DIR.glob("*.patch"))), script=_GPU_BS_PROBE, gpu=True)
    assert len(results) == 3
    for r in results:
        assert not r["errors"], r
        assert 0 < r["visited"] < 1, r  # some blocks skipped, some computed
        assert [x["cls"] for x in r["built"]] == ["FlashAttentionForwardSm120Tma",
                                                  "FlashAttentionBackwardSm120BlockSparse"], r
        for x in r["built"]:
            assert [s * t for s, t in zip(x["subtiles"], x["tile"])] == r["block"], r
        fwd_tile = r["built"][0]["tile"]
        first = block_sparse.forward_candidates(r["d"], r["d"], tuple(r["block"]))[0]
        assert fwd_tile == [first.tile_m, first.tile_n], r  # the package's config for the block
