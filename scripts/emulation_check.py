"""Check that SM120 emulation padding takes effect on this GPU: same kernel, padded vs unpadded.

For each config it prints the CTAs per SM the host fits unpadded and padded (the CUDA occupancy API on
the compiled kernels, occupancy.py), the SM120 count, and the measured time of both variants in one
process. Padding that works slows down configs whose unpadded occupancy on the host exceeds SM120's
(e.g. upstream's 64 KB d=128 tile: three CTAs per H200 SM unpadded, one on SM120).
tests/test_occupancy_gpu.py is the gate; this is the timing view of the same facts.

  python scripts/emulation_check.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    import torch

    from flash_attn_sm120 import bench, driver, hardware, occupancy
    from flash_attn_sm120.config import FwdConfig
    from flash_attn_sm120.device import device_info

    info = device_info(emulate=True)
    host = info.emulate_host_smem
    cases = [
        # latency-bound (one or two K/V blocks per CTA): occupancy shows directly in the time
        (FwdConfig(128, 128, 64), bench.Problem(16, 4096, 128, 16, 16, 128)),
        (FwdConfig(128, 64, 64, 1, True), bench.Problem(16, 4096, 128, 16, 16, 128)),
        (FwdConfig(128, 128, 64), bench.Problem(1, 8192, 8192, 16, 16, 128)),
        (FwdConfig(128, 128, 128), bench.Problem(4, 2048, 2048, 32, 32, 64)),
        (FwdConfig(256, 128, 96), bench.Problem(1, 8192, 8192, 16, 16, 128)),
    ]
    rows = []
    for cfg, p in cases:
        sets = [bench.make_inputs(p, seed=i) for i in range(bench.rotations_for(p))]
        smem = cfg.smem_bytes(p.head_dim, p.dv)
        row = dict(config=cfg.name, problem=p.name, smem=smem)
        for label, pad in (("padded", host), ("unpadded", None)):
            before = len(occupancy.records())
            def run(i, pad=pad):
                x = sets[i]
                driver.forward(x["q"], x["k"], x["v"], softmax_scale=None, causal=False, window_size_left=None,
                               window_size_right=None, softcap=None, pack_gqa=None, need_lse=False,
                               emulate_host_smem=pad, config=cfg)

            t = bench.time_cuda(run, rotations=len(sets), reps=args.reps)
            for rec in occupancy.records()[before:]:
                row[f"host_ctas_{label}"], row["sm120_ctas"] = rec.host_ctas_per_sm, rec.sm120_ctas_per_sm
            row[f"{label}_ms"] = t.median_ms
            row[f"{label}_tflops"] = bench.attention_flops(p) / t.median_ms / 1e9
        row["slowdown"] = row["padded_ms"] / row["unpadded_ms"]
        rows.append(row)
        print(f"[{info.name}] {row['config']:28s} {row['problem']:22s} smem {smem:6d} B  CTAs/SM host "
              f"{row.get('host_ctas_unpadded')} -> {row.get('host_ctas_padded')} (SM120 {row.get('sm120_ctas')}):  padded {row['padded_tflops']:6.1f} "
              f"unpadded {row['unpadded_tflops']:6.1f} TFLOPS (x{row['slowdown']:.2f} time)", flush=True)
    # The launch must really ask for the padded size: padding past the GPU's per-block limit has
    # to be refused by the driver (an error), not silently ignored.
    cfg, p = FwdConfig(128, 128, 64), bench.Problem(1, 256, 256, 2, 2, 128)
    x = bench.make_inputs(p)
    try:
        driver.forward(x["q"], x["k"], x["v"], softmax_scale=None, causal=False, window_size_left=None,
                       window_size_right=None, softcap=None, pack_gqa=None, need_lse=False,
                       emulate_host_smem=hardware.EmulationHost(4 * info.smem_per_sm, 4 * info.smem_per_sm,
                                                                info.reserved_smem_per_cta), config=cfg)
        torch.cuda.synchronize()
        overpad = "launched (padding NOT applied)"
    except Exception as e:
        # the occupancy check refuses it first (cuFuncSetAttribute above the GPU's limit): this
        # tests the check; tests/test_occupancy_gpu.py::test_waves tests the launch itself
        overpad = f"refused as it must be: {type(e).__name__}: {str(e)[:120]}"
    print(f"over-padded launch ({2 * info.smem_per_sm // 1024} KB per CTA): {overpad}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(dict(gpu=info.name, rows=rows, overpad=overpad), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
