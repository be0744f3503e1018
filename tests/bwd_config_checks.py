"""GPU checks of one backward config that several test files run (tests/test_bwd_*_gpu.py): gradients
with position-dependent modifiers, and deterministic=True bit for bit and against the plain backward."""

from __future__ import annotations

from typing import Optional

import torch

import flash_attn_sm120
from flash_attn_sm120 import driver_bwd
from flash_attn_sm120.kernels.bwd_tiling import BwdConfig


def check_position_dependent_modifiers(cfg: BwdConfig, d: int) -> None:
    """score_mod / score_mod_bwd and mask_mod see each element's (q_idx, kv_idx): a position-dependent scale
    and prefix-LM (not symmetric, so a transposed index shows) against an fp32 reference."""
    from test_mods_bwd_gpu import _inputs, check_against_ref, position_scale_ref

    from flash_attn_sm120.testing_mods import PREFIX, position_scale, position_scale_bwd, prefix_lm

    q, k, v, dout = _inputs(2, 200, 333, 4, 2, d, seed=d + 5)
    with driver_bwd.force_config(cfg):
        check_against_ref(q, k, v, dout, dict(score_mod=position_scale, score_mod_bwd=position_scale_bwd),
                          dict(score_fn=position_scale_ref))
        q, k, v, dout = _inputs(1, 300, 300, 4, 4, d, seed=d + 6)
        check_against_ref(q, k, v, dout, dict(mask_mod=prefix_lm),
                          dict(keep_fn=lambda b, h, qi, ki: (ki <= qi) | (ki < PREFIX)))


def _grads(q, k, v, g, **kw):
    out, _ = flash_attn_sm120.flash_attn_func(q, k, v, **kw)
    return torch.autograd.grad(out, (q, k, v), g)


def check_deterministic(cfg: BwdConfig, d: int, causal: bool, window: Optional[tuple[int, int]]) -> None:
    """Three deterministic backwards (GQA 8:2, s700) bitwise equal, finite, and within fp32-sum noise of the
    non-deterministic one (whose accuracy the other tests check against fp32)."""
    gen = torch.Generator(device="cuda").manual_seed(d)

    def mk(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16).requires_grad_(True)

    q, k, v = mk(2, 700, 8, d), mk(2, 700, 2, d), mk(2, 700, 2, d)
    g = torch.randn(2, 700, 8, d, generator=gen, device="cuda").to(torch.bfloat16)
    kw = dict(causal=causal, window_size=window if window else (None, None))
    with driver_bwd.force_config(cfg):
        runs = [_grads(q, k, v, g, deterministic=True, **kw) for _ in range(3)]
        plain = _grads(q, k, v, g, **kw)
    for other in runs[1:]:
        for a, c in zip(runs[0], other):
            assert torch.equal(a, c)
    for name, a, p in zip(("dq", "dk", "dv"), runs[0], plain):
        assert a.isfinite().all(), name
        assert (a.float() - p.float()).abs().max().item() <= 2e-2 * p.float().abs().max().item() + 1e-3, name
