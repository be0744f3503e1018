"""GQA packing on the TMA family, and paged-prefill configs, timed side by side in one process (GPU).

Two tables, each against references timed in the same run:

  gqa    causal GQA prefill shapes: the table's TMA entry with the query heads of a KV head packed
         into its M tile (pack_gqa=True) vs unpacked (pack_gqa=False), the table's cp.async entry
         packed (what explicit pack_gqa=True ran before the TMA family packed), the table's next TMA entry
         packed (where the first spills with packed GQA), and upstream's SM120
         path (its own tile, packed as upstream defaults).
  paged  prefill over 64-token pages (b4 s4096 32:8; default causal d64 and d128, --paged-keys):
         the dense call (the table), and the paged call with what driver_splitkv.kernel_config
         chooses, with upstream's tile (spills on sm_120a at causal d64/d128), with 4 warps 64x64
         without Q in registers (the fuzz suite's splitkv path) and with the table's cp.async entry.

Every timed call is first checked against the fp32 reference (output poisoned with NaN). On a
non-SM120 GPU it runs in SM120 emulation; say so when quoting the numbers.

  python scripts/bench_gqa_paged.py --json gqa_paged.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import prepare  # noqa: E402

from flash_attn_sm120 import bench, driver, driver_splitkv, occupancy  # noqa: E402
from flash_attn_sm120.config import FwdConfig, family_entries, load_fwd_table, select_fwd_config, upstream_fwd_config  # noqa: E402
from flash_attn_sm120.device import device_info  # noqa: E402

GQA_SHAPES = [  # (batch, seqlen, heads, kv heads, head dim), causal
    (2, 4096, 32, 8, 128),
    (8, 1024, 32, 8, 128),
    (16, 512, 32, 4, 128),
    (2, 4096, 32, 8, 96),
    (4, 2048, 32, 8, 64),
]
PAGE_SIZE = 64
# --paged-candidates: splitkv tiles that compile without spills on sm_120a for causal paged prefill
# (split and unsplit; compiled with codegen.compile_splitkv_cubin), (num_threads, tile_m, tile_n, stages, q_in_regs)
PAGED_CANDIDATES = {
    128: [(128, 128, 48, 2, False), (128, 128, 32, 2, False), (128, 128, 32, 1, False), (256, 128, 64, 1, False),
          (256, 128, 64, 1, True), (256, 128, 96, 1, True), (256, 256, 32, 1, False), (256, 256, 32, 2, False),
          (128, 64, 96, 1, True)],
    64: [(128, 128, 80, 1, False), (128, 128, 64, 1, False), (128, 128, 64, 2, False), (256, 256, 64, 1, False),
         (256, 128, 128, 1, False), (256, 128, 64, 1, True), (128, 64, 128, 1, True), (128, 64, 96, 1, True)],
}


def _check(out, x, causal: bool, where: str) -> None:
    ref, _ = bench.reference_attention(x["q"], x["k"], x["v"], causal=causal)
    low, _ = bench.reference_attention(x["q"], x["k"], x["v"], causal=causal, upcast=False)
    assert not torch.isnan(out).any(), f"unwritten output: {where}"
    err, low_err = bench.error_vs_reference(out, ref), bench.error_vs_reference(low, ref)
    assert err <= 2 * low_err + 1e-3, (where, err, low_err)


def _dense(x, emulate, config, pack_gqa, out, causal=True):
    return driver.forward(x["q"], x["k"], x["v"], softmax_scale=None, causal=causal, window_size_left=None,
                          window_size_right=None, softcap=None, pack_gqa=pack_gqa, need_lse=False,
                          emulate_host_smem=emulate, out=out, config=config)


def _timed(name, fn, sets, p, rows, extra):
    """Correctness on set 0 (poisoned output), then the timing over all sets."""
    out = torch.full_like(sets[0]["q"], float("nan"))
    try:
        fn(sets[0], out)
        torch.cuda.synchronize()
        _check(out, sets[0], p.causal, f"{name} {p.name}")
    except (AssertionError, NotImplementedError, ValueError) as e:  # a wrong kernel is reported, never timed
        rows.append(dict(problem=p.name, variant=name, error=str(e)[:500], **extra))
        print(f"{p.name:28s} {name:34s} FAILED: {str(e)[:300]}", flush=True)
        return float("nan")
    t = bench.time_cuda(lambda i: fn(sets[i], torch.empty_like(sets[i]["q"])), rotations=len(sets), warmup=3, reps=30)
    tflops = bench.attention_flops(p) / t.median_ms / 1e9
    rows.append(dict(problem=p.name, variant=name, median_ms=t.median_ms, p10_ms=t.p10_ms, p90_ms=t.p90_ms,
                     tflops=tflops, **extra))
    print(f"{p.name:28s} {name:34s} {t.median_ms:8.3f} ms {tflops:7.1f} TFLOPS", flush=True)
    return t.median_ms


def run_gqa(emulate) -> list:
    rows = []
    for b, s, h, hk, d in GQA_SHAPES:
        p = bench.Problem(b, s, s, h, hk, d, causal=True, tag="gqa")
        sets = [bench.make_inputs(p, seed=i) for i in range(bench.rotations_for(p))]
        tma = select_fwd_config(load_fwd_table(), d, d, True, False, seqlen_q=s)  # what the dispatcher runs
        cpasync = select_fwd_config(family_entries("cpasync"), d, d, True, False)
        times = {}
        variants = [
            (f"table {tma.name} packed", tma, True),
            (f"table {tma.name} unpacked", tma, False),
            (f"cpasync {cpasync.name} packed", cpasync, True),
            (f"upstream {upstream_fwd_config(d).name} packed", upstream_fwd_config(d), True),
        ]
        # the table's next TMA entry packed: the alternative where the first one spills with packed GQA
        others = [e.config for e in load_fwd_table() if e.head_dim == d and e.mask == "causal"
                  and e.config.family == "tma" and e.serves(s) and e.config != tma]
        if others:
            variants.append((f"next tma {others[0].name} packed", others[0], True))
        for name, cfg, pack in variants:
            times[name] = _timed(name, lambda x, o, c=cfg, pk=pack: _dense(x, emulate, c, pk, o), sets, p, rows,
                                 dict(table="gqa", pack_gqa=pack, config=cfg.name))
        packed, unpacked = times[variants[0][0]], times[variants[1][0]]
        print(f"{p.name:28s} packed / unpacked time = {packed / unpacked:.3f}", flush=True)
        del sets
        torch.cuda.empty_cache()
    return rows


def _paged(x, emulate, config, out, causal=True):
    return driver_splitkv.forward(
        x["q"], x["pk"], x["pv"], page_table=x["pt"], num_splits=1, softmax_scale=None, causal=causal,
        window_size_left=None, window_size_right=None, softcap=None, pack_gqa=None, need_lse=False,
        emulate_host_smem=emulate, config=config, out=out,
    )


def run_paged(emulate, candidates: bool = False, keys=((128, True), (64, True))) -> list:
    rows = []
    gen = torch.Generator().manual_seed(1)
    for d, causal in keys:
        p = bench.Problem(4, 4096, 4096, 32, 8, d, causal=causal, tag="paged")
        sets = [bench.make_inputs(p, seed=i) for i in range(bench.rotations_for(p))]
        for x in sets:
            x["pk"], x["pv"], x["pt"] = bench.paged_copy(x["k"], x["v"], PAGE_SIZE, gen)
        table_first = select_fwd_config(load_fwd_table(), d, d, causal, False)
        chosen = driver_splitkv.kernel_config(table_first, d, d, causal, False)
        cpasync = select_fwd_config(family_entries("cpasync"), d, d, causal, False)
        dense = _timed("dense (table)", lambda x, o: _dense(x, emulate, None, None, o, causal), sets, p, rows,
                       dict(table="paged", config=table_first.name))
        variants = [
            (f"paged{PAGE_SIZE} kernel_config: {chosen.name}", None),
            (f"paged{PAGE_SIZE} upstream tile {upstream_fwd_config(d).name}", upstream_fwd_config(d)),
            (f"paged{PAGE_SIZE} 4w 64x64 s1", FwdConfig(128, 64, 64, 1)),
            (f"paged{PAGE_SIZE} cp.async entry {cpasync.name}", cpasync),
        ]
        if candidates and causal and d in PAGED_CANDIDATES:
            variants += [(f"paged{PAGE_SIZE} {FwdConfig(*c).name}", FwdConfig(*c)) for c in PAGED_CANDIDATES[d]]
        for name, cfg in variants:
            t = _timed(name, lambda x, o, c=cfg: _paged(x, emulate, c, o, causal), sets, p, rows,
                       dict(table="paged", config=(cfg or chosen).name))
            rows[-1]["paged_over_dense"] = t / dense
            print(f"{p.name:28s} {name}: paged / dense time = {t / dense:.3f}", flush=True)
        del sets
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--only", choices=("gqa", "paged"), default=None)
    ap.add_argument("--paged-candidates", action="store_true", help="also time PAGED_CANDIDATES in the paged table")
    ap.add_argument("--paged-keys", default="128:causal,64:causal",
                    help="head_dim:mask pairs of the paged table (mask: causal or none)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (an SM120, or SM80+ with FLASH_ATTN_SM120_EMULATE=1)")
    info = device_info()
    if not info.uses_sm120_kernels:
        sys.exit("needs an SM120 GPU, or FLASH_ATTN_SM120_EMULATE=1 on another GPU (SM80+)")
    mode = "SM120" if info.mode == "sm120" else "emulated"
    print(info.label(), flush=True)
    rows = []
    if args.only in (None, "gqa"):
        rows += run_gqa(info.emulate_host_smem)
    if args.only in (None, "paged"):
        keys = [(int(d), m == "causal") for d, m in (k.split(":") for k in args.paged_keys.split(","))]
        rows += run_paged(info.emulate_host_smem, args.paged_candidates, keys)
    if args.json:
        args.json.write_text(json.dumps(dict(
            gpu=torch.cuda.get_device_name(), mode=mode, date=time.strftime("%Y-%m-%d %H:%M:%S"),
            command="python " + " ".join(sys.argv), commit=prepare.git_commit(),
            occupancy_verified=occupancy.all_verified(), occupancy=[r.to_dict() for r in occupancy.records()],
            unchecked_kernels=occupancy.unchecked(),
            rows=rows), indent=1))


if __name__ == "__main__":
    main()
