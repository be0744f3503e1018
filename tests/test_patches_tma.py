"""Upstream patch 0003 (the TMA forward family): its entries compile for sm_120a and are chosen only where
taken, the module is lifted without package parts, and on a GPU the patched forward matches the reference.
Helpers are test_patches.py's.
"""

from __future__ import annotations

import shutil

import pytest

from flash_attn_sm120.config import load_fwd_table, select_fwd_config
from test_patches import PATCH_DIR, _patched_site, _probe, mp  # noqa: F401


pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


# ------------------------------------------------------------------------------- TMA family patch
_TMA_PROBE = r"""
import json, sys
site = sys.argv[1]
import flash_attn.cute
assert flash_attn.cute.__file__.startswith(site), f"imported {flash_attn.cute.__file__}, not the patched copy"
from flash_attn.cute import flash_fwd_sm120_configs as configs
from flash_attn.cute.flash_fwd_sm120_tma import FlashAttentionForwardSm120Tma
from flash_attn.cute.interface import _get_fwd_config
from flash_attn_sm120.codegen import compile_fwd_cubin, inspect_cubin
from flash_attn_sm120.config import FwdConfig

out = {"entries": [], "tiles": {}}
for e in configs.SM120_FWD_TABLE:
    if e.config.family != "tma":
        continue
    cfg = e.config
    cubin, _ = compile_fwd_cubin(FwdConfig(**cfg.to_dict()), e.head_dim, causal=e.mask == "causal",
                                 kernel_cls=FlashAttentionForwardSm120Tma)
    res, hist, _ = inspect_cubin(cubin)
    out["entries"].append(dict(d=e.head_dim, mask=e.mask, config=cfg.to_dict(), regs=res["regs"], stack=res["stack"],
                               ldl=hist.get("LDL", 0), stl=hist.get("STL", 0), utmaldg=hist.get("UTMALDG", 0),
                               hmma=hist.get("HMMA", 0)))
    for ok in (True, False):
        c = _get_fwd_config(
            arch=120, head_dim=e.head_dim, head_dim_v=e.head_dim, max_seqlen_q=4096, max_seqlen_k=4096,
            num_head_kv=8, qhead_per_kvhead=1, pack_gqa=False, batch_size=2, causal=e.mask == "causal",
            local=False, window_size_left=None, window_size_right=None, num_splits=1, device=None,
            sm120_tma_ok=ok,
        )
        out["tiles"][f"{e.head_dim}/{e.mask}/{ok}"] = [c.m_block_size, c.n_block_size]
    out["tiles"][f"{e.head_dim}/{e.mask}/cpasync"] = [
        configs.sm120_fwd_config(e.head_dim, e.head_dim, e.mask == "causal", False).tile_m,
        configs.sm120_fwd_config(e.head_dim, e.head_dim, e.mask == "causal", False).tile_n,
    ]
    # a key may list several TMA entries (one per dtype they run): the interface takes the first
    out["tiles"].setdefault(f"{e.head_dim}/{e.mask}/tma", [cfg.tile_m, cfg.tile_n])
out["packs"] = {r: configs.sm120_tma_packs(r) for r in (1, 2, 3, 4, 6, 8, 16)}
out["fp16_ok"] = {f"{e.head_dim}/{e.mask}": configs.sm120_tma_fp16_ok(e.head_dim, e.head_dim, e.mask == "causal", False)
                  for e in configs.SM120_FWD_TABLE if e.config.family == "tma"}
out["varlen_ok"] = {f"{e.head_dim}/{e.mask}": configs.sm120_tma_varlen_ok(e.head_dim, e.head_dim, e.mask == "causal",
                                                                         False)
                    for e in configs.SM120_FWD_TABLE if e.config.family == "tma"}
out["tma_tile_m"] = sorted({e.config.tile_m for e in configs.SM120_FWD_TABLE if e.config.family == "tma"})
print("RESULT " + json.dumps(out))
"""


def test_patched_upstream_tma_entries_compile_and_are_chosen_only_when_taken(tmp_path):
    """Patch 0003: the table's TMA entries compile for sm_120a on the patched upstream (TMA loads,
    mma.sync, no local memory), and _get_fwd_config gives their tiles only with sm120_tma_ok."""
    table = mp.load_table(mp.DEFAULT_TABLE)
    if not any(e.config.family == "tma" for e in table):
        pytest.skip("the table has no TMA entry")
    result = _probe(_patched_site(tmp_path, sorted(PATCH_DIR.glob("*.patch"))), script=_TMA_PROBE)
    want = {(e.head_dim, e.mask) for e in table if e.config.family == "tma"}
    assert {(c["d"], c["mask"]) for c in result["entries"]} == want
    for c in result["entries"]:
        assert c["utmaldg"] > 0 and c["hmma"] > 0, c
        assert c["stack"] == 0 and c["ldl"] == 0 and c["stl"] == 0, f"patched TMA kernel spills: {c}"
        key = f"{c['d']}/{c['mask']}"
        tiles = result["tiles"]
        assert tiles[f"{key}/True"] == tiles[f"{key}/tma"], f"TMA-capable call did not get the TMA entry: {key}"
        assert tiles[f"{key}/False"] == tiles[f"{key}/cpasync"], f"other calls must get the cp.async entry: {key}"
    # GQA packing on the TMA family: only ratios that every TMA entry's tile_m holds whole
    for ratio, packs in result["packs"].items():
        assert packs == all(m % int(ratio) == 0 for m in result["tma_tile_m"]), (ratio, packs, result["tma_tile_m"])
    assert result["packs"]["4"] and not result["packs"]["3"]
    # float16 only where the key's TMA entry does not spill in float16 (the package's fp16_register_error)
    from flash_attn_sm120.kernels.fwd_tma import fp16_register_error

    for key, ok in result["fp16_ok"].items():
        d, mask = int(key.split("/")[0]), key.split("/")[1]
        first = select_fwd_config(tuple(table), d, d, mask == "causal", False)
        want = first.family != "tma" or fp16_register_error(d, first.tile_m, first.tile_n, first.num_threads) is None
        assert ok == want, (key, ok, first)
    # varlen only where the key's TMA entry does not spill with varlen (the package's varlen_register_error)
    from flash_attn_sm120.kernels.fwd_tma import varlen_register_error

    for key, ok in result["varlen_ok"].items():
        d, mask = int(key.split("/")[0]), key.split("/")[1]
        first = select_fwd_config(tuple(table), d, d, mask == "causal", False)
        want = first.family != "tma" or varlen_register_error(d, first.tile_m, first.tile_n, first.num_threads) is None
        assert ok == want, (key, ok, first)


def test_tma_module_is_lifted_without_package_parts():
    text = mp.render_tma_module()
    mp.check_no_package_refs(text, "flash_fwd_sm120_tma.py")
    for gone in ("def unsupported_reason", "PROPOSED_CONFIGS", "emulation_storage", "emulate_host_smem", "__all__",
                 "Mixin", "Where the code lives"):
        assert gone not in text, gone
    # the package's modules folded into one class: the rules, the GEMM helpers and every role's methods
    assert text.count("\nclass ") == 4  # RegisterSplit, the persistent and ordered tile schedulers, the kernel
    assert "class PersistentTileScheduler(SingleTileLPTScheduler):" in text
    assert "class WorkOrderedTileScheduler:" in text
    assert "class FlashAttentionForwardSm120Tma(FlashAttentionForwardSm120):" in text
    for there in ("def tma_config_error(", "def gemm_rs_by_ldmatrix(", "    def __call__(", "    def kernel(",
                  "    def load(", "    def mma_one_n_block(", "    def _pingpong_sync(", "    def epilogue("):
        assert there in text, there
    assert text.index("def register_split(") < text.index("def gemm_rs_by_ldmatrix(") < text.index("    def kernel(")
    assert "SM120_NUM_SMS = 188" in text and "hardware.DEFAULT_NUM_SMS" not in text


def test_tma_fold_refuses_what_it_cannot_fold():
    """A mixin module with more than its class, or a mixin the class does not name, fails the step."""
    import inspect

    from flash_attn_sm120.kernels import fwd_tma, fwd_tma_epilogue

    epilogue = inspect.getsource(fwd_tma_epilogue)
    with pytest.raises(mp.AnchorError, match="exactly one class"):
        mp.render_tma_module({"fwd_tma_epilogue": epilogue + "\n\nLATE = 1\n"})
    with pytest.raises(mp.AnchorError, match="is not among the bases"):
        mp.render_tma_module({"fwd_tma_epilogue": epilogue.replace("class TmaEpilogueMixin:", "class Other:")})
    with pytest.raises(mp.AnchorError, match="Where the code lives"):
        mp.render_tma_module({"fwd_tma": inspect.getsource(fwd_tma).replace("Where the code lives:", "Code:")})


_GPU_TMA_PROBE = r"""
import json, sys
site = sys.argv[1]
import torch
import flash_attn.cute
assert flash_attn.cute.__file__.startswith(site), f"imported {flash_attn.cute.__file__}, not the patched copy"
from flash_attn.cute import interface
from flash_attn_sm120 import testing
from flash_attn_sm120.testing import AttnCase, AttnProblem

built = []
for name in ("FlashAttentionForwardSm120Tma", "FlashAttentionForwardSm120"):
    base = getattr(interface, name)

    def init(self, *a, _base=base, _name=name, **k):
        built.append(_name)
        _base.__init__(self, *a, **k)

    setattr(interface, name, type(name, (base,), {"__init__": init}))  # test-only: see what the dispatch builds

CASES = [
    ("dense causal d128: the TMA entry", dict(mask="causal", return_lse=True), dict(seqlens_q=(1000,) * 2, seqlens_k=(1000,) * 2, nheads_kv=4)),
    ("varlen causal d128: the cp.async entry (the TMA entry spills with varlen)",
     dict(mask="causal", q_layout="packed", k_layout="packed"), dict(seqlens_q=(300, 77), seqlens_k=(300, 77), nheads_kv=4)),
    ("GQA 4:1 causal d128, packed by default: the TMA entry", dict(mask="causal", qhead_per_kvhead=4, return_lse=True),
     dict(seqlens_q=(333,) * 2, seqlens_k=(1000,) * 2, nheads_kv=2)),
    ("GQA 3:1 causal d128, packed by default: the cp.async entry", dict(mask="causal", qhead_per_kvhead=3),
     dict(seqlens_q=(333,) * 2, seqlens_k=(333,) * 2, nheads_kv=2)),
    ("bf16 d128 non-causal: the table's first entry", dict(mask="none", return_lse=True),
     dict(seqlens_q=(1000,) * 2, seqlens_k=(777,) * 2, nheads_kv=2)),
    ("fp16 d128 non-causal: not a TMA tile that spills in fp16", dict(dtype="float16", mask="none"),
     dict(seqlens_q=(1000,) * 2, seqlens_k=(777,) * 2, nheads_kv=2)),
    ("varlen d128 non-causal, seqused_q over packed K/V: the TMA entry (ragged descriptors)",
     dict(mask="none", q_layout="padded", k_layout="packed", return_lse=True),
     dict(seqlens_q=(300, 0, 77), seqlens_k=(500, 64, 1000), nheads_kv=2, pad_q=9)),
    ("varlen GQA 4:1 d64 causal, packed by default: the TMA entry", dict(head_dim=64, head_dim_v=64, mask="causal",
     qhead_per_kvhead=4, q_layout="packed", k_layout="packed"), dict(seqlens_q=(300, 77), seqlens_k=(300, 77), nheads_kv=2)),
]
out = []
for name, case_kw, problem_kw in CASES:
    case, problem = AttnCase(**case_kw), AttnProblem(**problem_kw)
    inputs = testing.make_inputs(case, problem)
    kw = testing.api_kwargs(inputs, case, problem)
    left, right = kw.pop("window_size")
    kw.pop("softcap")
    o = torch.full(inputs.out_shape(case.head_dim_v), float("nan"), dtype=case.torch_dtype, device="cuda")
    lse = torch.full(inputs.lse_shape(), float("nan"), dtype=torch.float32, device="cuda") if case.return_lse else None
    before = len(built)
    o, lse = interface._flash_attn_fwd(inputs.q, inputs.k, inputs.v, window_size_left=left, window_size_right=right,
                                       out=o, lse=lse, _arch=120, **kw)[:2]
    torch.cuda.synchronize()
    error = None
    try:
        testing.check_forward(inputs, case, problem, o, lse if case.return_lse else None)
    except AssertionError as e:
        error = str(e)[:2000]
    out.append(dict(name=name, built=built[before:], error=error))
print("RESULT " + json.dumps(out))
"""


@pytest.mark.gpu
def test_patched_upstream_tma_forward_matches_reference(tmp_path):
    """Patch 0003 on a GPU (SM120 dispatch forced, _arch=120): dense causal d128 calls run the TMA
    class (GQA 4:1 packed), GQA 3:1 packed calls the cp.async class, varlen the TMA class where the
    entry does not spill with varlen and q's GQA heads are not packed, all against the fp32 reference
    with poisoned outputs."""
    results = _probe(_patched_site(tmp_path, sorted(PATCH_DIR.glob("*.patch"))), script=_GPU_TMA_PROBE, gpu=True)
    from flash_attn_sm120.kernels.fwd_tma import varlen_register_error

    dense, varlen, packed, odd, bf16_none, fp16_none, varlen_none, varlen_gqa = results
    assert all(r["error"] is None for r in results), results
    assert dense["built"][-1] == "FlashAttentionForwardSm120Tma", dense
    assert varlen["built"][-1] == "FlashAttentionForwardSm120", varlen
    assert packed["built"][-1] == "FlashAttentionForwardSm120Tma", packed
    assert odd["built"][-1] == "FlashAttentionForwardSm120", odd
    from flash_attn_sm120.kernels.fwd_tma import fp16_register_error

    first = select_fwd_config(load_fwd_table(), 128, 128, False, False)
    if first.family == "tma":
        assert bf16_none["built"][-1] == "FlashAttentionForwardSm120Tma", bf16_none
        fp16_tma = fp16_register_error(128, first.tile_m, first.tile_n, first.num_threads) is None
        assert fp16_none["built"][-1] == ("FlashAttentionForwardSm120Tma" if fp16_tma else "FlashAttentionForwardSm120"), fp16_none
        varlen_tma = varlen_register_error(128, first.tile_m, first.tile_n, first.num_threads) is None
        assert varlen_none["built"][-1] == ("FlashAttentionForwardSm120Tma" if varlen_tma else
                                            "FlashAttentionForwardSm120"), varlen_none
    # varlen q with GQA packed (the default): the d64 causal TMA entry takes it
    first64 = select_fwd_config(load_fwd_table(), 64, 64, True, False)
    if first64.family == "tma" and varlen_register_error(64, first64.tile_m, first64.tile_n, first64.num_threads) is None:
        assert varlen_gqa["built"][-1] == "FlashAttentionForwardSm120Tma", varlen_gqa
