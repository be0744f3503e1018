"""explain(): the dispatch decision without running it (meta tensors, CPU only)."""

from __future__ import annotations

import pytest
import torch

from flash_attn_sm120 import driver_splitkv, hardware
from flash_attn_sm120.config import load_fwd_table, select_fwd_config
from flash_attn_sm120.decode import load_decode_table, select_decode_config
from flash_attn_sm120.explain import explain, main

META = dict(device="meta", dtype=torch.bfloat16)


def _qkv(b=2, sq=1024, sk=1024, h=16, hk=16, d=128):
    return (torch.empty(b, sq, h, d, **META), torch.empty(b, sk, hk, d, **META), torch.empty(b, sk, hk, d, **META))


def test_dense_causal_prefill_runs_the_tables_first_entry():
    q, k, v = _qkv()
    e = explain(q, k, v, causal=True)
    want = select_fwd_config(load_fwd_table(), 128, 128, True, False)
    assert e.route == "driver" and e.config == want and e.fallback is None and e.num_splits == 1
    smem = want.smem_bytes(128, 128) + hardware.DSL_STATIC_SMEM
    assert e.smem_bytes == smem and e.ctas_per_sm == hardware.sm120_occupancy(
        smem, want.num_threads + (128 if want.family == "tma" else 0)).ctas_per_sm
    assert e.grid_ctas == 2 * 16 * -(-1024 // want.tile_m)


def test_a_refused_family_says_why_and_falls_back_to_cpasync():
    first = select_fwd_config(load_fwd_table(), 128, 128, True, False)
    if first.family != "tma":
        pytest.skip("the table's causal d128 entry is not a TMA entry: nothing falls back")
    q, k, v = _qkv(h=32, hk=8)  # 4 query heads per KV head: the TMA family packs them
    packed = explain(q, k, v, causal=True)
    assert packed.family == "tma" and packed.pack_gqa and packed.fallback is None
    q, k, v = _qkv(h=24, hk=8)  # 3 per KV head do not tile the TMA entry's rows
    odd = explain(q, k, v, causal=True, pack_gqa=True)
    assert odd.family == "cpasync" and odd.pack_gqa and "pack_gqa" in odd.fallback
    default = explain(q, k, v, causal=True)  # a defaulted pack_gqa is turned off to keep the TMA entry
    assert default.family == "tma" and not default.pack_gqa and default.fallback is None
    qv = torch.empty(2048, 32, 128, **META)
    kv = torch.empty(2048, 8, 128, **META)
    cu = torch.empty(3, device="meta", dtype=torch.int32)
    varlen = explain(qv, kv, kv, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1024, max_seqlen_k=1024)
    assert varlen.family == "tma" and varlen.pack_gqa  # ragged TMA descriptors, GQA packed
    kpad = torch.empty(2, 1024, 8, 128, **META)
    used = torch.empty(2, device="meta", dtype=torch.int32)
    cache = explain(qv, kpad, kpad, causal=True, cu_seqlens_q=cu, seqused_k=used, max_seqlen_q=1024)
    assert cache.family == "cpasync" and "seqused_k" in cache.fallback


def test_decode_with_automatic_splits_matches_the_planner():
    for b, sk in ((1, 32768), (8, 4096), (1, 131072)):
        q, k, v = _qkv(b=b, sq=1, sk=sk, h=32, hk=8)
        e = explain(q, k, v, num_splits=0, num_sms=188)
        plan = driver_splitkv.plan(head_dim=128, head_dim_v=128, causal=False, local=False, window_size_left=None,
                                   window_size_right=None, batch=b, max_seqlen_q=1, max_seqlen_k=sk, num_heads=32,
                                   num_heads_kv=8, pack_gqa=True, num_splits=0, num_sms=188)
        assert e.decode and e.num_splits == plan.num_splits > 1
        dec = select_decode_config(load_decode_table(), 128, 128)
        assert (e.config.num_threads, e.config.tile_m, e.config.tile_n, e.config.num_stages) == (
            dec.num_threads, dec.tile_m, dec.tile_n, dec.num_stages)
        assert e.route == "splitkv" and e.grid_ctas == plan.total_mblocks * plan.num_splits
    q, k, v = _qkv(b=1, sq=1, sk=32768, h=32, hk=8)
    assert explain(q, k, v).num_splits == 1  # num_splits=1 (the default) is off, as upstream


def test_paged_prefill_takes_the_splitkv_route():
    q = torch.empty(2 * 512, 32, 128, **META)
    pool = torch.empty(2 * 8, 64, 8, 128, **META)
    table = torch.empty(2, 8, device="meta", dtype=torch.int32)
    cu = torch.empty(3, device="meta", dtype=torch.int32)
    e = explain(q, pool, pool, causal=True, page_table=table, cu_seqlens_q=cu, max_seqlen_q=512)
    assert e.route == "splitkv" and e.family == "splitkv" and e.num_splits == 1 and not e.decode


def test_cli_prints_a_summary(capsys):
    assert main(["--batch", "1", "--seqlen-q", "1", "--seqlen-k", "32768", "--num-splits", "0"]) == 0
    out = capsys.readouterr().out
    assert "route      splitkv (decode table)" in out and "SM120" in out and "splits" in out


def test_paged_prefill_reports_a_config_the_splitkv_family_cannot_take():
    """The table's causal entry (a TMA tile with Q in registers and 2 stages) cannot run in the splitkv
    family; explain names the config that runs instead (driver_splitkv.kernel_config's fallback)."""
    first = select_fwd_config(load_fwd_table(), 128, 128, True, False)
    if first.family != "tma":
        pytest.skip("the table's causal d128 entry is not a TMA entry")
    q = torch.empty(2 * 512, 32, 128, **META)
    pool = torch.empty(2 * 8, 64, 8, 128, **META)
    table = torch.empty(2, 8, device="meta", dtype=torch.int32)
    cu = torch.empty(3, device="meta", dtype=torch.int32)
    e = explain(q, pool, pool, causal=True, page_table=table, cu_seqlens_q=cu, max_seqlen_q=512)
    assert e.fallback is not None and first.name in e.fallback and e.config.name in e.fallback
    assert e.config == driver_splitkv.kernel_config(first, 128, 128, True, False)


def test_paged_prefill_at_d112_reports_a_tile_the_page_gathers_can_fill():
    """At d=112 the page gathers move 64 rows per pass with 4 warps: the 48-key d128 entries give way."""
    from flash_attn_sm120.kernels.fwd_splitkv_paged import paged_tile_error

    q = torch.empty(2, 512, 32, 112, **META)
    pool = torch.empty(2 * 8, 64, 8, 112, **META)
    table = torch.empty(2, 8, device="meta", dtype=torch.int32)
    e = explain(q, pool, pool, page_table=table)
    assert e.route == "splitkv" and paged_tile_error(e.config.num_threads, e.config.tile_n, 112, 112) is None
    dense = explain(q, torch.empty(2, 512, 8, 112, **META), torch.empty(2, 512, 8, 112, **META))
    if paged_tile_error(dense.config.num_threads, dense.config.tile_n, 112, 112) is None:
        pytest.skip(f"the table's d112 tile {dense.config.name} is pageable: nothing to route around")
    assert (e.config.tile_m, e.config.tile_n) != (dense.config.tile_m, dense.config.tile_n)


def test_cli_runs_without_warnings_and_documents_every_option():
    """`python -m flash_attn_sm120.explain`: no runpy warning (the package imports explain lazily), no
    NumPy warning (numpy is a dependency), and --help describes each option."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-W", "always", "-m", "flash_attn_sm120.explain", "--seqlen-k", "4096"],
                         capture_output=True, text=True, check=True)
    assert "found in sys.modules" not in run.stderr and "Failed to initialize NumPy" not in run.stderr, run.stderr
    helptext = subprocess.run([sys.executable, "-m", "flash_attn_sm120.explain", "--help"], capture_output=True,
                              text=True, check=True).stdout
    lines = helptext.splitlines()
    options = [i for i, line in enumerate(lines) if line.strip().startswith("--")]
    assert len(options) == 10
    for i in options:  # a description on the option's line, or on the next (argparse wraps long names)
        assert len(lines[i].split(None, 2)) == 3 or lines[i + 1].startswith(" " * 20), lines[i]
