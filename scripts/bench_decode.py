"""Decode and paged-prefill benchmark: achieved KV bandwidth of SplitKV / paged KV on SM120.

For b in {1, 8, 64} x seqlen_k in {4k, 32k, 128k} (combos over ~8 GB of K+V skipped), GQA 32:8,
d = 128, seqlen_q = 1, it times
  * ours-dense:  this package's SplitKV driver, dense KV, num_splits=0 (automatic split count,
                 decode config);
  * ours-api:    the same through the public flash_attn_func (validation and autograd wrapper included);
  * ours-paged:  the same over a shuffled page table (page size --page-size);
  * upstream:    upstream FA4's SM120 path: the cp.async family with upstream's config
                 (config.upstream_fwd_config(128): 4 warps, 128x64, 1 stage), dense KV, no split
                 (padded to SM120 occupancy in emulation, like ours),
each twice: eager (calls queued back to back, CUDA events: includes the host whenever the host
path is longer than the GPU work) and inside a CUDA graph (bench.time_cuda_graph: the GPU time, as
an inference engine that captures its decode step sees it). It reports KV bandwidth = bytes of K
and V read / time, next to the device's copy bandwidth
measured in the same run (a large device-to-device copy, bytes read + written). Then paged vs
dense prefill (b=4, s=4096, causal, 32:8, d=128) for a few page sizes.
Every line carries the mode label (SM120 native / SM120 emulated on ...); --out writes JSON.

  FLASH_ATTN_SM120_EMULATE=1 python scripts/bench_decode.py --out decode.json
  FLASH_ATTN_SM120_EMULATE=1 python scripts/bench_decode.py --candidates --splits 0,32,64 --batches 1,8
  FLASH_ATTN_SM120_EMULATE=1 python scripts/bench_decode.py --candidates --head-dims 64,96 --batches 1,8

--head-dims times the decode rows at other head dims (same GQA 32:8); with --candidates each head
dim gets its candidate decode configs (decode_candidates: the d=128 sweep's list at d=128, else
every 4-warp 64-row tile with tile_n 32/64/128 and 1-3 stages that fits, plus 8 warps 128x64).

Targets (issue 7): ours >= 60% of copy bandwidth at b=1, seqlen_k >= 32k; ours never slower than
upstream on any decode shape; paged prefill within 10% of dense.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402

import prepare  # noqa: E402

from flash_attn_sm120 import bench, driver, driver_splitkv, occupancy  # noqa: E402
from flash_attn_sm120.config import FwdConfig, upstream_fwd_config  # noqa: E402
from flash_attn_sm120.device import device_info  # noqa: E402
from flash_attn_sm120.interface import flash_attn_func  # noqa: E402

H, HK, D = 32, 8, 128
KV_LIMIT_BYTES = 8 * 10**9
CANDIDATES = [  # decode configs for --candidates at d=128 (splitkv family)
    FwdConfig(128, 64, 64, 2, False, "splitkv"),
    FwdConfig(128, 64, 128, 1, False, "splitkv"),
    FwdConfig(128, 64, 64, 1, False, "splitkv"),
    FwdConfig(128, 64, 32, 3, False, "splitkv"),
    FwdConfig(128, 64, 32, 2, False, "splitkv"),  # 48 KB: 2 CTAs per SM
    FwdConfig(256, 128, 64, 2, False, "splitkv"),
    FwdConfig(128, 64, 32, 1, False, "splitkv"),  # 32 KB: 2 CTAs per SM, one tile in flight each
]


def decode_candidates(head_dim: int) -> list[FwdConfig]:
    """Decode configs to time at this head dim (those that fit SM120's 99 KB, in a fixed order)."""
    if head_dim == D:
        return list(CANDIDATES)
    pool = [FwdConfig(128, 64, n, st, False, "splitkv") for n in (32, 64, 128) for st in (1, 2, 3)]
    pool.append(FwdConfig(256, 128, 64, 2, False, "splitkv"))
    return [c for c in pool if c.error(head_dim, head_dim) is None]


def timed(fn, rotations: int) -> bench.Timing:
    """bench.time_cuda with fewer repetitions for slow calls (an unsplit b=1 decode over 128k keys
    runs on 8 SMs and takes seconds)."""
    fn(0)  # compile / load outside the probe
    probe_ms = bench.event_times(lambda i: fn(0), 1)[0]
    if probe_ms > 50:
        return bench.time_cuda(fn, rotations=rotations, warmup=1, reps=5)
    return bench.time_cuda(fn, rotations=rotations, warmup=3, reps=30)


def copy_bandwidth(nbytes: int = 2 * 2**30) -> float:
    """Bytes read + written per second of a large device-to-device copy."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    t = bench.time_cuda(lambda i: dst.copy_(src), rotations=1, warmup=3, reps=20)
    return 2 * nbytes / (t.median_ms * 1e-3)


def _call_ours(x, emulate, num_splits=0, config=None):
    return driver_splitkv.forward(
        x["q"], x["k"], x["v"], page_table=x.get("page_table"), num_splits=num_splits, softmax_scale=None,
        causal=x.get("causal", False), window_size_left=None, window_size_right=None, softcap=None,
        pack_gqa=None, need_lse=False, emulate_host_smem=emulate, config=config,
    )


def _call_upstream(x, emulate):
    return driver.forward(
        x["q"], x["k"], x["v"], softmax_scale=None, causal=x.get("causal", False), window_size_left=None,
        window_size_right=None, softcap=None, pack_gqa=None, need_lse=False, emulate_host_smem=emulate,
        config=upstream_fwd_config(x["q"].shape[-1]),
    )


def decode_shapes(head_dim: int = D):
    for b in (1, 8, 64):
        for sk in (4096, 32768, 131072):
            if b * sk * HK * head_dim * 2 * 2 > KV_LIMIT_BYTES:
                continue
            yield b, sk


def _graph_or_none(fn, rot):
    """CUDA-graph time per call, or None (with the reason printed) when fn cannot be captured."""
    try:
        return bench.time_cuda_graph(fn, rotations=rot, reps=10)
    except Exception as e:  # noqa: BLE001 - reported in the row, the eager time still stands
        print(f"  (no CUDA graph: {type(e).__name__}: {str(e)[:200]})", flush=True)
        torch.cuda.synchronize()
        return None


def _call_api(x, num_splits=0):
    return flash_attn_func(x["q"], x["k"], x["v"], num_splits=num_splits)[0]


def run_decode(label, emulate, copy_bw, page_size, candidates: bool, splits_sweep=(0,), batches=(1, 8, 64),
               head_dim: int = D):
    rows = []
    gen = torch.Generator().manual_seed(0)
    for b, sk in decode_shapes(head_dim):
        if b not in batches:
            continue
        p = bench.Problem(b, 1, sk, H, HK, head_dim, tag="decode")
        rot = bench.rotations_for(p)
        sets = [bench.make_inputs(p, seed=i) for i in range(rot)]
        kv_bytes = bench.kv_bytes(p)
        variants = {}
        up_error = upstream_fwd_config(head_dim).error(head_dim, head_dim)
        if up_error is None:
            variants["upstream"] = lambda i: _call_upstream(sets[i], emulate)
        elif b == batches[0] and sk == 4096:
            print(f"[{label}] decode d={head_dim}: no upstream row, its SM120 tile cannot run: {up_error}", flush=True)
        if candidates:
            for cfg in decode_candidates(head_dim):
                for ns in splits_sweep:
                    variants[f"ours-dense[{cfg.name}][splits={ns}]"] = (
                        lambda c, n: lambda i: _call_ours(sets[i], emulate, num_splits=n, config=c))(cfg, ns)
        else:
            variants["ours-dense"] = lambda i: _call_ours(sets[i], emulate)
            variants["ours-api"] = lambda i: _call_api(sets[i])
            paged = []
            for x in sets:
                pk, pv, pt = bench.paged_copy(x["k"], x["v"], page_size, gen)
                paged.append(dict(q=x["q"], k=pk, v=pv, page_table=pt))
            variants[f"ours-paged{page_size}"] = lambda i: _call_ours(paged[i], emulate)
        plan = driver_splitkv.plan(
            head_dim=head_dim, head_dim_v=head_dim, causal=False, local=False, window_size_left=None, window_size_right=None,
            batch=b, max_seqlen_q=1, max_seqlen_k=sk, num_heads=H, num_heads_kv=HK, pack_gqa=True, num_splits=0,
            num_sms=device_info().num_sms,
        )
        gpu_times, eager_times = {}, {}
        for name, fn in variants.items():
            t = timed(fn, rot)
            host_us = None if candidates else bench.host_us_per_call(fn, rot)
            g = _graph_or_none(fn, rot)
            eager_times[name] = t.median_ms
            gpu_ms = g.median_ms if g else None
            if gpu_ms is not None:
                gpu_times[name] = gpu_ms
            bw = kv_bytes / (t.median_ms * 1e-3)
            gbw = kv_bytes / (gpu_ms * 1e-3) if gpu_ms else None
            row = dict(
                mode=label, kind="decode", variant=name, batch=b, seqlen_k=sk, nheads=H, nheads_kv=HK, head_dim=head_dim,
                kv_bytes=kv_bytes, median_ms=t.median_ms, p10_ms=t.p10_ms, p90_ms=t.p90_ms,
                kv_bandwidth_GBps=bw / 1e9, copy_bandwidth_GBps=copy_bw / 1e9, frac_of_copy=bw / copy_bw,
                graph_ms=gpu_ms, graph_p10_ms=g.p10_ms if g else None, graph_p90_ms=g.p90_ms if g else None,
                graph_kv_bandwidth_GBps=gbw / 1e9 if gbw else None, graph_frac_of_copy=gbw / copy_bw if gbw else None,
                num_splits_auto=plan.num_splits, decode_config=plan.config.name, rotations=rot,
                host_us_per_call=host_us,
            )
            rows.append(row)
            graph_txt = f"graph {gpu_ms:8.4f} ms {gbw / 1e9:7.1f} GB/s = {gbw / copy_bw:5.1%}" if gpu_ms else "graph n/a"
            host_txt = f"; host {host_us:6.1f} us/call" if host_us is not None else ""
            print(f"[{label}] decode d={head_dim:<3} b={b:<3} sk={sk:<6} {name:<44} eager {t.median_ms:8.4f} ms "
                  f"{bw / copy_bw:5.1%} | {graph_txt}  (splits auto={plan.num_splits}{host_txt})", flush=True)
        for kind, times in (("eager", eager_times), ("graph", gpu_times)):
            ours = {k: v for k, v in times.items() if k.startswith("ours")}
            if ours and "upstream" in times:
                best = min(ours, key=ours.get)
                print(f"[{label}] decode d={head_dim:<3} b={b:<3} sk={sk:<6} {kind}: best ours ({best}) / upstream time = "
                      f"{ours[best] / times['upstream']:.3f}", flush=True)
        del sets, variants
        torch.cuda.empty_cache()
    return rows


def run_paged_prefill(label, emulate, page_sizes):
    rows = []
    gen = torch.Generator().manual_seed(1)
    p = bench.Problem(4, 4096, 4096, H, HK, D, causal=True, tag="prefill")
    rot = bench.rotations_for(p)
    sets = [dict(bench.make_inputs(p, seed=i), causal=True) for i in range(rot)]
    dense = timed(lambda i: _call_ours(sets[i], emulate, num_splits=1), rot)
    flops = bench.attention_flops(p)
    print(f"[{label}] prefill {p.name} dense          {dense.median_ms:8.3f} ms "
          f"{flops / dense.median_ms / 1e9:7.1f} TFLOPS", flush=True)
    rows.append(dict(mode=label, kind="prefill", variant="dense", problem=p.name, median_ms=dense.median_ms,
                     p10_ms=dense.p10_ms, p90_ms=dense.p90_ms, tflops=flops / dense.median_ms / 1e9))
    for ps in page_sizes:
        paged = []
        for x in sets:
            pk, pv, pt = bench.paged_copy(x["k"], x["v"], ps, gen)
            paged.append(dict(q=x["q"], k=pk, v=pv, page_table=pt, causal=True))
        t = timed(lambda i: _call_ours(paged[i], emulate, num_splits=1), rot)
        print(f"[{label}] prefill {p.name} paged{ps:<4}      {t.median_ms:8.3f} ms "
              f"{flops / t.median_ms / 1e9:7.1f} TFLOPS  paged/dense time = {t.median_ms / dense.median_ms:.3f}",
              flush=True)
        rows.append(dict(mode=label, kind="prefill", variant=f"paged{ps}", problem=p.name, page_size=ps,
                         median_ms=t.median_ms, p10_ms=t.p10_ms, p90_ms=t.p90_ms,
                         tflops=flops / t.median_ms / 1e9, paged_over_dense=t.median_ms / dense.median_ms))
        del paged
    return rows


def profile_host(calls: int = 300, top: int = 30) -> None:
    """cProfile of the public API's decode call (b=1, 4k keys, automatic splits): where the host
    time per call goes. The GPU work is real; the profile counts only Python-visible host time."""
    import cProfile
    import pstats

    p = bench.Problem(1, 1, 4096, H, HK, D, tag="decode")
    x = bench.make_inputs(p, seed=0)
    for _ in range(5):
        _call_api(x)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    for _ in range(calls):
        _call_api(x)
    prof.disable()
    host = (time.perf_counter() - t) / calls * 1e6
    torch.cuda.synchronize()
    print(f"host profile: flash_attn_func decode b1 sk4096, {calls} calls, {host:.1f} us/call under cProfile")
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)
    pstats.Stats(prof).sort_stats("cumulative").print_stats(top)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="JSON file for the results")
    ap.add_argument("--page-size", type=int, default=64, help="page size of the paged decode rows")
    ap.add_argument("--prefill-page-sizes", default="16,64,256", help="page sizes of the paged prefill rows")
    ap.add_argument("--candidates", action="store_true", help="time the decode config candidates instead")
    ap.add_argument("--splits", default="0", help="comma list of num_splits for --candidates (0 = chooser)")
    ap.add_argument("--batches", default="1,8,64", help="comma list of batch sizes")
    ap.add_argument("--head-dims", default=str(D), help="comma list of head dims of the decode rows")
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--profile-host", action="store_true", help="only a cProfile of the public decode call")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (SM120, or SM80+ with FLASH_ATTN_SM120_EMULATE=1)")
    info = device_info()
    if not info.uses_sm120_kernels:
        sys.exit(f"{info.label()}: set FLASH_ATTN_SM120_EMULATE=1 to run the SM120 kernels on this GPU")
    label = info.label()
    emulate = info.emulate_host_smem
    if args.profile_host:
        profile_host()
        return
    copy_bw = copy_bandwidth()
    print(f"[{label}] device-to-device copy bandwidth {copy_bw / 1e9:.1f} GB/s (read + write)", flush=True)
    rows = []
    for head_dim in (int(x) for x in args.head_dims.split(",")):
        rows += run_decode(label, emulate, copy_bw, args.page_size, args.candidates,
                           tuple(int(x) for x in args.splits.split(",")),
                           tuple(int(x) for x in args.batches.split(",")), head_dim)
    if not args.no_prefill and not args.candidates:
        rows += run_paged_prefill(label, emulate, [int(x) for x in args.prefill_page_sizes.split(",")])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(
            device=info.name, mode=info.mode, label=label, num_sms=info.num_sms,
            copy_bandwidth_GBps=copy_bw / 1e9, date=time.strftime("%Y-%m-%d %H:%M:%S"),
            command="python " + " ".join(sys.argv), commit=prepare.git_commit(),
            occupancy_verified=occupancy.all_verified(), occupancy=[r.to_dict() for r in occupancy.records()],
            unchecked_kernels=occupancy.unchecked(),
            rows=rows,
        ), indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
