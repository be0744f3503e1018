#!/usr/bin/env python3
"""Where block-sparse time goes (GPU, one process): dense, the block-sparse config forced dense, and the
block-sparse kernel at densities 1.0 / 0.5 / 0.25 / 0.1 (all full blocks), per head dim.

  FLASH_ATTN_SM120_EMULATE=1 python scripts/bench_block_sparse_diag.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flash_attn_sm120 import bench, block_sparse, driver, testing_sparse  # noqa: E402


def main() -> int:
    import torch

    from flash_attn_sm120 import flash_attn_func

    for b, s, h, d in ((1, 8192, 16, 128), (2, 8192, 16, 64)):
        x = [[torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)] for _ in range(2)]
        flops = 4 * b * h * s * s * d
        t = bench.time_cuda(lambda i: flash_attn_func(*x[i]), rotations=2, reps=20).median_ms
        print(f"b{b}s{s}h{h}d{d} dense shipped        {t:7.3f} ms {flops / t / 1e9:6.1f} TF", flush=True)
        for cfg in block_sparse.CONFIGS[d]:
            with driver.force_config(cfg):
                t = bench.time_cuda(lambda i: flash_attn_func(*x[i]), rotations=2, reps=20).median_ms
            print(f"  dense {cfg.name:24s} {t:7.3f} ms {flops / t / 1e9:6.1f} TF", flush=True)
            n = s // 128
            for density in (1.0, 0.5, 0.25, 0.1):
                g = torch.Generator(device="cuda").manual_seed(0)
                kinds = testing_sparse.random_block_map(b, h, n, n, density=density, full_share=1.0, generator=g)
                sp = testing_sparse.lists_from_map(kinds, (128, 128))
                frac = testing_sparse.computed_fraction(kinds)
                with driver.force_config(cfg):
                    t = bench.time_cuda(lambda i: flash_attn_func(*x[i], block_sparse_tensors=sp), rotations=2,
                                        reps=20).median_ms
                print(f"  sparse {cfg.name:23s} density {frac:5.3f} {t:7.3f} ms {flops * frac / t / 1e9:6.1f} TF",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
