"""Learnable sinks on a CPU: the exact post-kernel arithmetic (sinks.py) against a reference that
appends the sink as a softmax column, as upstream's reference does; forward, LSE and dsink.

fp64 throughout, so the checks are tight: they test the algebra, and the GPU tests
(tests/test_sinks_gpu.py) test the kernels with it.
"""

from __future__ import annotations

import pytest
import torch

from flash_attn_sm120 import sinks
from flash_attn_sm120.testing import attention_ref

F64 = dict(dtype=torch.float64)


def _qkv(b=2, sq=9, sk=13, h=4, hk=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, **F64) for s in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d))]


@pytest.mark.parametrize("causal,window", [(False, (None, None)), (True, (None, None)), (False, (2, -4))])
def test_apply_sink_equals_the_sink_column_reference(causal, window):
    """(None... (2, -4)) leaves rows with no key at all: there O' = 0 and LSE' = sink, as upstream."""
    q, k, v = _qkv()
    sink = torch.tensor([0.5, -2.0, 3.0, 0.0], **F64)
    out, lse = attention_ref(q, k, v, causal=causal, window=window)
    got_out, got_lse = sinks.apply_sink(out.clone(), lse, sink)
    ref_out, ref_lse = attention_ref(q, k, v, causal=causal, window=window, learnable_sink=sink)
    torch.testing.assert_close(got_out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_lse, ref_lse, rtol=1e-12, atol=1e-12)
    if window == (2, -4):
        empty = torch.isinf(lse)
        assert empty.any()
        assert torch.equal(got_lse[empty], sink[None, :, None].expand_as(lse)[empty])
        assert (got_out.transpose(1, 2)[empty] == 0).all()


def test_apply_sink_varlen_layout():
    q, k, v = _qkv(b=1, sq=11, sk=11)
    sink = torch.tensor([1.0, -1.0, 0.25, 2.0], **F64)
    out, lse = attention_ref(q, k, v, causal=True)
    # varlen: out (total, h, d), lse (h, total)
    got_out, got_lse = sinks.apply_sink(out[0].clone(), lse[0], sink)
    ref_out, ref_lse = attention_ref(q, k, v, causal=True, learnable_sink=sink)
    torch.testing.assert_close(got_out, ref_out[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_lse, ref_lse[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("with_dlse", [False, True])
def test_sink_grad_equals_autograd_of_the_reference(with_dlse):
    q, k, v = _qkv(seed=3)
    sink = torch.tensor([0.5, -2.0, 3.0, 0.0], **F64, requires_grad=True)
    out, lse = attention_ref(q, k, v, causal=True, window=(3, None), learnable_sink=sink)
    g = torch.Generator().manual_seed(7)
    dout = torch.randn(out.shape, generator=g, **F64)
    dlse = torch.randn(lse.shape, generator=g, **F64) if with_dlse else None
    loss = (out * dout).sum() + ((lse * dlse).sum() if with_dlse else 0.0)
    (want,) = torch.autograd.grad(loss, sink)
    got = sinks.sink_grad(out.detach(), dout, lse.detach(), dlse, sink.detach())
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_sink_grad_skips_rows_outside_the_sequences():
    """Varlen with seqused_q: rows past a sequence's used length (garbage in the kernels' output) do not count."""
    h, total = 2, 10
    cu = torch.tensor([0, 4, 10])
    seqused = torch.tensor([3, 6])
    rows = sinks.valid_rows(torch.zeros(h, total), cu, seqused)
    assert rows.tolist() == [[True, True, True, False, True, True, True, True, True, True]]
    out, dout = torch.randn(total, h, 4, **F64), torch.randn(total, h, 4, **F64)
    lse, sink = torch.randn(h, total, **F64), torch.randn(h, **F64)
    poisoned = out.clone()
    poisoned[3] = float("nan")
    got = sinks.sink_grad(poisoned, dout, lse, None, sink, rows)
    keep = rows[0]
    want = sinks.sink_grad(out[keep], dout[keep], lse[:, keep], None, sink)
    torch.testing.assert_close(got, want)
    # dense (b, h, s) LSE with seqused_q
    rows = sinks.valid_rows(torch.zeros(2, h, 5), None, torch.tensor([5, 2]))
    assert rows.shape == (2, 1, 5) and rows[1, 0].tolist() == [True, True, False, False, False]
    assert sinks.valid_rows(torch.zeros(2, h, 5)) is None


def test_sink_dtype_is_kept():
    out, dout = torch.randn(1, 3, 2, 4), torch.randn(1, 3, 2, 4)
    lse, sink = torch.randn(1, 2, 3), torch.randn(2, dtype=torch.bfloat16)
    assert sinks.sink_grad(out, dout, lse, None, sink).dtype == torch.bfloat16


def test_a_minus_inf_sink_is_no_sink_and_keeps_empty_rows_empty():
    """sink = -inf switches a head's sink off: upstream gives the sink-free result, O = 0 and LSE = -inf on a
    row with no key; the gradient of that sink is 0, never NaN."""
    q, k, v = _qkv()
    sink = torch.tensor([float("-inf"), 0.5, float("-inf"), 1.0], **F64)
    out, lse = attention_ref(q, k, v, window=(2, -4))
    got_out, got_lse = sinks.apply_sink(out.clone(), lse, sink)
    assert got_out.isfinite().all() and not got_lse.isnan().any()
    off = [0, 2]
    torch.testing.assert_close(got_out[:, :, off], out[:, :, off])
    assert torch.equal(got_lse[:, off], lse[:, off])
    dsink = sinks.sink_grad(got_out, torch.randn_like(got_out), got_lse, None, sink)
    assert dsink.isfinite().all() and (dsink[off] == 0).all()


def test_rowsum_in_slices_equals_the_whole():
    out, dout = torch.randn(7, 5, 3, 4, **F64), torch.randn(7, 5, 3, 4, **F64)
    whole = (dout * out).sum(-1)
    torch.testing.assert_close(sinks._rowsum(dout, out, torch.float64, chunk_elems=24), whole)
    torch.testing.assert_close(sinks._rowsum(dout, out, torch.float64), whole)


# ---- the fold in the kernels (kernels/sink_fold.py), on sm_120a ----------------------------------------

def _table_config(d: int, causal: bool):
    from flash_attn_sm120.config import load_fwd_table, select_fwd_config

    return select_fwd_config(load_fwd_table(), d, d, causal, False)


@pytest.mark.parametrize("family", ["cpasync", "tma", "splitkv"])
def test_sink_fold_compiles_for_sm120a_without_spills_and_loads_the_sink(family):
    """Each forward family with a sink: spill-free on sm_120a, and it reads the sink (one more global
    load) and folds it (more MUFU ex2/lg2) compared with the same kernel without one."""
    from flash_attn_sm120 import codegen
    from flash_attn_sm120.config import FwdConfig

    def compile_(sink: bool):
        if family == "splitkv":
            return codegen.compile_splitkv_cubin(FwdConfig(128, 64, 64, 1), 128, learnable_sink=sink)[0]
        cfg = _table_config(64 if family == "cpasync" else 128, causal=family == "tma")
        assert cfg.family == family, cfg
        return codegen.compile_fwd_cubin(cfg, 64 if family == "cpasync" else 128, causal=family == "tma",
                                         learnable_sink=sink)[0]

    plain, sinked = (codegen.inspect_cubin(compile_(s)) for s in (False, True))
    res, hist, _ = sinked
    assert res["stack"] == 0 and hist.get("LDL", 0) == 0 and hist.get("STL", 0) == 0, res
    assert hist.get("LDG", 0) > plain[1].get("LDG", 0)
    assert hist.get("MUFU", 0) > plain[1].get("MUFU", 0)
