"""The wide dQ adds (launch plan's dq_wide_adds) on a GPU, against fp32 autograd with NaN-poisoned grads.

With dq_wide_adds the main kernel adds dQ four floats at a time (red.global.add.v4.f32) into an
accumulator laid out four consecutive floats per thread, and this package's postprocess reads that
layout (kernels/bwd_postprocess.py). A mismatch between the two partitions shows as wrong dQ
columns or rows, so every backward shape of the sanitizer's (dense, varlen, seqused, GQA, windows,
softcap, d192/d224, modifiers with aux tensors, sinks, deterministic turns and fixed point, the
block-sparse walk) runs here with the plan forced on, plus grids large enough for many CTAs to add
into one tile at once, and the seed shapes' table tiles.
"""

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import flash_attn_sm120  # noqa: E402
import sanitize  # noqa: E402
from flash_attn_sm120 import driver_bwd, testing  # noqa: E402
from flash_attn_sm120.testing import AttnCase, AttnProblem  # noqa: E402

pytestmark = pytest.mark.gpu

SHAPES = [s for s in sanitize.BWD_SHAPES + sanitize.MOD_SHAPES + sanitize.SPARSE_SHAPES if s[1].backward]


def _check(case, problem):
    inputs = testing.make_inputs(case, problem, "cuda", requires_grad=True)
    with driver_bwd.force_launch_plan(dq_wide_adds=True):
        return testing.check_backward(inputs, case, problem)


@pytest.mark.parametrize("name,case,problem", SHAPES, ids=[s[0] for s in SHAPES])
def test_sanitizer_shapes(name, case, problem):
    _check(case, problem)


@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_large_grids(d, mask):
    """The table's tiles for the seed head dims; many n_block CTAs add into each dQ tile at once."""
    case = AttnCase("bfloat16", d, d, 2, None, mask, backward=True)
    _check(case, AttnProblem((2048, 2048), (2048, 2048), nheads_kv=4, seed=d))


def test_the_wide_adds_ran_and_match_the_plain_ones():
    """The plan really switched (a compile key with dq_wide_adds) and gives the plain adds' gradients up to
    the order of fp32 additions."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(2, 1000, 8, 96, generator=gen, device="cuda").to(torch.bfloat16).requires_grad_(True)
               for _ in range(3))
    g = torch.randn(2, 1000, 8, 96, generator=gen, device="cuda").to(torch.bfloat16)

    def grads():
        out, _ = flash_attn_sm120.flash_attn_func(q, k, v, causal=True)
        return torch.autograd.grad(out, (q, k, v), g)

    plain = grads()
    with driver_bwd.force_launch_plan(dq_wide_adds=True):
        wide = grads()
    assert any(key.dq_wide_adds for key in driver_bwd._verified_keys)
    for name, a, p in zip(("dq", "dk", "dv"), wide, plain):
        assert a.isfinite().all(), name
        assert (a.float() - p.float()).abs().max().item() <= 1e-2 * p.float().abs().max().item() + 1e-3, name
