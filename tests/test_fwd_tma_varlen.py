"""Varlen in the TMA forward family, on a CPU: the rules, the table's choice, the fuzz paths, sm_120a code.

The family takes packed K/V (cu_seqlens_k, with or without seqused_k) through ragged TMA descriptors
that end at each sequence's seqlen_k, and packed or padded q (cu_seqlens_q / seqused_q) with O stored
through a ragged descriptor that ends at seqlen_q (kernels/fwd_tma.py). It refuses seqused_k alone
(TMA would read the cache rows past seqused_k). A varlen call costs the
MMA warps registers (the lengths are loaded, not kernel parameters): the 32-row tiles at the edge of
the budget spill at d > 64, so the table gives varlen calls the next entry (fwd_tma.varlen_register_error,
compiled against below). GPU correctness: tests/test_fwd_tma_varlen_gpu.py.
"""

import pytest
import torch

from flash_attn_sm120 import codegen, driver, paths
from flash_attn_sm120.config import FwdConfig, family_entries, load_fwd_table, select_fwd_config
from flash_attn_sm120.kernels.fwd_tma import unsupported_reason, varlen_error, varlen_register_error

VARLEN_KINDS = {  # name -> (index tensors, GQA 2:1 packed)
    "packed q, packed k": (("cu_seqlens_q", "cu_seqlens_k"), False),
    "packed q, packed k, GQA packed": (("cu_seqlens_q", "cu_seqlens_k"), True),
    "padded q, packed k with seqused_k": (("seqused_q", "cu_seqlens_k", "seqused_k"), False),
}


def test_varlen_rule():
    assert varlen_error(True, True, False, False) is None
    assert varlen_error(False, True, True, True) is None
    assert "seqused_k without cu_seqlens_k" in varlen_error(False, False, False, True)
    assert "seqused_k without cu_seqlens_k" in varlen_error(True, False, False, True)
    # the d=128 tiles of 32-row warps wider than 48 keys
    assert "tile_n=64" in varlen_register_error(128, 256, 64, 256)
    assert "tile_n=64" in varlen_register_error(96, 256, 64, 256)
    for d, m, n, t in ((128, 256, 48, 256), (128, 128, 64, 256), (96, 128, 64, 256), (64, 256, 64, 256)):
        assert varlen_register_error(d, m, n, t) is None, (d, m, n)


def test_table_gives_varlen_calls_an_entry_that_does_not_spill():
    table = load_fwd_table()
    for d in (64, 96, 128):
        for causal in (False, True):
            cfg = select_fwd_config(table, d, d, causal, False, dtype="bfloat16", varlen=True)
            assert cfg.varlen_error(d) is None, (d, causal, cfg.name)
            dense = select_fwd_config(table, d, d, causal, False, dtype="bfloat16")
            if dense.varlen_error(d) is None:
                assert cfg == dense  # varlen changes the choice only where the dense entry spills


def _statics_for(q, k, cfg=None, **index):
    args = dict(causal=True, local=False, pack_gqa=False, pack_gqa_chosen=False, has_lse=True, cu_seqlens_q=None,
                cu_seqlens_k=None, seqused_q=None, seqused_k=None, window_size_left=None, window_size_right=None,
                score_mod=None, mask_mod=None, aux_tensors=None, config=cfg, emulate_host_smem=None)
    args.update(index)
    return driver.choose_statics(q, k, k, **args)


def test_driver_runs_varlen_on_the_tma_entry():
    """A packed call whose table entry is TMA runs on TMA (before: always the cp.async entry), GQA
    packed; seqused_k alone still gets the cp.async entry."""
    tma = [e for e in load_fwd_table() if e.config.family == "tma" and e.mask == "causal"]
    if not tma:
        pytest.skip("the shipped table has no causal TMA entry")
    cu = torch.tensor([0, 100, 300], dtype=torch.int32)
    for d in sorted({e.head_dim for e in tma}):
        q, k = torch.zeros(300, 8, d, dtype=torch.bfloat16), torch.zeros(300, 2, d, dtype=torch.bfloat16)
        st = _statics_for(q, k, cu_seqlens_q=cu, cu_seqlens_k=cu, pack_gqa=True)
        takes_varlen = any(e.head_dim == d and e.config.varlen_error(d) is None for e in tma)
        assert st.config.family == ("tma" if takes_varlen else "cpasync") and st.pack_gqa, (d, st.config.name)
        assert st.config.varlen_error(d) is None
        kd = torch.zeros(2, 400, 2, d, dtype=torch.bfloat16)
        used = torch.tensor([100, 200], dtype=torch.int32)
        st = _statics_for(q, kd, cu_seqlens_q=cu, seqused_k=used)
        assert st.config.family == "cpasync", (d, st.config.name)
        # an explicit TMA config with seqused_k alone: a clear error naming it
        with pytest.raises(NotImplementedError, match="seqused_k without cu_seqlens_k"):
            _statics_for(q, kd, cfg=tma[0].config if tma[0].head_dim == d else FwdConfig(256, 128, 64, 2, family="tma"),
                         cu_seqlens_q=cu, seqused_k=used)


def test_fuzz_paths_draw_the_layouts_the_family_runs():
    by_name = {p.name: p for p in paths.kernel_paths()}
    tma = by_name["tma-w8-128x64-s2"].supports
    assert tma.allows_layout("dense", "dense") and tma.allows_layout("packed", "packed")
    assert tma.allows_layout("padded", "packed")
    assert not tma.allows_layout("padded", "padded") and not tma.allows_layout("dense", "padded")
    assert by_name["tma-w8-128x64-s2"].packs(4, 128, 128) and not by_name["tma-w8-128x64-s2"].packs(3, 128, 128)
    assert by_name["cpasync-table"].supports.allows_layout("dense", "padded")
    for e, p in zip(load_fwd_table(), paths.table_paths(load_fwd_table())):
        if e.config.family == "tma":
            refused = any(varlen_register_error(d, e.config.tile_m, e.config.tile_n, e.config.num_threads)
                          for d in p.supports.head_dims)
            assert p.supports.varlen == (not refused), p.name


def _tma_entries():
    seen, out = set(), []
    for e in family_entries("tma"):
        if e.config not in seen:
            seen.add(e.config)
            out.append(pytest.param(e, id=f"d{e.head_dim}-{e.mask}-{e.config.name}"))
    return out


@pytest.mark.parametrize("entry", _tma_entries())
def test_every_tma_entry_compiles_varlen_for_sm120a_as_the_rule_says(entry):
    """Spill-free with every kind of varlen call where varlen_register_error lets varlen run; where it
    refuses, some kind spills (the rule is not stricter than it must be); TMA loads and stores present."""
    d, cfg = entry.head_dim, entry.config
    refused = varlen_register_error(d, cfg.tile_m, cfg.tile_n, cfg.num_threads) is not None
    spilled = []
    for kind, (varlen, pack) in VARLEN_KINDS.items():
        cubin, _ = codegen.compile_fwd_cubin(cfg, d, causal=entry.mask == "causal", qhead_per_kvhead=2,
                                             pack_gqa=pack, varlen=varlen)
        res, hist, _ = codegen.inspect_cubin(cubin)
        if res["stack"] > 0 or hist.get("LDL", 0) > 0 or hist.get("STL", 0) > 0:
            spilled.append(kind)
        assert hist.get("UTMALDG", 0) > 0 and hist.get("UTMASTG", 0) > 0 and hist.get("HMMA", 0) > 0, kind
    assert bool(spilled) == refused, (spilled, refused)


def test_trace_time_refusals_name_the_argument():
    cfg = FwdConfig(256, 128, 64, 2, family="tma")
    with pytest.raises(NotImplementedError, match="seqused_k without cu_seqlens_k"):
        codegen.compile_fwd_cubin(cfg, 128, varlen=("seqused_k",))
    # packed GQA with varlen q compiles (the ragged O descriptor packed as a dense one)
    cubin, _ = codegen.compile_fwd_cubin(cfg, 128, causal=True, qhead_per_kvhead=4, pack_gqa=True,
                                         varlen=("cu_seqlens_q", "cu_seqlens_k"))
    res, hist, _ = codegen.inspect_cubin(cubin)
    assert res["stack"] == 0 and hist.get("UTMASTG", 0) > 0


def test_unsupported_reason_applies_the_register_rule_to_varlen_keys():
    def statics(cfg, **over):
        base = dict(dtype="bfloat16", head_dim=128, head_dim_v=128, qhead_per_kvhead=1, causal=True, local=False,
                    pack_gqa=False, has_lse=True, has_cu_seqlens_q=False, has_cu_seqlens_k=False,
                    has_seqused_q=False, has_seqused_k=False, has_window_left=False, has_window_right=False,
                    score_mod_hash=False, mask_mod_hash=False, aux_metadata=None, broadcast=(), config=cfg,
                    emulate_host_smem=None)
        return driver.FwdStatics(**{**base, **over})

    wide = FwdConfig(256, 256, 64, 1, family="tma")
    assert unsupported_reason(statics(wide)) is None
    assert "varlen" in unsupported_reason(statics(wide, has_cu_seqlens_q=True, has_cu_seqlens_k=True))
    assert unsupported_reason(statics(FwdConfig(256, 128, 64, 2, True, family="tma"), has_cu_seqlens_k=True)) is None


@pytest.mark.parametrize("d", [64, 96, 128])
def test_varlen_block_sparse_lists_compile_for_sm120a(d):
    """The list walk over upstream's varlen lists (2-D, cu_total_m_blocks, with and without
    cu_block_idx_offsets) on the config a varlen-q call runs: spill-free, TMA loads, with 128-key
    sparse blocks of 2-4 K/V tiles."""
    from flash_attn_sm120.block_sparse import forward_candidates

    cfg = forward_candidates(d, d, (128, 128), varlen_q=True)[0]  # what a varlen-q call runs
    for varlen in (("cu_seqlens_q",), ("cu_seqlens_q", "cu_seqlens_k")):
        cubin, _ = codegen.compile_fwd_cubin(cfg, d, causal=True, varlen=varlen,
                                             block_sparse=(128 // cfg.tile_m, 128 // cfg.tile_n, True))
        res, hist, _ = codegen.inspect_cubin(cubin)
        assert res["stack"] == 0 and hist.get("LDL", 0) == 0, (varlen, res)
        assert hist.get("UTMALDG", 0) > 0 and hist.get("HMMA", 0) > 0, varlen
