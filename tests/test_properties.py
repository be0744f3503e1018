"""CPU properties (hypothesis): configs are implementable, the registry is sound, bad inputs are refused.

1. Every valid problem (head dims, dtype, mask, GQA), under the shipped table or any valid table,
   maps to a config implementable on SM120 (FwdConfig.error is None, shared memory <= 99 KB);
   every invalid head dim gets a ValueError.
2. Every kernel path of flash_attn_sm120.paths can run each head dim it offers, and a forced
   config that cannot run is refused with its reason before any compile.
3. Validation: through the public API, with CPU, meta and fake-CUDA tensors, a valid problem gets
   through (fake CUDA: to the driver; CPU/meta: "need CUDA tensors") and each bad input of the
   catalogue (dtype, device, rank, head dim, GQA divisibility, k/v mismatch, batch, window, scale,
   softcap, flags, varlen index tensors) is refused with an error naming it, before the driver is
   called; the layouts upstream copies (strided head dim, misaligned pointer or rows) are copied
   the same way and reach the driver canonical.

API signatures equal to upstream's are checked in tests/test_api.py.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace

import pytest
import torch
from hypothesis import Phase, given, settings, strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

import fuzz_profiles
from flash_attn_sm120 import driver, flash_attn_func, flash_attn_varlen_func, interface
from flash_attn_sm120.config import (
    HEAD_DIM_BUCKETS,
    MASK_KINDS,
    FwdConfig,
    load_fwd_table,
    parse_fwd_table,
    select_fwd_config,
)
from flash_attn_sm120.device import DeviceInfo
from flash_attn_sm120.hardware import DSL_STATIC_SMEM, SMEM_PER_BLOCK_MAX
from flash_attn_sm120.paths import BASE_PATHS, kernel_paths

PLAN = fuzz_profiles.active_plan()
PROPS = settings(max_examples=PLAN.cpu_examples, deadline=None,
                 phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink))
HEAD_DIMS = st.integers(1, 32).map(lambda m: 8 * m)

# ------------------------------------------------------------------------------------------------
# 1. configs
# ------------------------------------------------------------------------------------------------


def _implementable(cfg: FwdConfig, d: int, dv: int) -> None:
    assert cfg.error(d, dv) is None, (cfg.name, d, dv, cfg.error(d, dv))
    assert cfg.smem_bytes(d, dv) + DSL_STATIC_SMEM <= SMEM_PER_BLOCK_MAX, (cfg.name, d, dv)


@st.composite
def fwd_tables(draw):
    """A valid config table: random implementable configs for random (bucket, mask) slots."""
    slots = draw(st.lists(st.tuples(st.sampled_from(HEAD_DIM_BUCKETS), st.sampled_from(MASK_KINDS)),
                          unique=True, max_size=8))
    rows = []
    for bucket, mask in slots:
        threads = draw(st.sampled_from((128, 256)))
        cfg = FwdConfig(threads, draw(st.sampled_from((64, 128, 256))), draw(st.sampled_from((32, 64, 80, 96, 128))),
                        draw(st.integers(1, 3)), draw(st.booleans()))
        if cfg.error(bucket, bucket) is not None:
            continue
        rows.append(dict(head_dim=bucket, mask=mask, num_threads=cfg.num_threads, tile_m=cfg.tile_m,
                         tile_n=cfg.tile_n, num_stages=cfg.num_stages, q_in_regs=cfg.q_in_regs,
                         provenance=dict(gpu="test", mode="emulated", date="2026-11-29", command="hypothesis")))
    return parse_fwd_table({"schema": 1, "fwd": rows})


@PROPS
@given(d=HEAD_DIMS, dv=HEAD_DIMS, mask=st.sampled_from(MASK_KINDS), table=st.one_of(st.none(), fwd_tables()))
def test_every_valid_problem_maps_to_an_implementable_config(d, dv, mask, table):
    shipped = table is None
    table = load_fwd_table() if shipped else table
    cfg = select_fwd_config(table, d, dv, causal=mask == "causal", local=mask == "local")
    _implementable(cfg, d, dv)
    if shipped:  # the dispatcher path runs exactly what the driver selects from the shipped table
        assert kernel_paths()[0].resolved_config(d, dv, mask == "causal", mask == "local") == cfg


@PROPS
@given(d=st.integers(-8, 600), dv=st.integers(-8, 600))
def test_invalid_head_dims_get_a_clear_error(d, dv):
    valid = all(x % 8 == 0 and 8 <= x <= 256 for x in (d, dv))
    if valid:
        _implementable(select_fwd_config(load_fwd_table(), d, dv, False, False), d, dv)
    else:
        with pytest.raises(ValueError, match="head dim"):
            select_fwd_config(load_fwd_table(), d, dv, False, False)


# ------------------------------------------------------------------------------------------------
# 2. kernel-path registry
# ------------------------------------------------------------------------------------------------


def test_registry_paths_are_named_and_runnable():
    paths = kernel_paths()
    assert [p.name for p in paths[: len(BASE_PATHS)]] == [p.name for p in BASE_PATHS]
    assert {"cpasync-table", "cpasync-w8-128x96-s1", "cpasync-w4-64x64-s2", "upstream-config"} <= {p.name for p in paths}
    for p in paths:
        dims = p.head_dims()
        assert dims, p.name
        for d in dims:
            _implementable(p.resolved_config(d, d), d, d)
        assert all(d in p.supports.head_dims for d in dims)
    assert kernel_paths()[0].config is None and kernel_paths()[0].family == "dispatch"


@PROPS
@given(table=fwd_tables())
def test_every_table_entry_becomes_a_path_restricted_to_its_bucket(table):
    paths = {p.name: p for p in kernel_paths(table)}
    assert len(paths) == len(BASE_PATHS) + len(table)
    for e in table:
        p = paths[f"table-d{e.head_dim}-{e.mask}"]
        assert p.config == e.config and p.family == e.config.family
        lower = max([b for b in HEAD_DIM_BUCKETS if b < e.head_dim], default=0)
        assert p.head_dims() and all(lower < d <= e.head_dim for d in p.head_dims())


def test_force_uses_driver_force_config():
    fixed = next(p for p in BASE_PATHS if isinstance(p.config, FwdConfig))
    with fixed.force(64, 64) as cfg:
        assert cfg == fixed.config and driver._forced_config[-1] == fixed.config
    assert not driver._forced_config
    upstream = next(p for p in BASE_PATHS if p.name == "upstream-config")
    assert upstream.config_for(64, 64).tile_n == 128 and upstream.config_for(128, 128).tile_n == 64
    dispatch = BASE_PATHS[0]
    with dispatch.force(64, 64) as nothing:
        assert nothing is None and not driver._forced_config


_LIMITED = [p for p in BASE_PATHS if p.config is not None and any(p.error(d, d) for d in range(8, 257, 8))]


@pytest.mark.parametrize("path", _LIMITED, ids=lambda p: p.name)
def test_forced_config_that_cannot_run_is_refused_before_compiling(path):
    d = max(d for d in range(8, 257, 8) if path.error(d, d) is not None)
    q = torch.zeros(1, 4, 1, d, dtype=torch.bfloat16)
    before = driver.compile_count["fwd"]
    with pytest.raises(ValueError, match="not implementable|shared memory"):
        driver.forward(q, q, q, softmax_scale=None, causal=False, window_size_left=None, window_size_right=None,
                       softcap=None, pack_gqa=None, need_lse=False, emulate_host_smem=None,
                       config=path.config_for(d, d))
    assert driver.compile_count["fwd"] == before


# ------------------------------------------------------------------------------------------------
# 3. validation catalogue
# ------------------------------------------------------------------------------------------------


@dataclass
class Call:
    """One public-API call: tensors, keyword arguments, and whether it is the varlen entry point."""

    q: object
    k: object
    v: object
    varlen: bool
    kwargs: dict = field(default_factory=dict)
    device: str = "cpu"

    def run(self):
        fn = flash_attn_varlen_func if self.varlen else flash_attn_func
        return fn(self.q, self.k, self.v, **self.kwargs)


OTHER_DEVICE = {"cpu": "meta", "meta": "cpu", "cuda": "cuda:1"}


def _empty(shape, dtype, device):
    return torch.empty(shape, dtype=dtype, device=device)


@st.composite
def valid_calls(draw, device: str):
    dtype = draw(st.sampled_from((torch.float16, torch.bfloat16)))
    b, sq, sk = draw(st.integers(1, 3)), draw(st.integers(1, 24)), draw(st.integers(1, 24))
    hk = draw(st.integers(1, 3))
    h = hk * draw(st.integers(1, 4))
    d = draw(HEAD_DIMS)
    dv = draw(st.one_of(st.just(d), HEAD_DIMS))
    if draw(st.booleans()):  # varlen: packed q and k with cu_seqlens
        cu_q = torch.tensor([0] + [sq * (i + 1) for i in range(b)], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0] + [sk * (i + 1) for i in range(b)], dtype=torch.int32, device=device)
        return Call(_empty((b * sq, h, d), dtype, device), _empty((b * sk, hk, d), dtype, device),
                    _empty((b * sk, hk, dv), dtype, device), True,
                    dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=sq, max_seqlen_k=sk), device)
    return Call(_empty((b, sq, h, d), dtype, device), _empty((b, sk, hk, d), dtype, device),
                _empty((b, sk, hk, dv), dtype, device), False, {}, device)


def _retensor(t, *, dtype=None, last=None, heads=None, rows=None, batch_delta=0):
    """A fresh tensor like t with some sizes changed."""
    shape = list(t.shape)
    if last is not None:
        shape[-1] = last
    if heads is not None:
        shape[-2] = heads
    if rows is not None:
        shape[-3] = rows
    if batch_delta:
        shape[0] += batch_delta
    return _empty(tuple(shape), dtype or t.dtype, t.device)


def _contiguous_strides(shape):
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides)), step


def _misaligned_pointer(t):
    """Same shape, contiguous, but starting one element (2 bytes) past an aligned address."""
    strides, numel = _contiguous_strides(t.shape)
    flat = _empty((numel + 8,), t.dtype, t.device)
    return torch.as_strided(flat, t.shape, strides, storage_offset=1)


def _padded_rows(t, extra):
    """Same shape, rows of the head dim padded by `extra` elements (stride(-2) = d + extra)."""
    strides, numel = _contiguous_strides((*t.shape[:-1], t.shape[-1] + extra))
    return torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device)


def _strided_last(t):
    """Same shape, every other element along the head dim (stride(-1) = 2)."""
    strides, _ = _contiguous_strides((*t.shape, 2))
    return torch.empty_strided(t.shape, strides[:-1], dtype=t.dtype, device=t.device)


NAMES = st.sampled_from(("q", "k", "v"))

# name -> (strategy of a mutation: Call -> (Call, exception, regex); needs fake CUDA for scalar checks)
MUTATIONS = {}


def mutation(name, scalar=False):
    def deco(fn):
        MUTATIONS[name] = (fn, scalar)
        return fn

    return deco


@mutation("dtype")
def _m_dtype(draw, c):
    which = draw(NAMES)
    dt = draw(st.sampled_from((torch.float32, torch.float64, torch.int8, torch.int32, torch.float8_e4m3fn)))
    setattr(c, which, _retensor(getattr(c, which), dtype=dt))
    return c, TypeError, rf"{which} has dtype"


@mutation("mixed dtypes")
def _m_mixed(draw, c):
    other = torch.float16 if c.q.dtype == torch.bfloat16 else torch.bfloat16
    which = draw(st.sampled_from(("k", "v")))
    setattr(c, which, _retensor(getattr(c, which), dtype=other))
    return c, TypeError, "share one dtype"


@mutation("rank")
def _m_rank(draw, c):
    which = draw(NAMES)
    t = getattr(c, which)
    shape = (1, *t.shape) if draw(st.booleans()) else t.shape[1:]
    setattr(c, which, _empty(shape, t.dtype, t.device))
    return c, ValueError, rf"{which} must have \d dimensions"


# layouts upstream's interface copies (its maybe_contiguous) rather than refuses: this package copies them too
# (test_layouts_upstream_copies_reach_the_driver_canonical)
LAYOUTS_COPIED = {
    "last dim strided": lambda draw, t: _strided_last(t),
    "misaligned pointer": lambda draw, t: _misaligned_pointer(t),
    "misaligned row stride": lambda draw, t: _padded_rows(t, draw(st.integers(1, 7))),
}


@mutation("head_dim not a multiple of 8 or too large")
def _m_head_dim(draw, c):
    d = draw(st.one_of(st.integers(1, 300).filter(lambda x: x % 8), st.integers(33, 64).map(lambda m: 8 * m)))
    c.q, c.k = _retensor(c.q, last=d), _retensor(c.k, last=d)
    return c, ValueError, rf"head_dim={d}\b"


@mutation("head_dim_v invalid")
def _m_head_dim_v(draw, c):
    dv = draw(st.one_of(st.integers(1, 300).filter(lambda x: x % 8), st.integers(33, 64).map(lambda m: 8 * m)))
    c.v = _retensor(c.v, last=dv)
    return c, ValueError, rf"head_dim_v={dv}\b"


@mutation("k head dim differs from q")
def _m_k_head_dim(draw, c):
    d = draw(HEAD_DIMS.filter(lambda x: x != c.q.shape[-1]))
    c.k = _retensor(c.k, last=d)
    return c, ValueError, "k head dim .* does not match q head dim"


@mutation("GQA: nheads not a multiple of nheads_kv")
def _m_gqa(draw, c):
    h = c.q.shape[-2]
    hk = draw(st.integers(2, h + 3).filter(lambda x: h % x))
    c.k, c.v = _retensor(c.k, heads=hk), _retensor(c.v, heads=hk)
    return c, ValueError, rf"nheads={h} must be a multiple of nheads_kv={hk}"


@mutation("k/v mismatch")
def _m_kv(draw, c):
    if draw(st.booleans()):
        c.v = _retensor(c.v, rows=c.v.shape[-3] + draw(st.integers(1, 5)))
    else:
        c.v = _retensor(c.v, heads=c.v.shape[-2] + 1)
    return c, ValueError, "must agree in all but the last dimension"


@mutation("batch mismatch")
def _m_batch(draw, c):
    if c.varlen:
        cu = c.kwargs["cu_seqlens_k"]
        c.kwargs["cu_seqlens_k"] = _empty((cu.shape[0] - 1,), cu.dtype, cu.device)
        return c, ValueError, "cu_seqlens_k must have shape"
    delta = draw(st.integers(1, 2))
    c.k, c.v = _retensor(c.k, batch_delta=delta), _retensor(c.v, batch_delta=delta)
    return c, ValueError, "k has batch"


@mutation("devices")
def _m_device(draw, c):
    which = draw(st.sampled_from(("k", "v")))
    t = getattr(c, which)
    setattr(c, which, _empty(t.shape, t.dtype, OTHER_DEVICE[c.device]))
    return c, ValueError, rf"{which} is on .* but q is on"


@mutation("varlen index tensors")
def _m_index(draw, c):
    if not c.varlen:
        c.varlen = True
        c.kwargs["seqused_k"] = _empty((c.q.shape[0] + 1,), torch.int32, c.q.device)
        return c, ValueError, "seqused_k must have shape"
    kind = draw(st.sampled_from(("dtype", "rank", "max_seqlen")))
    if kind == "dtype":
        cu = c.kwargs["cu_seqlens_q"]
        c.kwargs["cu_seqlens_q"] = _empty(cu.shape, torch.int64, cu.device)
        return c, TypeError, "cu_seqlens_q must be int32"
    if kind == "rank":
        cu = c.kwargs["cu_seqlens_q"]
        c.kwargs["cu_seqlens_q"] = _empty((1, *cu.shape), cu.dtype, cu.device)
        return c, ValueError, "cu_seqlens_q must be a 1-D"
    c.kwargs["max_seqlen_k"] = draw(st.sampled_from((-1, 2.5, "12")))
    return c, ValueError, "max_seqlen_k must be a non-negative int"


@mutation("not a tensor")
def _m_type(draw, c):
    which = draw(NAMES)
    setattr(c, which, draw(st.sampled_from(([1.0], None, 3, "q"))))
    return c, TypeError, rf"{which} must be a torch.Tensor"


@mutation("window", scalar=True)
def _m_window(draw, c):
    # (a negative side is valid: upstream's one-sided bound, tests/test_windows.py)
    kind = draw(st.sampled_from(("type_left", "type", "shape")))
    if kind == "type_left":
        c.kwargs["window_size"] = (draw(st.sampled_from((2.0, "-1", False))), 0)
        return c, TypeError, "window_size left must be an int"
    if kind == "type":
        c.kwargs["window_size"] = (None, draw(st.sampled_from((1.5, "3", True))))
        return c, TypeError, "window_size right must be an int"
    c.kwargs["window_size"] = draw(st.sampled_from(((1, 2, 3), (4,), 5, "ab")))
    return c, TypeError, "window_size must be a pair"


@mutation("softmax_scale / softcap", scalar=True)
def _m_scalars(draw, c):
    if draw(st.booleans()):
        c.kwargs["softmax_scale"] = draw(st.sampled_from((0.0, -1.0, float("nan"), float("inf"))))
        return c, ValueError, "softmax_scale must be finite and > 0"
    c.kwargs["softcap"] = draw(st.sampled_from((float("nan"), float("-inf"), float("inf"))))  # (-1.0: as 1.0)
    return c, ValueError, "softcap must be finite"


@mutation("boolean flags", scalar=True)
def _m_flags(draw, c):
    name = draw(st.sampled_from(("causal", "pack_gqa", "return_lse", "deterministic")))
    c.kwargs[name] = draw(st.sampled_from(("False", "yes", 2, 0.5)))
    return c, TypeError, rf"{name} must be a bool"


@contextlib.contextmanager
def _api_context(device: str):
    """CPU / meta tensors as they are; 'cuda': fake CUDA tensors, an SM120 device, a recording driver."""
    if device != "cuda":
        yield {}
        return
    calls = {}

    def fake_forward(q, k, v, **kw):
        calls["driver"] = kw
        rows = q.shape[:-1]
        return torch.empty(*rows, v.shape[-1], dtype=q.dtype, device=q.device), None

    info = DeviceInfo("fake SM120", (12, 0), 188, 102400, 101376, "sm120")
    with pytest.MonkeyPatch.context() as mp, FakeTensorMode():
        mp.setattr(interface, "device_info", lambda dev: info)
        for name in ("driver", "driver_splitkv"):  # every driver the interface may route to
            if hasattr(interface, name):
                mp.setattr(getattr(interface, name), "forward", fake_forward)
        yield calls


DEVICES = st.sampled_from(("cpu", "meta", "cuda"))


@PROPS
@given(data=st.data(), device=DEVICES)
def test_valid_inputs_pass_validation(data, device):
    with _api_context(device) as calls:
        call = data.draw(valid_calls(device))
        if device == "cuda":
            out, _ = call.run()
            assert "driver" in calls and out.shape[-1] == call.v.shape[-1]
        else:
            with pytest.raises(ValueError, match="q is on .*; the kernels need CUDA tensors"):
                call.run()


def _canonical(t: torch.Tensor) -> bool:
    """Upstream's kernel ABI: last dim contiguous, 16-byte aligned pointer and row strides."""
    step = 16 // t.element_size()
    return (t.stride(-1) == 1 and t.storage_offset() % step == 0
            and all(s % step == 0 for s in t.stride()[:-1]))


@pytest.mark.parametrize("layout", sorted(LAYOUTS_COPIED))
@settings(PROPS, max_examples=max(10, PLAN.cpu_examples // 5))
@given(data=st.data())
def test_layouts_upstream_copies_are_copied_canonical(data, layout):
    """A strided head dim, a misaligned pointer or misaligned rows in q, k or v: upstream's interface copies
    them (maybe_contiguous), and so does this one (interface._canonical, which both entry points call before
    validation: tests/test_api.py): same shape and values, canonical layout, gradients flow to the original.
    Real CPU tensors (a fake CUDA tensor cannot be copied on a CPU-only torch)."""
    call = data.draw(valid_calls("cpu"))
    which = data.draw(NAMES)
    bad = LAYOUTS_COPIED[layout](data.draw, getattr(call, which))
    assert not _canonical(bad)
    bad = bad.copy_(torch.randn(bad.shape)).requires_grad_(True)
    tensors = {"q": call.q, "k": call.k, "v": call.v}
    tensors[which] = bad
    got = dict(zip("qkv", interface._canonical(tensors["q"], tensors["k"], tensors["v"], None)[:3]))
    assert all(_canonical(t) for t in got.values()), layout
    assert got[which].shape == bad.shape and torch.equal(got[which].detach(), bad.detach())
    weights = torch.randn(bad.shape)
    (got[which].float() * weights).sum().backward()
    assert bad.grad is not None and bad.grad.shape == bad.shape
    assert torch.equal(bad.grad.float(), weights.to(bad.dtype).float())  # each element's own gradient, unmoved


# scalar options are checked after the devices, so CPU / meta calls stop at "need CUDA" first
_MUTATION_CASES = [(n, dev) for n in sorted(MUTATIONS) for dev in ("cpu", "meta", "cuda") if dev == "cuda" or not MUTATIONS[n][1]]


@pytest.mark.parametrize("name,device", _MUTATION_CASES, ids=[f"{n}-{d}" for n, d in _MUTATION_CASES])
@settings(PROPS, max_examples=max(10, PLAN.cpu_examples // 5))
@given(data=st.data())
def test_every_bad_input_is_refused_with_a_message_naming_it(data, name, device):
    fn, _ = MUTATIONS[name]
    with _api_context(device) as calls:
        call = data.draw(valid_calls(device))
        call, exc, match = fn(data.draw, replace(call, kwargs=dict(call.kwargs)))
        with pytest.raises(exc, match=match):
            call.run()
        assert "driver" not in calls
