"""Quick GPU iteration on the TMA forward family: compile, run a few shapes, print error and time.

    PYTHONPATH=. python scripts/smoke_tma.py                 # correctness shapes + the perf shape
    PYTHONPATH=. python scripts/smoke_tma.py --perf-only     # b1 s8192 h16 d128 only
    PYTHONPATH=. python scripts/smoke_tma.py --config 256,256,32,2 --head-dim 128
    PYTHONPATH=. python scripts/smoke_tma.py --perf-only --baseline   # + the table's choice

On a GPU that is not SM120 the kernels run in SM120 emulation (FLASH_ATTN_SM120_EMULATE=1 is set
here, this package's own switch). Every call is announced before it starts and guarded by a
watchdog: a call that does not finish within --timeout seconds (an mbarrier/TMA hang, the risk
cutlass PR #3189 reported on sm_120) prints which call hung and exits the process with code 3.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from dataclasses import replace

import torch

if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 12:
    os.environ.setdefault("FLASH_ATTN_SM120_EMULATE", "1")

from flash_attn_sm120 import bench, driver  # noqa: E402
from flash_attn_sm120.config import FwdConfig  # noqa: E402
from flash_attn_sm120.device import device_info  # noqa: E402
from flash_attn_sm120.kernels import FAMILIES  # noqa: E402
from flash_attn_sm120.kernels.fwd_tma import ALL_MASKS, PROPOSED_CONFIGS  # noqa: E402


def _plain_order(kernel_cls: type) -> type:
    """`kernel_cls` with the intra-warp overlap off: every tile runs the plain FA2 order."""

    class PlainOrder(kernel_cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, intra_warp_overlap=False, **kwargs)

    return PlainOrder


class Watchdog:
    """Kill the process if a guarded section runs longer than `timeout` seconds."""

    def __init__(self, timeout: float):
        self.timeout = timeout

    def __call__(self, label: str):
        return _Guard(self.timeout, label)


class _Guard:
    def __init__(self, timeout: float, label: str):
        self.timeout, self.label = timeout, label
        self.done = threading.Event()

    def _watch(self):
        if not self.done.wait(self.timeout):
            print(f"\nTIMEOUT after {self.timeout:.0f} s in: {self.label} (hang? exiting)", flush=True)
            os._exit(3)

    def __enter__(self):
        print(f"  -> {self.label}", end=" ... ", flush=True)
        threading.Thread(target=self._watch, daemon=True).start()
        self.t0 = time.time()

    def __exit__(self, *exc):
        self.done.set()
        print(f"{time.time() - self.t0:.2f} s", flush=True)


def run_once(cfg, x, causal, window, emulate, pack_gqa=False):
    q = x["q"]
    out = torch.full((*q.shape[:-1], x["v"].shape[-1]), float("nan"), dtype=q.dtype, device=q.device)
    driver.forward(q, x["k"], x["v"], softmax_scale=None, causal=causal, window_size_left=window[0],
                   window_size_right=window[1], softcap=None, pack_gqa=pack_gqa, need_lse=False,
                   emulate_host_smem=emulate, out=out, config=cfg)
    return out


def check(cfg, p: bench.Problem, guard, emulate) -> bool:
    x = bench.make_inputs(p, seed=p.seqlen_q + p.head_dim)
    with guard(f"{cfg.name} {p.name} window={p.window}"):
        out = run_once(cfg, x, p.causal, p.window, emulate)
        torch.cuda.synchronize()
    ref, _ = bench.reference_attention(x["q"], x["k"], x["v"], causal=p.causal, window=p.window)
    low, _ = bench.reference_attention(x["q"], x["k"], x["v"], causal=p.causal, window=p.window, upcast=False)
    err, low_err = bench.error_vs_reference(out, ref), bench.error_vs_reference(low, ref)
    nan = torch.isnan(out).any().item()
    ok = not nan and err <= 2 * low_err + 1e-3
    print(f"     max err {err:.2e} (torch {p.dtype} ref {low_err:.2e}) nan={nan} {'OK' if ok else 'FAIL'}")
    return ok


def perf(cfg, p: bench.Problem, guard, emulate, reps: int = 20) -> None:
    """Median time of one forward (output preallocated); cfg=None times the dispatcher's choice."""
    x = bench.make_inputs(p, seed=1)
    q, k, v = x["q"], x["k"], x["v"]
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
    window = p.window

    def call(_i):
        driver.forward(q, k, v, softmax_scale=None, causal=p.causal, window_size_left=window[0],
                       window_size_right=window[1], softcap=None, pack_gqa=False, need_lse=False,
                       emulate_host_smem=emulate, out=out, config=cfg)

    name = cfg.name if cfg is not None else "dispatcher"
    with guard(f"{name} {p.name} (compile + first call)"):
        call(0)
        torch.cuda.synchronize()
    with guard(f"{name} {p.name} x{reps}"):
        timing = bench.time_cuda(call, rotations=1, reps=reps)
    ms = timing.median_ms
    tflops = bench.attention_flops(p) / (ms * 1e-3) / 1e12
    print(f"     {name} {p.name}: {ms:.3f} ms, {tflops:.0f} TFLOPS ({'emulated SM120' if emulate else 'SM120'})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="num_threads,tile_m,tile_n,num_stages[,q_in_regs 0/1] (default: the proposed configs)")
    ap.add_argument("--head-dim", type=int, default=None, help="only this head dim")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per guarded call (compile included)")
    ap.add_argument("--perf-only", action="store_true")
    ap.add_argument("--baseline", action="store_true", help="also time the dispatcher's (table) choice")
    ap.add_argument("--no-overlap", action="store_true",
                    help="A/B experiment: every config runs the plain FA2 order (no intra-warp overlap)")
    args = ap.parse_args()
    if args.no_overlap:
        # this process only: the driver builds the TMA family's kernels with intra_warp_overlap=False
        FAMILIES["tma"] = replace(FAMILIES["tma"], kernel_cls=_plain_order(FAMILIES["tma"].kernel_cls))
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    info = device_info()
    print(info.label())
    emulate = info.emulate_host_smem
    guard = Watchdog(args.timeout)
    dims = [args.head_dim] if args.head_dim else sorted(PROPOSED_CONFIGS)
    failures = 0
    for d in dims:
        if args.config:
            nt, tm, tn, st, *qreg = (int(v) for v in args.config.split(","))
            cfgs = [(FwdConfig(nt, tm, tn, st, bool(qreg and qreg[0]), family="tma"), ALL_MASKS)]
        else:
            cfgs = [(FwdConfig(*c, family="tma"), masks) for c, masks in PROPOSED_CONFIGS[d]]
        for cfg, masks in cfgs:
            print(f"== d={d} {cfg.name} (masks {', '.join(masks)})")
            if not args.perf_only:
                shapes = [
                    bench.Problem(1, 1, 1, 2, 2, d),
                    bench.Problem(2, 17, 17, 4, 2, d, causal=True),
                    bench.Problem(1, 333, 1000, 4, 1, d),
                    bench.Problem(1, 1000, 333, 4, 4, d, causal=True),
                    bench.Problem(1, 1000, 1000, 2, 2, d, window=(100, 17)),
                    bench.Problem(2, 333, 333, 2, 2, d, dtype="float16"),
                ]
                for p in shapes:
                    kind = "local" if p.window != (None, None) else "causal" if p.causal else "none"
                    if kind in masks:
                        failures += not check(cfg, p, guard, emulate)
            if d == 128 or args.perf_only:
                perf(cfg, bench.Problem(1, 8192, 8192, 16, 16, d), guard, emulate)
                if not args.perf_only and "causal" in masks:
                    perf(cfg, bench.Problem(1, 8192, 8192, 16, 16, d, causal=True), guard, emulate)
    if args.baseline:
        print("== baseline: the dispatcher's config (flash_attn_sm120/configs/sm120_fwd.toml)")
        for causal in (False, True):
            perf(None, bench.Problem(1, 8192, 8192, 16, 16, 128, causal=causal), guard, emulate)
    print("FAILURES:", failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
