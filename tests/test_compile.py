"""torch.compile on a CPU: the custom ops' fake shapes, and full-graph traces through autograd.

The fake implementations are checked under FakeTensorMode with CUDA-placed fake tensors (no GPU
needed). The traces run on CPU tensors with a test-scoped CPU kernel for the two ops (an fp32
reference attention and its autograd VJP), so a compiled forward and backward are compared with
eager autograd of the same reference, and the graphs are checked to hold the ops and no break.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import flash_attn_sm120
from flash_attn_sm120 import compile_ops
from flash_attn_sm120.testing import attention_ref

FWD = torch.ops.flash_attn_sm120.fwd
BWD = torch.ops.flash_attn_sm120.bwd


def _fwd_args(q, k, v, *, cu_q=None, cu_k=None, page_table=None, return_lse=True, needs_grad=False, varlen=False):
    return (q, k, v, cu_q, cu_k, None, None, page_table, None, [], [], [], None, False, None, None, 0.0, 1, None, False,
            None, None, "", "", return_lse, return_lse or needs_grad, needs_grad, varlen)


@pytest.mark.parametrize("hk,dv", [(4, 64), (1, 64), (2, 32)])
def test_fake_fwd_dense_shapes(hk, dv):
    with FakeTensorMode():
        q = torch.empty(2, 100, 4, 64, device="cuda", dtype=torch.bfloat16)
        k = torch.empty(2, 300, hk, 64, device="cuda", dtype=torch.bfloat16)
        v = torch.empty(2, 300, hk, dv, device="cuda", dtype=torch.bfloat16)
        out, lse = FWD(*_fwd_args(q, k, v))
        assert out.shape == (2, 100, 4, dv) and out.dtype == torch.bfloat16 and out.is_contiguous()
        assert lse.shape == (2, 4, 100) and lse.dtype == torch.float32 and lse.is_contiguous()
        assert out.device.type == "cuda"
        _, no_lse = FWD(*_fwd_args(q, k, v, return_lse=False))
        assert no_lse.numel() == 0
        _, lse_for_grad = FWD(*_fwd_args(q, k, v, return_lse=False, needs_grad=True))
        assert lse_for_grad.shape == (2, 4, 100)


def test_fake_fwd_varlen_and_paged_shapes():
    with FakeTensorMode():
        q = torch.empty(70, 8, 128, device="cuda", dtype=torch.float16)
        k = torch.empty(90, 2, 128, device="cuda", dtype=torch.float16)
        cu = torch.empty(4, device="cuda", dtype=torch.int32)
        out, lse = FWD(*_fwd_args(q, k, k, cu_q=cu, cu_k=cu, varlen=True))
        assert out.shape == (70, 8, 128) and out.dtype == torch.float16
        assert lse.shape == (8, 70) and lse.is_contiguous()
        # paged decode: dense q rows (b, 1, h, d), a page pool for k/v
        qd = torch.empty(3, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
        pool = torch.empty(40, 64, 2, 128, device="cuda", dtype=torch.bfloat16)
        pages = torch.empty(3, 10, device="cuda", dtype=torch.int32)
        out, lse = FWD(*_fwd_args(qd, pool, pool, page_table=pages, varlen=True))
        assert out.shape == (3, 1, 8, 128) and lse.shape == (3, 8, 1)


def test_fake_bwd_matches_input_layouts():
    """dq/dk/dv laid out like the inputs: a transposed (b, h, s, d) view keeps its strides (as the eager
    backward's empty_like does), a last-dim-strided input gets a contiguous gradient."""
    with FakeTensorMode():
        q = torch.empty(2, 4, 100, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k = torch.empty(2, 2, 300, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        v = torch.empty_strided((2, 300, 2, 64), (300 * 2 * 128, 2 * 128, 128, 2), device="cuda",
                                dtype=torch.bfloat16)  # last dim strided
        out = torch.empty(2, 100, 4, 64, device="cuda", dtype=torch.bfloat16)
        lse = torch.empty(2, 4, 100, device="cuda", dtype=torch.float32)
        dq, dk, dv, dsink = BWD(out, q, k, v, out, lse, None, None, None, None, None, None, None, False, None, None,
                                0.0, False, None, None)
        assert dq.shape == q.shape and dq.stride() == q.stride()
        assert dsink.numel() == 0  # no sink
        sink = torch.empty(4, device="cuda", dtype=torch.bfloat16)
        *_, dsink = BWD(out, q, k, v, out, lse, None, None, None, None, None, sink, None, False, None, None,
                        0.0, False, None, None)
        assert dsink.shape == (4,) and dsink.dtype == torch.bfloat16
        assert dk.stride() == k.stride()
        assert dv.shape == v.shape and dv.is_contiguous()


# ---- full-graph traces on CPU, with a test-scoped reference kernel for the two ops -------------


def _attn_any_layout(q, k, v, cu_q, cu_k, sink, **kw):
    """attention_ref on dense (b, s, h, d) tensors, or per sequence on packed (total, h, d) ones with
    cu_seqlens (then out (total, h, d), lse (h, total)), as the real op lays them out."""
    if cu_q is None:
        return attention_ref(q, k, v, learnable_sink=sink, **kw)
    outs, lses = [], []
    for i in range(cu_q.numel() - 1):
        a, b, c, d = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        o, l = attention_ref(q[None, a:b], k[None, c:d], v[None, c:d], learnable_sink=sink, **kw)
        outs.append(o[0])
        lses.append(l[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def _ref_fwd(q, k, v, cu_q, cu_k, sq, sk, pages, sink, aux, aux_values, aux_kinds, scale, causal, wl, wr, softcap,
             num_splits, pack_gqa, deterministic, mq, mk, score_mod, mask_mod, return_lse, want_lse, needs_grad,
             varlen):
    out, lse = _attn_any_layout(q, k, v, cu_q, cu_k, sink, causal=causal, window=(wl, wr), softmax_scale=scale,
                                softcap=softcap)
    lse = lse.contiguous() if want_lse else q.new_empty((0,), dtype=torch.float32)
    return out.to(q.dtype).contiguous(), lse


def _ref_bwd(dout, q, k, v, out, lse, dlse, cu_q, cu_k, sq, sk, sink, scale, causal, wl, wr, softcap, deterministic,
             mq, mk):
    """The reference's VJP; it reads cu_seqlens_q/k from their own slots, so a swap in the op's wiring shows."""
    def f(q_, k_, v_, s_):
        return _attn_any_layout(q_, k_, v_, cu_q, cu_k, s_, causal=causal, window=(wl, wr), softmax_scale=scale,
                                softcap=softcap)

    if sink is None:  # no sink: the same reference without one
        _, vjp = torch.func.vjp(lambda q_, k_, v_: f(q_, k_, v_, None), q, k, v)
    else:
        _, vjp = torch.func.vjp(f, q, k, v, sink)
    grads = vjp((dout.float(), torch.zeros_like(lse) if dlse is None else dlse))
    dq, dk, dv = (g.to(x.dtype).contiguous() for g, x in zip(grads[:3], (q, k, v)))
    dsink = grads[3].to(sink.dtype) if sink is not None else q.new_empty((0,), dtype=torch.float32)
    return dq, dk, dv, dsink


@pytest.fixture
def cpu_reference_ops():
    lib = torch.library.Library(compile_ops.OP_NAMESPACE, "IMPL")
    lib.impl("fwd", _ref_fwd, "CPU")
    lib.impl("bwd", _ref_bwd, "CPU")
    yield
    lib._destroy()


class _Capture:
    """An aot_eager backend that keeps the forward and backward graphs it compiles."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        def keep(g, _inputs):
            self.graphs.append(g)
            return make_boxed_func(g.forward)

        return aot_autograd(fw_compiler=keep, bw_compiler=keep)(gm, example_inputs)

    def ops(self) -> list[str]:
        return [str(n.target) for g in self.graphs for n in g.graph.nodes if n.op == "call_function"]


class _Block(torch.nn.Module):
    def __init__(self, d=32, heads=4, heads_kv=2, causal=True, window=(None, None), return_lse=False, sink=False):
        super().__init__()
        self.heads, self.heads_kv, self.d = heads, heads_kv, d
        self.qkv = torch.nn.Linear(64, (heads + 2 * heads_kv) * d, dtype=torch.float32)
        self.causal, self.window, self.return_lse = causal, window, return_lse
        self.sink = torch.nn.Parameter(torch.randn(heads)) if sink else None

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.qkv(x).view(b, s, self.heads + 2 * self.heads_kv, self.d)
        q, k, v = qkv.split([self.heads, self.heads_kv, self.heads_kv], dim=2)
        out, lse = flash_attn_sm120.flash_attn_func(q, k, v, causal=self.causal, window_size=self.window,
                                                    return_lse=self.return_lse, learnable_sink=self.sink)
        loss = out.float().square().mean()
        return loss + (lse.mean() if self.return_lse else 0.0)


@pytest.mark.parametrize("causal,window,return_lse,sink", [(True, (None, None), False, False),
                                                          (False, (7, -1), True, False),
                                                          (True, (5, None), True, True)])
def test_fullgraph_forward_backward_matches_eager_reference(cpu_reference_ops, causal, window, return_lse, sink):
    torch.manual_seed(0)
    model = _Block(causal=causal, window=window, return_lse=return_lse, sink=sink)
    x = torch.randn(2, 40, 64)
    capture = _Capture()
    compiled = torch.compile(model, backend=capture, fullgraph=True)
    loss_c = compiled(x)  # (the block ignores an LSE it did not ask for)
    loss_c.backward()
    grads_c = [p.grad.clone() for p in model.parameters()]
    ops = capture.ops()
    assert "flash_attn_sm120.fwd.default" in ops and "flash_attn_sm120.bwd.default" in ops, ops

    # eager, through the same reference (the ops are what the graph replaced)
    for p in model.parameters():
        p.grad = None
    b, s, _ = x.shape
    qkv = model.qkv(x).view(b, s, model.heads + 2 * model.heads_kv, model.d)
    q, k, v = qkv.split([model.heads, model.heads_kv, model.heads_kv], dim=2)
    out, lse = attention_ref(q, k, v, causal=causal, window=window, learnable_sink=model.sink)
    loss_e = out.square().mean() + (lse.mean() if return_lse else 0.0)
    loss_e.backward()
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
    for gc, p in zip(grads_c, model.parameters()):
        torch.testing.assert_close(gc, p.grad, rtol=1e-4, atol=1e-6)


def test_inference_trace_has_no_backward_and_no_lse(cpu_reference_ops):
    capture = _Capture()
    q = torch.randn(1, 16, 4, 32)

    @torch.compile(backend=capture, fullgraph=True)
    def f(q):
        out, lse = flash_attn_sm120.flash_attn_func(q, q, q)
        assert lse is None  # no gradient to come and no return_lse: no LSE, as upstream
        return out

    with torch.no_grad():
        f(q)
    fwd = [n for g in capture.graphs for n in g.graph.nodes if str(n.target) == "flash_attn_sm120.fwd.default"]
    assert len(fwd) == 1 and fwd[0].args[-3:] == (False, False, False)  # want_lse, needs_grad, varlen


def test_registered_mod_travels_by_name_and_unregistered_breaks_the_graph(cpu_reference_ops):
    def plus_zero(score, b, h, q_idx, kv_idx, aux_tensors):
        return score

    q = torch.randn(1, 16, 2, 32)
    with pytest.raises(Exception, match="(?i)graph break|skip|disable"):
        torch.compile(lambda q: flash_attn_sm120.flash_attn_func(q, q, q, score_mod=plus_zero)[0],
                      backend="eager", fullgraph=True)(q)
    flash_attn_sm120.register_mod(plus_zero, "test_plus_zero")
    capture = _Capture()
    with torch.no_grad():
        torch.compile(lambda q: flash_attn_sm120.flash_attn_func(q, q, q, score_mod=plus_zero)[0],
                      backend=capture, fullgraph=True)(q)
    node = next(n for g in capture.graphs for n in g.graph.nodes if str(n.target) == "flash_attn_sm120.fwd.default")
    assert "test_plus_zero" in node.args
    assert compile_ops.registered_mod("test_plus_zero") is plus_zero


def test_aux_scalars_keep_their_python_types():
    values, kinds = compile_ops._encode_scalars((3, 0.5, True))
    assert compile_ops._decode_scalars(values, kinds) == (3, 0.5, True)
    assert [type(x) for x in compile_ops._decode_scalars(values, kinds)] == [int, float, bool]
    assert compile_ops._decode_scalars([], []) is None
    with pytest.raises(TypeError, match="aux_scalars"):
        compile_ops._encode_scalars(("x",))


def test_register_mod_refuses_bad_input():
    with pytest.raises(TypeError, match="callable"):
        flash_attn_sm120.register_mod(3, "x")
    flash_attn_sm120.register_mod(abs, "test_abs")
    with pytest.raises(ValueError, match="already registered"):
        flash_attn_sm120.register_mod(round, "test_abs")
    with pytest.raises(ValueError, match="no score_mod"):
        compile_ops.registered_mod("never_registered")


def test_compiled_call_on_cpu_raises_the_eager_validation_error():
    """No test kernel: the op's real implementation is the eager function, which names the problem."""
    q = torch.randn(1, 16, 2, 32, dtype=torch.bfloat16)
    f = torch.compile(lambda q: flash_attn_sm120.flash_attn_func(q, q, q)[0], backend="eager", fullgraph=True)
    with pytest.raises((TypeError, ValueError), match="(?i)cuda"):
        f(q)


@pytest.mark.parametrize("fn", [flash_attn_sm120.flash_attn_func, flash_attn_sm120.flash_attn_varlen_func])
def test_traced_branch_passes_every_parameter(fn):
    """Dynamo cannot trace locals(): the traced branch spells the arguments out, so it must name each one."""
    import inspect
    import re

    src = inspect.getsource(fn)
    branch = src[src.index("torch.compiler.is_compiling()"):src.index("compile_ops.traced_call")]
    passed = re.findall(r"(\w+)=(\w+)", branch)
    assert all(a == b for a, b in passed)
    assert [a for a, _ in passed] == list(inspect.signature(fn).parameters)


def test_lse_comes_back_for_autograd_like_upstream(cpu_reference_ops):
    """Upstream returns the LSE whenever an input requires grad, return_lse or not, and grad mode or not;
    so does the traced path (the eager path: test_api.py)."""
    q = torch.randn(1, 16, 2, 32, requires_grad=True)
    f = torch.compile(lambda q: flash_attn_sm120.flash_attn_func(q, q, q), backend="aot_eager", fullgraph=True)
    out, lse = f(q)
    assert lse is not None and lse.shape == (1, 2, 16)
    with torch.no_grad():
        out, lse = f(q)
    assert lse is not None and lse.shape == (1, 2, 16)


@pytest.mark.parametrize("bad,match", [(dict(causal="False"), "causal"), (dict(num_splits=True), "num_splits"),
                                       (dict(softcap=True), "softcap"), (dict(return_lse="yes"), "return_lse")])
def test_traced_call_checks_flags_like_eager(cpu_reference_ops, bad, match):
    q = torch.randn(1, 16, 2, 32)
    f = torch.compile(lambda q: flash_attn_sm120.flash_attn_func(q, q, q, **bad)[0], backend="eager", fullgraph=True)
    with pytest.raises(Exception, match=match):
        f(q)


def test_aux_scalars_keep_the_gradient_structure_in_training(cpu_reference_ops):
    """aux_scalars travel as plain lists; their gradient slots must match torch's input structure."""
    x = torch.randn(1, 16, 2, 32, requires_grad=True)
    f = torch.compile(lambda x: flash_attn_sm120.flash_attn_func(x, x, x, aux_scalars=(2, 0.5))[0],
                      backend="aot_eager", fullgraph=True)
    f(x).sum().backward()
    assert x.grad is not None and x.grad.isfinite().all()


def test_training_with_a_registered_mod_breaks_the_graph(cpu_reference_ops):
    """The backward op carries no modifiers: a call with one whose backward will run goes to the eager
    function outside the graph (fullgraph=True raises); without grad it stays one op."""
    def scaled(score, b, h, q_idx, kv_idx, aux_tensors):
        return score

    flash_attn_sm120.register_mod(scaled, "test_scaled")
    call = lambda x: flash_attn_sm120.flash_attn_func(x, x, x, score_mod=scaled, aux_scalars=(2, 0.5))[0]  # noqa
    x = torch.randn(1, 16, 2, 32)
    torch.compile(call, backend="aot_eager", fullgraph=True)(x)  # inference: no graph break
    with pytest.raises(Exception, match="(?i)skip|disable|graph break|unsupported"):
        torch.compile(call, backend="aot_eager", fullgraph=True)(x.requires_grad_())


def test_real_forward_op_applies_the_eager_refusals_first():
    """The op's real implementation (no test kernel here): the backward's refusals run before the eager call,
    and the eager call's own validation names the problem."""
    q = torch.randn(1, 16, 2, 32, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="paged"):
        FWD(*_fwd_args(q, q, q, page_table=torch.zeros(1, 1, dtype=torch.int32), needs_grad=True, varlen=True))
    with pytest.raises(ValueError, match="(?i)cuda"):
        FWD(*_fwd_args(q, q, q, needs_grad=True))
    qv = torch.randn(16, 2, 32, dtype=torch.bfloat16)  # the varlen call is assembled and reaches validation too
    cu = torch.tensor([0, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match="(?i)cuda"):
        FWD(*_fwd_args(qv, qv, qv, cu_q=cu, cu_k=cu, varlen=True))
    with pytest.raises(RuntimeError, match="traced for SM120"):
        BWD(q, q, q, q, q, torch.zeros(1, 2, 16), None, None, None, None, None, None, None, False, None, None, 0.0,
            False, None, None)


def test_fullgraph_varlen_backward_keeps_the_index_tensors_in_their_slots(cpu_reference_ops):
    """cu_seqlens_q and cu_seqlens_k differ here: if the op's saved index tensors were swapped or shifted,
    the reference backward would see other sequences and the gradients would differ from eager's."""
    torch.manual_seed(3)
    q = torch.randn(13, 4, 16, requires_grad=True)
    k = torch.randn(19, 2, 16, requires_grad=True)
    v = torch.randn(19, 2, 16, requires_grad=True)
    cu_q, cu_k = torch.tensor([0, 5, 13], dtype=torch.int32), torch.tensor([0, 11, 19], dtype=torch.int32)

    def f(q, k, v):
        out, lse = flash_attn_sm120.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                                           max_seqlen_q=8, max_seqlen_k=11, causal=True,
                                                           return_lse=True)
        return out.square().sum() + lse.sum()

    loss_c = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v)
    grads_c = torch.autograd.grad(loss_c, (q, k, v))
    out, lse = _attn_any_layout(q, k, v, cu_q, cu_k, None, causal=True)
    grads_e = torch.autograd.grad(out.square().sum() + lse.sum(), (q, k, v))
    for a, b in zip(grads_c, grads_e):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_the_backward_op_copies_its_inputs_into_upstream_layouts(monkeypatch):
    """The compiled backward gets the caller's q/k/v (saved by setup_context), not the forward op's copies;
    a contiguous tensor whose size-1 dim carries an odd stride reaches the kernels copied, as in eager, and
    the gradient buffers keep the fake op's layouts."""
    from flash_attn_sm120 import driver_bwd, interface

    seen = {}

    def fake_backward(q, k, v, out, dout, lse, **kw):
        seen.update(q=q, k=k, v=v)
        return kw["dq"], kw["dk"], kw["dv"]

    monkeypatch.setattr(interface, "_sm120_target", lambda q: (None,))
    monkeypatch.setattr(driver_bwd, "backward", fake_backward)
    q = torch.randn(2, 8, 1, 64, dtype=torch.bfloat16).as_strided((2, 8, 1, 64), (512, 64, 3, 1))
    k, v = (torch.randn(2, 8, 1, 64, dtype=torch.bfloat16) for _ in range(2))
    out, dout = torch.randn_like(k), torch.randn_like(k)
    lse = torch.randn(2, 1, 8)
    dq, dk, dv, _ = compile_ops.attention_bwd(dout, q, k, v, out, lse, None, None, None, None, None, None,
                                              None, False, None, None, 0.0, False, None, None)
    assert seen["q"].stride() == (512, 64, 64, 1) and torch.equal(seen["q"], q)
    assert seen["k"] is k and seen["v"] is v
    assert dq.shape == q.shape and dq.stride() == (512, 64, 64, 1)
