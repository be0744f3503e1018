#!/usr/bin/env python3
"""Where the one sink overhead above 3% lives: b4 s2048 h32 d64 causal with the table's TMA entry and
with the cp.async entry, each with and without a learnable sink, A B B A A B order, side by side (GPU).

  FLASH_ATTN_SM120_EMULATE=1 python scripts/bench_sink_tma_d64.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    import torch

    from flash_attn_sm120 import bench, driver, flash_attn_func
    from flash_attn_sm120.config import family_entries, load_fwd_table, select_fwd_config

    p = bench.Problem(4, 2048, 2048, 32, 32, 64, causal=True)
    rot = bench.rotations_for(p)
    sets = [bench.make_inputs(p, seed=i) for i in range(rot)]
    sink = torch.randn(32, device="cuda")
    cfgs = {"table": select_fwd_config(load_fwd_table(), 64, 64, True, False),
            "cpasync": select_fwd_config(family_entries("cpasync"), 64, 64, True, False)}
    for name, cfg in cfgs.items():
        ms = {False: [], True: []}
        for with_sink in (False, True, True, False, False, True):
            def call(i, s=with_sink):
                return flash_attn_func(sets[i]["q"], sets[i]["k"], sets[i]["v"], causal=True,
                                       learnable_sink=sink if s else None)

            with driver.force_config(cfg):
                ms[with_sink].append(bench.time_cuda(call, rotations=rot, reps=30).median_ms)
        a, b = sum(ms[False]) / 3, sum(ms[True]) / 3
        print(f"{name:8s} {cfg.name:28s} {a:.4f} ms  sink {b:.4f} ms  {100 * (b / a - 1):+.1f}%  {ms}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
