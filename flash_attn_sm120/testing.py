"""Correctness harness: inputs in every storage layout, fp32 references, upstream's tolerance rule.

Shared by the GPU fuzz suite (tests/test_fuzz_gpu.py) and scripts/sanitize.py; pure torch, so the
harness itself is checked on a CPU (tests/test_fuzz_harness.py).

The problems and their inputs (`AttnCase`, `AttnProblem`, `make_inputs`: every storage layout, NaN
wherever a correct kernel must not read) live in testing_inputs.py and are re-exported here.

Checks (`check_forward`, `check_backward`) work per sequence on the valid rows only: every value
finite; out, dq, dk, dv within upstream's rule (flash_attn/cute/testing.py `check_tensor_vs_ref`):
    max|actual - ref| <= rtol * max|pt - ref| + atol,  atol = 2 * max|ref + 0.3 - 0.3 - ref| (in dtype)
with ref the fp32 result and pt PyTorch's own result in the input precision (rtol 2, 3 with
softcap); for gradients max|pt - ref| is the larger of that and of FlashAttention's backward algorithm
in the input precision (testing_ref.fa_backward_ref). LSE: -inf exactly where the reference row is
empty, elsewhere the same rule (+1e-3). A deterministic case (`AttnCase.deterministic`, the public API's
deterministic=True) runs the backward twice on the same forward and output gradient: the two dq, dk, dv
must be equal bit for bit on the valid rows (torch.equal), and the first within the rule above.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from flash_attn_sm120.testing_inputs import (  # noqa: F401  (re-exported: the tests' and fuzz registry's names)
    K_LAYOUTS,
    LSE_ATOL,
    MASKS,
    Q_LAYOUTS,
    AttnCase,
    AttnProblem,
    Inputs,
    Layout,
    make_inputs,
    paginate,
)


def _nan_out(inputs: Inputs, case: AttnCase, device) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """NaN output buffer and its gap: for dense q with padding, a strided view whose rows are
    followed by NaN rows that the kernel must not touch."""
    shape = inputs.out_shape(case.head_dim_v)
    if inputs.out_pad_rows:
        b, s = shape[:2]
        buf = torch.full((b, s + inputs.out_pad_rows, *shape[2:]), float("nan"), dtype=case.torch_dtype, device=device)
        return buf[:, :s], buf[:, s:]
    return torch.full(shape, float("nan"), dtype=case.torch_dtype, device=device), None


def forward_via_driver(inputs: Inputs, case: AttnCase, problem: AttnProblem, config, emulate_host_smem):
    """driver.forward with NaN-poisoned out and lse buffers and the given (forced) config."""
    from flash_attn_sm120 import driver

    if case.k_layout == "paged" or problem.num_splits != 1:
        raise ValueError("paged K/V and num_splits go through the public API (driver.forward has no such inputs)")
    device = inputs.q.device
    out, inputs.out_gap = _nan_out(inputs, case, device)
    lse = torch.full(inputs.lse_shape(), float("nan"), dtype=torch.float32, device=device) if case.return_lse else None
    left, right = problem.window(case)
    ix = inputs.index
    out_ret, lse_ret = driver.forward(
        inputs.q, inputs.k, inputs.v,
        softmax_scale=problem.softmax_scale, causal=case.causal, window_size_left=left, window_size_right=right,
        softcap=case.softcap, pack_gqa=case.pack_gqa, need_lse=case.return_lse, emulate_host_smem=emulate_host_smem,
        cu_seqlens_q=ix.get("cu_seqlens_q"), cu_seqlens_k=ix.get("cu_seqlens_k"),
        seqused_q=ix.get("seqused_q"), seqused_k=ix.get("seqused_k"), out=out, lse=lse, config=config,
    )
    assert out_ret is out and lse_ret is lse, "driver.forward must return the buffers it was given"
    return out, lse


# modules whose forward() allocates the API's outputs when not given out= / lse=
OUTPUT_ALLOCATORS = ("flash_attn_sm120.driver", "flash_attn_sm120.driver_splitkv")


@contextlib.contextmanager
def poisoned_outputs():
    """Within: every out/lse that a driver's forward allocates itself, and every dq/dk/dv of the
    backward driver, starts as NaN.

    The public API lets the drivers allocate (torch.empty), whose stale contents may look right;
    wrapping the module attributes the interface calls makes an unwritten element fail for sure.
    """
    import importlib

    patched = []
    for name in OUTPUT_ALLOCATORS:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        original = module.forward

        def forward(q, k, v, *, need_lse, out=None, lse=None, _original=original, **kw):
            varlen_q = kw.get("cu_seqlens_q") is not None
            if out is None:
                rows = (q.shape[0],) if varlen_q else tuple(q.shape[:2])
                out = torch.full((*rows, q.shape[-2], v.shape[-1]), float("nan"), dtype=q.dtype, device=q.device)
            if lse is None and need_lse:
                shape = (q.shape[-2], q.shape[0]) if varlen_q else (q.shape[0], q.shape[2], q.shape[1])
                lse = torch.full(shape, float("nan"), dtype=torch.float32, device=q.device)
            return _original(q, k, v, need_lse=need_lse, out=out, lse=lse, **kw)

        module.forward = forward
        patched.append((module, original))
    from flash_attn_sm120 import driver_bwd

    original_bwd = driver_bwd.backward

    def backward(q, k, v, *args, dq=None, dk=None, dv=None, **kw):
        dq, dk, dv = (torch.full_like(x, float("nan")) if g is None else g for g, x in ((dq, q), (dk, k), (dv, v)))
        return original_bwd(q, k, v, *args, dq=dq, dk=dk, dv=dv, **kw)

    driver_bwd.backward = backward
    try:
        yield
    finally:
        driver_bwd.backward = original_bwd
        for module, original in patched:
            module.forward = original


def api_kwargs(inputs: Inputs, case: AttnCase, problem: AttnProblem) -> dict:
    kw = dict(
        softmax_scale=problem.softmax_scale, causal=case.causal, window_size=problem.window(case),
        softcap=case.softcap, pack_gqa=case.pack_gqa, return_lse=case.return_lse,
    )
    if problem.num_splits != 1:
        kw["num_splits"] = problem.num_splits
    if case.sink:
        kw["learnable_sink"] = inputs.sink
    if case.mods:
        from flash_attn_sm120 import testing_mods

        kw.update(testing_mods.api_kwargs(case.mods, inputs.aux))
    if case.block_sparse:
        from flash_attn_sm120 import testing_sparse

        if case.q_layout == "packed":  # upstream's varlen lists, from each sequence's part of the map
            kw.update(testing_sparse.case_varlen_lists(case.block_sparse, inputs.sparse_kinds, problem.seqlens_q,
                                                       problem.seqlens_k, case.backward))
        else:
            kw.update(testing_sparse.case_lists(case.block_sparse, inputs.sparse_kinds, case.backward))
    if case.deterministic:  # only then: forward-only callers pass these to upstream's _flash_attn_fwd as well
        kw["deterministic"] = True
    if not case.is_dense:
        kw.update(inputs.index)
    return kw


def forward_via_api(inputs: Inputs, case: AttnCase, problem: AttnProblem):
    """flash_attn_func / flash_attn_varlen_func (whatever the current device mode dispatches to)."""
    from flash_attn_sm120 import flash_attn_func, flash_attn_varlen_func

    fn = flash_attn_func if case.is_dense else flash_attn_varlen_func
    with poisoned_outputs():
        return fn(inputs.q, inputs.k, inputs.v, **api_kwargs(inputs, case, problem))


# ------------------------------------------------------------------------------------------------
# References (testing_ref.py)
# ------------------------------------------------------------------------------------------------

from flash_attn_sm120.testing_ref import (  # noqa: E402,F401  (re-exported: the checks' references)
    _empty_result,
    _loss,
    _mod_twins,
    attention_mask,
    attention_ref,
    fa_backward_ref,
    reference_backward,
    reference_forward,
)

REEXPORTED = (_empty_result, _mod_twins, attention_mask, attention_ref, fa_backward_ref)  # what tests reach here


# ------------------------------------------------------------------------------------------------
# Checks
# ------------------------------------------------------------------------------------------------


class CheckFailure(AssertionError):
    pass


def _where(t: torch.Tensor, flat_index: int) -> str:
    idx = []
    for size in reversed(t.shape):
        idx.append(flat_index % size)
        flat_index //= size
    return str(tuple(reversed(idx)))


def rule_tolerance(ref: torch.Tensor, pt, dtype: torch.dtype, rtol: float, extra_atol: float = 0.0):
    """(tolerance, pt error, atol) of upstream's rule for fp32 `ref` and low-precision `pt`; pt may be a
    tuple of input-precision results (the backward's two, see check_backward): the largest error counts."""
    ref_lp = ref.to(dtype)
    atol = 2 * (ref_lp + 0.3 - 0.3 - ref_lp).abs().max().item() + extra_atol if ref.numel() else extra_atol
    pts = pt if isinstance(pt, (tuple, list)) else (pt,)
    pt_err = max((p.float() - ref).abs().max().item() for p in pts) if ref.numel() else 0.0
    return rtol * pt_err + atol, pt_err, atol


def assert_close_to_ref(name: str, actual: torch.Tensor, ref: torch.Tensor, pt, dtype: torch.dtype,
                        rtol: float = 2.0, extra_atol: float = 0.0) -> dict:
    """Upstream's check_tensor_vs_ref on valid rows, NaN-aware; returns the measured errors."""
    if actual.shape != ref.shape:
        raise CheckFailure(f"{name}: shape {tuple(actual.shape)} != reference {tuple(ref.shape)}")
    bad = ~torch.isfinite(actual)
    if bool(bad.any()):
        first = int(bad.flatten().nonzero()[0])
        raise CheckFailure(
            f"{name}: {int(bad.sum())} of {actual.numel()} valid elements are not finite (first at row/head/col"
            f" {_where(actual, first)}): unwritten (NaN-poisoned) output or an out-of-bounds read of NaN padding"
        )
    if actual.numel() == 0:
        return {"err": 0.0, "tol": 0.0}
    diff = (actual.float() - ref).abs()
    err = diff.max().item()
    tol, pt_err, atol = rule_tolerance(ref, pt, dtype, rtol, extra_atol)
    if not err <= tol:
        worst = int(diff.flatten().argmax())
        raise CheckFailure(
            f"{name}: max error {err:.3e} at {_where(actual, worst)} > {rtol:g} x the input precision's {pt_err:.3e}"
            f" + atol {atol:.2e} (actual {actual.flatten()[worst].item():.4f},"
            f" reference {ref.flatten()[worst].item():.4f})"
        )
    return {"err": err, "tol": tol}


def assert_lse_close(actual: torch.Tensor, ref: torch.Tensor, pt: torch.Tensor, rtol: float, extra_atol: float) -> dict:
    """LSE (rows, h): -inf exactly where the reference is, elsewhere upstream's rule + LSE_ATOL."""
    if actual.shape != ref.shape:
        raise CheckFailure(f"lse: shape {tuple(actual.shape)} != reference {tuple(ref.shape)}")
    if bool(torch.isnan(actual).any()):
        raise CheckFailure(f"lse: {int(torch.isnan(actual).sum())} NaN values (unwritten or NaN read)")
    ref_empty = torch.isneginf(ref)
    if not torch.equal(torch.isneginf(actual), ref_empty):
        where = (torch.isneginf(actual) != ref_empty).nonzero()[0].tolist()
        raise CheckFailure(
            f"lse: -inf pattern differs from the reference (empty rows) at row/head {where}:"
            f" actual {actual[tuple(where)].item()}, reference {ref[tuple(where)].item()}"
        )
    keep = ~ref_empty
    if not bool(keep.any()):
        return {"err": 0.0, "tol": 0.0}
    a, r, p = actual[keep], ref[keep], pt[keep]
    err = (a - r).abs().max().item()
    pt_err = (p - r).abs().max().item()
    tol = rtol * pt_err + LSE_ATOL + extra_atol
    if not err <= tol:
        raise CheckFailure(f"lse: max error {err:.3e} > {rtol:g} x PyTorch's {pt_err:.3e} + {LSE_ATOL + extra_atol:.1e}")
    return {"err": err, "tol": tol}


def _rtol(case: AttnCase) -> float:
    return 3.0 if case.softcap else 2.0


def check_forward(inputs: Inputs, case: AttnCase, problem: AttnProblem, out: torch.Tensor,
                  lse: Optional[torch.Tensor]) -> dict:
    """Check a forward result against the fp32 and low-precision references; returns error stats."""
    expect_out = inputs.out_shape(case.head_dim_v)
    if tuple(out.shape) != expect_out or out.dtype != case.torch_dtype:
        raise CheckFailure(f"out: shape/dtype {tuple(out.shape)}/{out.dtype}, expected {expect_out}/{case.torch_dtype}")
    if inputs.out_gap is not None and not bool(torch.isnan(inputs.out_gap).all()):
        raise CheckFailure("out: the kernel wrote into the gap between the rows of a strided out buffer")
    refs, ref_lses = reference_forward(inputs, case, problem, upcast=True)
    pts, pt_lses = reference_forward(inputs, case, problem, upcast=False)
    cat = lambda parts: torch.cat([p[0] for p in parts]) if parts else None  # noqa: E731
    stats = {"out": assert_close_to_ref("out", inputs.q_layout.rows(out), cat(refs), cat(pts), case.torch_dtype,
                                        _rtol(case))}
    if case.return_lse:
        if lse is None:
            raise CheckFailure("lse: requested (return_lse=True) but None was returned")
        if tuple(lse.shape) != inputs.lse_shape() or lse.dtype != torch.float32:
            raise CheckFailure(f"lse: shape/dtype {tuple(lse.shape)}/{lse.dtype}, expected {inputs.lse_shape()}/float32")
        to_rows = lambda parts: torch.cat([p[0].transpose(0, 1) for p in parts])  # noqa: E731
        stats["lse"] = assert_lse_close(inputs.q_layout.lse_rows(lse), to_rows(ref_lses), to_rows(pt_lses),
                                        _rtol(case), case.softcap * 1e-3)
    return stats


def run_backward(inputs: Inputs, case: AttnCase, problem: AttnProblem, seed: int = 1):
    """Public API forward + autograd backward, and the references (`reference_backward`: "ref", "pt",
    "fa", the last with D from the API's own output); returns a dict of tensors.

    The loss is sum(out * g) (+ sum(lse * g_lse) with return_lse) over valid rows only. A deterministic
    case differentiates it twice (the graph retained): "again" holds the second run's gradients.
    """
    gen = torch.Generator(device=inputs.q.device).manual_seed(seed)
    out, lse = forward_via_api(inputs, case, problem)
    nq = range(problem.batch)
    g_out = [torch.randn(inputs.q_layout.seq(out, i).shape, generator=gen, device=out.device) for i in nq]
    g_lse = None
    if case.return_lse:
        g_lse = [torch.randn(inputs.q_layout.lse_seq(lse, i).shape, generator=gen, device=out.device) for i in nq]
    outs = [inputs.q_layout.seq(out, i) for i in nq]
    lses = [inputs.q_layout.lse_seq(lse, i) for i in nq] if case.return_lse else None
    wrt = (inputs.q, inputs.k, inputs.v) + ((inputs.sink,) if case.sink else ())
    loss = _loss(outs, lses, g_out, g_lse)
    again = None
    with poisoned_outputs():  # the backward driver's dq/dk/dv start as NaN (both runs: fresh buffers)
        grads = torch.autograd.grad(loss, wrt, retain_graph=case.deterministic)
        if case.deterministic:  # same forward, same output gradient: only the backward runs again
            again = torch.autograd.grad(loss, wrt)

    results = {"actual": grads, "again": again, "out": out.detach(), "lse": None if lse is None else lse.detach()}
    return results | reference_backward(inputs, case, problem, wrt, g_out, g_lse, out=results["out"])


def check_backward(inputs: Inputs, case: AttnCase, problem: AttnProblem) -> dict:
    """Forward result, then dq, dk, dv (and dsink) of the public API's autograd vs fp32 autograd of
    `attention_ref` (valid rows), every case: the rule's input-precision error is the larger of autograd
    of `attention_ref(upcast=False)` and `fa_backward_ref` (FlashAttention's own backward in the inputs'
    precision, D from the API's own rounded O), so the bound loosens only where the algorithm's rounding needs it."""
    if case.k_layout == "paged":
        raise ValueError("backward through paged K/V is not part of the API")
    res = run_backward(inputs, case, problem)
    stats = check_forward(inputs, case, problem, res["out"], res["lse"])
    extra = 3e-4 if case.softcap else 0.0
    for j, (name, leaf) in enumerate(zip(("dq", "dk", "dv"), (inputs.q, inputs.k, inputs.v))):
        layout = inputs.q_layout if name == "dq" else inputs.k_layout
        actual = res["actual"][j]
        if actual is None or actual.shape != leaf.shape or actual.dtype != leaf.dtype:
            got = None if actual is None else (tuple(actual.shape), actual.dtype)
            raise CheckFailure(f"{name}: gradient {got}, expected {(tuple(leaf.shape), leaf.dtype)}")
        ref, pt = (g if g is not None else torch.zeros_like(leaf) for g in (res["ref"][j], res["pt"][j]))
        pts = (layout.rows(pt), layout.rows(res["fa"][j]))
        stats[name] = assert_close_to_ref(name, layout.rows(actual), layout.rows(ref).float(), pts,
                                          case.torch_dtype, _rtol(case), extra)
    if case.sink:  # a sum over every row: the rule with the input precision's atol, plus 1e-2
        actual, ref, pt = res["actual"][3], res["ref"][3], res["pt"][3]
        if actual is None or actual.shape != inputs.sink.shape or actual.dtype != inputs.sink.dtype:
            raise CheckFailure(f"dsink: gradient {None if actual is None else tuple(actual.shape)}, expected "
                               f"{tuple(inputs.sink.shape)} {inputs.sink.dtype}")
        stats["dsink"] = assert_close_to_ref("dsink", actual, ref.float(), (pt, res["fa"][3]), case.torch_dtype,
                                             _rtol(case), 1e-2)
    if case.deterministic:
        stats["bitwise"] = assert_bitwise_equal(inputs, res["actual"], res["again"])
    return stats


def assert_bitwise_equal(inputs: Inputs, first, second) -> dict:
    """dq, dk, dv of two backward runs equal bit for bit on the valid rows (deterministic=True)."""
    if second is None:
        raise CheckFailure("deterministic: the backward ran once; two runs are compared")
    for j, name in enumerate(("dq", "dk", "dv")):
        layout = inputs.q_layout if name == "dq" else inputs.k_layout
        a, b = layout.rows(first[j]), layout.rows(second[j])
        if not torch.equal(a, b):
            differ = a.ne(b)  # NaN counts as a difference
            first_at = int(differ.flatten().nonzero()[0]) if bool(differ.any()) else 0
            worst = (a.float() - b.float()).abs().nan_to_num(float("inf")).max().item() if a.numel() else 0.0
            raise CheckFailure(
                f"{name}: deterministic=True, but two backward runs of the same forward differ in {int(differ.sum())}"
                f" of {a.numel()} valid elements (first at row/head/col {_where(a, first_at)}, max |diff| {worst:.3e})"
            )
    return {"err": 0.0, "tol": 0.0, "runs": 2}


def host_seqlens(case: AttnCase, problem: AttnProblem) -> tuple[int, int]:
    """(seqlen_q, seqlen_k) as the backward driver bounds them on the host: the longest sequence, plus the
    padding of a padded layout (a dense tensor's width)."""
    width = lambda kind, lens, pad: max(lens, default=0) + (pad if kind != "packed" else 0)  # noqa: E731
    return (width(case.q_layout, problem.seqlens_q, problem.pad_q if case.q_layout == "padded" else 0),
            width(case.k_layout, problem.seqlens_k, problem.pad_k if case.k_layout == "padded" else 0))


def routing_num_sms(num_sms: Optional[int] = None) -> int:
    """num_sms, else what the backward driver reads (device_info's count of the current CUDA device), else
    132 (an H100's or H200's: the emulation hosts) where no CUDA device is present."""
    if num_sms is not None:
        return num_sms
    if not torch.cuda.is_available():
        return 132
    from flash_attn_sm120.device import device_info

    return device_info().num_sms


def bwd_routing(case: AttnCase, problem: Optional[AttnProblem] = None,
                num_sms: Optional[int] = None) -> tuple[bool, bool, bool, dict]:
    """(causal, local, user score_mod, config_bwd.entry_kinds) of a backward case as the driver resolves
    them: upstream's window resolution (a mask_mod replaces the mask flags; right 0 without a left side
    is causal) with the problem's window, else the case's own flags; a MODS entry is a user modifier.
    A dense deterministic case without a mask takes its key's rotated turns entry where the problem's
    lengths fit it on num_sms SMs (config_bwd.rotated_turns_config; default routing_num_sms: the driver's
    count); without a problem, never."""
    from flash_attn.cute.interface import _resolve_causal_local_window

    from flash_attn_sm120 import bwd_plans
    from flash_attn_sm120.config_bwd import entry_kinds, load_bwd_table, rotated_turns_config

    mask_mod, user_score_mod = None, False
    if case.mods:
        from flash_attn_sm120 import testing_mods

        spec = testing_mods.spec(case.mods)
        mask_mod = spec.mask_mod
        user_score_mod = spec.score_mod is not None or spec.score_mod_bwd is not None
    if problem is not None:
        causal, local, _, _ = _resolve_causal_local_window(case.causal, *problem.window(case), mask_mod)
    else:
        causal, local = case.causal and mask_mod is None, case.local and mask_mod is None
    layouts = (case.q_layout, case.k_layout)
    rotated = (rotated_turns_config(load_bwd_table(), case.head_dim, case.head_dim_v) if problem is not None
               and case.deterministic and case.is_dense and not (causal or local) else None)
    kinds = entry_kinds(deterministic=case.deterministic, causal=causal, local=local,
                        qhead_per_kvhead=case.qhead_per_kvhead, packed="packed" in layouts,
                        seqused=case.q_layout == "padded" or case.k_layout in ("padded", "paged"),
                        block_sparse=bool(case.block_sparse), score_mod=bool(case.softcap),
                        user_mods=bool(case.mods),
                        fixed_point=case.deterministic and bwd_plans.fixed_point_allowed(user_score_mod),
                        plan_forced=bwd_plans.plan_forced(),
                        rotated_entry=rotated is not None and bwd_plans.rotated_entry_fits(
                            rotated, *host_seqlens(case, problem), routing_num_sms(num_sms)))
    return causal, local, user_score_mod, kinds


def deterministic_order(case: AttnCase, problem: AttnProblem, num_sms: Optional[int] = None) -> str:
    """The dQ ordering driver_bwd.deterministic_plan picks for a problem (the backward table's config, nothing
    forced): "fixed" (64-bit fixed-point adds, no order: every call but a dense causal one or one a "none" key's
    rotated turns entry serves, without a user score_mod), else turns: "rotated", "descending" (with
    "+reversed" for the shortest-first launch) or "ascending"; "lists" for block-sparse lists with a score_mod (turns from the lists:
    driver_bwd.SPARSE_DETERMINISTIC_PLAN).
    num_sms: the GPU's (default routing_num_sms: the driver's count, 132 without CUDA; a head's n_blocks are
    resident when they number at most that)."""
    from flash_attn_sm120 import bwd_plans, driver_bwd
    from flash_attn_sm120.config_bwd import load_bwd_table, select_bwd_config

    num_sms = routing_num_sms(num_sms)
    causal, local, user_score_mod, kinds = bwd_routing(case, problem, num_sms)
    fixed_point = driver_bwd.fixed_point_allowed(user_score_mod)
    if case.block_sparse:
        return "fixed" if fixed_point else "lists"
    if not bwd_plans.dq_takes_turns(fixed_point, causal, local, case.is_dense, kinds["turns"]):
        return "fixed"
    cfg = select_bwd_config(load_bwd_table(), case.head_dim, case.head_dim_v, causal, local, **kinds)
    seqlen_q, seqlen_k = host_seqlens(case, problem)
    index = (case.q_layout == "packed" or None, case.k_layout == "packed" or None,
             case.q_layout == "padded" or None, case.k_layout in ("padded", "paged") or None)
    plan = driver_bwd.deterministic_plan(num_sms, cfg, causal, seqlen_q, seqlen_k, index_tensors=index,
                                         fixed_point=fixed_point, local=local, rotated_entry=kinds["turns"])
    if plan["dq_rotated"]:
        return "rotated"
    if plan["dq_descending"]:
        return "descending" + ("+reversed" if plan["reverse_n_blocks"] else "")
    return "ascending"


# ------------------------------------------------------------------------------------------------
# One case end to end (the fuzz suite's example, the sanitizer's case, a replay)
# ------------------------------------------------------------------------------------------------


def run_case(path, api: str, case: AttnCase, problem: AttnProblem, device="cuda") -> dict:
    """Run one problem on one kernel path and check it; returns the error stats, raises CheckFailure.

    path: a paths.KernelPath or its name; api: "driver" (driver.forward with NaN out/lse and the
    path's config) or "public" (flash_attn_func / varlen under the path's force()). Backward cases
    (case.backward; with case.deterministic, deterministic=True and two runs compared bit for bit) and sink
    cases (case.sink) always use the public API. A failing fuzz example prints this call for replay:

        FLASH_ATTN_SM120_EMULATE=1 python -c "from flash_attn_sm120.testing import *; print(run_case(...))"
    """
    from flash_attn_sm120.device import device_info
    from flash_attn_sm120.paths import get_path

    path = get_path(path) if isinstance(path, str) else path
    d, dv = case.head_dim, case.head_dim_v
    if case.backward:
        inputs = make_inputs(case, problem, device, requires_grad=True)
        with path.force(d, dv):
            return check_backward(inputs, case, problem)
    inputs = make_inputs(case, problem, device)
    if (case.sink or case.mods or case.block_sparse) and api == "driver":
        api = "public"  # sinks, modifiers and block lists are drawn through the public API
    if api == "driver":
        emulate = device_info(inputs.q.device).emulate_host_smem
        out, lse = forward_via_driver(inputs, case, problem, path.config_for(d, dv), emulate)
    elif api == "public":
        with path.force(d, dv), torch.no_grad():
            out, lse = forward_via_api(inputs, case, problem)
    else:
        raise ValueError(f"api must be 'driver' or 'public', got {api!r}")
    if inputs.q.is_cuda:
        torch.cuda.synchronize()
    return check_forward(inputs, case, problem, out, lse)

