"""GPU checks of the layouts and arguments upstream's interface takes loosely (tests/test_api.py has the CPU
side): strided or misaligned q/k/v and a strided sink are copied (upstream's maybe_contiguous) and give the
same bits as the contiguous call, gradients included; the LSE an autograd call needs stays differentiable
without return_lse; a negative softcap is |softcap|."""

import pytest
import torch

from flash_attn_sm120 import flash_attn_func

pytestmark = pytest.mark.gpu


def _inputs(seed=0, b=2, s=200, h=4, d=64):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]


def _strided(x: torch.Tensor) -> torch.Tensor:
    """x's values in a tensor whose head dim has stride 2."""
    wide = torch.empty(*x.shape[:-1], 2 * x.shape[-1], device=x.device, dtype=x.dtype)
    out = wide[..., ::2]
    out.copy_(x)
    return out


def _misaligned(x: torch.Tensor) -> torch.Tensor:
    """x's values starting one element past a 16-byte boundary."""
    flat = torch.empty(x.numel() + 8, device=x.device, dtype=x.dtype)
    out = flat[1:1 + x.numel()].view(x.shape)
    out.copy_(x)
    return out


@pytest.mark.parametrize("make", [_strided, _misaligned], ids=["strided", "misaligned"])
@pytest.mark.parametrize("causal", [False, True])
def test_copied_layouts_give_the_contiguous_calls_bits(make, causal):
    q, k, v = _inputs()
    sink = torch.randn(8, device="cuda")[::2]
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    # deterministic: the dQ adds in a fixed order, so both calls' gradients can be compared bit for bit
    out, lse = flash_attn_func(*leaves, causal=causal, learnable_sink=sink.contiguous(), return_lse=True,
                               deterministic=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    odd = [make(t).requires_grad_(True) for t in (q, k, v)]
    out2, lse2 = flash_attn_func(*odd, causal=causal, learnable_sink=sink, return_lse=True, deterministic=True)
    out2.backward(dout)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    for a, b in zip(leaves, odd):
        assert b.grad is not None and torch.equal(a.grad, b.grad)


def test_an_lse_not_asked_for_backpropagates_zero():
    q, k, v = (t.requires_grad_(True) for t in _inputs(1))
    out, lse = flash_attn_func(q, k, v, causal=True)
    assert lse is not None and lse.requires_grad
    lse.sum().backward()
    assert all(t.grad is not None and not t.grad.any() for t in (q, k, v))


def test_a_negative_softcap_is_its_magnitude():
    q, k, v = _inputs(2)
    assert torch.equal(flash_attn_func(q, k, v, softcap=-30.0)[0], flash_attn_func(q, k, v, softcap=30.0)[0])


def _odd_unit_stride(x: torch.Tensor) -> torch.Tensor:
    """x (b, s, 1, d): a tensor torch calls contiguous whose size-1 head dim carries stride 3, which the kernels'
    16-byte stride rule refuses (interface._aligned_rows copies it)."""
    b, s, _, d = x.shape
    out = torch.empty_like(x).as_strided(x.shape, (s * d, d, 3, 1))
    out.copy_(x)
    return out


def test_compiled_backward_copies_layouts_as_eager_does():
    """Under torch.compile the backward op receives the caller's tensors (the forward op copied them inside its
    eager call): a size-1 dim's odd stride must reach the kernels copied there too, with the eager call's bits."""
    q, k, v = _inputs(2, h=1)

    def loss(q, k, v, dout):
        return (flash_attn_func(q, k, v, causal=True, deterministic=True)[0] * dout).sum()

    dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)
    eager = [t.clone().requires_grad_(True) for t in (q, k, v)]
    loss(*eager, dout).backward()
    odd = [_odd_unit_stride(t).requires_grad_(True) for t in (q, k, v)]
    assert all(t.is_contiguous() and t.stride(2) == 3 for t in odd)
    torch.compile(loss, fullgraph=True)(*odd, dout).backward()
    for a, b in zip(eager, odd):
        assert b.grad is not None and torch.equal(a.grad, b.grad)
