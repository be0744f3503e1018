"""The backward driver and its config table on a CPU: table parsing and selection, fallbacks, buffer
layouts against upstream's, and that autograd reaches driver_bwd in the SM120 modes."""

import math
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import flash_attn_sm120
from flash_attn_sm120 import bwd_plans, config_bwd, driver_bwd, interface
from flash_attn_sm120.config_bwd import BWD_FALLBACKS, parse_bwd_table, select_bwd_config
from flash_attn_sm120.device import DeviceInfo
from flash_attn_sm120.hardware import EmulationHost
from flash_attn_sm120.kernels.bwd_tiling import BwdConfig, bwd_config_error

ROW = dict(head_dim=128, mask="none", num_threads=256, m_block=64, n_block=64, stages_q=1, stages_do=1,
           sdp_swapab=False, dkv_swapab=False, dq_swapab=False, atom_m_sdp=2, atom_n_dkv=4, atom_m_dq=2,
           v_in_regs=False, provenance=dict(gpu="g", mode="emulated", date="d", command="c"))


def test_shipped_table_parses():
    for e in config_bwd.load_bwd_table():
        assert bwd_config_error(e.head_dim, e.head_dim, e.config) is None


@pytest.mark.parametrize("change,match", [
    (dict(head_dim=100), "not a bucket"), (dict(mask="sliding"), "mask"),
    (dict(atom_m_sdp=8), "S/dP"), (dict(provenance={"gpu": "g"}), "provenance"),
    (dict(num_threads=None), "missing"), (dict(sdp_swapab=True), "sdp_swapab"),
])
def test_bad_rows_are_named(change, match):
    row = {**ROW, **change}
    row = {k: v for k, v in row.items() if v is not None}
    with pytest.raises(ValueError, match=match):
        parse_bwd_table({"schema": 1, "bwd": [row]})


def test_duplicate_and_schema():
    with pytest.raises(ValueError, match="duplicate"):
        parse_bwd_table({"schema": 1, "bwd": [ROW, ROW]})
    with pytest.raises(ValueError, match="schema"):
        parse_bwd_table({"schema": 2})


def test_selection_order():
    causal_row = {**ROW, "mask": "causal", "atom_m_dq": 4}
    table = tuple(parse_bwd_table({"schema": 1, "bwd": [ROW, causal_row]}))
    assert select_bwd_config(table, 128, 128, False, False).atom_m_dq == 2
    assert select_bwd_config(table, 128, 128, True, False).atom_m_dq == 4
    assert select_bwd_config(table, 128, 128, False, True).atom_m_dq == 4  # local -> causal
    assert select_bwd_config(table, 112, 112, False, False) == table[0].config  # bucket 128
    assert select_bwd_config(table, 64, 64, False, False) in BWD_FALLBACKS  # no d64 entry


def test_modifier_entries_serve_only_calls_with_user_modifiers():
    """An entry with modifiers = true is tried before its key's plain entry by calls with user modifiers,
    and by nothing else; the mask lookup order comes first (local: causal, then none)."""
    mods_row = {**ROW, "modifiers": True, "atom_m_dq": 4}
    causal_row = {**ROW, "mask": "causal", "stages_q": 2}
    table = tuple(parse_bwd_table({"schema": 1, "bwd": [ROW, mods_row, causal_row]}))
    assert [e.modifiers for e in table] == [False, True, False]
    assert select_bwd_config(table, 128, 128, False, False) == table[0].config
    assert select_bwd_config(table, 128, 128, False, False, modifiers=True) == table[1].config
    assert select_bwd_config(table, 128, 128, True, False, modifiers=True) == table[2].config  # causal: plain
    assert select_bwd_config(table, 128, 128, False, True, modifiers=True) == table[2].config  # local -> causal
    only_mods = tuple(parse_bwd_table({"schema": 1, "bwd": [mods_row]}))
    assert select_bwd_config(only_mods, 128, 128, False, False) in BWD_FALLBACKS  # never for a plain call
    with pytest.raises(ValueError, match="duplicate entry for \\(128, none, modifiers\\)"):
        parse_bwd_table({"schema": 1, "bwd": [mods_row, mods_row]})
    with pytest.raises(ValueError, match="modifiers must be true or false"):
        parse_bwd_table({"schema": 1, "bwd": [{**ROW, "modifiers": "yes"}]})


def test_plain_mha_entries_serve_only_plain_mha_calls_of_their_key():
    """An entry with plain_mha_only = true is tried first by plain MHA calls of its exact key; a window
    (local -> causal), modifiers or any other call takes the key's other entry."""
    causal_row = {**ROW, "mask": "causal", "stages_q": 2}
    mha_row = {**causal_row, "plain_mha_only": True, "num_threads": 128, "m_block": 32, "atom_m_sdp": 1,
               "atom_n_dkv": 1, "atom_m_dq": 2, "stages_q": 1}
    mods_row = {**causal_row, "modifiers": True, "atom_m_dq": 4}
    table = tuple(parse_bwd_table({"schema": 1, "bwd": [ROW, causal_row, mha_row, mods_row]}))
    assert [e.plain_mha_only for e in table] == [False, False, True, False]
    assert select_bwd_config(table, 128, 128, True, False, plain_mha=True) == table[2].config
    assert select_bwd_config(table, 128, 128, True, False) == table[1].config
    assert select_bwd_config(table, 128, 128, True, True, plain_mha=True) == table[1].config  # local -> causal
    assert select_bwd_config(table, 128, 128, True, False, modifiers=True, plain_mha=True) == table[3].config
    assert select_bwd_config(table, 128, 128, False, False, plain_mha=True) == table[0].config  # no such key
    with pytest.raises(ValueError, match="duplicate entry for \\(128, causal, plain_mha_only\\)"):
        parse_bwd_table({"schema": 1, "bwd": [mha_row, mha_row]})
    with pytest.raises(ValueError, match="one of them"):
        parse_bwd_table({"schema": 1, "bwd": [{**mha_row, "modifiers": True}]})
    with pytest.raises(ValueError, match="would serve no call"):
        parse_bwd_table({"schema": 1, "bwd": [{**mha_row, "mask": "local"}]})
    with pytest.raises(ValueError, match="plain_mha_only must be true or false"):
        parse_bwd_table({"schema": 1, "bwd": [{**mha_row, "plain_mha_only": 1}]})


def test_plain_entries_serve_plain_calls_of_any_head_ratio_after_the_plain_mha_entry():
    """An entry with plain_only = true is tried by plain calls (GQA included) of its exact key, after the
    key's plain_mha_only entry for plain MHA calls; deterministic, windowed or modifier calls skip it."""
    causal_row = {**ROW, "mask": "causal", "stages_q": 2}
    mha_row = {**causal_row, "plain_mha_only": True, "num_threads": 128, "m_block": 32, "atom_m_sdp": 1,
               "atom_n_dkv": 1, "atom_m_dq": 2, "stages_q": 1}
    plain_row = {**causal_row, "plain_only": True, "m_block": 32, "n_block": 128, "atom_m_sdp": 1, "stages_q": 1,
                 "v_in_regs": True}
    table = tuple(parse_bwd_table({"schema": 1, "bwd": [ROW, causal_row, plain_row, mha_row]}))
    assert [e.plain_only for e in table] == [False, False, True, False]
    assert select_bwd_config(table, 128, 128, True, False, plain=True) == table[2].config  # plain GQA
    assert select_bwd_config(table, 128, 128, True, False, plain_mha=True, plain=True) == table[3].config
    assert select_bwd_config(table, 128, 128, True, False) == table[1].config  # e.g. deterministic
    assert select_bwd_config(table, 128, 128, True, True, plain=True) == table[1].config  # local -> causal
    assert select_bwd_config(table, 128, 128, True, False, modifiers=True, plain=True) == table[1].config
    assert select_bwd_config(table, 128, 128, False, False, plain=True) == table[0].config  # no such key
    no_mha = tuple(parse_bwd_table({"schema": 1, "bwd": [ROW, causal_row, plain_row]}))
    assert select_bwd_config(no_mha, 128, 128, True, False, plain_mha=True) == no_mha[2].config  # MHA is plain
    with pytest.raises(ValueError, match="duplicate entry for \\(128, causal, plain_only\\)"):
        parse_bwd_table({"schema": 1, "bwd": [plain_row, plain_row]})
    with pytest.raises(ValueError, match="one of them"):
        parse_bwd_table({"schema": 1, "bwd": [{**plain_row, "plain_mha_only": True}]})
    with pytest.raises(ValueError, match="plain_only excludes windows"):
        parse_bwd_table({"schema": 1, "bwd": [{**plain_row, "mask": "local"}]})
    with pytest.raises(ValueError, match="plain_only must be true or false"):
        parse_bwd_table({"schema": 1, "bwd": [{**plain_row, "plain_only": "yes"}]})


def test_turns_entries_serve_deterministic_calls_in_turns_only():
    """An entry with turns_only = true is tried first by the deterministic calls whose dQ takes turns, of its
    exact key (not by a window's fallback to causal, nor with modifiers, which take the modifier step's
    entry); every other call skips it. A "none" key's turns entry serves the calls without a mask whose dQ
    takes its rotated turns. The parser refuses a second such entry per key, one combined with another flag,
    and one on a local key (no call takes turns there: windows add dQ in fixed point)."""
    causal_row = {**ROW, "mask": "causal", "stages_q": 2}
    det_row = {**causal_row, "turns_only": True, "m_block": 32, "n_block": 128, "atom_m_sdp": 1,
               "stages_q": 1}
    mods_row = {**causal_row, "modifiers": True, "stages_q": 1}
    table = tuple(parse_bwd_table({"schema": 1, "bwd": [ROW, causal_row, det_row, mods_row]}))
    assert [e.kind for e in table] == ["", "", "turns", "mods"]
    assert select_bwd_config(table, 128, 128, True, False, turns=True) == table[2].config
    assert select_bwd_config(table, 128, 128, True, False) == table[1].config
    assert select_bwd_config(table, 128, 128, True, False, plain=True, plain_mha=True) == table[1].config
    assert select_bwd_config(table, 128, 128, True, False, modifiers=True, turns=True) == table[3].config
    assert select_bwd_config(table, 128, 128, True, True, turns=True) == table[1].config  # local -> causal
    assert select_bwd_config(table, 128, 128, False, False, turns=True) == table[0].config  # no such key
    with pytest.raises(ValueError, match="duplicate entry for \\(128, causal, turns_only\\)"):
        parse_bwd_table({"schema": 1, "bwd": [det_row, det_row]})
    with pytest.raises(ValueError, match="one of them"):
        parse_bwd_table({"schema": 1, "bwd": [{**det_row, "plain_only": True}]})
    with pytest.raises(ValueError, match="turns_only must be true or false"):
        parse_bwd_table({"schema": 1, "bwd": [{**det_row, "turns_only": 1}]})
    with pytest.raises(ValueError, match="turns_only serves dense causal calls and dense calls without a mask"):
        parse_bwd_table({"schema": 1, "bwd": [{**det_row, "mask": "local"}]})
    rotated_row = {**det_row, "mask": "none"}
    table = tuple(parse_bwd_table({"schema": 1, "bwd": [ROW, rotated_row]}))
    assert select_bwd_config(table, 128, 128, False, False, turns=True) == table[1].config
    assert select_bwd_config(table, 128, 128, False, False) == table[0].config
    assert config_bwd.rotated_turns_config(table, 128, 128) == table[1].config
    assert config_bwd.rotated_turns_config(table[:1], 128, 128) is None


def test_a_forced_plan_keeps_the_keys_entry(monkeypatch):
    """Under force_deterministic_plan (benchmarks, tests of the orderings) a dense causal deterministic call
    does not take the turns entry: those are measured and spill-checked with the plan's own ordering only
    (the d96 one spills with fixed-point dQ)."""
    seen = []

    def spy(*args, turns=False, **kw):
        seen.append(turns)
        raise _Chosen

    monkeypatch.setattr(driver_bwd, "choose_config", spy)
    q = torch.zeros(1, 64, 2, 96, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 64)
    for forced in (None, dict(dq_fixed_point=True), dict(dq_descending=True, reverse_n_blocks=True, fused_turns=True)):
        with pytest.raises(_Chosen), (driver_bwd.force_deterministic_plan(**forced) if forced else nullcontext()):
            driver_bwd.backward(q, q, q, q, q, lse, softmax_scale=None, causal=True, window_size_left=None,
                                window_size_right=None, deterministic=True)
    assert seen == [True, False, False]


def test_the_shipped_turns_entries_serve_the_dense_deterministic_calls_in_turns_only():
    """Each shipped turns entry: a causal or "none" key that keeps another entry for its fixed-point and other
    calls; the "none" ones run the rotated order at the seed problems' lengths."""
    shipped = config_bwd.load_bwd_table()
    for e in (e for e in shipped if e.turns_only):
        other = [o for o in shipped if o.key == (e.head_dim, e.mask, False, False, False, False)]
        causal = e.mask == "causal"
        assert e.mask in ("causal", "none") and len(other) == 1, e
        assert select_bwd_config(shipped, e.head_dim, e.head_dim, causal, False, turns=True) == e.config
        assert select_bwd_config(shipped, e.head_dim, e.head_dim, causal, False) == other[0].config  # fixed point
        assert select_bwd_config(shipped, e.head_dim, e.head_dim, True, True, turns=True) != e.config  # a window
        if not causal:
            assert bwd_plans.rotated_entry_fits(e.config, 4096, 4096, 132)


@pytest.mark.parametrize("case", ["fits", "gqa", "long_keys", "half_the_sms", "seqused", "softcap", "causal",
                                  "forced_config"])
def test_dense_deterministic_calls_without_a_mask_take_the_rotated_entry_where_it_fits(case, monkeypatch):
    """backward() asks for the turns entry of a d96 call without a mask, and plans the rotated turns, where
    that entry's rotated order fits (a head's n_blocks at most its m_blocks and the SMs); else fixed point on
    the key's other entry (no turns entry asked for): more n_blocks than m_blocks or than half the SMs (the
    margin for other streams' kernels), seqused, softcap (its score_mod: the key's entry), a forced config, and
    GQA as ROTATED_ENTRIES_SERVE_GQA says (on since session 37)."""
    seen = []

    def spy(*args, turns=False, **kw):
        seen.append(turns)
        raise _Chosen

    monkeypatch.setattr(driver_bwd, "choose_config", spy)
    sms = 5 if case == "half_the_sms" else 132  # 3 n_blocks: at most 5 SMs, more than half of them
    monkeypatch.setattr(driver_bwd, "device_info", lambda device: SimpleNamespace(num_sms=sms))
    sq, sk = (256, 1024) if case == "long_keys" else (512, 384)  # 64-row m_blocks, 128-key n_blocks
    q = torch.zeros(1, sq, 4, 96, dtype=torch.bfloat16)
    kv = torch.zeros(1, sk, 1 if case == "gqa" else 4, 96, dtype=torch.bfloat16)
    kw = dict(seqused_q=torch.tensor([sq], dtype=torch.int32), seqused_k=torch.tensor([sk], dtype=torch.int32)) \
        if case == "seqused" else dict(softcap=30.0) if case == "softcap" else {}
    forced = driver_bwd.force_config(config_bwd.BWD_FALLBACKS[1]) if case == "forced_config" else nullcontext()
    with pytest.raises(_Chosen), forced:
        driver_bwd.backward(q, kv, kv, q, q, torch.zeros(1, 4, sq), softmax_scale=None, causal=case == "causal",
                            window_size_left=None, window_size_right=None, deterministic=True, **kw)
    assert seen == [case in ("fits", "causal") or (case == "gqa" and config_bwd.ROTATED_ENTRIES_SERVE_GQA)]
    rotated = config_bwd.rotated_turns_config(config_bwd.load_bwd_table(), 96, 96)
    assert rotated is not None and rotated.n_block == 128 and rotated.m_block == 64
    plan = bwd_plans.deterministic_plan(132, rotated, False, 512, 384, fixed_point=True, rotated_entry=True)
    assert plan["dq_rotated"] and plan["fused_turns"] and not plan["dq_fixed_point"]
    assert bwd_plans.deterministic_plan(132, rotated, False, 512, 384, fixed_point=True)["dq_fixed_point"]


def test_the_shipped_plain_mha_entry_spills_nowhere_it_serves_and_its_key_has_another():
    """The shipped plain-MHA entries: each key keeps an entry for the other calls, and the patch leaves
    them out (the patched interface never asks for one)."""
    shipped = config_bwd.load_bwd_table()
    for e in (e for e in shipped if e.plain_mha_only or e.plain_only):
        others = [o for o in shipped if o.key == (e.head_dim, e.mask, False, False, False, False)]
        assert len(others) == 1, e
        causal = e.mask == "causal"
        flags = dict(plain_mha=True, plain=True) if e.plain_mha_only else dict(plain=True)
        assert select_bwd_config(shipped, e.head_dim, e.head_dim, causal, False, **flags) == e.config
        assert select_bwd_config(shipped, e.head_dim, e.head_dim, causal, False) == others[0].config


class _Chosen(Exception):
    pass


@pytest.mark.parametrize("kind", ["plain", "softcap", "mask_mod", "score_mod", "aux", "block_sparse", "gqa",
                                  "deterministic", "det_causal", "det_causal_seqused", "det_causal_softcap", "det_causal_gqa",
                                  "window", "varlen",
                                  "varlen_gqa", "seqused"])
def test_the_driver_takes_modifier_entries_where_the_modifier_step_runs(kind, monkeypatch):
    """backward() asks for the modifier entries for user modifiers (Mods.user) and for the block-sparse
    walk, not for a plain or softcap call (upstream's step); for the plain-MHA entries only for a plain
    call (not GQA, deterministic=True, a window, softcap, modifiers or lists); for the plain entries for
    those plain calls and plain GQA ones, packed GQA (cu_seqlens) included; packed MHA calls take neither
    (the plain-MHA tile spills with cu_seqlens, the plain tile measured slower there); seqused are not plain.
    A deterministic call asks for the turns entries where its dQ takes turns (dense causal, GQA too), not
    where it is added in fixed point (no mask at d128, seqused), nor with softcap."""
    from flash_attn_sm120.testing_mods import position_scale, position_scale_bwd, prefix_lm

    seen = []

    def spy(*args, modifiers=False, plain_mha=False, plain=False, turns=False):
        seen.append((modifiers, plain_mha, plain, turns))
        raise _Chosen

    monkeypatch.setattr(driver_bwd, "choose_config", spy)
    kw = dict(softcap=30.0) if kind.endswith("softcap") else dict(mask_mod=prefix_lm) if kind == "mask_mod" else \
        dict(score_mod=position_scale, score_mod_bwd=position_scale_bwd) if kind == "score_mod" else \
        dict(aux_tensors=[torch.zeros(4)]) if kind == "aux" else \
        dict(block_sparse_tensors=object()) if kind == "block_sparse" else \
        dict(deterministic=True) if kind.startswith("det") else {}
    if kind == "det_causal_softcap":
        kw = dict(kw, softcap=30.0)
    q = torch.zeros(1, 64, 2, 128, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 64)
    if kind.startswith("varlen"):  # two packed sequences of 24 and 40 tokens
        q, lse = q[0], lse[0]
        cu = torch.tensor([0, 24, 64], dtype=torch.int32)
        kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=40, max_seqlen_k=40)
    elif kind.endswith("seqused"):
        kw = dict(kw, seqused_q=torch.tensor([50], dtype=torch.int32), seqused_k=torch.tensor([50], dtype=torch.int32))
    kv = q[..., :1, :] if kind.endswith("gqa") else q
    window = (32, 0) if kind == "window" else (None, None)
    with pytest.raises(_Chosen):
        driver_bwd.backward(q, kv, kv, q, q, lse, softmax_scale=None, causal=kind.startswith("det_causal"), window_size_left=window[0],
                            window_size_right=window[1], **kw)
    plain_kinds = ("plain", "gqa", "varlen_gqa")
    assert seen == [(kind not in plain_kinds + ("varlen", "softcap", "window", "seqused") and not kind.startswith("det"),
                     kind == "plain", kind in plain_kinds, kind in ("det_causal", "det_causal_gqa"))]
    shipped = config_bwd.load_bwd_table()
    if any(e.modifiers for e in shipped):  # the shipped modifier entries are what those calls run
        e = next(e for e in shipped if e.modifiers)
        assert select_bwd_config(shipped, e.head_dim, e.head_dim, e.mask == "causal", False, modifiers=True) == e.config


@pytest.mark.parametrize("d", range(8, 257, 8))
def test_every_head_dim_has_a_config(d):
    cfg = select_bwd_config((), d, d, False, False)
    assert bwd_config_error(d, d, cfg) is None


@pytest.mark.parametrize("d,dv,m_block,multiple", [
    (96, 96, 32, 64), (224, 224, 32, 64), (160, 160, 32, 64), (80, 64, 32, 32), (64, 96, 32, 64),
    (64, 64, 32, 32), (128, 128, 32, 32), (192, 192, 32, 32), (256, 256, 32, 32), (96, 96, 64, 32),
    (96, 96, 16, 64), (160, 160, 16, 128), (64, 64, 16, 128), (128, 128, 16, 32),
])
def test_the_preprocess_pass_is_widened_for_short_tiles(d, dv, m_block, multiple):
    """Upstream's preprocess covers preprocess_rows(dv) rows per pass with m_block as its tile; a shorter
    tile's last m_block per head zeroed the next head's first dPsum rows (wrong gradients on the H200
    at b1 s4096 h16 d96, measured). The driver runs it at the smallest head-dim multiple whose pass fits
    the tile (preprocess_multiple; a wider k-block covers fewer rows), so no tile of 16+ rows is refused.
    The rule keys on head_dim_v, the preprocess's O/dO width."""
    from flash_attn_sm120.kernels.bwd_tiling import preprocess_multiple, preprocess_rows

    assert [preprocess_rows(x) for x in (64, 96, 128, 160, 192, 224, 256)] == [32, 64, 16, 64, 32, 64, 16]
    assert [preprocess_rows(x, multiple=128) for x in (64, 96, 160, 224)] == [16] * 4
    assert preprocess_multiple(dv, m_block) == multiple
    assert preprocess_rows(dv, multiple=multiple) <= m_block
    assert preprocess_multiple(dv, 8) is None
    cfg = BwdConfig(128, m_block, 32, 1, 1, atom_m_sdp=m_block // 16, atom_n_dkv=1 if dv % 64 == 0 else 2,
                    atom_m_dq=1 if d % 64 == 0 else 2)
    assert "preprocess" not in (bwd_config_error(d, dv, cfg) or "")


def test_forced_config_is_checked():
    with driver_bwd.force_config(BwdConfig(128, 128, 128, 2, 2)):
        with pytest.raises(ValueError, match="not implementable.*shared memory"):
            driver_bwd.choose_config(128, 128, False, False, None)
    cfg = BwdConfig(256, 64, 64, 2, 1, atom_m_sdp=2, atom_n_dkv=4, atom_m_dq=4)
    with driver_bwd.force_config(cfg):
        assert driver_bwd.choose_config(128, 128, True, False, None) == cfg


def _statics(cfg, qhead_per_kvhead=1, d=128):
    return driver_bwd.BwdStatics("bfloat16", d, d, qhead_per_kvhead, False, False, False, False, 0.0, False,
                                 False, False, False, False, False, (), cfg, None)


@pytest.mark.parametrize("cfg", [BwdConfig(), BWD_FALLBACKS[0], BwdConfig(128, 32, 128, atom_m_sdp=2, atom_n_dkv=4,
                                                                        atom_m_dq=2)])
def test_buffers_have_upstreams_layout(cfg):
    """The sizes upstream's _flash_attn_bwd allocates for the same tiles (its formulas, written out)."""
    b, sq, sk, h, hk, d = 3, 300, 200, 8, 2, 96
    hd = math.ceil(d / 32) * 32
    with FakeTensorMode():
        q = torch.empty(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
        k = torch.empty(b, sk, hk, d, device="cuda", dtype=torch.bfloat16)
        dq_accum, dpsum, lse_log2, dk_accum, dv_accum = driver_bwd._allocate(
            q, k, _statics(cfg, h // hk, d), b, sq, sk, False, False)
        m, n = cfg.m_block, cfg.n_block
        assert dq_accum.shape == (b, h, math.ceil(sq / m) * m * hd)
        assert dpsum.shape == lse_log2.shape == (b, h, math.ceil(sq / m) * m)
        assert dk_accum.shape == dv_accum.shape == (b, hk, math.ceil(sk / n) * n * hd)
        # varlen: one extra tile per sequence
        qv = torch.empty(b * sq, h, d, device="cuda", dtype=torch.bfloat16)
        kv = torch.empty(b * sk, hk, d, device="cuda", dtype=torch.bfloat16)
        dq_accum, dpsum, _, dk_accum, _ = driver_bwd._allocate(qv, kv, _statics(cfg, h // hk, d), b, sq, sk, True, True)
        rows_q = (b * sq + (b + 1) * m - 1) // m * m
        rows_k = (b * sk + (b + 1) * n - 1) // n * n
        assert dq_accum.shape == (h, rows_q * hd) and dpsum.shape == (h, rows_q)
        assert dk_accum.shape == (hk, rows_k * hd)
        # MHA writes dK/dV directly
        assert driver_bwd._allocate(q, k, _statics(cfg, 1, d), b, sq, sk, False, False)[3] is None


@pytest.mark.parametrize("mode,pad", [("sm120", None), ("emulated", EmulationHost(233472, 232448, 1024))])
def test_autograd_runs_the_sm120_backward(monkeypatch, mode, pad):
    """The call's backward arguments (as flash_attn_func records them) reach driver_bwd.backward.
    (Fake CUDA tensors cannot run autograd's engine on a CPU build, so the Function's backward is
    called with the context the forward would leave.)"""
    info = DeviceInfo("fake", (12, 0) if mode == "sm120" else (9, 0), 188, 233472, 232448, mode, 1024)
    monkeypatch.setattr(interface, "device_info", lambda dev: info)
    recorded, seen = {}, {}

    def fake_forward(q, k, v, fwd_kwargs, bwd_kwargs, return_lse, requires_grad, learnable_sink=None, want_lse=None):
        recorded.update(bwd_kwargs=dict(bwd_kwargs), requires_grad=requires_grad, want_lse=want_lse)
        return torch.zeros_like(q), None

    def fake_backward(q, k, v, out, dout, lse, **kw):
        seen.update(kw)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    monkeypatch.setattr(interface, "_forward", fake_forward)
    monkeypatch.setattr(interface.driver_bwd, "backward", fake_backward)
    with FakeTensorMode():
        q = torch.empty(2, 64, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.empty(2, 64, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.empty(2, 64, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        flash_attn_sm120.flash_attn_func(q, k, v, causal=True, window_size=(None, -3), softcap=5.0)
        assert recorded["requires_grad"] and recorded["want_lse"]  # the LSE is returned for autograd, as upstream
        kw = recorded["bwd_kwargs"]
        kw.pop("_tensors")
        ctx = SimpleNamespace(saved_tensors=(q, k, v, torch.zeros_like(q), torch.zeros(2, 8, 64, device="cuda"), None),
                              bwd_kwargs=kw, return_lse=False, needs_input_grad=(True, True, True, False))
        grads = interface._Sm120AttnFunc.backward(ctx, torch.zeros_like(q), None)
    # one gradient per Function input: q, k, v, the sink (None here), and four non-tensor arguments
    assert len(grads) == 8 and grads[0].shape == q.shape and grads[1].shape == k.shape and grads[3] is None
    assert seen["emulate_host_smem"] == pad and seen["causal"] is True and seen["softcap"] == 5.0
    assert (seen["window_size_left"], seen["window_size_right"]) == (None, -3)
    assert seen["dlse"] is None


def test_bad_gradient_buffer_is_named():
    with FakeTensorMode():
        x = torch.empty(2, 4, device="cuda")
        with pytest.raises(ValueError, match="dq must be"):
            driver_bwd._checked_grad("dq", torch.empty(4, 2, device="cuda"), x)
