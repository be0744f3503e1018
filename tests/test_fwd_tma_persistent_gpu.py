"""GPU correctness of the TMA forward's persistent tile order (FwdConfig.persistent).

One wave of CTAs walks every tile, the Q slot and the K/V rings running on from one tile to the
next, so the shapes here have several tiles per CTA (hundreds of tiles on 132 or 188 SMs) as well as
fewer tiles than SMs, and tiles with no visible key block (causal with seqlen_q > seqlen_k, a local
window, a Q tile with nothing listed): their Q load and release must still pair up. Outputs and
LSE are NaN-poisoned and compared with the fp32 reference (test_fwd_tma_gpu's check and rule).
"""

import pytest

from test_fwd_tma_gpu import MASKS, _check
from flash_attn_sm120 import bench, testing_sparse
from flash_attn_sm120.config import FwdConfig
from flash_attn_sm120.kernels.fwd_tma_proposals import DYNAMIC_CONFIGS, PERSISTENT_CONFIGS, Q_RING_CONFIGS

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("hang_watchdog")]

LISTED = [(d, FwdConfig(*c, family="tma", persistent=True), masks, ok) for d, c, masks, ok in PERSISTENT_CONFIGS] + [
    (d, FwdConfig(*c, family="tma", persistent=True, q_stages=2), masks, ok) for d, c, masks, ok in Q_RING_CONFIGS
] + [
    (d, FwdConfig(*c, family="tma", persistent=True, q_stages=qs, dynamic=True), masks, ok)
    for d, c, masks, ok, qs in DYNAMIC_CONFIGS
]
DENSE = [(d, cfg, masks) for d, cfg, masks, _ in LISTED if masks]
SPARSE = [(d, cfg) for d, cfg, _, ok in LISTED if ok]
# (batch, seqlen_q, seqlen_k, heads, kv heads): many tiles per CTA, few tiles, ragged ends, sq != sk
SHAPES = [(4, 1500, 1500, 8, 8), (2, 17, 17, 4, 2), (3, 1000, 333, 8, 4), (2, 333, 1000, 8, 8), (1, 1, 1, 1, 1)]


@pytest.mark.parametrize("d,cfg,masks", DENSE, ids=[f"d{d}-{c.name}" for d, c, _ in DENSE])
def test_persistent_matches_reference(d, cfg, masks):
    for mask in masks + ("local",):
        causal, window = MASKS[mask]
        for b, sq, sk, h, hk in SHAPES:
            _check(cfg, bench.Problem(b, sq, sk, h, hk, d), causal, window, seed=sq + sk + d)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_persistent_packed_gqa(dtype):
    cfg = FwdConfig(256, 256, 64, 2, False, "tma", persistent=True)
    for b, sq, sk in [(4, 1500, 1500), (2, 333, 1000), (2, 1000, 333)]:
        _check(cfg, bench.Problem(b, sq, sk, 16, 4, 64, dtype=dtype), True, (None, None), seed=sq, pack_gqa=True)


def test_persistent_lpt_off():
    cfg = FwdConfig(256, 256, 64, 3, True, "tma", lpt=False, persistent=True)
    _check(cfg, bench.Problem(4, 1500, 1500, 8, 8, 64), True, (None, None), seed=5)


@pytest.mark.parametrize("d,cfg", SPARSE, ids=[f"d{d}-{c.name}" for d, c in SPARSE])
def test_persistent_block_sparse(d, cfg):
    import flash_attn_sm120
    from test_block_sparse_gpu import _inputs, _map_case, check

    b, h, sq, sk = 3, 8, 1100, 1300
    q, k, v, _ = _inputs(b, sq, sk, h, h, d, seed=d)
    block = (128, 128)
    kinds = _map_case(b, h, sq, sk, block, seed=d, density=0.3)
    kinds[0, 0, 0] = testing_sparse.SKIP  # a Q block with nothing listed
    kinds[1, 2, 3] = testing_sparse.SKIP
    keep = testing_sparse.keep_from_map(kinds, block, sq, sk)
    with flash_attn_sm120.driver.force_config(cfg):
        check(q, k, v, keep, dict(block_sparse_tensors=testing_sparse.lists_from_map(kinds, block)))


@pytest.mark.parametrize("sms", ["1", "3"])
def test_small_wave_walks_many_tiles_per_cta(sms, monkeypatch):
    """With one or three CTAs every CTA walks dozens of tiles: the Q slot and the rings hand over at
    every tile boundary, including empty tiles (causal, seqlen_q > seqlen_k) and a local window."""
    from flash_attn_sm120 import driver

    monkeypatch.setenv(driver.PERSISTENT_SMS_ENV, sms)
    cfg = FwdConfig(256, 256, 64, 3, True, "tma", persistent=True)
    for mask in ("none", "causal", "local"):
        causal, window = MASKS[mask]
        _check(cfg, bench.Problem(3, 700, 300, 4, 2, 64), causal, window, seed=int(sms))
    _check(FwdConfig(128, 64, 64, 2, False, "tma", persistent=True), bench.Problem(2, 333, 1000, 4, 4, 128),
           True, (None, None), seed=7)
    # two Q slots: each tile's Q lands in the slot the tile before last released (empty tiles included)
    for mask in ("none", "causal", "local"):
        causal, window = MASKS[mask]
        _check(FwdConfig(256, 128, 64, 1, False, "tma", persistent=True, q_stages=2),
               bench.Problem(3, 700, 300, 4, 2, 128), causal, window, seed=11 + int(sms))
    _check(FwdConfig(128, 128, 48, 1, False, "tma", persistent=True, q_stages=2), bench.Problem(2, 333, 1000, 4, 4, 64),
           True, (None, None), seed=13)
    # the dynamic order: every tile taken once from the counter, one or two Q slots, empty tiles included
    for cfg in (FwdConfig(256, 256, 64, 3, True, "tma", persistent=True, dynamic=True),
                FwdConfig(256, 256, 64, 2, False, "tma", persistent=True, q_stages=2, dynamic=True)):
        for mask in ("none", "causal", "local"):
            causal, window = MASKS[mask]
            _check(cfg, bench.Problem(3, 700, 300, 4, 2, 64), causal, window, seed=17 + int(sms))


@pytest.mark.parametrize("sms", ["1", "3"])
def test_small_wave_block_sparse_handoffs(sms, monkeypatch):
    """One CTA (or three) walks every Q tile of a block-sparse call: tiles whose first visited tile comes from
    the mask list, from the full list (mask list empty) and tiles with nothing listed, one after another."""
    from flash_attn_sm120 import driver
    from test_block_sparse_gpu import _inputs, _map_case, check

    monkeypatch.setenv(driver.PERSISTENT_SMS_ENV, sms)
    b, h, sq, sk, d = 2, 3, 900, 1000, 128
    q, k, v, _ = _inputs(b, sq, sk, h, h, d, seed=17)
    block = (128, 128)
    kinds = _map_case(b, h, sq, sk, block, seed=17, density=0.4)
    kinds[0, 0, 1] = testing_sparse.SKIP  # nothing listed
    kinds[0, 1, 2] = testing_sparse.SKIP
    kinds[0, 1, 2, 3] = testing_sparse.FULL  # the full list only
    kinds[1, 2, 0] = testing_sparse.SKIP
    kinds[1, 2, 0, 0] = testing_sparse.PARTIAL  # the mask list only
    keep = testing_sparse.keep_from_map(kinds, block, sq, sk)
    for cfg in (FwdConfig(128, 64, 64, 2, False, "tma", persistent=True),
                FwdConfig(128, 64, 64, 2, False, "tma", persistent=True, q_stages=2),
                FwdConfig(128, 64, 64, 2, False, "tma", persistent=True, q_stages=2, dynamic=True)):
        with driver.force_config(cfg):
            check(q, k, v, keep, dict(block_sparse_tensors=testing_sparse.lists_from_map(kinds, block)))


def test_dynamic_order_replays_in_a_cuda_graph(monkeypatch):
    """The dynamic order's counter is allocated and zeroed inside the call, so a captured call zeroes it on
    every replay: two replays over new q/k/v (outputs NaN-poisoned before each) both match the reference. A
    wave of 3 CTAs takes ~30 tiles each from the counter, so a replay that started from a stale count would
    leave tiles unwritten."""
    import torch

    from flash_attn_sm120 import driver, flash_attn_func

    monkeypatch.setenv(driver.PERSISTENT_SMS_ENV, "3")

    cfg = FwdConfig(256, 256, 64, 2, False, "tma", persistent=True, q_stages=2, dynamic=True)
    p = bench.Problem(2, 1500, 1500, 8, 8, 64)
    x = bench.make_inputs(p, seed=29)
    with driver.force_config(cfg):
        call = lambda: flash_attn_func(x["q"], x["k"], x["v"], causal=True, return_lse=True)  # noqa: E731
        call()  # compile outside the capture
        graph, (out, lse) = bench.capture_graph(call)
    for seed in (1, 2):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        for name in ("q", "k", "v"):
            x[name].copy_(torch.randn(x[name].shape, generator=gen, device="cuda", dtype=x[name].dtype))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, ref_lse = bench.reference_attention(x["q"], x["k"], x["v"], causal=True, window=(None, None))
        low, _ = bench.reference_attention(x["q"], x["k"], x["v"], causal=True, window=(None, None), upcast=False)
        assert not torch.isnan(out).any() and not torch.isnan(lse).any()
        from test_fwd_tma_gpu import ATOL
        assert bench.error_vs_reference(out, ref) <= 2 * bench.error_vs_reference(low, ref) + ATOL
        assert torch.allclose(lse, ref_lse, atol=1e-3, rtol=1e-3)
