"""SplitKV / paged KV / decode on the CPU: the split chooser, the decode table, dispatch and input
validation before any kernel work, and sm_120a codegen of the splitkv kernels and the combine."""

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import flash_attn_sm120
from flash_attn_sm120 import driver, driver_splitkv, hardware, interface, splitkv
from flash_attn_sm120.codegen import compile_combine_cubin, compile_splitkv_cubin, inspect_cubin
from flash_attn_sm120.config import FwdConfig, family_entries, load_fwd_table, select_fwd_config
from flash_attn_sm120.decode import (
    DECODE_MAX_SEQLEN_Q,
    is_decode,
    load_decode_table,
    load_prefill_table,
    parse_decode_table,
    select_decode_config,
    select_prefill_config,
)
from flash_attn_sm120.device import DeviceInfo

# ------------------------------------------------------------------------------------------------
# the chooser
# ------------------------------------------------------------------------------------------------


def _eff(total, s, slots):
    waves = total * s / slots
    return waves / math.ceil(waves)


GRID = [
    (total, n_blocks, sms, ctas)
    for total in (1, 4, 8, 32, 64, 150, 512)
    for n_blocks in (1, 4, 5, 16, 64, 512, 2048)
    for sms in (132, 170, 188)
    for ctas in (1, 2, 3)
]


@pytest.mark.parametrize("total,n_blocks,sms,ctas", GRID)
def test_choice_is_in_range_and_near_best_wave_efficiency(total, n_blocks, sms, ctas):
    s = splitkv.choose_num_splits(total_mblocks=total, n_blocks=n_blocks, num_sms=sms, ctas_per_sm=ctas)
    assert 1 <= s <= min(splitkv.MAX_SPLITS, max(n_blocks, 1))
    slots = sms * ctas
    if n_blocks <= splitkv.MIN_N_BLOCKS_TO_SPLIT or total >= splitkv.FULL_GRID_SHARE * slots:
        assert s == 1
        return
    limit = min(splitkv.MAX_SPLITS, n_blocks, slots)
    # split counts that change the blocks per split (the others only add empty splits)
    eligible = [c for c in range(1, limit + 1) if c == 1 or -(-n_blocks // c) != -(-n_blocks // (c - 1))]
    assert s in eligible
    # long KV: at least MIN_WAVES waves and at most MAX_BLOCKS_PER_SPLIT blocks per split, unless
    # that would leave a split fewer than MIN_BLOCKS_PER_SPLIT blocks
    low = max(-(-n_blocks // splitkv.MAX_BLOCKS_PER_SPLIT), -(-splitkv.MIN_WAVES * slots // total))
    low = -(-n_blocks // -(-n_blocks // low))  # same blocks per split, fewest splits
    long_kv = 1 < low <= limit and -(-n_blocks // low) >= splitkv.MIN_BLOCKS_PER_SPLIT
    if long_kv:
        assert s >= low and -(-n_blocks // s) <= splitkv.MAX_BLOCKS_PER_SPLIT
    first = low if long_kv else 1
    best = max(_eff(total, c, slots) for c in eligible if c >= first)
    assert _eff(total, s, slots) >= splitkv.EFFICIENCY_SLACK * best - 1e-9
    if not long_kv:  # never more CTAs than slots when one wave suffices for the best efficiency
        assert total * s <= max(slots, total) * math.ceil(total * s / slots)
    # the fewest such split count
    assert all(_eff(total, c, slots) < splitkv.EFFICIENCY_SLACK * best - 1e-9 for c in eligible if first <= c < s)


def test_decode_b1_fills_the_gpu():
    """One sequence, 8 KV heads at tile_n 64: 8 CTAs unsplit. 4k keys -> about one full wave; 32k
    keys (long KV) -> about two waves of splits of <= 64 blocks, measured faster (see splitkv.py)."""
    short = splitkv.num_n_blocks(4096, 64)
    assert 0.95 * 132 <= 8 * splitkv.choose_num_splits(total_mblocks=8, n_blocks=short, num_sms=132,
                                                       ctas_per_sm=1) <= 132
    n_blocks = splitkv.num_n_blocks(32768, 64)
    s188 = splitkv.choose_num_splits(total_mblocks=8, n_blocks=n_blocks, num_sms=188, ctas_per_sm=1)
    s132 = splitkv.choose_num_splits(total_mblocks=8, n_blocks=n_blocks, num_sms=132, ctas_per_sm=1)
    assert s132 == 32  # 256 CTAs ~ 2 waves on 132 SMs, 16 blocks per split (the 32-split rows measured best)
    assert 0.95 * 188 <= 8 * s188 <= 188  # on 188 SMs two waves would leave < 16 blocks per split
    assert s188 != s132  # the real SM count matters
    s2 = splitkv.choose_num_splits(total_mblocks=8, n_blocks=n_blocks, num_sms=188, ctas_per_sm=2)
    assert s2 > s188  # so do the CTAs per SM


def test_no_split_when_grid_is_full_or_keys_are_few():
    assert splitkv.choose_num_splits(total_mblocks=512, n_blocks=2048, num_sms=188, ctas_per_sm=1) == 1
    assert splitkv.choose_num_splits(total_mblocks=1, n_blocks=4, num_sms=188, ctas_per_sm=1) == 1
    assert splitkv.choose_num_splits(total_mblocks=0, n_blocks=100, num_sms=188, ctas_per_sm=1) == 1


@pytest.mark.parametrize("requested,n_blocks,want", [
    (1, 100, 1), (2, 100, 2), (7, 100, 7), (7, 3, 3), (1000, 5000, splitkv.MAX_SPLITS), (5, 0, 1), (300, 300, 128),
])
def test_explicit_num_splits_clamped(requested, n_blocks, want):
    got = splitkv.resolve_num_splits(requested, total_mblocks=8, n_blocks=n_blocks, num_sms=188, ctas_per_sm=1)
    assert got == want


@pytest.mark.parametrize("requested", [0, -1, -100])
def test_nonpositive_num_splits_means_auto(requested):
    kw = dict(total_mblocks=8, n_blocks=512, num_sms=188, ctas_per_sm=1)
    assert splitkv.resolve_num_splits(requested, **kw) == splitkv.choose_num_splits(**kw) > 1


def test_num_n_blocks_and_m_blocks():
    assert splitkv.num_n_blocks(0, 64) == 0
    assert splitkv.num_n_blocks(65, 64) == 2
    # local: window band plus one M tile, capped by the sequence
    assert splitkv.num_n_blocks(100000, 64, local=True, window_left=255, window_right=0, tile_m=64) == 5
    assert splitkv.num_n_blocks(100, 64, local=True, window_left=1000, window_right=1000, tile_m=64) == 2
    assert splitkv.total_m_blocks(batch=2, max_seqlen_q=1, num_heads=32, num_heads_kv=8, tile_m=64, pack_gqa=True) == 16
    assert splitkv.total_m_blocks(batch=2, max_seqlen_q=1, num_heads=32, num_heads_kv=8, tile_m=64, pack_gqa=False) == 64
    assert splitkv.total_m_blocks(batch=1, max_seqlen_q=16, num_heads=32, num_heads_kv=8, tile_m=64, pack_gqa=True) == 8


# ------------------------------------------------------------------------------------------------
# decode table and plan
# ------------------------------------------------------------------------------------------------


def test_decode_table_loads_and_fits():
    table = load_decode_table()
    assert {e.head_dim for e in table} == {64, 96, 128, 192, 256}
    for e in table:
        assert e.config.family == "splitkv"
        assert e.config.error(e.head_dim, e.head_dim) is None
        smem = e.config.smem_bytes(e.head_dim, e.head_dim) + hardware.DSL_STATIC_SMEM
        assert smem <= hardware.SMEM_PER_BLOCK_MAX
        assert e.measured or e.provenance["reason"]


@pytest.mark.parametrize("raw,match", [
    ({"schema": 2}, "schema"),
    ({"schema": 1, "decode": [{"head_dim": 128, "num_threads": 128, "tile_m": 64, "tile_n": 64,
                               "family": "cpasync", "provenance": {"status": "unmeasured", "reason": "x"}}]}, "family"),
    ({"schema": 1, "decode": [{"head_dim": 128, "num_threads": 128, "tile_m": 64, "tile_n": 64,
                               "provenance": {"status": "unmeasured"}}]}, "reason"),
    ({"schema": 1, "decode": [{"head_dim": 128, "num_threads": 128, "tile_m": 64, "tile_n": 64,
                               "provenance": {"gpu": "x"}}]}, "provenance"),
    ({"schema": 1, "decode": [{"head_dim": 100, "num_threads": 128, "tile_m": 64, "tile_n": 64,
                               "provenance": {"status": "unmeasured", "reason": "x"}}]}, "bucket"),
    ({"schema": 1, "decode": [{"head_dim": 128, "num_threads": 128, "tile_m": 64, "tile_n": 512,
                               "provenance": {"status": "unmeasured", "reason": "x"}}]}, "shared memory"),
])
def test_decode_table_rejects_bad_data(raw, match):
    with pytest.raises(ValueError, match=match):
        parse_decode_table(raw)


def test_is_decode():
    assert is_decode(1) and is_decode(DECODE_MAX_SEQLEN_Q)
    assert not is_decode(DECODE_MAX_SEQLEN_Q + 1) and not is_decode(None) and not is_decode(0)


def _plan(**kw):
    base = dict(head_dim=128, head_dim_v=128, causal=False, local=False, window_size_left=None,
                window_size_right=None, batch=1, max_seqlen_q=1, max_seqlen_k=32768, num_heads=32,
                num_heads_kv=8, pack_gqa=True, num_splits=0, num_sms=188)
    base.update(kw)
    return driver_splitkv.plan(**base)


def test_plan_decode_uses_decode_table_and_splits():
    p = _plan()
    assert p.decode and p.config == select_decode_config(load_decode_table(), 128, 128)
    smem = p.config.smem_bytes(128, 128) + hardware.DSL_STATIC_SMEM
    assert p.ctas_per_sm == hardware.sm120_occupancy(smem, p.config.num_threads).ctas_per_sm
    assert p.total_mblocks == 8 and p.num_splits > 1
    assert p.num_splits == splitkv.choose_num_splits(
        total_mblocks=8, n_blocks=p.n_blocks, num_sms=188, ctas_per_sm=p.ctas_per_sm)


def test_plan_prefill_uses_prefill_table():
    p = _plan(max_seqlen_q=4096, num_splits=1, causal=True)
    assert not p.decode and p.num_splits == 1
    assert p.config == select_fwd_config(load_fwd_table(), 128, 128, True, False)


def test_plan_honours_forced_config_and_explicit_splits():
    cfg = FwdConfig(256, 128, 64, 2, False)
    with driver.force_config(cfg):
        p = _plan(num_splits=7)
    assert p.num_splits == 7 and p.config.tile_m == 128 and p.config.tile_n == 64 and p.config.family == "splitkv"
    assert _plan(num_splits=10**6, max_seqlen_k=640).num_splits == splitkv.num_n_blocks(640, p.config.tile_n)


# ------------------------------------------------------------------------------------------------
# dispatch and validation (fake CUDA tensors, no kernel work)
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def fake_sm120(monkeypatch):
    calls = {}
    info = DeviceInfo("fake", (12, 0), 188, 102400, 101376, "sm120")
    monkeypatch.setattr(interface, "device_info", lambda dev: info)

    def fake(name):
        def run(q, k, v, **kw):
            calls[name] = kw
            return torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device), None
        return run

    monkeypatch.setattr(interface.driver, "forward", fake("driver"))
    monkeypatch.setattr(interface.driver_splitkv, "forward", fake("splitkv"))
    with FakeTensorMode():
        yield calls


def _t(*shape, dtype=torch.bfloat16, device="cuda"):
    return torch.empty(*shape, dtype=dtype, device=device)


def _paged(batch=2, pages=64, page_size=64, hk=2, d=128, max_pages=8):
    q = _t(batch, 1, 8, d)
    k = _t(pages, page_size, hk, d)
    v = _t(pages, page_size, hk, d)
    pt = _t(batch, max_pages, dtype=torch.int32)
    return q, k, v, pt


def test_paged_call_routes_to_splitkv(fake_sm120):
    q, k, v, pt = _paged()
    used = _t(2, dtype=torch.int32)
    flash_attn_sm120.flash_attn_varlen_func(q, k, v, page_table=pt, seqused_k=used, num_splits=0, causal=True)
    kw = fake_sm120["splitkv"]
    assert kw["page_table"] is pt and kw["num_splits"] == 0 and kw["seqused_k"] is used
    assert "driver" not in fake_sm120


def test_split_and_decode_route_to_splitkv_plain_prefill_does_not(fake_sm120):
    q, k = _t(2, 128, 8, 64), _t(2, 128, 2, 64)
    flash_attn_sm120.flash_attn_func(q, k, k)
    assert "driver" in fake_sm120 and "splitkv" not in fake_sm120
    flash_attn_sm120.flash_attn_func(q, k, k, num_splits=3)
    assert fake_sm120["splitkv"]["num_splits"] == 3
    fake_sm120.clear()
    flash_attn_sm120.flash_attn_func(_t(2, 1, 8, 64), k, k)  # decode-shaped
    assert "splitkv" in fake_sm120 and "driver" not in fake_sm120


@pytest.mark.parametrize("mutate,exc,match", [
    (lambda q, k, v, pt: (q, k, v, pt.to(torch.int64)), TypeError, "page_table must be int32"),
    (lambda q, k, v, pt: (q, k, v, _t(8, dtype=torch.int32)), ValueError, "2-D"),
    (lambda q, k, v, pt: (q, k, v, [[0]]), TypeError, "page_table must be a torch.Tensor"),
    (lambda q, k, v, pt: (q, k, v, _t(2, 8, dtype=torch.int32, device="cuda:1")), ValueError, "page_table is on"),
    (lambda q, k, v, pt: (q, _t(64, 24, 2, 128), _t(64, 24, 2, 128), pt), ValueError, "page size 24"),
    (lambda q, k, v, pt: (q, _t(4, 1024, 2, 128), _t(4, 1024, 2, 128), pt), ValueError, "page size 1024"),
    (lambda q, k, v, pt: (q, k, v, _t(3, 8, dtype=torch.int32)), ValueError, "does not match page_table"),
    (lambda q, k, v, pt: (q, k, _t(64, 32, 2, 128), pt), ValueError, "must agree"),
    (lambda q, k, v, pt: (q, _t(64, 64, 128), v, pt), ValueError, "4 dimensions"),
    (lambda q, k, v, pt: (_t(2, 1, 8, 72), _t(64, 64, 2, 72), _t(64, 64, 2, 72), pt), NotImplementedError,
     "multiples of 16"),
    (lambda q, k, v, pt: (q, k.half(), v, pt), TypeError, "dtype"),
    # (a page pool with misaligned rows is copied, as upstream's maybe_contiguous copies it: interface._canonical)
    (lambda q, k, v, pt: (q, _t(0, 64, 2, 128), _t(0, 64, 2, 128), pt), ValueError, "no pages"),
])
def test_paged_bad_inputs(fake_sm120, mutate, exc, match):
    q, k, v, pt = mutate(*_paged())
    with pytest.raises(exc, match=match):
        flash_attn_sm120.flash_attn_varlen_func(q, k, v, page_table=pt)
    assert not fake_sm120


def test_paged_max_seqlen_k_longer_than_pages(fake_sm120):
    q, k, v, pt = _paged(page_size=64, max_pages=8)
    flash_attn_sm120.flash_attn_varlen_func(q, k, v, page_table=pt, max_seqlen_k=512)  # exactly full: fine
    with pytest.raises(ValueError, match="longer than the pages hold"):
        flash_attn_sm120.flash_attn_varlen_func(q, k, v, page_table=pt, max_seqlen_k=513)


def test_paged_seqused_k_shape_and_cu_seqlens_k(fake_sm120):
    q, k, v, pt = _paged()
    with pytest.raises(ValueError, match="seqused_k must have shape"):
        flash_attn_sm120.flash_attn_varlen_func(q, k, v, page_table=pt, seqused_k=_t(3, dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="cu_seqlens_k"):
        flash_attn_sm120.flash_attn_varlen_func(q, k, v, page_table=pt, cu_seqlens_k=_t(3, dtype=torch.int32))


def test_paged_backward_rejected(fake_sm120):
    q, k, v, pt = _paged()
    q.requires_grad_(True)
    with pytest.raises(NotImplementedError, match="paged KV backward"):
        flash_attn_sm120.flash_attn_varlen_func(q, k, v, page_table=pt)


def test_num_splits_type_checked(fake_sm120):
    q, k = _t(2, 1, 8, 64), _t(2, 128, 2, 64)
    with pytest.raises(TypeError, match="num_splits"):
        flash_attn_sm120.flash_attn_func(q, k, k, num_splits=2.0)


# ------------------------------------------------------------------------------------------------
# sm_120a codegen
# ------------------------------------------------------------------------------------------------


def _forbidden(sass: dict) -> list:
    return [op for op in sass if op.startswith(("HGMMA", "UTC", "WARPGROUP", "UTMA"))]


CODEGEN_CASES = [
    # (config, head_dim, kwargs): every decode table entry split and paged, then other combinations
    *((e.config, e.head_dim, dict(split=True, paged=True)) for e in load_decode_table()),
    (select_decode_config(load_decode_table(), 128, 128), 128, dict(split=True, paged=False, causal=True)),
    (select_decode_config(load_decode_table(), 64, 64), 64, dict(split=True, paged=True, varlen_q=True)),
    (FwdConfig(256, 128, 64, 2, False, "splitkv"), 128, dict(split=False, paged=True, causal=True)),
    (FwdConfig(256, 128, 64, 2, False, "splitkv"), 128, dict(split=True, paged=False, local=True,
                                                             qhead_per_kvhead=1, pack_gqa=False)),
]


@pytest.mark.parametrize("cfg,d,kw", CODEGEN_CASES, ids=[f"{c.name}-d{d}-{'-'.join(k for k, v in kw.items() if v is True)}"
                                                          for c, d, kw in CODEGEN_CASES])
def test_splitkv_kernel_codegen_sm120a(cfg, d, kw):
    cubin, smem = compile_splitkv_cubin(cfg, d, **kw)
    res, hist, _ = inspect_cubin(cubin)
    assert res["stack"] == 0 and res["local"] == 0, res
    assert hist.get("LDL", 0) == 0 and hist.get("STL", 0) == 0, hist
    assert smem + res["shared"] <= hardware.SMEM_PER_BLOCK_MAX
    assert smem == cfg.smem_bytes(d, d)
    assert hist.get("HMMA", 0) > 0 and hist.get("LDGSTS", 0) > 0
    assert not _forbidden(hist), _forbidden(hist)
    if kw.get("split"):
        assert hist.get("STG", 0) > 0


def test_splitkv_emulation_padding_lands_in_kernel():
    cfg = select_decode_config(load_decode_table(), 128, 128)
    host = hardware.EmulationHost(233472, 232448, 1024, 0)  # an H200 as its driver reports it
    _, smem = compile_splitkv_cubin(cfg, 128, emulate_host_smem=host)
    want = hardware.sm120_occupancy(cfg.smem_bytes(128, 128) + hardware.DSL_STATIC_SMEM, cfg.num_threads).ctas_per_sm
    assert host.smem_per_sm // (smem + host.static_smem + host.reserved_per_cta) == want


@pytest.mark.parametrize("d,splits,varlen", [(128, 20, False), (64, 7, True), (256, 128, False)])
def test_upstream_combine_compiles_for_sm120a(d, splits, varlen):
    """Upstream's combine uses cp.async, shuffles and griddepcontrol.wait (sm_90+, on sm_120 too)."""
    res, hist, _ = inspect_cubin(compile_combine_cubin(d, splits, varlen=varlen))
    assert res["stack"] == 0 and res["local"] == 0
    assert hist.get("LDGSTS", 0) > 0
    assert not _forbidden(hist), _forbidden(hist)


@pytest.mark.parametrize("pack_gqa,want", [(None, None), (True, True), (False, False)])
def test_unsplit_decode_route_leaves_a_defaulted_pack_gqa_to_the_driver(monkeypatch, pack_gqa, want):
    """An unsplit decode-shaped call is handed to driver.forward with pack_gqa as the caller gave it:
    a defaulted None lets a family that refuses GQA packing (TMA) run the call unpacked instead of
    raising (a deep-fuzz find: backward cases with seqlen_q <= 16 on the TMA table entries)."""
    import flash_attn_sm120.device as devmod

    seen = {}
    info = DeviceInfo("fake", (12, 0), 188, 101376, 101376, "sm120")
    monkeypatch.setattr(devmod, "device_info", lambda dev: info)
    monkeypatch.setattr(driver, "forward", lambda q, k, v, **kw: seen.update(kw) or (None, None))
    q = torch.zeros(1, 1, 8, 128, dtype=torch.bfloat16)
    k = v = torch.zeros(1, 256, 2, 128, dtype=torch.bfloat16)
    driver_splitkv.forward(q, k, v, softmax_scale=None, causal=False, window_size_left=None,
                           window_size_right=None, softcap=None, pack_gqa=pack_gqa, need_lse=True, num_splits=1,
                           emulate_host_smem=None)
    assert "pack_gqa" in seen and seen["pack_gqa"] is want


def test_host_overhead_script_runs_the_real_dispatch_path():
    """scripts/host_overhead.py times driver_splitkv.forward with the GPU work stubbed (a subprocess:
    it replaces module globals)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    res = subprocess.run([sys.executable, str(root / "scripts" / "host_overhead.py"), "--calls", "50",
                          "--profile", "30"], capture_output=True, text=True, timeout=300, cwd=root)  # every row: the
    # order of rows this close in time changes from run to run (3 rows made the check flaky)
    assert res.returncode == 0, res.stderr[-2000:]
    line = next(l for l in res.stdout.splitlines() if l.startswith("host time per call"))
    assert float(line.split(":")[1].split()[0]) > 0
    assert "_plan_key" in res.stdout  # after the first call only the memo key is built,
    assert "make_call_plan" not in res.stdout  # never the plan itself


def test_driver_call_helpers_shared_by_both_drivers():
    """resolve_pack_gqa / softcap_score_mod / allocate_outputs / empty_result: the rules both
    driver.forward and driver_splitkv.forward apply."""
    assert driver.resolve_pack_gqa(None, 4) is True and driver.resolve_pack_gqa(False, 4) is False
    assert driver.resolve_pack_gqa(True, 1) is False and driver.resolve_pack_gqa(None, 1) is False
    mod = object()
    assert driver.softcap_score_mod(None, mod) is mod and driver.softcap_score_mod(0.0, None) is None
    assert callable(driver.softcap_score_mod(30.0, None))
    with pytest.raises(ValueError, match="softcap and score_mod"):
        driver.softcap_score_mod(30.0, mod)
    q = torch.zeros(2, 5, 8, 64, dtype=torch.bfloat16)
    out, lse, shape = driver.allocate_outputs(q, 8, 32, False, True, None, None)
    assert out.shape == (2, 5, 8, 32) and lse.shape == shape == (2, 8, 5) and lse.dtype == torch.float32
    out, lse, shape = driver.allocate_outputs(q.view(10, 8, 64), 8, 32, True, False, None, None)
    assert out.shape == (10, 8, 32) and lse is None and shape == (8, 10)
    given = torch.full((10, 8, 32), float("nan"), dtype=torch.bfloat16)
    lse_given = torch.full((8, 10), float("nan"))
    out, lse = driver.empty_result(*driver.allocate_outputs(q.view(10, 8, 64), 8, 32, True, False, given, lse_given)[:2])
    assert out is given and bool((out == 0).all()) and bool(torch.isneginf(lse).all())
    # with a sink, no key leaves its logit as the LSE (upstream's meaning), dense and varlen layouts
    sink = torch.arange(8, dtype=torch.bfloat16) - 3.0
    _, lse = driver.empty_result(given, torch.empty(8, 10), sink)
    assert torch.equal(lse, sink.float()[:, None].expand(8, 10))
    _, lse = driver.empty_result(torch.empty(2, 5, 8, 32), torch.empty(2, 8, 5), sink)
    assert torch.equal(lse, sink.float()[None, :, None].expand(2, 8, 5))


def _stub_split_launch(monkeypatch, info):
    """driver_splitkv.forward on CPU tensors: device query, compile and launches replaced."""
    import flash_attn_sm120.device as devmod

    launches = []
    monkeypatch.setattr(devmod, "device_info", lambda dev: info)
    monkeypatch.setattr(driver_splitkv, "make_splitkv_kernel", lambda *a, **k: None)
    monkeypatch.setattr(driver_splitkv, "compile_splitkv_kernel", lambda *a, **k: lambda *x: launches.append(x))
    # compile + occupancy check (the CUDA driver's occupancy API): compile only, no check on a CPU
    monkeypatch.setattr(driver, "compile_verified", lambda make, compile_fn, host, device, name:
                        compile_fn(make(host), ""))
    monkeypatch.setattr(driver_splitkv, "to_cute_tensor", lambda *a, **k: None)
    # the compiled combine is looked up once per CallPlan (a "lookup" entry), then called per split call
    monkeypatch.setattr(driver_splitkv, "combine_kernel",
                        lambda key: launches.append("lookup") or (lambda *a: launches.append("combine")))
    driver_splitkv.clear_cache()
    return launches


def test_call_plan_is_memoized_per_metadata(monkeypatch):
    """Same metadata -> the same CallPlan (the decode step's host path skips planning); any change
    of shape, stride, flag or split request -> its own plan; score_mod calls are never memoized."""
    info = DeviceInfo("fake", (12, 0), 188, 101376, 101376, "sm120")
    launches = _stub_split_launch(monkeypatch, info)
    built = []
    real = driver_splitkv.make_call_plan
    monkeypatch.setattr(driver_splitkv, "make_call_plan", lambda *a, **k: built.append(1) or real(*a, **k))
    q = torch.zeros(1, 1, 32, 128, dtype=torch.bfloat16)
    k = torch.zeros(1, 32768, 8, 128, dtype=torch.bfloat16)
    kw = dict(softmax_scale=None, causal=False, window_size_left=None, window_size_right=None, softcap=None,
              pack_gqa=None, need_lse=False, emulate_host_smem=None)
    for _ in range(3):
        driver_splitkv.forward(q, k, k, num_splits=0, **kw)
    assert len(built) == 1 and len(driver_splitkv._PLANS) == 1
    (cp,) = driver_splitkv._PLANS.values()
    assert cp.kernel is not None and cp.combine is not None and cp.split.num_splits > 1 and not cp.to_driver
    # 3 split kernels + 3 combines, the combine kernel looked up once (then held by the plan)
    assert launches.count("combine") == 3 and launches.count("lookup") == 1 and len(launches) == 7
    assert driver_splitkv.compile_count["splitkv"] >= 1
    driver_splitkv.forward(q, k, k, num_splits=4, **kw)  # another split request
    driver_splitkv.forward(q, k, k, num_splits=0, **dict(kw, causal=True))  # another flag
    driver_splitkv.forward(q, k[:, :16384], k[:, :16384], num_splits=0, **kw)  # another shape
    kt = torch.zeros(1, 8, 32768, 128, dtype=torch.bfloat16).transpose(1, 2)  # same shape, other strides
    driver_splitkv.forward(q, kt, kt, num_splits=0, **kw)
    assert len(built) == 5 and len(driver_splitkv._PLANS) == 5
    assert {p.split.num_splits for p in driver_splitkv._PLANS.values()} >= {4, cp.split.num_splits}
    mod = lambda *a: a[0]  # noqa: E731 (a score_mod: plans are rebuilt every call)
    driver_splitkv.forward(q, k, k, num_splits=0, score_mod=mod, **kw)
    driver_splitkv.forward(q, k, k, num_splits=0, score_mod=mod, **kw)
    assert len(built) == 7 and len(driver_splitkv._PLANS) == 5
    other = DeviceInfo("fake-small", (12, 0), 48, 101376, 101376, "sm120")  # another GPU: its own plan
    import flash_attn_sm120.device as devmod
    monkeypatch.setattr(devmod, "device_info", lambda dev: other)
    driver_splitkv.forward(q, k, k, num_splits=0, **kw)
    assert len(built) == 8
    driver_splitkv.clear_cache()
    assert not driver_splitkv._PLANS


def test_call_plan_matches_the_pure_planner(monkeypatch):
    """The memoized plan holds what driver_splitkv.plan decides for the same call."""
    info = DeviceInfo("fake", (12, 0), 188, 101376, 101376, "sm120")
    _stub_split_launch(monkeypatch, info)
    q = torch.zeros(2, 1, 32, 128, dtype=torch.bfloat16)
    k = torch.zeros(2, 8192, 8, 128, dtype=torch.bfloat16)
    driver_splitkv.forward(q, k, k, softmax_scale=None, causal=False, window_size_left=None, window_size_right=None,
                           softcap=None, pack_gqa=None, need_lse=True, emulate_host_smem=None, num_splits=0)
    (cp,) = driver_splitkv._PLANS.values()
    want = driver_splitkv.plan(head_dim=128, head_dim_v=128, causal=False, local=False, window_size_left=None,
                               window_size_right=None, batch=2, max_seqlen_q=1, max_seqlen_k=8192, num_heads=32,
                               num_heads_kv=8, pack_gqa=True, num_splits=0, num_sms=188)
    assert cp.split == want and cp.softmax_scale == pytest.approx(128 ** -0.5)
    assert cp.compile_key[0].fwd.has_lse and cp.compile_key[0].is_split_kv == (want.num_splits > 1)
    driver_splitkv.clear_cache()


def test_write_pages_round_trips_through_a_shuffled_table():
    """bench.write_pages (the benchmark's and the CUDA-graph test's page filler): gathering the pages
    back in table order gives the dense rows, and the last page's tail is zero."""
    from flash_attn_sm120.bench import write_pages

    torch.manual_seed(0)
    b, s, h, d, page = 2, 70, 3, 16, 16
    dense = torch.randn(b, s, h, d)
    pages = -(-s // page)
    table = torch.randperm(b * pages + 3)[: b * pages].to(torch.int32).view(b, pages)
    pool = torch.full((b * pages + 3, page, h, d), float("nan"))
    write_pages(pool, dense, table)
    for i in range(b):
        rows = pool[table[i].long()].reshape(-1, h, d)
        assert torch.equal(rows[:s], dense[i])
        assert torch.equal(rows[s:], torch.zeros_like(rows[s:]))
    unused = sorted(set(range(b * pages + 3)) - set(table.view(-1).tolist()))
    assert torch.isnan(pool[unused]).all()


def test_paged_copy_holds_the_dense_rows_in_shuffled_pages():
    """bench.paged_copy (the paged benchmarks' inputs): a permutation of pages holding k and v."""
    from flash_attn_sm120.bench import paged_copy

    torch.manual_seed(1)
    k, v = torch.randn(3, 100, 2, 16), torch.randn(3, 100, 2, 32)
    pk, pv, table = paged_copy(k, v, 32, torch.Generator().manual_seed(5))
    assert table.shape == (3, 4) and table.dtype == torch.int32
    assert sorted(table.view(-1).tolist()) == list(range(12))
    assert pk.shape == (12, 32, 2, 16) and pv.shape == (12, 32, 2, 32)
    for i in range(3):
        assert torch.equal(pk[table[i].long()].reshape(-1, 2, 16)[:100], k[i])
        assert torch.equal(pv[table[i].long()].reshape(-1, 2, 32)[:100], v[i])


@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("num_splits", [2, 5, 33, 128])
@pytest.mark.parametrize("varlen,seqused,with_lse", [(False, False, False), (False, True, True), (True, False, True), (True, True, False)])
def test_combine_key_is_the_one_upstreams_wrapper_compiles(monkeypatch, head_dim, num_splits, varlen, seqused, with_lse):
    """driver_splitkv calls the combine kernel directly: it must look up exactly the kernel that
    upstream's _flash_attn_fwd_combine would compile and cache for the same tensors (fake tensors)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from flash_attn.cute import interface as upstream_interface

    from flash_attn_sm120 import driver_splitkv

    compiled = []
    monkeypatch.setattr(upstream_interface, "_compile_fwd_combine", lambda *key: compiled.append(key) or (lambda *a: None))
    monkeypatch.setattr(upstream_interface._flash_attn_fwd_combine, "compile_cache", {})
    h, b, s = 8, 3, 2
    with FakeTensorMode():
        rows = (b * s,) if varlen else (b, s)
        o_partial = torch.empty(num_splits, *rows, h, head_dim, dtype=torch.float32, device="cuda")
        lse_partial = torch.empty(num_splits, *rows[:-1], h, rows[-1], dtype=torch.float32, device="cuda").transpose(-1, -2)
        out = torch.empty(*rows, h, head_dim, dtype=torch.float16, device="cuda")
        lse = torch.empty(*rows[:-1], h, rows[-1], dtype=torch.float32, device="cuda").transpose(-1, -2) if with_lse else None
        cu = torch.zeros(b + 1, dtype=torch.int32, device="cuda") if varlen else None
        used = torch.zeros(b, dtype=torch.int32, device="cuda") if seqused else None
        upstream_interface._flash_attn_fwd_combine(o_partial, lse_partial, out, lse, cu, used, _arch=120)
        key = driver_splitkv.combine_compile_key(120, out, num_splits, varlen=varlen, seqused=seqused, lse=with_lse)
    assert compiled == [key]


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_paged_prefill_config_of_every_table_key_is_spill_free_on_sm120a(d, causal):
    """What paged / split prefill runs for each (bucket, mask) of the table, compiled for sm_120a.
    A TMA entry gives way to the `[[prefill]]` entry of its key, else its cp.async entry, never to its
    own tiles (measured on another kernel) nor to upstream's tile (which spills here at causal d64 / d128)."""
    first = select_fwd_config(load_fwd_table(), d, d, causal, False)
    cfg = driver_splitkv.kernel_config(first, d, d, causal, False)
    if first.family == "tma":
        want = select_prefill_config(load_prefill_table(), d, d, causal, False) or select_fwd_config(
            family_entries("cpasync"), d, d, causal, False)
        assert (cfg.num_threads, cfg.tile_m, cfg.tile_n, cfg.num_stages, cfg.q_in_regs) == (
            want.num_threads, want.tile_m, want.tile_n, want.num_stages, want.q_in_regs), (cfg, want)
    cubin, _ = compile_splitkv_cubin(cfg, d, split=False, paged=True, causal=causal)
    res, hist, _ = inspect_cubin(cubin)
    assert res["stack"] == 0 and hist.get("LDL", 0) == 0 and hist.get("STL", 0) == 0, (cfg.name, res)


def test_prefill_entries_are_validated_and_selected_per_key():
    from flash_attn_sm120.decode import parse_prefill_table

    prov = dict(gpu="g", mode="emulated", date="2026-11-29", command="c")
    row = dict(head_dim=128, mask="causal", family="splitkv", num_threads=128, tile_m=128, tile_n=48, num_stages=2,
               provenance=prov)
    table = parse_prefill_table({"schema": 1, "prefill": [row]})
    assert select_prefill_config(table, 128, 128, True, False) == table[0].config
    assert select_prefill_config(table, 128, 128, True, True) == table[0].config  # local: the causal entry
    assert select_prefill_config(table, 128, 128, False, False) is None  # no entry: kernel_config goes on
    assert select_prefill_config(table, 64, 64, True, False) is None
    with pytest.raises(ValueError, match="family must be 'splitkv'"):
        parse_prefill_table({"schema": 1, "prefill": [dict(row, family="cpasync")]})
    with pytest.raises(ValueError, match="provenance"):
        parse_prefill_table({"schema": 1, "prefill": [dict(row, provenance={})]})
    with pytest.raises(ValueError, match="shared memory"):
        parse_prefill_table({"schema": 1, "prefill": [dict(row, tile_m=256, tile_n=256)]})
    shipped = load_prefill_table()
    assert {(e.head_dim, e.mask) for e in shipped} == {(64, "causal"), (96, "causal"), (128, "causal")}
    for e in shipped:
        assert e.provenance["mode"] == "emulated" and "paged_prefill" in e.provenance["result"]


def test_paged_tile_rule_matches_the_gather_layout_and_every_paged_choice_obeys_it():
    """PagedKVManager copies num_threads / (gcd(head dims, 64) / 8) rows per pass (2-byte dtypes): the
    rule reproduces the measured cases (8 warps x 48 keys wrong at d=128; 8 warps x 32 / 64 and 4
    warps x 48 right) and kernel_config(paged=True) never picks a tile it refuses, at any head dim."""
    from flash_attn_sm120.kernels.fwd_splitkv_paged import paged_tile_error

    assert "32 rows per pass" in paged_tile_error(256, 48, 128, 128)
    for ok in ((256, 32, 128, 128), (256, 64, 128, 128), (128, 48, 128, 128), (256, 64, 96, 96), (128, 64, 112, 112)):
        assert paged_tile_error(*ok) is None, ok
    assert "64 rows per pass" in paged_tile_error(128, 48, 112, 112)  # gcd(112, 64) = 16: 2 threads per row
    assert paged_tile_error(256, 32, 96, 96) is not None  # gcd(96, 64) = 32: 4 threads per row
    for d in range(16, 257, 16):
        for causal, local in ((False, False), (True, False), (False, True)):
            first = select_fwd_config(load_fwd_table(), d, d, causal, local)
            for cfg in (first, select_decode_config(load_decode_table(), d, d) or first):
                chosen = driver_splitkv.kernel_config(cfg, d, d, causal, local, paged=True)
                assert paged_tile_error(chosen.num_threads, chosen.tile_n, d, d) is None, (d, causal, local, chosen)
    # d=112 (a multiple of 16, so pageable) falls off the 48-key entries
    chosen = driver_splitkv.kernel_config(select_fwd_config(load_fwd_table(), 112, 112, True, False), 112, 112, True,
                                          False, paged=True)
    assert chosen.tile_n % 64 == 0, chosen
