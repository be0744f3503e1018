#!/usr/bin/env python3
"""Nsight Compute, side by side: this package's kernel and a reference on one problem (GPU, ncu on PATH).

Profile first, then change what differs. For one seed-style problem, each implementation runs in a
child process under `ncu --csv --page raw --profile-from-start off`: the child compiles and warms up
outside the profiled range, then runs the call once between cudaProfilerStart/Stop, so only that
call's kernels are measured. The longest kernel of each run (the attention kernel; not the
pre/post-processing or combine kernels) is compared on:

  achieved occupancy and its shared-memory limit, issue-slot and tensor-pipe utilization, the top
  warp stall reasons (per issued instruction), shared-memory bank conflicts, L2 and DRAM throughput,
  registers, shared memory and local-memory traffic, duration.

Implementations: `table` (the shipped config table, what flash_attn_func runs), `upstream` (upstream's
SM120 kernel with its default tiles, padded like every SM120 kernel in emulation), or `config:<name>`
for a registry path of flash_attn_sm120/paths.py (e.g. config:cpasync-w8-128x96-s1), `sparse:<density>` (the
public API with random block-sparse lists: that share of the 128 x 128 blocks, all full; `sparse:0.1:grid` or
`sparse:0.1:hg2` launch the tiles in grid order or longest first within groups of 2 heads). Backward: `bwd:table`,
`bwd:deterministic` (the same with deterministic=True), `bwd:upstream` (the main backward kernel),
`bwd:config:<name>` (one backward tile by config_bwd's name, e.g. bwd-w4-64x64-q1do1-a242-vreg) or
`bwd:sparse:<density>` (autograd.grad of the block-sparse call, with the lists' Q-direction twins).

  FLASH_ATTN_SM120_EMULATE=1 python scripts/ncu_compare.py --problem b4s2048h32d64 [--causal]
  python scripts/ncu_compare.py --problem b2s4096h16d96 --candidate table --reference config:upstream-config
  python scripts/ncu_compare.py --problem b2s4096h16d128 --candidate bwd:deterministic --reference bwd:table
  python scripts/ncu_compare.py --problem b1s8192h16d128 --candidate sparse:0.1 --reference table
  python scripts/ncu_compare.py --parse saved.csv       # print the table of an existing ncu --csv file
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# (label, ncu metric); the stall reasons are listed apart and ranked by the candidate's values
METRICS = (
    ("duration (us)", "gpu__time_duration.sum"),
    ("achieved occupancy (%)", "sm__warps_active.avg.pct_of_peak_sustained_active"),
    ("occupancy limit: smem (CTAs)", "launch__occupancy_limit_shared_mem"),
    ("occupancy limit: registers (CTAs)", "launch__occupancy_limit_registers"),
    ("issue slots busy (%)", "sm__inst_issued.avg.pct_of_peak_sustained_active"),
    ("warp instructions executed", "smsp__inst_executed.sum"),
    ("tensor pipe busy (%)", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"),
    ("smem bank conflicts, loads", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum"),
    ("smem bank conflicts, stores", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum"),
    ("L2 throughput (%)", "lts__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("L2 hit rate (%)", "lts__t_sector_hit_rate.pct"),
    ("global reductions (requests)", "l1tex__t_requests_pipe_lsu_mem_global_op_red.sum"),
    ("DRAM throughput (%)", "dram__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("registers / thread", "launch__registers_per_thread"),
    ("smem / block, static (B)", "launch__shared_mem_per_block_static"),
    ("smem / block, dynamic (B)", "launch__shared_mem_per_block_dynamic"),
    ("local memory loads (B)", "l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum"),
    ("local memory stores (B)", "l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum"),
)
STALLS = ("barrier", "long_scoreboard", "short_scoreboard", "math_pipe_throttle", "mio_throttle", "wait",
          "not_selected", "selected", "lg_throttle", "dispatch_stall", "no_instruction", "membar", "sleeping",
          "tex_throttle", "drain", "branch_resolving", "misc")
STALL_METRIC = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
DURATION = METRICS[0][1]


def all_metrics() -> list[str]:
    return [m for _, m in METRICS] + [STALL_METRIC.format(s) for s in STALLS]


# ----------------------------------------------------------------------------------- parsing
def parse_ncu_csv(text: str) -> list[dict]:
    """Rows of `ncu --csv --page raw` output: one dict per profiled kernel, metric name -> value
    (float when numeric, else the string). Lines before the header (the application's own output,
    ncu's ==PROF== lines) and the units row are skipped."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return []
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header, body = rows[0], rows[1:]
    if body and (not body[0] or body[0][0] == ""):  # the units row
        body = body[1:]
    out = []
    for r in body:
        if len(r) != len(header):
            continue
        out.append({k: _number(v) for k, v in zip(header, r)})
    return out


def _number(v: str):
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return v


def main_kernel(rows: list[dict]) -> Optional[dict]:
    """The longest kernel of a run (the attention kernel)."""
    timed = [r for r in rows if isinstance(r.get(DURATION), float)]
    return max(timed, key=lambda r: r[DURATION]) if timed else None


def format_comparison(names: tuple[str, str], kernels: tuple[dict, dict], top_stalls: int = 6) -> str:
    """A side-by-side table of two kernels' metrics; stall reasons ranked by the first kernel."""
    a, b = kernels
    width = 36
    lines = [f"{'':{width}s} {names[0][:24]:>24s} {names[1][:24]:>24s}",
             f"{'kernel':{width}s} {str(a.get('Kernel Name', '?'))[:24]:>24s} {str(b.get('Kernel Name', '?'))[:24]:>24s}"]
    for label, metric in METRICS:
        va, vb = a.get(metric), b.get(metric)
        if metric == DURATION:  # ncu reports nanoseconds (usecond/msecond when told; raw page: ns)
            va, vb = (v / 1e3 if isinstance(v, float) else v for v in (va, vb))
        lines.append(f"{label:{width}s} {_cell(va):>24s} {_cell(vb):>24s}")
    def weight(stall: str) -> float:
        v = a.get(STALL_METRIC.format(stall))
        return v if isinstance(v, float) else 0.0

    stalls = sorted(STALLS, key=weight, reverse=True)
    lines.append(f"{'top warp stalls (cycles / issue)':{width}s}")
    for s in stalls[:top_stalls]:
        m = STALL_METRIC.format(s)
        lines.append(f"{'  ' + s:{width}s} {_cell(a.get(m)):>24s} {_cell(b.get(m)):>24s}")
    return "\n".join(lines)


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:,.2f}" if abs(v) < 1e6 else f"{v:,.0f}"
    return "n/a" if v is None else str(v)[:24]


# ------------------------------------------------------------------------------------ running
def find_problem(problem: str, causal: bool):
    """A seed/real problem by name, else a plain dense shape named b<batch>s<seqlen>h<heads>[k<kv heads>]d<dim>
    (e.g. b1s32768h16d128: a long row for the block-sparse walk)."""
    import re

    from flash_attn_sm120 import bench

    for p in bench.problem_set("seed") + bench.problem_set("real"):
        if p.name.split("-")[0] == problem and p.causal == causal:
            return p
    m = re.fullmatch(r"b(\d+)s(\d+)h(\d+)(?:k(\d+))?d(\d+)", problem)
    if m is None:
        raise SystemExit(f"--problem {problem!r}: not a seed/real problem, nor b<B>s<S>h<H>[k<KV>]d<D>")
    b, s, h, kv, d = (int(g) if g else None for g in m.groups())
    return bench.Problem(b, s, s, h, kv or h, d, causal=causal)


def run_child(impl: str, problem: str, causal: bool) -> int:
    """Compile and warm up, then one call inside the profiled range."""
    import torch

    from flash_attn_sm120 import bench
    from flash_attn_sm120.device import device_info

    info = device_info()
    p = find_problem(problem, causal)
    x = bench.make_inputs(p)
    call = _backward_call(impl, p, x, info) if impl.startswith("bwd:") else _forward_call(impl, p, x, info)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    return 0


def _forward_call(impl: str, p, x, info):
    from flash_attn_sm120 import driver
    from flash_attn_sm120.config import upstream_fwd_config
    from flash_attn_sm120.paths import get_path

    if impl == "table":
        config = None
    elif impl == "upstream":
        config = upstream_fwd_config(max(p.head_dim, p.dv))
    elif impl.startswith("config:"):
        config = get_path(impl.split(":", 1)[1]).config_for(p.head_dim, p.dv)
    elif impl.startswith("sparse:"):
        return _sparse_call(impl.split(":", 1)[1], p, x)
    else:
        raise SystemExit(f"unknown implementation {impl!r} (table, upstream, config:<registry path>, sparse:<density>, "
                         "bwd:table, bwd:deterministic, bwd:upstream)")

    def call():
        return driver.forward(x["q"], x["k"], x["v"], softmax_scale=None, causal=p.causal, window_size_left=None,
                              window_size_right=None, softcap=None, pack_gqa=None, need_lse=False,
                              emulate_host_smem=info.emulate_host_smem, config=config)

    return call


def _random_kinds(density: float, p):
    """A random `density` of the problem's 128 x 128 blocks, all full (seeded: the same map every run)."""
    import torch

    from flash_attn_sm120 import testing_sparse

    g = torch.Generator(device="cuda").manual_seed(0)
    return testing_sparse.random_block_map(p.batch, p.nheads, -(-p.seqlen_q // 128), -(-p.seqlen_k // 128),
                                           density=density, full_share=1.0, generator=g)


def _sparse_order(spec: str):
    """`<density>[:grid|:hg<heads>]` -> (density, the launch order's context: None (longest first),
    block_sparse.grid_order() or block_sparse.head_groups(heads))."""
    from flash_attn_sm120 import block_sparse

    density, _, order = spec.partition(":")
    if not order:
        return float(density), None
    if order == "grid":
        return float(density), block_sparse.grid_order
    if order.startswith("hg") and order[2:].isdigit() and int(order[2:]) >= 1:
        return float(density), lambda: block_sparse.head_groups(int(order[2:]))
    raise SystemExit(f"sparse:{spec}: the order is ':grid' or ':hg<heads>', heads >= 1 (block_sparse.head_groups)")


def _sparse_call(spec: str, p, x):
    """The public API with block-sparse lists: a random `density` of the 128 x 128 blocks, all full (no
    mask_mod), the dispatcher's sparse config (scripts/bench_block_sparse.py's random10 at 0.1); `spec` is
    `<density>[:grid|:hg<heads>]`, the suffix a launch order other than longest first."""
    import contextlib

    import flash_attn_sm120
    from flash_attn_sm120 import testing_sparse

    density, order = _sparse_order(spec)
    lists = testing_sparse.lists_from_map(_random_kinds(density, p), (128, 128))

    def call():
        with order() if order is not None else contextlib.nullcontext():
            return flash_attn_sm120.flash_attn_func(x["q"], x["k"], x["v"], causal=p.causal,
                                                    block_sparse_tensors=lists)

    return call


def _backward_call(impl: str, p, x, info):
    """One backward (driver_bwd.backward) on the shipped forward's out/LSE: `bwd:table`, the same
    with `deterministic=True` (`bwd:deterministic`), or upstream's SM120 config (`bwd:upstream`)."""
    import torch

    from flash_attn_sm120 import driver, driver_bwd
    from flash_attn_sm120.kernels.bwd_tiling import upstream_bwd_config

    from flash_attn_sm120.config_bwd import bwd_config_from_name

    kind = impl.split(":", 1)[1]
    if kind.startswith("sparse:"):
        density = kind.split(":", 1)[1]
        if ":" in density:
            raise SystemExit(f"{impl}: a launch order suffix is the forward's (sparse:<density>:grid|:hg<heads>)")
        return _sparse_backward_call(float(density), p, x)
    if kind not in ("table", "deterministic", "upstream") and not kind.startswith("config:"):
        raise SystemExit(f"unknown backward implementation {impl!r} (bwd:table, bwd:deterministic, bwd:upstream, "
                         "bwd:config:<config name>, bwd:sparse:<density>)")
    out, lse = driver.forward(x["q"], x["k"], x["v"], softmax_scale=None, causal=p.causal, window_size_left=None,
                              window_size_right=None, softcap=None, pack_gqa=None, need_lse=True,
                              emulate_host_smem=info.emulate_host_smem)
    dout = torch.randn_like(out)
    config = upstream_bwd_config(max(p.head_dim, p.dv)) if kind == "upstream" else None
    if kind.startswith("config:"):
        # one tile on any problem, e.g. a causal entry's tile on its non-causal twin
        config = bwd_config_from_name(kind.split(":", 1)[1])

    def call():
        return driver_bwd.backward(x["q"], x["k"], x["v"], out, dout, lse, softmax_scale=None, causal=p.causal,
                                   window_size_left=None, window_size_right=None, emulate_host_smem=info.emulate_host_smem, config=config,
                                   deterministic=kind == "deterministic")

    return call


def _sparse_backward_call(density: float, p, x):
    """autograd.grad of the public API's block-sparse forward (kept): random lists as `sparse:<density>`,
    with their Q-direction twins for the backward (`bwd:sparse:<density>`; 0 gives empty lists)."""
    import torch

    import flash_attn_sm120
    from flash_attn_sm120 import testing_sparse

    kinds = _random_kinds(density, p)
    lists = [testing_sparse.lists_from_map(m, (128, 128)) for m in (kinds, kinds.transpose(2, 3).contiguous())]
    leaves = [x[n].detach().requires_grad_() for n in ("q", "k", "v")]
    out = flash_attn_sm120.flash_attn_func(*leaves, causal=p.causal, block_sparse_tensors=lists[0],
                                           block_sparse_tensors_bwd=lists[1])[0]
    dout = torch.randn_like(out)

    def call():
        return torch.autograd.grad(out, leaves, dout, retain_graph=True)

    return call


def profile(impl: str, problem: str, causal: bool, ncu: str) -> tuple[Optional[dict], str]:
    cmd = [ncu, "--csv", "--page", "raw", "--profile-from-start", "off", "--metrics", ",".join(all_metrics()),
           sys.executable, str(Path(__file__).resolve()), "--child", impl, "--problem", problem]
    if causal:
        cmd.append("--causal")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    kernel = main_kernel(parse_ncu_csv(proc.stdout))
    return kernel, (proc.stderr or "")[-2000:] if kernel is None else ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--problem", default="b4s2048h32d64", help="a seed/real problem name without '-causal', or a dense shape b<B>s<S>h<H>[k<KV>]d<D>")
    ap.add_argument("--causal", action="store_true", help="the causal variant of the problem")
    ap.add_argument("--candidate", default="table", help="table | upstream | config:<registry path> (default table)")
    ap.add_argument("--reference", default="upstream", help="the same choices (default upstream)")
    ap.add_argument("--ncu", default=shutil.which("ncu") or "ncu", help="the ncu executable")
    ap.add_argument("--parse", type=Path, default=None, help="print the main kernel of an existing ncu --csv file")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return run_child(args.child, args.problem, args.causal)
    if args.parse:
        k = main_kernel(parse_ncu_csv(args.parse.read_text()))
        if k is None:
            raise SystemExit(f"{args.parse}: no profiled kernel with {DURATION}")
        print(format_comparison((args.parse.name, ""), (k, {})))
        return 0
    found = {}
    for role, impl in (("candidate", args.candidate), ("reference", args.reference)):
        kernel, err = profile(impl, args.problem, args.causal, args.ncu)
        if kernel is None:
            print(f"{role} {impl}: ncu gave no kernel row\n{err}", file=sys.stderr)
            return 1
        found[role] = kernel
    title = f"{args.problem}{'-causal' if args.causal else ''}"
    print(f"Nsight Compute, {title} (the longest kernel of each run)")
    print(format_comparison((args.candidate, args.reference), (found["candidate"], found["reference"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
