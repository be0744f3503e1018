"""Drop-in API on the CPU: signatures, dispatch rules, validation before any kernel work."""

import functools
import inspect

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import flash_attn.cute as upstream
import flash_attn_sm120
from flash_attn_sm120.hardware import EmulationHost
from flash_attn_sm120 import device as devmod
from flash_attn_sm120 import interface, validation
from flash_attn_sm120.device import DeviceInfo, mode_for_capability


@pytest.mark.parametrize("name", ["flash_attn_func", "flash_attn_varlen_func"])
def test_signature_matches_upstream(name):
    """Upstream's parameters, in order, kinds and defaults; then this package's own ones (validation.OWN_PARAMETERS),
    keyword-only and None by default, so that no upstream call reads differently."""
    ours = inspect.signature(getattr(flash_attn_sm120, name))
    theirs = inspect.signature(getattr(upstream, name))
    own = validation.OWN_PARAMETERS.get(name, ())
    assert list(ours.parameters) == list(theirs.parameters) + list(own)
    for p in theirs.parameters.values():
        assert ours.parameters[p.name].default == p.default, p.name
        assert ours.parameters[p.name].kind == p.kind, p.name
    for n in own:
        assert n not in theirs.parameters
        assert ours.parameters[n].kind == inspect.Parameter.KEYWORD_ONLY and ours.parameters[n].default is None, n


def test_mode_rules():
    assert mode_for_capability((12, 0), False) == "sm120"
    assert mode_for_capability((12, 1), True) == "sm120"
    assert mode_for_capability((9, 0), False) == "upstream"
    assert mode_for_capability((9, 0), True) == "emulated"
    assert mode_for_capability((10, 0), True) == "emulated"
    assert mode_for_capability((8, 0), True) == "emulated"
    assert mode_for_capability((7, 5), True) == "upstream"


def test_emulation_env(monkeypatch):
    monkeypatch.setenv(devmod.EMULATE_ENV, "1")
    assert devmod.emulation_requested()
    monkeypatch.setenv(devmod.EMULATE_ENV, "0")
    assert not devmod.emulation_requested()
    monkeypatch.delenv(devmod.EMULATE_ENV)
    assert not devmod.emulation_requested()


def test_execution_mode_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    assert flash_attn_sm120.execution_mode() == "cpu"


def test_device_info_label():
    emu = DeviceInfo("NVIDIA H200", (9, 0), 132, 233472, 232448, "emulated", 1024)
    assert emu.emulate_host_smem == EmulationHost(233472, 232448, 1024, 0) and "emulated" in emu.label()
    native = DeviceInfo("RTX PRO 6000", (12, 0), 188, 102400, 101376, "sm120")
    assert native.emulate_host_smem is None and "SM120 native" in native.label()


def _cuda_qkv(b=2, s=64, h=4, hk=4, d=64, dtype=torch.bfloat16):
    q = torch.empty(b, s, h, d, device="cuda", dtype=dtype)
    k = torch.empty(b, s, hk, d, device="cuda", dtype=dtype)
    v = torch.empty(b, s, hk, d, device="cuda", dtype=dtype)
    return q, k, v


@pytest.fixture
def fake_device(monkeypatch):
    """Fake CUDA tensors on the CPU, and a chosen device mode for dispatch."""
    calls = {}

    def set_mode(mode):
        info = DeviceInfo("fake", (12, 0) if mode == "sm120" else (9, 0), 188, 233472, 232448, mode, 1024)
        monkeypatch.setattr(interface, "device_info", lambda dev: info)

    def fake_forward(q, k, v, **kw):
        calls["driver"] = kw
        out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
        return out, None

    def fake_upstream(**kw):
        calls["upstream"] = kw
        return "upstream-result"

    monkeypatch.setattr(interface.driver, "forward", fake_forward)
    monkeypatch.setattr(interface.upstream, "flash_attn_func", fake_upstream)
    monkeypatch.setattr(interface.upstream, "flash_attn_varlen_func", fake_upstream)
    with FakeTensorMode():
        yield set_mode, calls


def test_dispatch_upstream_passes_everything_through(fake_device):
    set_mode, calls = fake_device
    set_mode("upstream")
    q, k, v = _cuda_qkv()
    assert flash_attn_sm120.flash_attn_func(q, k, v, causal=True, num_splits=3) == "upstream-result"
    kw = calls["upstream"]
    assert kw["causal"] is True and kw["num_splits"] == 3 and kw["q"] is q
    assert set(kw) == set(inspect.signature(upstream.flash_attn_func).parameters)
    assert "driver" not in calls


@pytest.mark.parametrize("traced", [False, True])
def test_upstream_route_takes_no_own_parameter(fake_device, monkeypatch, traced):
    """On a GPU that runs upstream, varlen calls reach upstream's function with upstream's parameters only (this
    package's own ones, validation.OWN_PARAMETERS, dropped when None), eager or as torch.compile traces them
    (compile_ops.traced_call); set, they are a ValueError naming them (upstream has no such feature)."""
    from flash_attn_sm120 import compile_ops

    set_mode, calls = fake_device
    set_mode("upstream")
    monkeypatch.setattr(compile_ops, "_routes_to_sm120", lambda *a: False)
    q, k, v = (t.flatten(0, 1) for t in _cuda_qkv())
    cu = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device)
    def call(**kw):
        if not traced:
            return flash_attn_sm120.flash_attn_varlen_func(q, k, v, **kw)
        bound = inspect.signature(flash_attn_sm120.flash_attn_varlen_func).bind(q, k, v, **kw)
        bound.apply_defaults()  # the interface's traced branch passes every parameter
        return compile_ops.traced_call(dict(bound.arguments), varlen=True)

    assert call(cu_seqlens_q=cu, cu_seqlens_k=cu) == "upstream-result"
    assert set(calls["upstream"]) <= set(inspect.signature(upstream.flash_attn_varlen_func).parameters)
    with pytest.raises(ValueError, match="block_sparse_tensors_bwd in flash_attn_varlen_func is this package's"):
        call(cu_seqlens_q=cu, cu_seqlens_k=cu, block_sparse_tensors_bwd=object())


@pytest.mark.parametrize("mode,pad", [("sm120", None), ("emulated", EmulationHost(233472, 232448, 1024))])
def test_dispatch_sm120_uses_driver(fake_device, mode, pad):
    set_mode, calls = fake_device
    set_mode(mode)
    q, k, v = _cuda_qkv(h=8, hk=2)
    out, lse = flash_attn_sm120.flash_attn_func(q, k, v, causal=True, window_size=(-1, -1), softcap=0.0)
    kw = calls["driver"]
    assert kw["emulate_host_smem"] == pad
    # passed as given: the driver resolves it with upstream's rule (both negative: no window)
    assert kw["causal"] is True and (kw["window_size_left"], kw["window_size_right"]) == (-1, -1)
    assert out.shape == q.shape and "upstream" not in calls


@pytest.mark.parametrize("grad,return_lse,want", [(True, False, True), (False, False, False), (False, True, True)])
def test_forward_computes_lse_for_autograd(monkeypatch, grad, return_lse, want):
    """The backward needs the LSE even when the caller did not ask for it. Grad mode is off inside
    autograd.Function.forward, so the caller decides (a deep-fuzz find: every backward without
    return_lse reached the backward with lse=None)."""
    seen = {}

    def fake_forward(q, k, v, need_lse, **kw):
        seen["need_lse"] = need_lse
        lse = torch.zeros(q.shape[0], q.shape[2], q.shape[1]) if need_lse else None
        return torch.zeros_like(q), lse

    def fake_bwd(q, k, v, out, dout, lse, **kw):
        seen["bwd_lse"] = lse
        return torch.ones_like(q), torch.ones_like(k), torch.ones_like(v)

    monkeypatch.setattr(interface.driver_splitkv, "takes_this_path", lambda **kw: False)
    monkeypatch.setattr(interface.driver, "forward", fake_forward)
    monkeypatch.setattr(interface.driver_bwd, "backward", fake_bwd)
    q, k, v = (torch.zeros(1, 32, 2, 64, requires_grad=grad) for _ in range(3))
    bwd_kwargs = dict(_tensors=(), _tensor_names=())
    out, lse = interface._Sm120AttnFunc.apply(q, k, v, None, {}, bwd_kwargs, return_lse, grad)
    assert seen["need_lse"] is want
    if grad:
        out.sum().backward()
        assert seen["bwd_lse"] is not None and q.grad is not None


def test_an_lse_not_asked_for_stays_differentiable_and_its_gradient_is_dropped(monkeypatch):
    """Upstream returns the LSE an autograd call needs with requires_grad and ignores its gradient without
    return_lse: lse.sum().backward() runs there (zero gradients), so it runs here, and dlse never reaches
    the backward."""
    seen = {}

    def fake_forward(q, k, v, need_lse, **kw):
        return torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    def fake_bwd(q, k, v, out, dout, lse, dlse=None, **kw):
        seen["dlse"] = dlse
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    monkeypatch.setattr(interface.driver_splitkv, "takes_this_path", lambda **kw: False)
    monkeypatch.setattr(interface.driver, "forward", fake_forward)
    monkeypatch.setattr(interface.driver_bwd, "backward", fake_bwd)
    q, k, v = (torch.zeros(1, 32, 2, 64, requires_grad=True) for _ in range(3))
    out, lse = interface._Sm120AttnFunc.apply(q, k, v, None, {}, dict(_tensors=(), _tensor_names=()), False, True)
    assert lse.requires_grad
    lse.sum().backward()
    assert seen["dlse"] is None and q.grad is not None and not q.grad.any()


@pytest.mark.parametrize("sink_kw,match", [
    (dict(shape=(3,)), r"shape \(num_heads,\) = \(4,\)"),
    (dict(shape=(1, 4)), "shape"),
    (dict(dtype=torch.int32), "float16, bfloat16 or float32"),
    (dict(device="cpu"), "is on cpu"),
])
def test_learnable_sink_is_validated(fake_device, sink_kw, match):
    set_mode, calls = fake_device
    set_mode("sm120")
    q, k, v = _cuda_qkv()
    sink = torch.zeros(sink_kw.get("shape", (4,)), dtype=sink_kw.get("dtype", torch.float32),
                       device=sink_kw.get("device", "cuda"))
    with pytest.raises(ValueError, match=match):
        flash_attn_sm120.flash_attn_func(q, k, v, learnable_sink=sink)
    assert "driver" not in calls


def test_learnable_sink_goes_to_the_kernel_driver(fake_device, monkeypatch):
    """The sink is folded into the kernels' output (kernels/sink_fold.py): the driver gets the tensor,
    no LSE is asked for without return_lse or grad, and nothing is applied after the kernel."""
    set_mode, calls = fake_device
    set_mode("sm120")
    q, k, v = _cuda_qkv()
    seen = {}

    def forward(q, k, v, need_lse, **kw):
        seen["need_lse"], seen["sink"] = need_lse, kw.get("learnable_sink")
        out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
        return out, None

    def apply_sink(out, lse, sink):
        raise AssertionError("the forward must not rescale O after the kernel")

    monkeypatch.setattr(interface.driver, "forward", forward)
    monkeypatch.setattr(interface.sinks, "apply_sink", apply_sink)
    sink = torch.zeros(4, device="cuda")
    out, lse = flash_attn_sm120.flash_attn_func(q, k, v, learnable_sink=sink)
    assert seen["need_lse"] is False and seen["sink"] is sink
    assert lse is None and out.shape == q.shape  # no return_lse, no grad: no LSE, as upstream


def test_lse_comes_back_when_an_input_requires_grad_even_under_no_grad(fake_device, monkeypatch):
    """Upstream computes and returns the LSE whenever q/k/v (or the sink) require grad, whatever the grad mode."""
    set_mode, _ = fake_device
    set_mode("sm120")
    q, k, v = _cuda_qkv()
    q.requires_grad_(True)
    seen = {}

    def forward_with_lse(q, k, v, need_lse, **kw):
        seen["need_lse"] = need_lse
        out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
        return out, (torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device) if need_lse else None)

    monkeypatch.setattr(interface.driver, "forward", forward_with_lse)
    with torch.no_grad():
        out, lse = flash_attn_sm120.flash_attn_func(q, k, v)
    assert seen["need_lse"] is True and lse is not None
    q.requires_grad_(False)
    with torch.no_grad():
        out, lse = flash_attn_sm120.flash_attn_func(q, k, v)
    assert seen["need_lse"] is False and lse is None


@pytest.mark.parametrize("feature,kwargs,match", [
    ("qv", dict(qv=torch.zeros(1)), "qv"),
    ("gather", dict(gather_kv_indices=torch.zeros(1)), "gather"),
])
def test_unsupported_features_raise_not_implemented(fake_device, feature, kwargs, match):
    set_mode, _ = fake_device
    set_mode("sm120")
    q, k, v = _cuda_qkv()
    with pytest.raises(NotImplementedError, match=match):
        flash_attn_sm120.flash_attn_func(q, k, v, **kwargs)


def _lists(b=2, h=4, m=1, n=1):
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    cnt = torch.ones(b, h, m, dtype=torch.int32, device="cuda")
    idx = torch.zeros(b, h, m, n, dtype=torch.int32, device="cuda")
    return BlockSparseTensorsTorch(cnt, idx, block_size=(128, 128))


def test_block_sparse_forward_reaches_the_unsplit_driver(fake_device):
    """block_sparse_tensors go to driver.forward as given, never to SplitKV (num_splits is a hint)."""
    set_mode, calls = fake_device
    set_mode("sm120")
    q, k, v = _cuda_qkv()
    sparse = _lists()
    flash_attn_sm120.flash_attn_func(q, k, v, block_sparse_tensors=sparse, num_splits=4)
    assert calls["driver"]["block_sparse_tensors"] is sparse


def test_block_sparse_backward_takes_causal_and_deterministic_and_paged_is_refused(fake_device):
    """Backward lists take causal masks, windows and deterministic=True (the walk applies the rule inside its
    listed tiles and orders dQ by its lists): the walk's check refuses varlen only without per-sequence lists; the
    check without turns
    (patch 0006's interface) still refuses deterministic=True (GPU tests run the backward). Paged KV takes no
    lists."""
    from flash_attn_sm120 import block_sparse_bwd

    set_mode, calls = fake_device
    set_mode("sm120")
    block_sparse_bwd.check_block_sparse(True, False, turns_from_lists=True)
    with pytest.raises(NotImplementedError, match="deterministic=True"):
        block_sparse_bwd.check_block_sparse(True, False)
    with pytest.raises(NotImplementedError, match="varlen"):  # patch 0006's interface: no per-sequence lists
        block_sparse_bwd.check_block_sparse(False, True, turns_from_lists=True)
    block_sparse_bwd.check_block_sparse(False, True, turns_from_lists=True, per_sequence_lists=True)
    q, k, v = _cuda_qkv()
    for kwargs in (dict(causal=True), dict(deterministic=True, window_size=(8, 0))):
        calls.clear()
        with torch.no_grad():
            flash_attn_sm120.flash_attn_func(q, k, v, block_sparse_tensors=_lists(),
                                             block_sparse_tensors_bwd=_lists(), **kwargs)
        assert "driver" in calls
    qv = torch.empty(100, 4, 64, device="cuda", dtype=torch.bfloat16)
    pool = torch.empty(4, 16, 4, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="block sparsity with paged KV"):
        flash_attn_sm120.flash_attn_varlen_func(
            qv, pool, pool, cu_seqlens_q=torch.tensor([0, 100], dtype=torch.int32, device="cuda"),
            page_table=torch.zeros(1, 4, dtype=torch.int32, device="cuda"), block_sparse_tensors=_lists(1))


def test_varlen_paged_not_implemented(fake_device):
    set_mode, _ = fake_device
    set_mode("sm120")
    q = torch.empty(100, 4, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.empty(100, 4, 64, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 40, 100], dtype=torch.int32, device="cuda")
    with pytest.raises(NotImplementedError, match="paged"):
        flash_attn_sm120.flash_attn_varlen_func(q, k, k, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                page_table=torch.zeros(2, 4, dtype=torch.int32, device="cuda"))


def test_deterministic_with_a_window_and_a_score_mod_reaches_the_kernels(fake_device, monkeypatch):
    """deterministic=True with a sliding window and a user score_mod (whose dQ takes turns counted from the
    window's edges: bwd_plans.deterministic_plan) is no longer refused when a backward may follow: the call
    reaches the forward with the backward's keywords (window, deterministic, the score_mod pair)."""
    from flash_attn_sm120.testing_mods import position_scale, position_scale_bwd

    set_mode, calls = fake_device
    set_mode("sm120")
    monkeypatch.setattr(interface, "_forward", lambda q, k, v, fwd, bwd, *rest: calls.setdefault("bwd", bwd))
    q, k, v = _cuda_qkv()
    q.requires_grad_(True)
    mods = dict(score_mod=position_scale, score_mod_bwd=position_scale_bwd)
    flash_attn_sm120.flash_attn_func(q, k, v, deterministic=True, window_size=(8, 0), **mods)
    bwd = calls["bwd"]
    assert bwd["deterministic"] and (bwd["window_size_left"], bwd["window_size_right"]) == (8, 0)
    assert bwd["score_mod"] is position_scale and bwd["score_mod_bwd"] is position_scale_bwd


def test_cpu_tensors_rejected():
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA"):
        flash_attn_sm120.flash_attn_func(q, q, q)


@pytest.mark.parametrize("make,kwargs,exc,match", [
    (lambda: _cuda_qkv(dtype=torch.float32), {}, TypeError, "float16 or bfloat16"),
    (lambda: _cuda_qkv(d=60), {}, ValueError, "multiple of 8"),
    (lambda: _cuda_qkv(d=264), {}, ValueError, r"\[8, 256\]"),
    (lambda: _cuda_qkv(h=6, hk=4), {}, ValueError, "multiple of nheads_kv"),
    (lambda: (torch.empty(64, 4, 64, device="cuda", dtype=torch.bfloat16),) + _cuda_qkv()[1:], {}, ValueError,
     "4 dimensions"),
    (lambda: (_cuda_qkv()[0], _cuda_qkv()[1].half(), _cuda_qkv()[2]), {}, TypeError, "share one dtype"),
    (lambda: (_cuda_qkv()[0], _cuda_qkv(s=32)[1], _cuda_qkv()[2]), {}, ValueError, "agree"),
    (lambda: (_cuda_qkv()[0], _cuda_qkv(d=32)[1], _cuda_qkv(d=32)[2]), {}, ValueError, "does not match q head dim"),
    (lambda: _cuda_qkv(), dict(window_size=(1.5, 0)), TypeError, "window_size left"),
    (lambda: _cuda_qkv(), dict(window_size=(3,)), TypeError, "pair"),
    (lambda: _cuda_qkv(), dict(softmax_scale=-1.0), ValueError, "softmax_scale"),
    (lambda: _cuda_qkv(), dict(softcap=float("nan")), ValueError, "softcap"),
])
def test_bad_inputs(fake_device, make, kwargs, exc, match):
    set_mode, calls = fake_device
    set_mode("sm120")
    q, k, v = make()
    with pytest.raises(exc, match=match):
        flash_attn_sm120.flash_attn_func(q, k, v, **kwargs)
    assert "driver" not in calls


@pytest.mark.parametrize("varlen", [False, True])
def test_both_entry_points_copy_layouts_as_upstream_does(fake_device, monkeypatch, varlen):
    """q, k, v and the sink pass through interface._canonical (upstream's maybe_contiguous: what it copies
    tests/test_properties.py checks) before validation, and the driver gets what it returns."""
    set_mode, calls = fake_device
    set_mode("sm120")
    q, k, v = _cuda_qkv()
    if varlen:
        q, k, v = (t.reshape(-1, *t.shape[2:]) for t in (q, k, v))
    sink = torch.empty(4, device="cuda", dtype=torch.bfloat16)
    fresh = [torch.empty_like(t) for t in (q, k, v, sink)]
    seen = []
    monkeypatch.setattr(interface, "_canonical", lambda *a: seen.append(a) or tuple(fresh))
    if varlen:
        cu = torch.zeros(3, dtype=torch.int32, device="cuda")
        flash_attn_sm120.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=64,
                                                max_seqlen_k=64, learnable_sink=sink)
    else:
        flash_attn_sm120.flash_attn_func(q, k, v, learnable_sink=sink)
    assert len(seen) == 1 and all(a is b for a, b in zip(seen[0], (q, k, v, sink)))
    assert calls["driver"]["learnable_sink"] is fresh[3]


def test_canonical_copies_a_strided_sink():
    base = torch.randn(8, requires_grad=True)
    sink = base[::2]
    got = interface._canonical(torch.empty(1, 8, 1, 64), torch.empty(1, 8, 1, 64), torch.empty(1, 8, 1, 64), sink)[3]
    assert got.stride() == (1,) and torch.equal(got, sink)
    (got * torch.arange(4.0)).sum().backward()  # the sink's gradient reaches the caller's strided view
    assert torch.equal(base.grad, torch.tensor([0.0, 0, 1, 0, 2, 0, 3, 0]))


def test_upstream_meanings_of_loose_arguments(fake_device):
    """What upstream's truth tests and arithmetic accept means the same here: None flags are off, a numpy
    int is an int, a negative softcap is |softcap| (tanh is odd), scheduler_metadata is a hint the kernels
    do not need; gather_bwd options without gather_kv_indices are upstream's own ValueError."""
    import numpy as np

    set_mode, calls = fake_device
    set_mode("sm120")
    q, k, v = _cuda_qkv()
    flash_attn_sm120.flash_attn_func(q, k, v, causal=None, deterministic=None, return_lse=None,
                                     num_splits=np.int64(1), softcap=-5.0)
    kw = calls["driver"]
    assert kw["causal"] is False and kw["softcap"] == 5.0
    with pytest.raises(ValueError, match="gather_kv_indices is not set"):
        flash_attn_sm120.flash_attn_func(q, k, v, gather_bwd_recompute_p=True)
    with pytest.raises(ValueError, match="gather_kv_indices is not set"):
        flash_attn_sm120.flash_attn_func(q, k, v, gather_bwd_token_chunk=64)
    with pytest.raises(TypeError, match="num_splits"):
        flash_attn_sm120.flash_attn_func(q, k, v, num_splits=True)
    cu = torch.zeros(3, dtype=torch.int32, device="cuda")
    qv, kv, vv = (t.reshape(-1, *t.shape[2:]) for t in (q, k, v))
    from flash_attn.cute.prepare_scheduler import SchedulerMetadataTensorsTorch

    per_seq = torch.zeros(2, dtype=torch.int32, device="cuda")
    meta = SchedulerMetadataTensorsTorch(per_seq, per_seq, None, None, torch.zeros(1, dtype=torch.int32, device="cuda"))
    flash_attn_sm120.flash_attn_varlen_func(qv, kv, vv, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=64,
                                            max_seqlen_k=64, scheduler_metadata=meta)
    assert calls["driver"]["cu_seqlens_q"] is cu and "scheduler_metadata" not in calls["driver"]


def test_scheduler_metadata_is_checked_as_upstream_checks_it(fake_device):
    """Upstream reads the metadata's fields (an AttributeError for anything else) and asserts CUDA tensors of
    shape (batch,) and a (1,) semaphore, unless disable_scheduler_metadata; here the same calls are refused by
    name, and disabled metadata is not read."""
    from flash_attn.cute.prepare_scheduler import SchedulerMetadataTensorsTorch

    set_mode, _ = fake_device
    set_mode("sm120")
    q, k, v = (t.reshape(-1, *t.shape[2:]) for t in _cuda_qkv())
    cu = torch.zeros(3, dtype=torch.int32, device="cuda")
    call = functools.partial(flash_attn_sm120.flash_attn_varlen_func, q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                             max_seqlen_q=64, max_seqlen_k=64)
    good = torch.zeros(2, dtype=torch.int32, device="cuda")
    with pytest.raises(TypeError, match="SchedulerMetadataTensorsTorch"):
        call(scheduler_metadata=object())
    with pytest.raises(ValueError, match=r"num_m_blocks_ptr must have shape \(batch_size,\) = \(2,\)"):
        call(scheduler_metadata=SchedulerMetadataTensorsTorch(torch.zeros(1, dtype=torch.int32, device="cuda"), good, None, None, None))
    with pytest.raises(ValueError, match="tile_count_semaphore must have shape"):
        call(scheduler_metadata=SchedulerMetadataTensorsTorch(good, good, None, None, good))
    with pytest.raises(ValueError, match="virtual_batch_idx_ptr must be a CUDA tensor"):
        call(scheduler_metadata=SchedulerMetadataTensorsTorch(good, good, torch.zeros(2, dtype=torch.int32), None, None))
    call(scheduler_metadata=object(), disable_scheduler_metadata=True)


def test_mixed_devices_rejected(fake_device):
    set_mode, _ = fake_device
    set_mode("sm120")
    q, k, v = _cuda_qkv()
    k1 = torch.empty_like(k, device="cuda:1")
    with pytest.raises(ValueError, match="cuda:1"):
        flash_attn_sm120.flash_attn_func(q, k1, v)


def test_varlen_validation(fake_device):
    set_mode, _ = fake_device
    set_mode("sm120")
    q = torch.empty(100, 4, 64, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 40, 100], dtype=torch.int32, device="cuda")
    with pytest.raises(TypeError, match="int32"):
        flash_attn_sm120.flash_attn_varlen_func(q, q, q, cu_seqlens_q=cu.to(torch.int64), cu_seqlens_k=cu)
    with pytest.raises(ValueError, match="shape"):
        cu2 = torch.empty(2, dtype=torch.int32, device="cuda")
        flash_attn_sm120.flash_attn_varlen_func(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu2)
    with pytest.raises(ValueError, match="3 dimensions"):
        q4 = torch.empty(1, 100, 4, 64, device="cuda", dtype=torch.bfloat16)
        flash_attn_sm120.flash_attn_varlen_func(q4, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu)


@pytest.mark.parametrize("window", [(None, -1), (-1, None), (-4, 9), (9, -4)])
def test_one_sided_negative_window_reaches_the_driver_as_a_bound(fake_device, window):
    """Upstream's meaning: one negative side is a real bound, so the driver (which applies upstream's
    resolver) gets the values unchanged and compiles a local kernel."""
    from flash_attn.cute.interface import _resolve_causal_local_window

    set_mode, calls = fake_device
    set_mode("sm120")
    flash_attn_sm120.flash_attn_func(*_cuda_qkv(), window_size=window)
    kw = calls["driver"]
    got = (kw["window_size_left"], kw["window_size_right"])
    assert got == window
    assert _resolve_causal_local_window(kw["causal"], *got)[:2] == (False, True)
