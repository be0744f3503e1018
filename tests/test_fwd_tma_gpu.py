"""GPU correctness of the TMA forward family (real SM120, or SM120 emulation on other GPUs).

Outputs and LSE are poisoned with NaN before each call and compared with an fp32 reference on
random data; the error may be at most 2x that of the same attention computed in bf16/fp16 by
torch, plus 1e-3. Sequence lengths include 1, 17, 333 and 1000 (not tile multiples) and
seqlen_q != seqlen_k in both directions; GQA runs unpacked (pack_gqa=False) and packed (query heads
folded into the M tile, the ratio dividing tile_m). A hung kernel (mbarrier/TMA) ends the process through
tests/watchdog.py when that module is present.
"""

import pytest
import torch

from flash_attn_sm120 import bench, driver
from flash_attn_sm120.config import FwdConfig
from flash_attn_sm120.device import device_info
from flash_attn_sm120.kernels.fwd_tma import PROPOSED_CONFIGS

# a hung kernel (mbarrier/TMA) ends the process through conftest.hang_watchdog
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("hang_watchdog")]

ATOL = 1e-3
SEQLENS = [(1, 1), (17, 17), (333, 333), (1000, 1000), (333, 1000), (1000, 333), (17, 1000)]
MASKS = {"none": (False, (None, None)), "causal": (True, (None, None)), "local": (False, (64, 32))}
ALL_PROPOSED = [
    (d, FwdConfig(*c, family="tma"), masks) for d, entries in PROPOSED_CONFIGS.items() for c, masks in entries
]


def _first_config(d: int) -> FwdConfig:
    return FwdConfig(*PROPOSED_CONFIGS[d][0][0], family="tma")


def _run(cfg, x, causal, window, softcap=None, pack_gqa=False):
    q, k, v = x["q"], x["k"], x["v"]
    out = torch.full((*q.shape[:-1], v.shape[-1]), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device=q.device)
    driver.forward(q, k, v, softmax_scale=None, causal=causal, window_size_left=window[0],
                   window_size_right=window[1], softcap=softcap, pack_gqa=pack_gqa, need_lse=True,
                   emulate_host_smem=device_info().emulate_host_smem, out=out, lse=lse, config=cfg)
    torch.cuda.synchronize()
    return out, lse


def _check(cfg, p: bench.Problem, causal, window, softcap=None, seed=0, pack_gqa=False):
    x = bench.make_inputs(p, seed=seed)
    out, lse = _run(cfg, x, causal, window, softcap, pack_gqa)
    ref, ref_lse = bench.reference_attention(x["q"], x["k"], x["v"], causal=causal, window=window,
                                             softcap=softcap or 0.0)
    low, _ = bench.reference_attention(x["q"], x["k"], x["v"], causal=causal, window=window,
                                       softcap=softcap or 0.0, upcast=False)
    where = f"{cfg.name} {p.name} causal={causal} window={window} softcap={softcap} pack_gqa={pack_gqa}"
    assert not torch.isnan(out).any(), f"unwritten (NaN-poisoned) output elements: {where}"
    assert not torch.isnan(lse).any(), f"unwritten (NaN-poisoned) LSE rows: {where}"
    err, low_err = bench.error_vs_reference(out, ref), bench.error_vs_reference(low, ref)
    assert err <= 2 * low_err + ATOL, (where, err, low_err)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), f"fully masked rows must have LSE -inf: {where}"
    assert torch.allclose(lse[finite], ref_lse[finite], atol=1e-3, rtol=1e-3), where


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [64, 96, 128])
def test_matches_reference(d, dtype, mask):
    cfg = _first_config(d)
    causal, window = MASKS[mask]
    hk = {"none": 2, "causal": 4, "local": 1}[mask]  # GQA 2:1, MHA, MQA (one compile per case)
    for sq, sk in SEQLENS:
        p = bench.Problem(2, sq, sk, 4, hk, d, dtype=dtype)
        _check(cfg, p, causal, window, seed=sq + 7 * sk + d)


@pytest.mark.parametrize("d,cfg,masks", ALL_PROPOSED, ids=[f"d{d}-{c.name}" for d, c, _ in ALL_PROPOSED])
def test_every_proposed_config(d, cfg, masks):
    for mask in masks:
        causal, window = MASKS[mask]
        for sq, sk in [(333, 1000), (1000, 333), (257, 257)]:
            _check(cfg, bench.Problem(2, sq, sk, 6, 2, d), causal, window, seed=sq + sk)


# (head_dim, query heads per KV head, mask): every proposed config of the head dim that compiles
# for the mask runs packed; 8:1 fills a 128-row tile with 16 positions
PACKED_CASES = [(128, 4, "causal"), (128, 8, "none"), (96, 2, "causal"), (64, 4, "local"), (128, 2, "local")]


@pytest.mark.parametrize("d,ratio,mask", PACKED_CASES, ids=[f"d{d}-g{r}-{m}" for d, r, m in PACKED_CASES])
def test_packed_gqa_matches_reference(d, ratio, mask):
    causal, window = MASKS[mask]
    configs = [FwdConfig(*c, family="tma") for c, masks in PROPOSED_CONFIGS[d] if mask in masks]
    for cfg in configs:
        for sq, sk in [(1, 1), (17, 17), (333, 1000), (1000, 333), (257, 257)]:
            _check(cfg, bench.Problem(2, sq, sk, 2 * ratio, 2, d), causal, window, seed=sq + sk + ratio,
                   pack_gqa=True)


def _check_causal_mask_mod(cfg, p: bench.Problem, seed: int, pack_gqa: bool):
    """A mask_mod of q_idx >= kv_idx (causal for sq == sk), run without the causal flag, against
    the causal fp32 reference with a NaN-poisoned output."""
    import cutlass.cute as cute

    @cute.jit
    def lower_triangle(batch_idx, head_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return q_idx >= kv_idx

    x = bench.make_inputs(p, seed=seed)
    q, k, v = x["q"], x["k"], x["v"]
    out = torch.full_like(q, float("nan"))
    driver.forward(q, k, v, softmax_scale=None, causal=False, window_size_left=None, window_size_right=None,
                   softcap=None, pack_gqa=pack_gqa, need_lse=False, mask_mod=lower_triangle,
                   emulate_host_smem=device_info().emulate_host_smem, out=out, config=cfg)
    ref, _ = bench.reference_attention(q, k, v, causal=True)
    low, _ = bench.reference_attention(q, k, v, causal=True, upcast=False)
    assert not torch.isnan(out).any()
    assert bench.error_vs_reference(out, ref) <= 2 * bench.error_vs_reference(low, ref) + ATOL


def test_packed_gqa_softcap_and_mask_mod():
    """score_mod (softcap) and mask_mod see the real query head and position of a packed row."""
    cfg = _first_config(128)
    _check(cfg, bench.Problem(2, 300, 700, 8, 2, 128), True, (None, None), softcap=30.0, seed=9, pack_gqa=True)
    _check_causal_mask_mod(cfg, bench.Problem(2, 333, 333, 8, 2, 128), seed=3, pack_gqa=True)


def test_default_gqa_call_runs_packed_on_the_tma_entry():
    """The public API's default (pack_gqa=None) packs GQA heads on a TMA table entry."""
    from flash_attn_sm120 import flash_attn_func
    from flash_attn_sm120.explain import explain

    assert device_info().uses_sm120_kernels, "the public API must run this package's kernels here"
    x = bench.make_inputs(bench.Problem(2, 1000, 1000, 16, 4, 128), seed=21)
    q, k, v = x["q"], x["k"], x["v"]
    e = explain(q, k, v, causal=True)
    if e.family != "tma":
        pytest.skip(f"the table's causal d128 entry runs {e.family}")
    assert e.pack_gqa
    out = flash_attn_func(q, k, v, causal=True)
    out = out[0] if isinstance(out, tuple) else out
    ref, _ = bench.reference_attention(q, k, v, causal=True)
    low, _ = bench.reference_attention(q, k, v, causal=True, upcast=False)
    assert bench.error_vs_reference(out, ref) <= 2 * bench.error_vs_reference(low, ref) + ATOL


@pytest.mark.parametrize("window", [(0, 0), (100, None), (None, 50), (300, 0)])
def test_local_windows(window):
    cfg = _first_config(128)
    for sq, sk in [(1000, 1000), (333, 1000), (1000, 333)]:
        _check(cfg, bench.Problem(1, sq, sk, 4, 2, 128), False, window, seed=sq)


def test_softcap_goes_through_score_mod():
    cfg = _first_config(128)
    for causal in (False, True):
        _check(cfg, bench.Problem(2, 300, 700, 8, 2, 128), causal, (None, None), softcap=30.0, seed=5)


def test_mask_mod_equal_to_causal():
    """A mask_mod is applied on every n_block (here: q_idx >= kv_idx, i.e. causal for sq == sk)."""
    cfg = _first_config(128)
    for s in (333, 1000):
        _check_causal_mask_mod(cfg, bench.Problem(2, s, s, 4, 2, 128), seed=s, pack_gqa=False)


def test_long_sequence_many_blocks():
    """Many trips around the K/V ring (phase bits wrap many times)."""
    for d in (64, 128):
        _check(_first_config(d), bench.Problem(1, 4096, 4096, 2, 1, d), True, (None, None), seed=11)
        _check(_first_config(d), bench.Problem(1, 1000, 5000, 2, 2, d), False, (None, None), seed=12)
