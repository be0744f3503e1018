"""CPU checks of the fuzz harness itself: a gate that cannot fail would be a defect.

The references agree with each other; the checks pass a correct low-precision result and catch
each kind of wrong one (unwritten element, wrong mask, wrong LSE, stray write, wrong gradient);
layouts put NaN exactly where no kernel may read; the static cases cover every registry path
within its supports and upstream's backward gaps; the dynamic strategy respects the budget; the
watchdog kills a hung process with its message.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from hypothesis import Phase, given, settings, strategies as st

import fuzz_cases
import fuzz_profiles
import fuzz_report
from flash_attn_sm120 import bench, testing, testing_mods, testing_sparse
from flash_attn_sm120.config import FwdConfig, parse_fwd_table
from flash_attn_sm120.paths import BACKWARD_GAPS, kernel_paths
from flash_attn_sm120.testing import AttnCase, AttnProblem, CheckFailure
from fuzz_cases import DETERMINISTIC, bwd_tile, problems, static_cases

PLAN = fuzz_profiles.active_plan()
CPU_SETTINGS = settings(max_examples=max(20, PLAN.cpu_examples // 4), deadline=None,
                        phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink))

CASES = [
    (AttnCase("bfloat16", 64, 64, 2, None, "causal", 0.0, True, "dense", "dense"),
     AttnProblem((70, 70), (50, 50), nheads_kv=2, pad_q=3, pad_k=5, seed=1)),
    (AttnCase("float16", 32, 48, 3, True, "local_lr", 5.0, True, "packed", "packed"),
     AttnProblem((0, 17, 40), (9, 0, 33), nheads_kv=1, window_left=3, window_right=0, seed=2)),
    (AttnCase("bfloat16", 40, 40, 1, None, "local_l", 0.0, True, "padded", "padded"),
     AttnProblem((5, 33), (40, 7), nheads_kv=2, window_left=0, pad_q=4, pad_k=9, softmax_scale=0.3, seed=3)),
    (AttnCase("bfloat16", 16, 16, 2, None, "none", 0.0, True, "dense", "paged"),
     AttnProblem((9, 9), (30, 5), nheads_kv=1, page_size=8, seed=4)),
    (AttnCase("float16", 24, 24, 1, None, "causal_l", 0.0, False, "packed", "padded"),
     AttnProblem((20, 3), (6, 11), nheads_kv=3, window_left=2, seed=5)),
]
CASE_IDS = [c.label for c, _ in CASES]


def fake_kernel(inputs, case, problem, *, window=None, lse_shift=0.0):
    """A 'kernel' that writes the low-precision reference into NaN buffers (optionally wrong)."""
    out = torch.full(inputs.out_shape(case.head_dim_v), float("nan"), dtype=case.torch_dtype)
    lse = torch.full(inputs.lse_shape(), float("nan"))
    for i in range(problem.batch):
        q_i, k_i, v_i = inputs.q_layout.seq(inputs.q, i), inputs.k_seq(i), inputs.v_seq(i)
        o, l = testing.attention_ref(q_i, k_i, v_i, causal=case.causal, window=window or problem.window(case),
                                     softmax_scale=problem.softmax_scale, softcap=case.softcap, upcast=False)
        inputs.q_layout.seq(out, i).copy_(o)
        inputs.q_layout.lse_seq(lse, i).copy_(l + lse_shift)
    return out, lse


# ------------------------------------------------------------------------------------------------
# references
# ------------------------------------------------------------------------------------------------


@st.composite
def small_attention(draw):
    hk = draw(st.integers(1, 2))
    h = hk * draw(st.sampled_from((1, 2, 3)))
    d = draw(st.sampled_from((8, 16, 24)))
    dv = draw(st.sampled_from((d, 8, 32)))
    sq, sk = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    causal = draw(st.booleans())
    window = (draw(st.one_of(st.none(), st.integers(-45, 45))), draw(st.one_of(st.none(), st.integers(-45, 45))))
    softcap = draw(st.sampled_from((0.0, 0.0, 2.0)))
    scale = draw(st.one_of(st.none(), st.floats(0.05, 1.0)))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    q = torch.randn(1, sq, h, d, generator=gen)
    k = torch.randn(1, sk, hk, d, generator=gen)
    v = torch.randn(1, sk, hk, dv, generator=gen)
    return q, k, v, dict(causal=causal, window=window, softcap=softcap, softmax_scale=scale)


@CPU_SETTINGS
@given(small_attention())
def test_autograd_reference_matches_bench_reference(x):
    q, k, v, kw = x
    out, lse = testing.attention_ref(q, k, v, **kw)
    ref, ref_lse = bench.reference_attention(q, k, v, **kw)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert torch.allclose(lse[fin], ref_lse[fin], atol=1e-5)


def test_reference_gradients_are_exact_and_finite_on_empty_rows():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 6, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 4, 1, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 4, 1, 8, generator=gen, dtype=torch.float64, requires_grad=True)

    # causal with sq > sk: the first two rows attend to nothing
    def f(q, k, v):
        out, lse = testing.attention_ref(q, k, v, causal=True, softcap=3.0)
        return out, lse.masked_fill(torch.isneginf(lse), 0.0)

    assert torch.autograd.gradcheck(f, (q, k, v))
    out, _ = testing.attention_ref(q, k, v, causal=True)
    assert torch.equal(out[0, :2], torch.zeros_like(out[0, :2]))
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.equal(grads[0][0, :2], torch.zeros_like(grads[0][0, :2]))


# ------------------------------------------------------------------------------------------------
# layouts
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case,problem", CASES, ids=CASE_IDS)
def test_layouts_put_nan_only_where_no_kernel_reads(case, problem):
    x = testing.make_inputs(case, problem, device="cpu")
    h = problem.nheads_kv * case.qhead_per_kvhead
    for i in range(problem.batch):
        q_i, k_i, v_i = x.q_layout.seq(x.q, i), x.k_seq(i), x.v_seq(i)
        assert q_i.shape == (1, problem.seqlens_q[i], h, case.head_dim)
        assert k_i.shape == (1, problem.seqlens_k[i], problem.nheads_kv, case.head_dim)
        assert v_i.shape[-1] == case.head_dim_v
        assert all(torch.isfinite(t).all() for t in (q_i, k_i, v_i))
    if case.q_layout == "padded" or (case.q_layout == "dense" and problem.pad_q):
        base = x.q if x.q._base is None else x.q._base
        assert torch.isnan(base.float()).any()
    if case.q_layout == "packed":
        assert x.q.shape[0] == sum(problem.seqlens_q) and torch.isfinite(x.q.float()).all()
        assert x.index["cu_seqlens_q"].tolist() == [0] + list(torch.tensor(problem.seqlens_q).cumsum(0).tolist())
    if case.k_layout == "paged":
        table = x.index["page_table"]
        assert table.dtype == torch.int32 and sorted(table.flatten().tolist()) == list(range(x.k.shape[0]))
        ps = problem.page_size
        for i, s in enumerate(problem.seqlens_k):
            pages = [x.k[int(table[i, j])] for j in range(-(-s // ps))]
            gathered = torch.cat(pages)[:s] if pages else x.k.new_zeros(0, *x.k.shape[2:])
            assert torch.equal(gathered, x.k_seq(i)[0])
    assert x.lse_shape()[-2 if case.q_layout != "packed" else 0] == h


def test_dense_layout_requires_equal_lengths():
    with pytest.raises(ValueError, match="equal lengths"):
        testing.make_inputs(AttnCase(head_dim=8, head_dim_v=8), AttnProblem((3, 4), (3, 4)), device="cpu")


# ------------------------------------------------------------------------------------------------
# forward checks
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case,problem", CASES, ids=CASE_IDS)
def test_check_forward_passes_a_correct_low_precision_result(case, problem):
    x = testing.make_inputs(case, problem, device="cpu")
    out, lse = fake_kernel(x, case, problem)
    stats = testing.check_forward(x, case, problem, out, lse if case.return_lse else None)
    assert stats["out"]["err"] <= stats["out"]["tol"]


@pytest.mark.parametrize("case,problem", CASES, ids=CASE_IDS)
def test_check_forward_catches_an_unwritten_element(case, problem):
    x = testing.make_inputs(case, problem, device="cpu")
    out, lse = fake_kernel(x, case, problem)
    last = max(i for i, s in enumerate(problem.seqlens_q) if s)
    x.q_layout.seq(out, last)[0, -1, -1, -1] = float("nan")
    with pytest.raises(CheckFailure, match="not finite"):
        testing.check_forward(x, case, problem, out, lse)


def test_check_forward_catches_a_wrong_window_and_wrong_lse():
    case = AttnCase("bfloat16", 32, 32, 1, None, "local_lr", 0.0, True, "dense", "dense")
    problem = AttnProblem((64,), (64,), nheads_kv=2, window_left=4, window_right=2, seed=9)
    x = testing.make_inputs(case, problem, device="cpu")
    out, lse = fake_kernel(x, case, problem, window=(5, 2))  # off by one on the left
    with pytest.raises(CheckFailure, match="out: max error"):
        testing.check_forward(x, case, problem, out, lse)
    out, lse = fake_kernel(x, case, problem, lse_shift=0.05)
    with pytest.raises(CheckFailure, match="lse: max error"):
        testing.check_forward(x, case, problem, out, lse)


def test_check_forward_catches_lse_on_empty_rows_and_missing_lse():
    case = AttnCase("bfloat16", 16, 16, 1, None, "causal", 0.0, True, "dense", "dense")
    problem = AttnProblem((10,), (4,), seed=3)  # rows 0..5 see no key
    x = testing.make_inputs(case, problem, device="cpu")
    out, lse = fake_kernel(x, case, problem)
    assert torch.isneginf(lse[0, 0, :6]).all()
    testing.check_forward(x, case, problem, out, lse)
    bad = lse.clone()
    bad[0, 0, 0] = 0.0
    with pytest.raises(CheckFailure, match="-inf pattern"):
        testing.check_forward(x, case, problem, out, bad)
    with pytest.raises(CheckFailure, match="requested"):
        testing.check_forward(x, case, problem, out, None)


def test_check_forward_catches_a_write_into_the_out_gap():
    case = AttnCase("float16", 16, 16, 1, None, "none", 0.0, False, "dense", "dense")
    problem = AttnProblem((8, 8), (8, 8), pad_q=4, seed=1)
    x = testing.make_inputs(case, problem, device="cpu")
    out_buf, x.out_gap = testing._nan_out(x, case, "cpu")
    out, _ = fake_kernel(x, case, problem)
    out_buf.copy_(out)
    testing.check_forward(x, case, problem, out_buf, None)
    x.out_gap[1, 0] = 0.0
    with pytest.raises(CheckFailure, match="gap"):
        testing.check_forward(x, case, problem, out_buf, None)


def test_rule_matches_upstream_formula():
    ref = torch.tensor([0.1, -2.0, 3.0])
    pt = ref + torch.tensor([0.01, 0.0, 0.0])
    tol, pt_err, atol = testing.rule_tolerance(ref, pt, torch.bfloat16, rtol=2.0)
    ref_lp = ref.to(torch.bfloat16)
    assert atol == pytest.approx(2 * (ref_lp + 0.3 - 0.3 - ref_lp).abs().max().item())
    assert tol == pytest.approx(2 * pt_err + atol)
    testing.assert_close_to_ref("x", ref + tol * 0.99, ref, pt, torch.bfloat16)
    with pytest.raises(CheckFailure):
        testing.assert_close_to_ref("x", ref + tol * 1.01 + 1e-6, ref, pt, torch.bfloat16)


# ------------------------------------------------------------------------------------------------
# backward checks (the public API replaced by a differentiable CPU stand-in)
# ------------------------------------------------------------------------------------------------


def _index_blind(twins: dict) -> dict:
    """What upstream's SM80/SM120 backward step does with a modifier: every index 0."""
    blind = {}
    if twins.get("score_fn") is not None:
        blind["score_fn"] = lambda s, h, qi, ki, fn=twins["score_fn"]: fn(s, h * 0, qi * 0, ki * 0)
    if twins.get("keep_fn") is not None:
        blind["keep_fn"] = lambda h, qi, ki, fn=twins["keep_fn"]: fn(h * 0, qi * 0, ki * 0)
    return blind


def _stand_in(grad_scale: float = 1.0, sink_grad_scale: float = 1.0, blind_mods: bool = False,
              ignore_lists: bool = False):
    """forward_via_api replacement: the fp32 reference, differentiable, assembled in q's layout.
    blind_mods: the modifiers' twins see index 0 everywhere (the bug the modifier backward fixes);
    ignore_lists: a block-sparse case computed densely (a kernel that ignores the lists)."""

    def forward_via_api(inputs, case, problem):
        outs, lses = [], []
        sink = None
        if case.sink:  # same value, the sink's gradient scaled
            sink = inputs.sink * sink_grad_scale - inputs.sink.detach() * (sink_grad_scale - 1.0)
        for i in range(problem.batch):
            q_i, k_i, v_i = inputs.q_layout.seq(inputs.q, i), inputs.k_seq(i), inputs.v_seq(i)
            twins = testing._mod_twins(dataclasses.replace(case, block_sparse="") if ignore_lists else case, inputs, i)
            o, l = testing.attention_ref(q_i, k_i, v_i, causal=case.causal, window=problem.window(case),
                                         softmax_scale=problem.softmax_scale, softcap=case.softcap,
                                         learnable_sink=sink, **(_index_blind(twins) if blind_mods else twins))
            outs.append(o[0] + (grad_scale - 1.0) * (o[0] - o[0].detach()))  # same value, scaled gradient
            lses.append(l[0])
        if inputs.q_layout.kind == "packed":
            out, lse = torch.cat(outs), torch.cat(lses, dim=1)
        else:
            width = inputs.q.shape[1]
            out = torch.stack([F.pad(o, (0, 0, 0, 0, 0, width - o.shape[0])) for o in outs])
            lse = torch.stack([F.pad(l, (0, width - l.shape[1])) for l in lses])
        return out.to(case.torch_dtype), lse

    return forward_via_api


@pytest.mark.parametrize("layout", [("dense", "dense"), ("packed", "packed"), ("padded", "padded")])
def test_check_backward_passes_correct_gradients_and_catches_wrong_ones(monkeypatch, layout):
    case = AttnCase("bfloat16", 16, 16, 2, None, "local_lr", 0.0, True, *layout, backward=True)
    lens = (12, 12) if layout[0] == "dense" else (12, 7)
    problem = AttnProblem(lens, (12, 12) if layout[1] == "dense" else (14, 9), nheads_kv=1,
                          window_left=3, window_right=1, pad_q=2, pad_k=3, seed=11)
    monkeypatch.setattr(testing, "forward_via_api", _stand_in())
    stats = testing.check_backward(testing.make_inputs(case, problem, "cpu", requires_grad=True), case, problem)
    assert set(stats) >= {"out", "lse", "dq", "dk", "dv"}
    monkeypatch.setattr(testing, "forward_via_api", _stand_in(grad_scale=1.1))
    with pytest.raises(CheckFailure, match="dq|dk|dv"):
        testing.check_backward(testing.make_inputs(case, problem, "cpu", requires_grad=True), case, problem)


@pytest.mark.parametrize("layout", [("dense", "dense"), ("packed", "packed")])
def test_check_backward_with_a_sink_checks_dsink(monkeypatch, layout):
    case = AttnCase("bfloat16", 16, 16, 2, None, "causal_l", 0.0, True, *layout, backward=True, sink=True)
    problem = AttnProblem((12, 12) if layout[0] == "dense" else (12, 5), (12, 12) if layout[0] == "dense" else (12, 5),
                          nheads_kv=1, window_left=3, seed=5)
    monkeypatch.setattr(testing, "forward_via_api", _stand_in())
    stats = testing.check_backward(testing.make_inputs(case, problem, "cpu", requires_grad=True), case, problem)
    assert set(stats) >= {"out", "lse", "dq", "dk", "dv", "dsink"}
    monkeypatch.setattr(testing, "forward_via_api", _stand_in(sink_grad_scale=1.2))
    with pytest.raises(CheckFailure, match="dsink"):
        testing.check_backward(testing.make_inputs(case, problem, "cpu", requires_grad=True), case, problem)


@pytest.mark.parametrize("mods", ["position", "alibi", "document", "prefix+position"])
def test_check_backward_with_mods_catches_an_index_blind_kernel(monkeypatch, mods):
    """A modifier case passes with the twins applied at the real indices and fails where a kernel passed
    index 0 to them (upstream's SM80/SM120 backward step)."""
    case = AttnCase("bfloat16", 16, 16, 2, None, "none", 0.0, True, "packed", "packed", backward=True, mods=mods)
    problem = AttnProblem((40, 9), (45, 12), nheads_kv=2, seed=7)
    monkeypatch.setattr(testing, "forward_via_api", _stand_in())
    stats = testing.check_backward(testing.make_inputs(case, problem, "cpu", requires_grad=True), case, problem)
    assert set(stats) >= {"out", "dq", "dk", "dv"}
    monkeypatch.setattr(testing, "forward_via_api", _stand_in(blind_mods=True))
    with pytest.raises(CheckFailure):
        testing.check_backward(testing.make_inputs(case, problem, "cpu", requires_grad=True), case, problem)


@pytest.mark.parametrize("sparse,mods,mask", [("random", "", "none"), ("nofull", "prefix", "none"),
                                              ("q256", "document", "none"), ("random", "", "causal")])
def test_check_block_sparse_catches_a_kernel_that_ignores_the_lists(monkeypatch, sparse, mods, mask):
    """A block-sparse case passes with the lists' dense mask (and the mask_mod's twin on partial blocks)
    and fails for a kernel that computes every block (upstream's SM80/SM120 kernels ignore the lists)."""
    backward = mask == "none"
    case = AttnCase("bfloat16", 16, 16, 2, None, mask, 0.0, True, "dense", "dense", backward=backward, mods=mods,
                    block_sparse=sparse)
    problem = AttnProblem((300, 300), (520, 520), nheads_kv=1, seed=9)
    check = testing.check_backward if backward else (
        lambda inputs, c, p: testing.check_forward(inputs, c, p, *testing.forward_via_api(inputs, c, p)))
    monkeypatch.setattr(testing, "forward_via_api", _stand_in())
    stats = check(testing.make_inputs(case, problem, "cpu", requires_grad=backward), case, problem)
    assert "out" in stats
    monkeypatch.setattr(testing, "forward_via_api", _stand_in(ignore_lists=True))
    with pytest.raises(CheckFailure):
        check(testing.make_inputs(case, problem, "cpu", requires_grad=backward), case, problem)


def test_block_sparse_cases_are_drawn_within_their_limits():
    from flash_attn_sm120 import testing_sparse

    fwd, bwd = static_cases(kernel_paths(TABLE), fuzz_profiles.PLANS["deep"], seed=1, mode="emulated")
    sparse = [c for c in fwd + bwd if c.case.block_sparse]
    assert sparse and any(c.case.block_sparse for c in bwd)
    assert {c.case.block_sparse for c in sparse} == set(testing_sparse.CASES)
    for c in sparse:
        assert c.api == "public" and c.path.supports.block_sparse
        # dense, or varlen lists in a case whose sparse Q block is one kernel tile, GQA unpacked
        assert c.case.is_dense or (testing_sparse.varlen_case_ok(c.case.block_sparse, c.case.q_layout,
                                                                 c.case.k_layout, c.case.backward)
                                   and not c.case.pack_gqa), c.id
        assert c.case.head_dim == c.case.head_dim_v and c.case.head_dim in testing_sparse.HEAD_DIMS
        assert c.case.mask in ("none", "causal")
    assert any(not c.case.is_dense for c in sparse)  # varlen lists are drawn
    assert any(not c.case.is_dense for c in bwd if c.case.block_sparse)  # the varlen backward's lists too
    assert any(c.case.mask == "causal" for c in bwd if c.case.block_sparse)  # the walk's causal tiles are drawn


def test_a_keep_twin_replaces_causal_as_upstream():
    """keep_fn = causal on a square problem equals the causal flag; given with causal=True it replaces it."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 20, 2, 16, generator=g) for _ in range(3))
    causal = testing.attention_ref(q, k, v, causal=True)
    keep = testing.attention_ref(q, k, v, keep_fn=lambda h, qi, ki: ki <= qi)
    torch.testing.assert_close(keep[0], causal[0])
    full = testing.attention_ref(q, k, v, causal=True, keep_fn=lambda h, qi, ki: ki >= 0)
    torch.testing.assert_close(full[0], testing.attention_ref(q, k, v)[0])


def test_mod_cases_are_drawn_through_the_public_api_never_with_softcap_and_a_score_mod():
    from flash_attn_sm120 import testing_mods

    fwd, bwd = static_cases(kernel_paths(TABLE), fuzz_profiles.PLANS["deep"], seed=1, mode="emulated")
    modded = [c for c in fwd + bwd if c.case.mods]
    assert modded and all(c.api == "public" for c in modded)
    assert {c.case.mods for c in modded} == set(testing_mods.MODS)
    assert any(c.case.mods for c in bwd)
    assert not [c for c in modded if c.case.softcap and testing_mods.has_score_mod(c.case.mods)]


def test_sink_cases_are_drawn_through_the_public_api():
    fwd, bwd = static_cases(kernel_paths(TABLE), fuzz_profiles.PLANS["deep"], seed=1, mode="emulated")
    sinked = [c for c in fwd if c.case.sink]
    assert sinked and all(c.api == "public" for c in sinked)
    assert any(c.case.sink for c in bwd)


# ------------------------------------------------------------------------------------------------
# static cases and dynamic strategy
# ------------------------------------------------------------------------------------------------


def _table(*entries):
    rows = [dict(head_dim=d, mask=m, num_threads=c.num_threads, tile_m=c.tile_m, tile_n=c.tile_n,
                 num_stages=c.num_stages, q_in_regs=c.q_in_regs,
                 provenance=dict(gpu="test", mode="emulated", date="2026-11-29", command="test"))
            for d, m, c in entries]
    return parse_fwd_table({"schema": 1, "fwd": rows})


TABLE = _table((64, "causal", FwdConfig(128, 64, 64, 2)), (128, "none", FwdConfig(256, 128, 96, 1)),
               (256, "none", FwdConfig(128, 64, 32, 1)))


@pytest.mark.parametrize("mode", ["emulated", "sm120"])
def test_static_cases_cover_every_path_within_its_supports(mode):
    paths = kernel_paths(TABLE)
    fwd, bwd = static_cases(paths, fuzz_profiles.PLANS["fast"], seed=7, mode=mode)
    assert {c.path.name for c in fwd} == {p.name for p in paths}
    assert len({c.id for c in fwd + bwd}) == len(fwd + bwd)
    for c in fwd + bwd:
        s, case = c.path.supports, c.case
        assert c.path.error(case.head_dim, case.head_dim_v) is None, c.id
        assert case.head_dim in s.head_dims and case.dtype in s.dtypes
        if c.path.name.startswith("table-d128"):
            assert 96 < case.head_dim <= 128
    gaps = BACKWARD_GAPS[mode]
    assert bwd and all(c.api == "public" and c.case.backward for c in bwd)
    for c in bwd:
        assert c.case.head_dim in c.path.supports.backward_head_dims
        if "varlen" in gaps:
            assert c.case.is_dense
        if "d64-noncausal" in gaps:
            assert not (c.case.head_dim == 64 and c.case.mask == "none")
    again = static_cases(paths, fuzz_profiles.PLANS["fast"], seed=7, mode=mode)
    assert [c.id for c in again[0] + again[1]] == [c.id for c in fwd + bwd]
    other = static_cases(paths, fuzz_profiles.PLANS["fast"], seed=8, mode=mode)
    assert [c.id for c in other[0]] != [c.id for c in fwd]


def test_static_cases_spread_the_static_dimensions():
    fwd, _ = static_cases(kernel_paths(TABLE), fuzz_profiles.PLANS["deep"], seed=1, mode="emulated")
    seen = lambda f: {f(c.case) for c in fwd}  # noqa: E731
    assert seen(lambda c: c.mask) == set(testing.MASKS)
    assert seen(lambda c: c.dtype) == {"float16", "bfloat16"}
    assert {1, 2, 4, 8} <= seen(lambda c: c.qhead_per_kvhead)
    assert seen(lambda c: (c.q_layout, c.k_layout)) >= {("dense", "dense"), ("packed", "packed"), ("padded", "padded")}
    assert seen(lambda c: c.return_lse) == {True, False} and len(seen(lambda c: c.softcap)) >= 3
    assert {c.api for c in fwd} == {"driver", "public"}
    assert any(c.case.head_dim != c.case.head_dim_v for c in fwd)


_FAST_CASES = static_cases(kernel_paths(TABLE), fuzz_profiles.PLANS["fast"], seed=3, mode="sm120")


@CPU_SETTINGS
@given(data=st.data(), index=st.integers(0, len(_FAST_CASES[0]) + len(_FAST_CASES[1]) - 1))
def test_dynamic_problems_respect_layout_and_budget(data, index):
    plan = fuzz_profiles.PLANS["fast"]
    fc = (_FAST_CASES[0] + _FAST_CASES[1])[index]
    p = data.draw(problems(fc, plan))
    case = fc.case
    assert len(p.seqlens_q) == len(p.seqlens_k) == p.batch <= plan.max_batch
    assert 1 <= p.nheads_kv <= plan.max_kv_heads
    if case.q_layout == "dense":
        assert len(set(p.seqlens_q)) == 1 and p.seqlens_q[0] >= 1
    if case.k_layout == "dense":
        assert len(set(p.seqlens_k)) == 1 and p.seqlens_k[0] >= 1
    assert (p.window_left is not None) == case.has_window[0]
    assert (p.window_right is not None) == case.has_window[1]
    if case.backward:
        assert max(p.seqlens_q + p.seqlens_k) <= plan.max_seqlen_bwd
        assert min(p.seqlens_k) >= 1
        # each sequence's queries and keys stay within the backward's per-sequence budget
        h = p.nheads_kv * case.qhead_per_kvhead
        assert all(sq * sk * h <= max(plan.bwd_work // p.batch, 80 * sq * h) or sk <= 80
                   for sq, sk in zip(p.seqlens_q, p.seqlens_k))
    else:
        assert max(p.seqlens_q + p.seqlens_k) <= plan.max_seqlen
        h = p.nheads_kv * case.qhead_per_kvhead
        # each sequence's keys are capped by the per-sequence share of the budget
        assert all(sk <= max(1, plan.fwd_work // p.batch // (h * max(sq, 1))) or sk <= 80
                   for sq, sk in zip(p.seqlens_q, p.seqlens_k))


def test_plan_overrides_and_shards(monkeypatch):
    monkeypatch.setenv(fuzz_profiles.PLAN_ENV, "fwd_cases=3,bwd_examples=1")
    plan = fuzz_profiles.active_plan()
    assert plan.fwd_cases == 3 and plan.bwd_examples == 1
    monkeypatch.setenv(fuzz_profiles.PLAN_ENV, "nonsense=1")
    with pytest.raises(ValueError, match="unknown field"):
        fuzz_profiles.active_plan()
    monkeypatch.setenv(fuzz_profiles.SHARD_ENV, "2/4")
    assert fuzz_profiles.shard() == (2, 4)
    monkeypatch.setenv(fuzz_profiles.SHARD_ENV, "4/4")
    with pytest.raises(ValueError):
        fuzz_profiles.shard()


def test_profiles_are_registered():
    from hypothesis import settings as hsettings

    for name, plan in fuzz_profiles.PLANS.items():
        assert hsettings.get_profile(name).max_examples == plan.fwd_examples
        assert hsettings.get_profile(name).deadline is None


# ------------------------------------------------------------------------------------------------
# deterministic=True backward cases
# ------------------------------------------------------------------------------------------------


def test_deterministic_case_needs_backward():
    with pytest.raises(ValueError, match="needs backward=True"):
        AttnCase(deterministic=True)
    for mask in ("local_l", "local_r", "local_lr", "causal_l"):
        AttnCase(mask=mask, backward=True, deterministic=True, mods="position")  # turns from the window's edges
        AttnCase(mask=mask, backward=True, deterministic=True)  # fixed point takes windows
        AttnCase(mask=mask, backward=True, deterministic=True, mods="document")  # a mask_mod alone too
        AttnCase(mask=mask, backward=True, deterministic=True, block_sparse="random")  # the list walk takes windows
    AttnCase(backward=True, deterministic=True, block_sparse="random")
    for mask in ("none", "causal"):
        for layout in (("dense", "dense"), ("packed", "packed"), ("padded", "padded")):
            AttnCase(mask=mask, q_layout=layout[0], k_layout=layout[1], backward=True, deterministic=True,
                     qhead_per_kvhead=2, sink=True, mods="position")


def test_deterministic_shows_in_the_label_and_survives_a_json_round_trip():
    det = AttnCase("float16", 64, 64, 2, None, "causal", 0.0, True, "packed", "packed", True, deterministic=True)
    assert det.label == "fp16-d64-g2-causal-lse-packed.packed-bwd-det"
    assert dataclasses.replace(det, deterministic=False).label == "fp16-d64-g2-causal-lse-packed.packed-bwd"
    assert AttnCase(**json.loads(json.dumps(dataclasses.asdict(det)))) == det  # the sanitizer's cases file
    assert "deterministic=True" in repr(det)  # the fuzz suite's replay line


def test_api_kwargs_pass_deterministic_only_when_set():
    problem = AttnProblem((20,), (30,), seed=1)
    for det in (False, True):
        case = AttnCase("bfloat16", 16, 16, backward=True, deterministic=det)
        kw = testing.api_kwargs(testing.make_inputs(case, problem, "cpu"), case, problem)
        # absent, not False, otherwise: forward-only callers hand these to upstream's _flash_attn_fwd
        assert kw.get("deterministic", "absent") == (True if det else "absent")


def _counting_stand_in(jitter_on_call=None):
    """_stand_in whose q passes through an identity counting its backward calls; on call `jitter_on_call`
    one element of dq moves by one bf16 step near 1 (a run that is correct but not reproducible)."""
    calls = []

    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            calls.append(1)
            if len(calls) == jitter_on_call:
                g = g.clone()
                g.view(-1)[0] += 2 ** -7 * max(1.0, g.view(-1)[0].abs().item())  # a valid row in every layout
            return g

    inner = _stand_in()

    def forward_via_api(inputs, case, problem):
        q = inputs.q
        inputs.q = Identity.apply(q)
        try:
            return inner(inputs, case, problem)
        finally:
            inputs.q = q

    return forward_via_api, calls


@pytest.mark.parametrize("layout", [("dense", "dense"), ("packed", "packed"), ("padded", "padded")])
def test_deterministic_backward_runs_twice_and_catches_a_difference(monkeypatch, layout):
    lens_q, lens_k = ((40, 40), (50, 50)) if layout[0] == "dense" else ((40, 0), (50, 9))
    problem = AttnProblem(lens_q, lens_k, nheads_kv=1, pad_q=2, pad_k=3, seed=4)
    for det in (False, True):
        case = AttnCase("bfloat16", 16, 16, 2, None, "causal", 0.0, True, *layout, backward=True, deterministic=det)
        stand_in, calls = _counting_stand_in()
        monkeypatch.setattr(testing, "forward_via_api", stand_in)
        stats = testing.check_backward(testing.make_inputs(case, problem, "cpu", requires_grad=True), case, problem)
        assert len(calls) == (2 if det else 1) and ("bitwise" in stats) == det
        assert set(stats) >= {"out", "lse", "dq", "dk", "dv"}
    for call in (1, 2):  # the first run off by one step passes the rule but not the comparison; so does the second
        stand_in, calls = _counting_stand_in(jitter_on_call=call)
        monkeypatch.setattr(testing, "forward_via_api", stand_in)
        with pytest.raises(CheckFailure, match="dq: deterministic=True, but two backward runs .* differ in 1 of"):
            testing.check_backward(testing.make_inputs(case, problem, "cpu", requires_grad=True), case, problem)
    case = dataclasses.replace(case, deterministic=False)  # not compared without deterministic
    stand_in, _ = _counting_stand_in(jitter_on_call=1)
    monkeypatch.setattr(testing, "forward_via_api", stand_in)
    testing.check_backward(testing.make_inputs(case, problem, "cpu", requires_grad=True), case, problem)


def test_bitwise_check_compares_valid_rows_only_and_counts_nan_as_a_difference():
    case = AttnCase("bfloat16", 8, 8, 1, None, "none", 0.0, False, "padded", "padded", backward=True,
                    deterministic=True)
    x = testing.make_inputs(case, AttnProblem((5, 2), (3, 4), pad_q=2, pad_k=1, seed=2), "cpu")
    grads = [torch.randn(t.shape).to(t.dtype) for t in (x.q, x.k, x.v)]
    again = [g.clone() for g in grads]
    for g in again:
        g[1, -1] = float("nan")  # past sequence 1's rows: no kernel writes there
    assert testing.assert_bitwise_equal(x, grads, again)["runs"] == 2
    again[2][0, 0, 0, 0] = float("nan")
    with pytest.raises(CheckFailure, match="dv: .* differ in 1 of"):
        testing.assert_bitwise_equal(x, grads, again)
    with pytest.raises(CheckFailure, match="ran once"):
        testing.assert_bitwise_equal(x, grads, None)


@pytest.mark.parametrize("profile", ["fast", "deep"])
def test_deterministic_cases_cover_every_dq_ordering(profile):
    plan = fuzz_profiles.PLANS[profile]
    paths = kernel_paths(TABLE)
    fwd, bwd = static_cases(paths, plan, seed=0, mode="emulated")
    det = [c for c in bwd if c.case.deterministic]
    assert len(det) == plan.det_cases >= 3 and bwd[-len(det):] == det
    assert len({c.index for c in bwd}) == len(bwd) and all(c.id.startswith("det") for c in det)
    for c in det:
        assert c.api == "public" and c.case.backward
        assert c.det_order != "lists" or c.case.block_sparse  # the lists' turns only with lists
        assert not c.case.block_sparse or (c.det_order in ("fixed", "lists") and (
            c.case.is_dense or testing_sparse.varlen_case_ok(c.case.block_sparse, c.case.q_layout, c.case.k_layout,
                                                             backward=True)))
        # fixed point: every call without a user score_mod but a dense causal one (a mask_mod replaces the causal
        # flag, as upstream resolves it) or one a rotated turns entry serves (the last row); turns the rest
        spec = testing_mods.spec(c.case.mods) if c.case.mods else None
        no_score_mod = spec is None or spec.score_mod is None
        causal = c.case.mask == "causal" and (spec is None or spec.mask_mod is None)
        if c.case.local and not c.case.block_sparse:  # a window: turns from its edges when dense or with a user
            # score_mod (never rotated), else fixed point
            assert (c.det_order == "fixed") == (no_score_mod and not c.case.is_dense) and c.det_order != "rotated"
        entry = fuzz_cases._aims_at_rotated_entry(c.case, testing.bwd_routing(c.case)[3])
        assert (c.det_order == "fixed") == (no_score_mod and not entry and (
            not c.case.is_dense or not (causal or c.case.local) or bool(c.case.block_sparse)))
        if entry:  # the entry's row: no mask, no softcap, a head dim with the entry
            assert c.det_order == "rotated" and c.case.mask == "none" and not (c.case.softcap or c.case.mods)
        assert c.path.family == "dispatch" and c.case.head_dim in c.path.supports.backward_head_dims
        assert c.id.endswith("-bwd-det")
    orders = [c.det_order for c in det]
    assert set(orders[:4]) == {"fixed", "descending+reversed", "rotated", "ascending"}  # the first four: one each
    assert {c.case.dtype for c in det} == {"bfloat16", "float16"}
    assert any(c.case.qhead_per_kvhead > 1 for c in det)
    assert any(not c.case.is_dense for c in det) and any(c.det_order == "ascending" and not c.case.is_dense
                                                         for c in det)
    if profile == "deep":
        assert [(c.det_order, c.case.mask, (c.case.q_layout, c.case.k_layout)) for c in det] == \
            [t[:3] for t in DETERMINISTIC][:len(det)]
        assert any(c.det_order == "ascending" and c.case.is_dense for c in det)  # n_blocks > m_blocks
        assert any(c.det_order == "lists" and c.case.block_sparse for c in det)  # the block-sparse walk's turns
        assert any(c.det_order == "fixed" and c.case.block_sparse for c in det)  # and its fixed-point dQ
        assert any(c.det_order == "fixed" and c.case.local for c in det)  # windows, by fixed point
        # the rotated turns entry (d96's "none" key)
        assert any(fuzz_cases._aims_at_rotated_entry(c.case, testing.bwd_routing(c.case)[3]) for c in det)
    # the other cases do not move with det_cases
    without = static_cases(paths, dataclasses.replace(plan, det_cases=0), seed=0, mode="emulated")
    assert [c.id for c in without[0] + without[1]] == [c.id for c in fwd + bwd if not c.case.deterministic]


_DET_CASES = [c for c in static_cases(kernel_paths(TABLE), fuzz_profiles.PLANS["deep"], seed=5, mode="emulated")[1]
              if c.case.deterministic]


@CPU_SETTINGS
@given(data=st.data(), index=st.integers(0, len(_DET_CASES) - 1), profile=st.sampled_from(("fast", "deep")))
def test_deterministic_problems_select_their_dq_ordering_with_several_blocks(data, index, profile):
    """Each drawn problem keeps its case's ordering (driver_bwd.deterministic_plan: one compile key per case) and
    has a sequence of two or more m_blocks and n_blocks, so the CTAs' turns interleave."""
    fc = _DET_CASES[index]
    p = data.draw(problems(fc, fuzz_profiles.PLANS[profile]))
    assert testing.deterministic_order(fc.case, p) == fc.det_order
    m, n = bwd_tile(fc.case)
    assert any(sq > m and sk > n for sq, sk in zip(p.seqlens_q, p.seqlens_k)), (p.seqlens_q, p.seqlens_k)
    if fc.case.is_dense and fc.det_order == "rotated":
        assert -(-p.seqlens_k[0] // n) <= -(-p.seqlens_q[0] // m)
    if fc.case.is_dense and fc.det_order == "ascending":
        assert -(-p.seqlens_k[0] // n) > -(-p.seqlens_q[0] // m)


def test_bwd_routing_matches_the_drivers_entry_kinds():
    """testing.bwd_routing (what the fuzz cases and deterministic_order assume the driver picks) against the
    driver's own rule, case by case: the plain entries for plain calls (packed only with GQA), the turns
    entries for deterministic dense causal calls without softcap or modifiers, and for dense ones without a
    mask whose lengths the rotated entry (d96) fits; the modifier entries for MODS cases and lists; a right
    window of 0 is causal (upstream's resolution)."""
    base = AttnCase("bfloat16", 96, 96, backward=True)
    kinds = lambda case, **kw: testing.bwd_routing(case, AttnProblem((300,), (300,), **kw))[3]  # noqa: E731
    k = lambda modifiers=False, plain_mha=False, plain=False, turns=False: dict(  # noqa: E731
        modifiers=modifiers, plain_mha=plain_mha, plain=plain, turns=turns)
    assert kinds(base) == k(plain_mha=True, plain=True)
    assert kinds(dataclasses.replace(base, qhead_per_kvhead=4)) == k(plain=True)
    assert kinds(dataclasses.replace(base, q_layout="packed", k_layout="packed")) == k()
    assert kinds(dataclasses.replace(base, qhead_per_kvhead=2, q_layout="packed", k_layout="packed")) == k(plain=True)
    assert kinds(dataclasses.replace(base, q_layout="padded", k_layout="padded")) == k()  # seqused
    assert kinds(dataclasses.replace(base, softcap=5.0)) == k()
    assert kinds(dataclasses.replace(base, mods="position")) == k(modifiers=True)
    det = dataclasses.replace(base, mask="causal", deterministic=True)
    assert kinds(det) == k(turns=True)
    assert kinds(dataclasses.replace(det, qhead_per_kvhead=2)) == k(turns=True)
    assert kinds(dataclasses.replace(det, softcap=5.0)) == k()
    none = dataclasses.replace(det, mask="none")
    assert kinds(none) == k(turns=True)  # 3 n_blocks of 128 keys, 5 m_blocks of 64 rows: the rotated entry
    assert testing.bwd_routing(none, AttnProblem((100,), (300,)))[3] == k()  # 3 n_blocks > 2 m_blocks: fixed point
    assert testing.bwd_routing(none)[3] == k()  # no lengths, no rotated entry
    assert kinds(dataclasses.replace(none, head_dim=128, head_dim_v=128)) == k()  # no rotated entry at d128
    assert kinds(dataclasses.replace(none, softcap=5.0)) == k()
    from flash_attn_sm120.config_bwd import ROTATED_ENTRIES_SERVE_GQA

    assert kinds(dataclasses.replace(none, qhead_per_kvhead=2)) == k(turns=ROTATED_ENTRIES_SERVE_GQA)
    assert kinds(dataclasses.replace(det, q_layout="packed", k_layout="packed")) == k()  # fixed point
    assert kinds(dataclasses.replace(det, mask="local_r"), window_right=0) == k(turns=True)  # causal
    # a window: descending turns (dense), on the key's regular entry (a turns entry serves its exact key only)
    assert kinds(dataclasses.replace(det, mask="local_r"), window_right=7) == k(turns=True)
    assert kinds(dataclasses.replace(det, block_sparse="random")) == k(modifiers=True)


def test_deterministic_order_names_the_plans_choices():
    plain = AttnCase("bfloat16", 128, 128, backward=True, deterministic=True)
    order = lambda c, sq, sk, **kw: testing.deterministic_order(c, AttnProblem((sq,), (sk,), **kw))  # noqa: E731
    # a dense window: descending turns (session 38), softcap or not; packed: fixed point; block-sparse lists too
    w = dict(window_left=64, window_right=16)
    assert order(dataclasses.replace(plain, mask="local_lr"), 4 * 64, 3 * 64, **w) == "descending+reversed"
    assert order(dataclasses.replace(plain, mask="local_lr", softcap=5.0), 4 * 64, 3 * 64, **w) == "descending+reversed"
    assert order(dataclasses.replace(plain, mask="local_lr", q_layout="packed", k_layout="packed"),
                 4 * 64, 3 * 64, **w) == "fixed"
    assert order(dataclasses.replace(plain, mask="local_lr"), 4 * 64, 3 * 64) == "fixed"  # no sizes: no window
    assert order(dataclasses.replace(plain, mask="causal", block_sparse="random"), 4 * 128, 3 * 128) == "fixed"
    assert order(dataclasses.replace(plain, mask="causal", block_sparse="random", mods="position"),
                 4 * 128, 3 * 128) == "lists"
    # a mask_mod replaces the window (upstream's resolution)
    # (no mask left, no score_mod: fixed point; a causal mask under a mask_mod is no causal flag either)
    assert order(dataclasses.replace(plain, mask="local_lr", mods="document"), 4 * 64, 3 * 64) == "fixed"
    assert order(dataclasses.replace(plain, mask="causal", mods="document"), 4 * 64, 3 * 64) == "fixed"
    # no window: dense causal calls take turns, with a score_mod or not; no mask: fixed point without one
    for mods in ("", "position"):
        case = dataclasses.replace(plain, mods=mods)
        m, n = bwd_tile(case)
        assert order(case, 4 * m, 3 * n) == ("fixed" if not mods else "rotated"), mods
        assert order(dataclasses.replace(case, mask="causal"), 2 * m, 3 * n) == "descending+reversed", mods
    case = dataclasses.replace(plain, mods="position")
    m, n = bwd_tile(case)
    assert order(case, 4 * m, 3 * n) == "rotated"
    assert order(case, 2 * m, 3 * n) == "ascending"
    causal = dataclasses.replace(case, mask="causal")
    assert order(causal, 2 * m, 3 * n) == "descending+reversed"
    packed = dataclasses.replace(causal, q_layout="packed", k_layout="packed")
    assert order(packed, 4 * m, 3 * n) == "ascending"  # cu_seqlens_k with a user score_mod: turns
    for layouts in (("packed", "packed"), ("padded", "padded"), ("dense", "paged")):  # varlen, no score_mod
        varlen = dataclasses.replace(plain, mask="causal", q_layout=layouts[0], k_layout=layouts[1])
        assert order(varlen, 4 * 128, 3 * 128) == "fixed", layouts
    padded = dataclasses.replace(case, q_layout="padded", k_layout="padded")
    assert order(padded, 4 * m, 3 * n) == "ascending"  # seqused: not dense
    assert order(dataclasses.replace(padded, mask="causal"), 4 * m, 3 * n) == "ascending"  # seqused_k: ascending
    # a mask_mod replaces the causal flag, as upstream resolves it; a modifier call has its own tile
    # (the table's modifier entries)
    alibi = dataclasses.replace(causal, mods="alibi")
    am, an = bwd_tile(alibi)
    assert order(alibi, 2 * am, 3 * an) == "descending+reversed"
    # a right window of 0 and no left one is a causal mask (upstream's resolution, as the driver's): turns
    right0 = dataclasses.replace(plain, mask="local_r")
    assert order(right0, 4 * 128, 3 * 128, window_right=0) == "descending+reversed"
    assert order(right0, 4 * 128, 3 * 128, window_right=5) == "descending+reversed"
    # d96 without a mask: the rotated turns entry (64 x 128) where its rotated order fits, else fixed point
    d96 = dataclasses.replace(plain, head_dim=96, head_dim_v=96)
    assert order(d96, 4 * 64, 3 * 128) == "rotated"
    assert order(d96, 2 * 64, 3 * 128) == "fixed"  # 3 n_blocks > 2 m_blocks
    assert order(dataclasses.replace(d96, softcap=5.0), 4 * 64, 3 * 128) == "fixed"
    assert order(dataclasses.replace(d96, q_layout="padded", k_layout="padded"), 4 * 64, 3 * 128) == "fixed"


# ------------------------------------------------------------------------------------------------
# report and watchdog
# ------------------------------------------------------------------------------------------------


def test_report_counts_and_json(tmp_path, monkeypatch):
    monkeypatch.setattr(fuzz_report, "COUNTS", fuzz_report.defaultdict(lambda: fuzz_report.defaultdict(int)))
    monkeypatch.setattr(fuzz_report, "CASES_SEEN", set())
    fuzz_report.record_case("p1", "case-a")
    fuzz_report.record_case("p1", "case-a")
    fuzz_report.record_example("p1", "fwd", True)
    fuzz_report.record_example("p1", "fwd", False)
    fuzz_report.record_example("p2", "bwd", True)
    lines = fuzz_report.summary_lines()
    assert lines[1].split() == ["p1", "1", "0", "1", "1", "0", "0"]
    assert lines[-1].split() == ["TOTAL", "1", "0", "1", "1", "1", "0"]
    fuzz_report.write_json(str(tmp_path / "s.json"))
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["paths"]["p2"]["bwd_pass"] == 1


def test_watchdog_kills_a_hung_process_with_a_message(tmp_path):
    tests_dir = Path(__file__).resolve().parent
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(tests_dir)!r})
        from watchdog import Watchdog
        wd = Watchdog(seconds=0.5, backstop=30, report_path={str(tmp_path / 'r.json')!r})
        wd.arm("tests/x.py::test_hang[case]")
        time.sleep(30)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3
    assert "WATCHDOG: tests/x.py::test_hang[case] still running after 0 s" in proc.stderr
    assert "time.sleep" in proc.stderr or "line 7" in proc.stderr  # the stack dump
    assert (tmp_path / "r.json.hang").exists()


def test_watchdog_message_escapes_pytest_capture(tmp_path):
    """Under pytest's fd capture the message must still reach the real stderr before the exit."""
    tests_dir = Path(__file__).resolve().parent
    (tmp_path / "test_hang.py").write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(tests_dir)!r})
        from watchdog import Watchdog

        def test_hang(request):
            capture = request.config.pluginmanager.getplugin("capturemanager")
            wd = Watchdog(seconds=0.5, backstop=30,
                          before_report=lambda: capture.suspend_global_capture(in_=False))
            wd.arm(request.node.nodeid)
            print("captured output")
            time.sleep(30)
    """))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_hang.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3
    assert "WATCHDOG: test_hang.py::test_hang still running" in proc.stdout + proc.stderr


def test_watchdog_rearm_and_disarm_do_not_fire():
    from watchdog import Watchdog

    with Watchdog(seconds=0.2, backstop=5) as wd:
        wd.arm("a")
        wd.arm("b")
    import time

    time.sleep(0.4)  # a fired timer would have ended this process


def test_watchdog_env_default(monkeypatch):
    from watchdog import WATCHDOG_ENV, Watchdog

    monkeypatch.setenv(WATCHDOG_ENV, "0")
    wd = Watchdog()
    wd.arm("never")
    assert wd._timer is None
    monkeypatch.delenv(WATCHDOG_ENV)
    assert Watchdog().seconds == 300
    assert os.environ.get(WATCHDOG_ENV) is None


def test_varlen_block_sparse_case_builds_lists_and_per_sequence_masks():
    """A forward block-sparse case in the packed layout: upstream's varlen lists (one region of the index
    tensor per sequence) and each sequence's dense mask at its own lengths, an empty sequence included."""
    from flash_attn_sm120 import testing_ref

    case = testing.AttnCase("bfloat16", 64, 64, 2, None, "causal", 0.0, True, "packed", "packed", block_sparse="random")
    problem = testing.AttnProblem((300, 0, 150), (520, 64, 200), nheads_kv=2, seed=21)
    inputs = testing.make_inputs(case, problem, "cpu")
    lists = testing.api_kwargs(inputs, case, problem)["block_sparse_tensors"]
    assert lists.cu_total_m_blocks.tolist() == [0, 3, 3, 5]  # 128-row blocks of 300, 0 and 150 rows
    assert lists.cu_block_idx_offsets.tolist() == [0, 15, 15, 19]  # 3 x 5, 0 x 1, 2 x 2 entries
    assert tuple(lists.mask_block_cnt.shape) == (4, 5) and tuple(lists.mask_block_idx.shape) == (4, 19)
    for seq, (sq, sk) in enumerate(zip(problem.seqlens_q, problem.seqlens_k)):
        keep = testing_ref._mod_twins(case, inputs, seq)["keep_fn"](0, 0, 0)
        assert tuple(keep.shape) == (1, 4, sq, sk), seq
    with pytest.raises(ValueError, match="block-sparse cases take the dense layout"):
        testing.make_inputs(dataclasses.replace(case, block_sparse="q256"), problem, "cpu")  # 256-row blocks: no varlen lists


def test_routing_counts_the_drivers_sms(monkeypatch):
    """testing's routing reads the SM count the driver reads (device_info of the current device), 132 without
    CUDA: a d96 call without a mask whose rotated walk has 80 n_blocks fits half of 188 SMs, not half of 132."""
    from types import SimpleNamespace

    import flash_attn_sm120.device as device

    case = AttnCase("bfloat16", 96, 96, backward=True, deterministic=True)
    problem = AttnProblem((80 * 64,), (80 * 128,))
    assert testing.routing_num_sms(None) == 132 and testing.routing_num_sms(188) == 188
    assert testing.deterministic_order(case, problem) == "fixed"  # 80 > 132 / 2
    assert testing.deterministic_order(case, problem, num_sms=188) == "rotated"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(device, "device_info", lambda *a, **k: SimpleNamespace(num_sms=188))
    assert testing.routing_num_sms(None) == 188
    assert testing.deterministic_order(case, problem) == "rotated"
    assert testing.bwd_routing(case, problem)[3]["turns"]
