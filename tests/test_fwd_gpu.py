"""GPU correctness of the SM120 forward (real SM120, or SM120 emulation on other GPUs).

Every shipped config and the dispatcher's choice are checked against an fp32 reference on random
data, with the output buffer poisoned with NaN before the call, within 2x the error of upstream's
own SM120 kernel (plus a small atol). Autograd through the drop-in API is checked against fp32
reference gradients.
"""

import math

import pytest
import torch

from flash_attn_sm120 import bench, driver, flash_attn_func, flash_attn_varlen_func
from flash_attn_sm120.config import FwdConfig, load_fwd_table, upstream_fwd_config
from flash_attn_sm120.device import device_info

pytestmark = pytest.mark.gpu

SHIPPED = sorted({(e.head_dim, e.mask, e.config) for e in load_fwd_table()}, key=str)
ATOL = 1e-3


def _upstream_sm120_out(q, k, v, causal, window=(None, None), monkeypatch=None):
    """Upstream's own SM120 kernel (its class, tiles and interface) on this GPU."""
    from flash_attn.cute.interface import _flash_attn_fwd

    monkeypatch.setenv("FLASH_ATTENTION_NUM_SMS", str(torch.cuda.get_device_properties(0).multi_processor_count))
    out, *_ = _flash_attn_fwd(q, k, v, causal=causal, window_size_left=window[0], window_size_right=window[1], _arch=120)
    return out


def _run(cfg, x, causal, window=(None, None), softcap=None, need_lse=False, pack_gqa=None):
    info = device_info()
    q = x["q"]
    out = torch.full((*q.shape[:-1], x["v"].shape[-1]), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device=q.device) if need_lse else None
    driver.forward(q, x["k"], x["v"], softmax_scale=None, causal=causal, window_size_left=window[0],
                   window_size_right=window[1], softcap=softcap, pack_gqa=pack_gqa, need_lse=need_lse,
                   emulate_host_smem=info.emulate_host_smem, out=out, lse=lse, config=cfg)
    return out, lse


@pytest.mark.parametrize("head_dim,mask,cfg", SHIPPED, ids=[f"{d}-{m}-{c.name}" for d, m, c in SHIPPED])
@pytest.mark.parametrize("shape", [(2, 333, 517, 4, 2), (1, 1024, 1024, 4, 4), (3, 77, 77, 6, 1)])
def test_shipped_configs_match_reference(head_dim, mask, cfg, shape, monkeypatch):
    b, sq, sk, h, hk = shape
    causal = mask != "none"
    p = bench.Problem(b, sq, sk, h, hk, head_dim, causal=causal)
    x = bench.make_inputs(p, seed=sq + head_dim)
    out, _ = _run(cfg, x, causal)
    ref, _ = bench.reference_attention(x["q"], x["k"], x["v"], causal=causal)
    up = _upstream_sm120_out(x["q"], x["k"], x["v"], causal, monkeypatch=monkeypatch)
    err, up_err = bench.error_vs_reference(out, ref), bench.error_vs_reference(up, ref)
    assert not torch.isnan(out).any(), "unwritten (NaN-poisoned) output elements"
    assert err <= 2 * up_err + ATOL, (err, up_err)


@pytest.mark.parametrize("dtype,cfg", [(torch.bfloat16, FwdConfig(256, 128, 96)),
                                       (torch.float16, FwdConfig(128, 64, 64, 1, True))],
                         ids=["bf16-w8-128x96", "fp16-w4-64x64-qreg"])
def test_lse_gqa_local_softcap(dtype, cfg):
    p = bench.Problem(2, 300, 700, 8, 2, 128, dtype=str(dtype).replace("torch.", ""))
    x = bench.make_inputs(p, seed=7)
    for causal, window, softcap in [(False, (None, None), None), (True, (None, None), None),
                                    (False, (64, 32), None), (False, (0, 0), None), (True, (None, None), 30.0)]:
        out, lse = _run(cfg, x, causal, window, softcap, need_lse=True)
        ref, ref_lse = bench.reference_attention(x["q"], x["k"], x["v"], causal=causal, window=window,
                                                 softcap=softcap or 0.0)
        low, _ = bench.reference_attention(x["q"], x["k"], x["v"], causal=causal, window=window,
                                           softcap=softcap or 0.0, upcast=False)
        tol = 2 * bench.error_vs_reference(low, ref) + ATOL + (2e-3 if softcap else 0)
        assert bench.error_vs_reference(out, ref) <= tol, (causal, window, softcap)
        finite = torch.isfinite(ref_lse)
        assert torch.allclose(lse[finite], ref_lse[finite], atol=1e-3, rtol=1e-3), (causal, window)


def test_api_autograd_matches_reference():
    p = bench.Problem(2, 257, 257, 4, 2, 64, causal=True)
    x = bench.make_inputs(p, seed=3, requires_grad=True)
    out, lse = flash_attn_func(x["q"], x["k"], x["v"], causal=True, return_lse=True)
    g = torch.randn_like(out)
    (out * g).sum().backward()
    grads = [t.grad.clone() for t in (x["q"], x["k"], x["v"])]
    qf, kf, vf = (t.detach().float().requires_grad_(True) for t in (x["q"], x["k"], x["v"]))
    ref = _torch_attention(qf, kf, vf, causal=True)
    (ref * g.float()).sum().backward()
    for name, ours, theirs in zip("qkv", grads, (qf.grad, kf.grad, vf.grad)):
        assert torch.isfinite(ours).all(), name
        rel = (ours.float() - theirs).norm() / theirs.norm()
        assert rel < 2e-2, (name, rel.item())
    assert (out.float() - ref.detach()).abs().max() < 2e-2


def _torch_attention(q, k, v, causal):
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)


def test_varlen_api_matches_per_sequence_reference():
    lens = [1, 100, 517, 0, 64]
    h, hk, d = 4, 2, 128
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
    total = sum(lens)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(total, h, d, device="cuda", generator=g).bfloat16()
    k = torch.randn(total, hk, d, device="cuda", generator=g).bfloat16()
    v = torch.randn(total, hk, d, device="cuda", generator=g).bfloat16()
    out, _ = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens),
                                    max_seqlen_k=max(lens), causal=True)
    for i, n in enumerate(lens):
        if n == 0:
            continue
        s, e = cu[i].item(), cu[i + 1].item()
        ref, _ = bench.reference_attention(q[None, s:e], k[None, s:e], v[None, s:e], causal=True)
        low, _ = bench.reference_attention(q[None, s:e], k[None, s:e], v[None, s:e], causal=True, upcast=False)
        err = bench.error_vs_reference(out[None, s:e], ref)
        assert err <= 2 * bench.error_vs_reference(low, ref) + ATOL, (i, n, err)


def test_emulation_mode_is_reported():
    info = device_info()
    if torch.cuda.get_device_capability()[0] == 12:
        assert info.mode == "sm120"
    else:
        assert info.mode == "emulated" and info.emulate_host_smem is not None
    assert info.label()


def test_upstream_reference_config_is_upstreams_kernel(monkeypatch):
    """Our class with upstream's config computes what upstream's SM120 interface computes."""
    p = bench.Problem(1, 512, 512, 4, 4, 128, causal=True)
    x = bench.make_inputs(p, seed=11)
    ours, _ = _run(upstream_fwd_config(128), x, True)
    theirs = _upstream_sm120_out(x["q"], x["k"], x["v"], True, monkeypatch=monkeypatch)
    assert torch.equal(ours, theirs)
