"""The backward part of the harness (`prepare.py --set bwd`): candidates against references, one process.

Each problem's forward (out, LSE) is computed once with the shipped forward; then every
implementation's backward alone is timed on the same q, k, v, out, dO, LSE:

  * candidates: this package's backward (driver_bwd.backward: upstream's preprocess, the main kernel
    of a BwdConfig, upstream's postprocess), with the table's config or a given one;
  * `upstream_sm120`: upstream's SM120 backward kernel class with upstream's own SM120 config
    (kernels.bwd_sm120.upstream_bwd_config), through the same driver, padded and occupancy-checked
    the same way in emulation;
  * `sdpa_*`: PyTorch SDPA backends' backward (autograd of their forward, the backward kernels timed);
  * `fa4_native_not_sm120`: the host GPU's own FA4 backward (never an SM120 number).

Before timing, each implementation's dq/dk/dv (poisoned with NaN before the call where the
implementation takes buffers) are checked against fp32 autograd with upstream's rule: within 2x the
error of the same reference in the inputs' precision, plus an atol. A wrong candidate is `incorrect`.
"""

from __future__ import annotations

import contextlib

from dataclasses import dataclass
from typing import Callable, Optional

from flash_attn_sm120 import bench, progress
from flash_attn_sm120.bench import Problem

GRAD_ATOL = 1e-3


@dataclass
class BwdImpl:
    name: str
    run: Callable  # run(p, x, poisoned: bool) -> (dq, dk, dv)
    kind: str = "candidate"
    supports: Callable[[Problem], bool] = lambda p: True


def forward_state(p: Problem, info, seed: int = 0, score_mod=None) -> dict:
    """Inputs, the shipped forward's out and LSE (with `score_mod`, the modifier the backward will get), and a
    random dO for one problem."""
    import torch

    from flash_attn_sm120 import driver

    x = bench.make_inputs(p, seed=seed)
    out, lse = driver.forward(x["q"], x["k"], x["v"], softmax_scale=None, causal=p.causal,
                              window_size_left=p.window[0], window_size_right=p.window[1], softcap=None,
                              pack_gqa=None, need_lse=True, emulate_host_smem=info.emulate_host_smem,
                              score_mod=score_mod, **_varlen_args(x, with_max=False))
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    x.update(out=out, lse=lse, dout=torch.randn(out.shape, generator=g, device="cuda").to(out.dtype))
    return x


def _varlen_args(x: dict, with_max: bool = True) -> dict:
    """A varlen problem's cu_seqlens (and max_seqlen) arguments from its inputs; {} for a dense one."""
    names = ("cu_seqlens_q", "cu_seqlens_k") + (("max_seqlen_q", "max_seqlen_k") if with_max else ())
    return {n: x[n] for n in names if n in x}


def sm120_bwd_impl(name: str, config_for: Callable[[Problem], object], info, kind: str = "candidate",
                   deterministic: bool = False) -> BwdImpl:
    """This package's backward driver with config_for(problem) (None: the table's choice)."""
    import torch

    from flash_attn_sm120 import driver_bwd

    def run(p, x, poisoned):
        grads = [torch.full_like(x[n], float("nan")) if poisoned else None for n in ("q", "k", "v")]
        return driver_bwd.backward(
            x["q"], x["k"], x["v"], x["out"], x["dout"], x["lse"], softmax_scale=None, causal=p.causal,
            window_size_left=p.window[0], window_size_right=p.window[1], emulate_host_smem=info.emulate_host_smem,
            config=config_for(p), deterministic=deterministic, dq=grads[0], dk=grads[1], dv=grads[2],
            **_varlen_args(x))

    return BwdImpl(name, run, kind)


def _autograd_impl(name: str, forward: Callable, supports) -> BwdImpl:
    """A reference whose backward is autograd of its own forward: the graph is built once per input
    set, and `run` times torch.autograd.grad through it (the backward kernels only)."""
    import torch

    graphs: dict = {}

    def run(p, x, poisoned):
        key = id(x["q"])
        if key not in graphs:
            leaves = [x[n].detach().requires_grad_(True) for n in ("q", "k", "v")]
            graphs.clear()
            graphs[key] = (leaves, forward(p, *leaves))
        leaves, out = graphs[key]
        return torch.autograd.grad(out, leaves, x["dout"], retain_graph=True)

    return BwdImpl(name, run, "reference", supports)


def reference_bwd_impls(info) -> list[BwdImpl]:
    import torch

    from flash_attn_sm120.kernels.bwd_tiling import upstream_bwd_config

    refs = [sm120_bwd_impl("upstream_sm120", lambda p: upstream_bwd_config(max(p.head_dim, p.dv)), info, "reference")]
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        sdpa_kernel = None
    if sdpa_kernel is not None:
        for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
            def fwd(p, q, k, v, _backend=backend):
                with sdpa_kernel(_backend):
                    o = torch.nn.functional.scaled_dot_product_attention(
                        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=p.causal,
                        enable_gqa=p.nheads != p.nheads_kv)
                return o.transpose(1, 2)
            refs.append(_autograd_impl(name, fwd, lambda p: not p.is_varlen and p.window == (None, None)))
    if info.capability[0] != 12:
        import flash_attn.cute as fa4

        refs.append(_autograd_impl("fa4_native_not_sm120", lambda p, q, k, v: fa4.flash_attn_func(q, k, v, causal=p.causal)[0],
                                   lambda p: not p.is_varlen))
    return refs


def reference_chunks(p: Problem, heads_per_chunk: int = 4) -> list[tuple[int, int, int, int, int]]:
    """(batch, h0, h1, hk0, hk1) pieces whose gradients are independent of each other: one batch entry
    (a varlen problem: one sequence) and whole KV groups (the query heads [h0, h1) and their KV heads
    [hk0, hk1)), at least heads_per_chunk query heads each. A KV head's dK/dV sum over its group, so a
    group is never split; one batch entry at a time keeps fp32 scores of the long GQA shapes in memory."""
    ratio = p.nheads // p.nheads_kv
    groups = max(1, -(-heads_per_chunk // ratio))  # KV heads per piece
    return [(b, hk0 * ratio, min(hk0 + groups, p.nheads_kv) * ratio, hk0, min(hk0 + groups, p.nheads_kv))
            for b in range(p.batch) for hk0 in range(0, p.nheads_kv, groups)]


def reference_grads(p: Problem, x: dict, heads_per_chunk: int = 4):
    """fp32 and input-precision autograd gradients of the reference attention, piece by piece
    (reference_chunks), so long sequences and many heads fit."""
    import torch

    from flash_attn_sm120 import testing

    out = {}
    for upcast in (True, False):
        # NaN until a piece writes it: a row no piece covers fails every comparison
        grads = [torch.full(x[n].shape, float("nan"), dtype=torch.float32 if upcast else x[n].dtype,
                            device=x[n].device) for n in ("q", "k", "v")]
        for b, h0, h1, hk0, hk1 in reference_chunks(p, heads_per_chunk):
            rows_q, rows_k = _rows(x, "cu_seqlens_q", b), _rows(x, "cu_seqlens_k", b)
            piece = lambda t, rows, lo, hi: t[rows][..., lo:hi, :].reshape(1, -1, hi - lo, t.shape[-1])  # noqa: E731
            leaves = [piece(x["q"], rows_q, h0, h1), piece(x["k"], rows_k, hk0, hk1), piece(x["v"], rows_k, hk0, hk1)]
            leaves = [(t.detach().float() if upcast else t.detach().clone()).requires_grad_(True) for t in leaves]
            o, _ = testing.attention_ref(*leaves, causal=p.causal, window=p.window, upcast=upcast,
                                         reorder_ops=not upcast)
            g = torch.autograd.grad(o, leaves, piece(x["dout"], rows_q, h0, h1).to(o.dtype))
            for dst, grad, rows, lo, hi in zip(grads, g, (rows_q, rows_k, rows_k), (h0, hk0, hk0), (h1, hk1, hk1)):
                view = dst[rows][..., lo:hi, :]  # a view of the buffer: basic slicing only
                view.copy_(grad.reshape(view.shape))
            del o, g, leaves
        out["ref" if upcast else "pt"] = grads
    return out["ref"], out["pt"]


def _rows(x: dict, cu_name: str, b: int) -> slice:
    """Batch entry b's rows of a tensor: its slice of the packed tokens (varlen), else of the batch."""
    if cu_name in x:
        cu = x[cu_name]
        return slice(int(cu[b]), int(cu[b + 1]))
    return slice(b, b + 1)


def grad_bound(ref, pt) -> float:
    """Upstream's rule's bound for one gradient: 2 max|pt - ref| + atol (pt: the reference in the inputs' precision)."""
    return 2 * (pt.float() - ref).abs().max().item() + GRAD_ATOL


def check_grads(actual, ref, pt) -> tuple[bool, float, str]:
    """Upstream's rule per gradient: max|actual - ref| <= grad_bound(ref, pt), every element finite."""
    worst, detail = 0.0, ""
    for name, a, r, lo in zip(("dq", "dk", "dv"), actual, ref, pt):
        if not bool(a.isfinite().all()):
            return False, float("inf"), f"{name}: non-finite (unwritten) elements"
        err = (a.float() - r).abs().max().item()
        bound = grad_bound(r, lo)
        worst = max(worst, err)
        if err > bound:
            return False, err, f"{name}: error {err:.3e} > bound {bound:.3e}"
    return True, worst, detail


def evaluate_bwd(impls: list[BwdImpl], problems: list[Problem], info, reps: int = 20, log=progress.write,
                 row_cls=None) -> list:
    """One row per (impl, problem): correctness, then the backward's median time and TFLOPS."""
    import torch

    rows = []
    tick = progress.bar(total=len(problems) * len(impls), desc="backward benchmark", unit="run")
    for p in problems:
        xs = [forward_state(p, info, seed=s) for s in range(2)]
        ref, pt = reference_grads(p, xs[0])
        for impl in impls:
            tick.update()  # (counted as it starts: each run ends in one of several branches below)
            row = row_cls(impl.name, impl.kind, p.name, info.mode, "ok")
            if not impl.supports(p):
                row.status = "unsupported"
                rows.append(row)
                continue
            try:
                ok, err, detail = check_grads(impl.run(p, xs[0], True), ref, pt)
                row.max_err = err
                if not ok:
                    row.status, row.detail = "incorrect", detail
                    rows.append(row)
                    log(_fmt(row))
                    continue
                torch.cuda.reset_peak_memory_stats()
                t = bench.time_cuda(lambda i: impl.run(p, xs[i], False), rotations=len(xs), reps=reps)
                row.peak_vram_mib = torch.cuda.max_memory_allocated() / 2**20
                row.bwd_ms, row.spread = t.median_ms, t.spread
                row.bwd_tflops = bench.backward_flops(p) / t.median_ms / 1e9
            except Exception as e:  # a crashing candidate is reported, the run goes on
                row.status, row.detail = "error", f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
            log(_fmt(row))
        del ref, pt, xs
        torch.cuda.empty_cache()
    tick.close()
    return rows


def _fmt(r) -> str:
    t = (f"bwd {r.bwd_tflops:7.1f} TFLOPS {r.bwd_ms:8.3f} ms ±{100 * r.spread:4.1f}%" if r.status == "ok"
         else f"{r.status:>30s}")
    e = f" err {r.max_err:.2e}" if r.max_err == r.max_err else ""
    return f"[{r.mode}] {r.problem:32s} {r.impl:26s} {t}{e} {r.detail}"


def table_candidate(info) -> list[BwdImpl]:
    """The shipped table, and the same with deterministic=True (semaphore-ordered accumulation)."""
    return [sm120_bwd_impl("sm120_bwd_table", lambda p: None, info),
            sm120_bwd_impl("sm120_bwd_table_deterministic", lambda p: None, info, deterministic=True)]


# The deterministic orderings of kernels/bwd_deterministic.py, for attribution (--det-variants): per
# mask, the flags forced through driver_bwd.force_deterministic_plan. The table's own deterministic
# row runs driver_bwd.deterministic_plan's choice.
def _walk(**flags) -> dict:
    """Per mask: the shipped walks (causal: descending turns, shortest-first launch; no mask: the
    rotated order) with these protocol flags."""
    return {"causal": dict(dq_descending=True, reverse_n_blocks=True, **flags), "none": dict(dq_rotated=True, **flags)}


_DEFERRED = dict(barrier_release=True, release_deferred=True)  # session 13's release (upstream's step)
DET_VARIANTS = {
    # session 8's: descending turns when resident (every seed problem), per-thread release fences
    "det_session8": {"causal": dict(dq_descending=True), "none": {}},
    "det_order_barrier_release": _walk(barrier_release=True),
    "det_deferred_fetch": _walk(**_DEFERRED, fetch_early=True),
    "det_warp_turns": _walk(**_DEFERRED, warp_turns=True),
    "det_late_adds": _walk(**_DEFERRED, late_dq_adds=True),
    # diagnostics (not deterministic): session 13's plan with its waits replaced by CTA barriers, and
    # with no waits, releases or barriers (what waiting costs; what the walk order and protocol cost)
    "det_diag_no_wait": _walk(**_DEFERRED, diag_no_wait=True),
    "det_diag_no_sync": _walk(diag_no_sync=True),
    # session 13's shipped plan: CUTLASS's barrier release, deferred to the next m_block
    "det_session13": _walk(**_DEFERRED),
    # the turns on the step's own barriers (no barrier of the protocol's own, the shipped plan), with an
    # early relaxed read; two dQ accumulators (twice the slack between a release and its wait); both
    "det_fused": _walk(fused_turns=True),
    "det_fused_fetch": _walk(fused_turns=True, fused_fetch=True),
    "det_split": _walk(**_DEFERRED, dq_split=True),
    "det_split_fused": _walk(dq_split=True, fused_turns=True),
    "det_deferred_fetch_relaxed": _walk(**_DEFERRED, fetch_early=True, fetch_relaxed=True),
    # no turns: dQ added in 64-bit fixed point (kernels/bwd_fixed_point.py), the same bits in any order
    "det_fixed_point": {"causal": dict(dq_fixed_point=True), "none": dict(dq_fixed_point=True)},
    # descending turns with the usual launch (a head's longest n_block first) instead of the shortest-first one:
    # resident calls only (deterministic_plan refuses it otherwise). scripts/det_launch_model.py predicted +2-4%
    # at d128; measured 0.537x / 0.733x the table at b1 s8192 / b2 s4096 d128 causal against 0.783x / 0.793x
    # for the shipped launch (session 38, gate_2026-12-07_session38/w48b): not shipped
    "det_fused_resident": {"causal": dict(dq_descending=True, fused_turns=True), "none": dict(dq_rotated=True, fused_turns=True)},
    # the turns in launch order (what varlen calls took before fixed point served them)
    "det_ascending": {"causal": dict(fused_turns=True), "none": dict(fused_turns=True)},
    # fixed point with every tile masked (its "launch": launch_plan flags forced beside the ordering): the
    # runtime mask test costs the d96 64x128 tiles the registers that keep them spill-free on sm_120a
    "det_fixed_point_mask_always": {"causal": dict(dq_fixed_point=True), "none": dict(dq_fixed_point=True),
                                    "launch": dict(mask_where_needed=False)},
}
# the orderings that need a dense grid: the rotated walk, descending turns, the reversed launch
_DENSE_GRID_FLAGS = ("dq_rotated", "dq_descending", "reverse_n_blocks")


def deterministic_variants(info, names=None) -> list[BwdImpl]:
    """The table's configs, deterministic, with each DET_VARIANTS ordering forced."""
    return [with_ordering(sm120_bwd_impl(name, lambda p: None, info, deterministic=True), name)
            for name in DET_VARIANTS if names is None or name in names]


def with_ordering(impl: BwdImpl, variant: str) -> BwdImpl:
    """`impl` (deterministic) with the DET_VARIANTS ordering `variant` forced, on the problems it can run:
    the turn orders a dense call without a window, fixed point and the ascending turns varlen too."""
    from flash_attn_sm120 import driver_bwd

    flags = DET_VARIANTS[variant]

    def run(p, x, poisoned, _inner=impl.run):
        launch = driver_bwd.force_launch_plan(**flags["launch"]) if "launch" in flags else contextlib.nullcontext()
        with driver_bwd.force_deterministic_plan(**flags["causal" if p.causal else "none"]), launch:
            return _inner(p, x, poisoned)

    dense_only = any(flags[mask].get(f) for mask in ("causal", "none") for f in _DENSE_GRID_FLAGS)
    return BwdImpl(impl.name, run, impl.kind, supports=lambda p, _s=impl.supports: (
        _s(p) and not (dense_only and p.is_varlen) and p.window == (None, None)))


# The launch plan's options (driver_bwd.launch_plan), each forced on or off, for what each is worth next to the
# table's row, which runs them as the plan picks (--launch-variants)
LAUNCH_VARIANTS = {
    "launch_before": dict(lpt=False, mask_where_needed=False),  # as before both (session 16's kernels)
    "launch_no_lpt": dict(lpt=False),
    "launch_mask_always": dict(mask_where_needed=False),
    # causal problems only (--subset causal): the longest-first launch and the per-tile mask test, each
    # and together, on the table's current tiles (two CTAs per SM on the d64 / d96 / plain d128 entries)
    "launch_lpt": dict(lpt=True),
    "launch_mask_where_needed": dict(mask_where_needed=True),
    "launch_lpt_where_needed": dict(lpt=True, mask_where_needed=True),
    # dQ added 16 bytes at a time (on this package's step), and this package's step alone (what it is worth)
    "launch_dq_wide": dict(dq_wide_adds=True),
    "launch_own_step": dict(own_step=True),
}


def launch_variants(info, names=None) -> list[BwdImpl]:
    """The table's configs, with each LAUNCH_VARIANTS plan forced."""
    from flash_attn_sm120 import driver_bwd

    out = []
    for name, flags in LAUNCH_VARIANTS.items():
        if names is not None and name not in names:
            continue
        inner = sm120_bwd_impl(name, lambda p: None, info)

        def run(p, x, poisoned, _inner=inner, _flags=flags):
            with driver_bwd.force_launch_plan(**_flags):
                return _inner.run(p, x, poisoned)

        out.append(BwdImpl(name, run, "candidate", supports=inner.supports))
    return out


# a candidates file's keys beside the BwdConfig fields; "det_plan": a DET_VARIANTS name forced on the
# candidate's deterministic runs (else driver_bwd.deterministic_plan's choice)
CANDIDATE_EXTRAS = ("head_dims", "deterministic", "det_plan")


def read_bwd_candidates(path) -> dict:
    """A --bwd-configs file (scripts/search_bwd.py stage_candidates writes one): name -> (BwdConfig, head
    dims or None, whether to time it deterministic too: True, False or "only")."""
    import json
    from pathlib import Path

    from flash_attn_sm120.kernels.bwd_tiling import BwdConfig

    raw = json.loads(Path(path).read_text())
    return {n: (BwdConfig(**{k: v for k, v in c.items() if k not in CANDIDATE_EXTRAS}), c.get("head_dims"),
                _det_flag(n, c.get("deterministic", False))) for n, c in raw.items()}


def _det_flag(name: str, value) -> bool | str:
    if value not in (True, False, "only"):
        raise ValueError(f"candidate {name!r}: deterministic must be true, false or \"only\", not {value!r}")
    return value


def read_det_plans(path) -> dict:
    """A --bwd-configs file's "det_plan" keys: candidate name -> DET_VARIANTS name."""
    import json
    from pathlib import Path

    raw = json.loads(Path(path).read_text())
    plans = {n: c["det_plan"] for n, c in raw.items() if "det_plan" in c}
    for n, plan in plans.items():
        if plan not in DET_VARIANTS:
            raise ValueError(f"candidate {n!r}: det_plan {plan!r} is not one of {sorted(DET_VARIANTS)}")
        if not raw[n].get("deterministic"):
            raise ValueError(f"candidate {n!r}: det_plan needs \"deterministic\": true or \"only\"")
    return plans


def config_candidates(info, configs: dict, deterministic: bool = False, det_plans: dict | None = None) -> list[BwdImpl]:
    """name -> (BwdConfig, head dims or None): timed on the problems of those head dims (None: every head
    dim the config can run); with `deterministic`, through driver_bwd.deterministic_plan's ordering, or
    the DET_VARIANTS ordering det_plans names for it."""
    from flash_attn_sm120.kernels.bwd_tiling import bwd_config_error

    out = []
    for name, (cfg, dims) in configs.items():
        impl = sm120_bwd_impl(name, lambda p, _c=cfg: _c, info, deterministic=deterministic)
        impl.supports = lambda p, _c=cfg, _d=dims: ((_d is None or p.head_dim in _d)
                                                  and bwd_config_error(p.head_dim, p.dv, _c) is None)
        plan = (det_plans or {}).get(name) if deterministic else None
        out.append(impl if plan is None else with_ordering(impl, plan))
    return out


def summary_ratios(rows, candidate: str, reference: str = "upstream_sm120") -> dict:
    """Per problem candidate / reference TFLOPS, and their geomean and minimum."""
    by = {(r.impl, r.problem): r for r in rows if r.status == "ok"}
    ratios = {}
    for (impl, prob), r in by.items():
        if impl == candidate and (reference, prob) in by:
            ratios[prob] = r.bwd_tflops / by[(reference, prob)].bwd_tflops
    return {"ratios": ratios, "geomean": bench.geomean(list(ratios.values())),
            "min": min(ratios.values(), default=float("nan"))}


def best_per_problem(rows, kind: str = "candidate") -> dict[str, Optional[object]]:
    best: dict = {}
    for r in rows:
        if r.kind == kind and r.status == "ok" and (r.problem not in best or r.bwd_tflops > best[r.problem].bwd_tflops):
            best[r.problem] = r
    return best
