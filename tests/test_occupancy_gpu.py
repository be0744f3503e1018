"""Verified emulation occupancy on a GPU: every shipped config runs at SM120's CTAs per SM.

For each config the kernel is compiled and launched the way the package launches it, and the record
the driver's occupancy check made (the CUDA occupancy API on the compiled function, with its block
size and launched dynamic shared memory) must show the host's CTAs per SM equal to SM120's. The SM120
count is cross-checked against the sm_120a cubin of the same config (registers and static shared
memory from that cubin, compiled on this machine's CPU). A waves test then times 1x and 2x the SM
count of CTAs: about 2.0x the time for a 1-CTA/SM config, well under that for a 2-CTA/SM one.
"""

from __future__ import annotations

import pytest
import torch

from flash_attn_sm120 import bench, codegen, driver, driver_splitkv, hardware, occupancy
from flash_attn_sm120.config import FwdConfig, load_fwd_table, upstream_fwd_config
from flash_attn_sm120.decode import load_decode_table, load_prefill_table
from flash_attn_sm120.device import device_info

pytestmark = pytest.mark.gpu

FWD = sorted({(e.head_dim, e.mask, e.config) for e in load_fwd_table()}, key=str)
# upstream's SM120 tiles, the references every ratio is taken against (d=256 does not fit 99 KB)
UPSTREAM = [(d, mask, upstream_fwd_config(d)) for d in (64, 96, 128, 192) for mask in ("none", "causal")]
DECODE = [(e.head_dim, e.config) for e in load_decode_table()]
PREFILL = sorted({(e.head_dim, e.mask, e.config) for e in load_prefill_table()}, key=str)


def _new_records(before: int) -> list:
    recs = occupancy.records()[before:]
    assert recs, "the call compiled nothing (already cached?) or recorded no occupancy check"
    return recs


def _assert_emulated_match(rec) -> None:
    assert rec.mode == "emulated", rec
    assert rec.host_ctas_per_sm == rec.sm120_ctas_per_sm >= 1, rec.to_dict()
    # shared memory alone (the host's measured static size and reservation, nothing assumed) holds the
    # host to SM120's count without registers; registers may then lower both counts alike
    info = device_info()
    by_smem = info.smem_per_sm // (rec.dynamic_smem + rec.host_static_smem + info.reserved_smem_per_cta)
    assert by_smem <= hardware.sm120_occupancy(rec.unpadded_smem + hardware.DSL_STATIC_SMEM, rec.threads).ctas_per_sm


def _sm120a_count(cubin: bytes, launched_smem: int, threads: int) -> int:
    """CTAs/SM on SM120 from the sm_120a cubin's own registers and static shared memory."""
    res, _, _ = codegen.inspect_cubin(cubin)
    return hardware.sm120_occupancy(launched_smem + res["shared"], threads, res["regs"]).ctas_per_sm


def _dense(d, causal, b=1, s=256, h=2, hk=2, dtype="bfloat16"):
    return bench.make_inputs(bench.Problem(b, s, s, h, hk, d, causal=causal, dtype=dtype), seed=d)


@pytest.mark.parametrize("d,mask,cfg", FWD + UPSTREAM, ids=[f"{d}-{m}-{c.name}" for d, m, c in FWD + UPSTREAM])
def test_forward_configs_run_at_sm120_occupancy(d, mask, cfg):
    causal = mask == "causal"
    x = _dense(d, causal)
    before = len(occupancy.records())
    driver.clear_cache()
    out, _ = driver.forward(x["q"], x["k"], x["v"], softmax_scale=None, causal=causal, window_size_left=None,
                            window_size_right=None, softcap=None, pack_gqa=None, need_lse=False,
                            emulate_host_smem=device_info().emulate_host_smem, config=cfg)
    torch.cuda.synchronize()
    (rec,) = _new_records(before)
    _assert_emulated_match(rec)
    kernels: list = []
    cubin, _ = codegen.compile_fwd_cubin(cfg, d, causal=causal, kernel_out=kernels)
    assert kernels[0].launch_threads == rec.threads
    assert _sm120a_count(cubin, rec.unpadded_smem, rec.threads) == rec.sm120_ctas_per_sm, rec.to_dict()


def _splitkv_case(d, cfg, paged: bool, causal: bool):
    b, sk, hk, group = 2, 1024, 2, 4
    g = torch.Generator(device="cuda").manual_seed(d)
    sq = 1 if not causal else 64
    q = torch.randn(b, sq, hk * group, d, device="cuda", generator=g).bfloat16()
    k = torch.randn(b, sk, hk, d, device="cuda", generator=g).bfloat16()
    v = torch.randn(b, sk, hk, d, device="cuda", generator=g).bfloat16()
    page_table = None
    if paged:
        page = 64
        k, v = (t.reshape(b * sk // page, page, hk, d) for t in (k, v))
        page_table = torch.arange(b * sk // page, dtype=torch.int32, device="cuda").view(b, sk // page)
    before = len(occupancy.records())
    driver_splitkv.clear_cache()
    driver_splitkv.forward(q, k, v, page_table=page_table, num_splits=2, softmax_scale=None, causal=causal,
                           window_size_left=None, window_size_right=None, softcap=None, pack_gqa=None,
                           need_lse=True, emulate_host_smem=device_info().emulate_host_smem, config=cfg)
    torch.cuda.synchronize()
    recs = _new_records(before)
    return [r for r in recs if r.name.startswith("splitkv")]


@pytest.mark.parametrize("d,cfg", DECODE, ids=[f"decode-{d}-{c.name}" for d, c in DECODE])
@pytest.mark.parametrize("paged", [False, True])
def test_decode_configs_run_at_sm120_occupancy(d, cfg, paged):
    (rec,) = _splitkv_case(d, cfg, paged, causal=False)
    _assert_emulated_match(rec)
    cubin, _ = codegen.compile_splitkv_cubin(cfg, d, split=True, paged=paged, qhead_per_kvhead=4)
    assert _sm120a_count(cubin, rec.unpadded_smem, rec.threads) == rec.sm120_ctas_per_sm, rec.to_dict()


@pytest.mark.parametrize("d,mask,cfg", PREFILL, ids=[f"prefill-{d}-{m}-{c.name}" for d, m, c in PREFILL])
def test_prefill_configs_run_at_sm120_occupancy(d, mask, cfg):
    (rec,) = _splitkv_case(d, cfg, paged=True, causal=mask == "causal")
    _assert_emulated_match(rec)
    cubin, _ = codegen.compile_splitkv_cubin(cfg, d, split=True, paged=True, causal=mask == "causal",
                                             qhead_per_kvhead=4)
    assert _sm120a_count(cubin, rec.unpadded_smem, rec.threads) == rec.sm120_ctas_per_sm, rec.to_dict()


def test_occupancy_mismatch_raises():
    """A host that claims less shared memory per SM than it has: padding leaves room for more CTAs than
    SM120, the occupancy API sees it, and the launch is refused with both counts named."""
    info = device_info()
    lying = hardware.EmulationHost(info.smem_per_sm // 2, info.smem_per_block_max, info.reserved_smem_per_cta)
    x = _dense(128, False)
    driver.clear_cache()
    with pytest.raises(RuntimeError, match=r"another occupancy: .*fits [2-9] CTAs per SM.*SM120 fits 1"):
        driver.forward(x["q"], x["k"], x["v"], softmax_scale=None, causal=False, window_size_left=None,
                       window_size_right=None, softcap=None, pack_gqa=None, need_lse=False,
                       emulate_host_smem=lying, config=upstream_fwd_config(128))


def _wave_time(cfg: FwdConfig, d: int, heads: int, reps: int = 20) -> float:
    tile_m = cfg.tile_m
    p = bench.Problem(1, tile_m, 16384, heads, heads, d)  # one CTA per head, long K loop
    sets = [bench.make_inputs(p, seed=i) for i in range(2)]
    host = device_info().emulate_host_smem

    def run(i):
        x = sets[i]
        driver.forward(x["q"], x["k"], x["v"], softmax_scale=None, causal=False, window_size_left=None,
                       window_size_right=None, softcap=None, pack_gqa=None, need_lse=False,
                       emulate_host_smem=host, config=cfg)

    return bench.time_cuda(run, rotations=len(sets), reps=reps).median_ms


@pytest.mark.parametrize("cfg,d,ctas,lo,hi", [
    (FwdConfig(128, 128, 64), 128, 1, 1.8, 2.25),  # upstream's d128 tile: 64 KB, 1 CTA/SM on SM120
    (FwdConfig(128, 128, 64), 64, 2, 0.9, 1.5),    # the same tile at d64: 32 KB, 2 CTAs/SM
])
def test_waves(cfg, d, ctas, lo, hi):
    """2x the SM count of CTAs takes two waves at 1 CTA/SM and about one at 2 CTAs/SM."""
    sms = device_info().num_sms
    assert occupancy.sm120_count(cfg.smem_bytes(d, d), cfg.num_threads, 255).ctas_per_sm == ctas
    _wave_time(cfg, d, sms // 2)  # compile + warm up
    ratio = _wave_time(cfg, d, 2 * sms) / _wave_time(cfg, d, sms)
    print(f"waves {cfg.name} d{d} ({ctas} CTA/SM): t(2x SMs) / t(1x SMs) = {ratio:.2f}")
    assert lo <= ratio <= hi, ratio
