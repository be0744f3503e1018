"""torch.compile on the GPU: compiled == eager, forward and backward, with fullgraph=True.

The forward is deterministic, so a compiled forward must equal the eager one bit for bit; with
deterministic=True the backward is too, so compiled gradients must equal eager gradients exactly.
The default (atomic dQ) backward is checked against the fp32 reference with upstream's rule. A
decode step compiled with mode="reduce-overhead" must run from a CUDA graph (no cudagraph skip) and
follow new data written into its inputs.
"""

import pytest

torch = pytest.importorskip("torch")

import flash_attn_sm120  # noqa: E402
from flash_attn_sm120 import testing  # noqa: E402

pytestmark = pytest.mark.gpu


def _attn(q, k, v, **kw):
    out, lse = flash_attn_sm120.flash_attn_func(q, k, v, **kw)
    return (out, lse) if kw.get("return_lse") else out


def _with_lse(q, k, v, **kw):
    return flash_attn_sm120.flash_attn_func(q, k, v, **kw)


def _leaves(*shapes, seed, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(s, device="cuda", dtype=dtype, generator=g).requires_grad_(True) for s in shapes]


@pytest.mark.parametrize("causal,window,d", [(True, (None, None), 128), (False, (None, None), 64),
                                             (False, (256, -1), 128)])
def test_compiled_matches_eager_deterministic(causal, window, d):
    torch._dynamo.reset()
    q, k, v = _leaves((2, 700, 8, d), (2, 700, 2, d), (2, 700, 2, d), seed=d + causal)
    g = torch.randn_like(q)
    kw = dict(causal=causal, window_size=window, deterministic=True)  # (the window: fixed-point dQ)
    compiled = torch.compile(_attn, fullgraph=True)
    out_c = compiled(q, k, v, **kw)
    grads_c = torch.autograd.grad(out_c, (q, k, v), g)
    out_e = _attn(q, k, v, **kw)
    grads_e = torch.autograd.grad(out_e, (q, k, v), g)
    assert torch.equal(out_c, out_e)
    # as upstream: with a gradient to come, the LSE comes back even without return_lse, in both paths
    (_, lse_c), (_, lse_e) = torch.compile(_with_lse, fullgraph=True)(q, k, v, **kw), _with_lse(q, k, v, **kw)
    assert lse_c is not None and lse_e is not None and torch.equal(lse_c, lse_e)
    for name, a, b in zip(("dq", "dk", "dv"), grads_c, grads_e):
        assert a.stride() == b.stride(), name
        assert torch.equal(a, b), name


def test_compiled_lse_and_atomic_backward_against_fp32_reference():
    torch._dynamo.reset()
    q, k, v = _leaves((1, 513, 4, 128), (1, 513, 4, 128), (1, 513, 4, 128), seed=3)
    g_out, g_lse = torch.randn_like(q), torch.randn(1, 4, 513, device="cuda")
    compiled = torch.compile(_attn, fullgraph=True)
    out, lse = compiled(q, k, v, causal=True, return_lse=True)
    grads = torch.autograd.grad((out, lse), (q, k, v), (g_out, g_lse))
    ref, pt = [], []
    for upcast, dst in ((True, ref), (False, pt)):
        leaves = [(t.detach().float() if upcast else t.detach().clone()).requires_grad_(True) for t in (q, k, v)]
        o, l = testing.attention_ref(*leaves, causal=True, upcast=upcast, reorder_ops=not upcast)
        if dst is ref:
            torch.testing.assert_close(out.float(), o, rtol=0, atol=2e-2)
            torch.testing.assert_close(lse, l, rtol=0, atol=1e-3)
        dst.extend(torch.autograd.grad((o, l), leaves, (g_out.to(o.dtype), g_lse)))
    for name, a, r, lo in zip(("dq", "dk", "dv"), grads, ref, pt):
        err, bound = (a.float() - r).abs().max().item(), 2 * (lo.float() - r).abs().max().item() + 2e-3
        assert err <= bound, (name, err, bound)


def test_compiled_varlen_matches_eager():
    torch._dynamo.reset()
    lens = [300, 17, 512]
    cu = torch.tensor([0, 300, 317, 829], dtype=torch.int32, device="cuda")
    q, k, v = _leaves((829, 8, 128), (829, 2, 128), (829, 2, 128), seed=5)
    g = torch.randn_like(q)

    def f(q, k, v):
        return flash_attn_sm120.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                       max_seqlen_q=max(lens), max_seqlen_k=max(lens), causal=True,
                                                       deterministic=True)[0]

    out_c = torch.compile(f, fullgraph=True)(q, k, v)
    grads_c = torch.autograd.grad(out_c, (q, k, v), g)
    out_e = f(q, k, v)
    grads_e = torch.autograd.grad(out_e, (q, k, v), g)
    assert torch.equal(out_c, out_e)
    for a, b in zip(grads_c, grads_e):
        assert torch.equal(a, b)


def test_compiled_decode_step_runs_from_a_cuda_graph():
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    b, sk, h, hk, d = 2, 3000, 32, 8, 128
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)

    def step(q, k, v):
        return flash_attn_sm120.flash_attn_func(q, k, v, num_splits=0)[0] * 1.0

    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for _ in range(3):  # warm-up runs, then recorded and replayed
            compiled(q, k, v)
        q.copy_(torch.randn_like(q))
        out = compiled(q, k, v).clone()
        ref = step(q, k, v)
    assert counters["inductor"].get("cudagraph_skips", 0) == 0, dict(counters["inductor"])
    assert torch.equal(out, ref)


def test_compiled_sink_matches_eager():
    """learnable_sink as an op argument: compiled == eager bit for bit (forward and, deterministic, backward)."""
    torch._dynamo.reset()
    q, k, v = _leaves((2, 300, 8, 128), (2, 300, 2, 128), (2, 300, 2, 128), seed=21)
    sink = torch.randn(8, device="cuda").requires_grad_(True)
    g = torch.randn_like(q)

    def f(q, k, v, sink):
        return flash_attn_sm120.flash_attn_func(q, k, v, causal=True, learnable_sink=sink, deterministic=True)[0]

    out_c = torch.compile(f, fullgraph=True)(q, k, v, sink)
    grads_c = torch.autograd.grad(out_c, (q, k, v, sink), g)
    out_e = f(q, k, v, sink)
    grads_e = torch.autograd.grad(out_e, (q, k, v, sink), g)
    assert torch.equal(out_c, out_e)
    for a, b in zip(grads_c, grads_e):
        assert torch.equal(a, b)
