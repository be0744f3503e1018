"""Config table parsing and selection (pure, CPU)."""

import pytest

from flash_attn_sm120.config import (
    HEAD_DIM_BUCKETS,
    FwdConfig,
    TableEntry,
    head_dim_bucket,
    load_fwd_table,
    parse_fwd_table,
    select_fwd_config,
    upstream_fwd_config,
)
from flash_attn_sm120.hardware import SMEM_PER_BLOCK_MAX

PROV = {"gpu": "NVIDIA H200", "mode": "emulated", "date": "2026-11-29", "command": "x"}


def entry(d, mask, **kw):
    base = dict(head_dim=d, mask=mask, num_threads=256, tile_m=128, tile_n=96, num_stages=1, provenance=PROV)
    base.update(kw)
    return base


def test_shipped_table_parses_and_has_entries():
    table = load_fwd_table()
    assert len(table) >= 4, "flash_attn_sm120/configs/sm120_fwd.toml must ship measured entries"
    for e in table:
        assert e.config.error(e.head_dim, e.head_dim) is None
        assert e.provenance["mode"] in ("sm120", "emulated")
        for k in ("gpu", "date", "command", "tflops"):
            assert k in e.provenance, (e, k)


def test_parse_rejects_bad_tables():
    with pytest.raises(ValueError, match="schema"):
        parse_fwd_table({"schema": 2})
    with pytest.raises(ValueError, match="bucket"):
        parse_fwd_table({"schema": 1, "fwd": [entry(100, "none")]})
    with pytest.raises(ValueError, match="mask"):
        parse_fwd_table({"schema": 1, "fwd": [entry(128, "sliding")]})
    with pytest.raises(ValueError, match="shared memory"):
        parse_fwd_table({"schema": 1, "fwd": [entry(256, "none", tile_n=128, num_stages=2)]})
    with pytest.raises(ValueError, match="provenance"):
        bad = entry(128, "none")
        bad["provenance"] = {"gpu": "x"}
        parse_fwd_table({"schema": 1, "fwd": [bad]})
    with pytest.raises(ValueError, match="duplicate"):
        parse_fwd_table({"schema": 1, "fwd": [entry(128, "none"), entry(128, "none")]})
    with pytest.raises(ValueError, match="missing key"):
        parse_fwd_table({"schema": 1, "fwd": [{"head_dim": 128, "mask": "none"}]})


def test_selection_order():
    table = parse_fwd_table({"schema": 1, "fwd": [
        entry(128, "none", tile_n=96),
        entry(128, "causal", tile_n=64),
        entry(64, "none", num_threads=128, tile_m=64, tile_n=64, num_stages=2),
    ]})
    assert select_fwd_config(table, 128, 128, False, False).tile_n == 96
    assert select_fwd_config(table, 128, 128, True, False).tile_n == 64
    assert select_fwd_config(table, 120, 120, True, False).tile_n == 64  # bucket 128
    assert select_fwd_config(table, 128, 128, False, True).tile_n == 64  # local -> causal
    assert select_fwd_config(table, 64, 64, True, False).num_stages == 2  # causal -> none
    # no entry for the bucket: the spill-free fallback
    assert select_fwd_config(table, 96, 96, False, False) == FwdConfig(128, 64, 64, 1)


def test_selection_skips_config_that_cannot_run_actual_dims():
    # an entry valid at d=64 bucket but a d=56 problem: tile_m copy rule still holds -> same config
    table = [TableEntry(64, "none", FwdConfig(256, 128, 128, 1, False))]
    assert select_fwd_config(table, 56, 56, False, False) == FwdConfig(256, 128, 128, 1, False)


@pytest.mark.parametrize("d", list(range(8, 257, 8)))
@pytest.mark.parametrize("causal,local", [(False, False), (True, False), (False, True)])
def test_every_head_dim_gets_an_implementable_config(d, causal, local):
    cfg = select_fwd_config(load_fwd_table(), d, d, causal, local)
    assert cfg.error(d, d) is None
    assert cfg.smem_bytes(d, d) + 1024 <= SMEM_PER_BLOCK_MAX


def test_buckets():
    assert head_dim_bucket(8, 8) == 64
    assert head_dim_bucket(72, 64) == 96
    assert head_dim_bucket(128, 64) == 128
    assert head_dim_bucket(136, 136) == 192
    assert head_dim_bucket(256, 256) == 256
    with pytest.raises(ValueError):
        head_dim_bucket(264, 264)
    assert HEAD_DIM_BUCKETS[-1] == 256


def test_config_errors_name_the_problem():
    assert "multiple of 128" in FwdConfig(256, 64, 64).error(128, 128)
    assert "tile_n" in FwdConfig(128, 128, 40).error(128, 128)
    assert "shared memory" in FwdConfig(128, 128, 128, 2).error(128, 128)
    assert "num_threads" in FwdConfig(192, 128, 64).error(128, 128)
    assert "num_stages" in FwdConfig(128, 128, 64, 4).error(128, 128)
    assert "unknown kernel family" in FwdConfig(family="nope").error(128, 128)


def test_families_env_restricts_the_table(monkeypatch):
    """FLASH_ATTN_SM120_FAMILIES=cpasync keeps the dispatcher on upstream's kernel family (the escape
    hatch for a real SM120 until the TMA family has run there)."""
    from flash_attn_sm120 import config as cfgmod

    table = cfgmod.load_fwd_table()
    if not any(e.config.family != "cpasync" for e in table):
        pytest.skip("the shipped table has no non-cp.async entry")
    monkeypatch.setenv(cfgmod.FAMILIES_ENV, "cpasync")
    restricted = cfgmod.load_fwd_table()
    assert restricted and all(e.config.family == "cpasync" for e in restricted)
    for d in (64, 96, 128):
        assert cfgmod.select_fwd_config(restricted, d, d, True, False).family == "cpasync"
    monkeypatch.setenv(cfgmod.FAMILIES_ENV, "cpasync,warp9")
    with pytest.raises(ValueError, match="unknown kernel families"):
        cfgmod.load_fwd_table()


def test_driver_routes_calls_the_tma_family_refuses_to_the_cpasync_entry():
    """A table-chosen TMA config that cannot serve a call (seqused_k without cu_seqlens_k here) falls back to the table's
    cp.async entry of the same (bucket, mask); a defaulted pack_gqa the family cannot pack (3 query heads
    per KV head) is first turned off; an explicitly requested config raises NotImplementedError instead."""
    import torch

    from flash_attn_sm120 import driver
    from flash_attn_sm120.config import family_entries, load_fwd_table

    tma = next((e for e in load_fwd_table() if e.config.family == "tma" and e.mask == "causal"), None)
    if tma is None:
        pytest.skip("the shipped table has no causal TMA entry")
    d = tma.head_dim
    q = torch.zeros(2, 64, 8, d, dtype=torch.bfloat16)
    k = torch.zeros(2, 64, 2, d, dtype=torch.bfloat16)

    def statics(q=q, k=k, **kw):
        args = dict(causal=True, local=False, pack_gqa=False, has_lse=False, cu_seqlens_q=None, cu_seqlens_k=None,
                    seqused_q=None, seqused_k=None, window_size_left=None, window_size_right=None,
                    score_mod=None, mask_mod=None, aux_tensors=None, config=tma.config, emulate_host_smem=None)
        args.update(kw)
        return driver.build_statics(q, k, k, **args)

    packed = statics(pack_gqa=True)  # 4 query heads per KV head: the TMA family packs them
    assert driver._route(packed, False, False, True, False) == packed
    q6 = torch.zeros(2, 64, 6, d, dtype=torch.bfloat16)
    odd = statics(q=q6, pack_gqa=True)  # 3 per KV head do not tile 128 or 256 rows
    assert driver._route(odd, False, False, True, False).config == tma.config  # runs unpacked on TMA
    assert not driver._route(odd, False, False, True, False).pack_gqa
    chosen = driver._route(odd, True, False, True, False)  # packing asked for: the cp.async entry packs
    assert chosen.pack_gqa and chosen.config.family == "cpasync"
    varlen = statics(seqused_k=torch.zeros(2, dtype=torch.int32))
    routed = driver._route(varlen, False, False, True, False)
    want = next(e.config for e in family_entries("cpasync") if (e.head_dim, e.mask) == (d, "causal"))
    assert routed.config == want
    with pytest.raises(NotImplementedError, match="seqused_k without cu_seqlens_k"):
        driver._route(varlen, False, True, True, False)


def test_tables_ship_inside_the_package():
    """The tables are package data (a wheel carries them), not a link to a directory outside the package:
    scripts/wheel_check.py (run by .ci/run) builds and uses the wheel from outside the repository."""
    import sys
    from pathlib import Path

    from flash_attn_sm120.config import CONFIG_DIR

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    assert CONFIG_DIR.is_dir() and not CONFIG_DIR.is_symlink()
    assert {p.name for p in CONFIG_DIR.glob("*.toml")} >= {"sm120_fwd.toml", "sm120_bwd.toml", "sm120_decode.toml"}
    pyproject = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    assert "configs/*.toml" in pyproject["tool"]["setuptools"]["package-data"]["flash_attn_sm120"]


def test_selection_by_dtype_and_seqlen():
    """Entries are tried in table order: a float16 call skips a TMA tile that spills in float16
    (FwdConfig.dtype_error), and a short-sequence entry serves only dense calls with seqlen_q <= its
    seqlen_q_max (a call of unknown seqlen, e.g. varlen, skips it)."""
    tma = dict(family="tma", num_threads=256, tile_m=256, tile_n=64, num_stages=1)
    table = tuple(parse_fwd_table({"schema": 1, "fwd": [
        entry(128, "causal", num_threads=128, tile_m=64, tile_n=64, seqlen_q_max=1024),
        entry(128, "causal", **tma),
        entry(128, "causal", family="tma", num_threads=256, tile_m=256, tile_n=48, num_stages=1),
        entry(128, "causal", num_threads=128, tile_m=64, tile_n=32),
    ]}))
    assert FwdConfig(256, 256, 64, 1, family="tma").dtype_error("float16", 128) is not None
    assert FwdConfig(256, 256, 64, 1, family="tma").dtype_error("bfloat16", 128) is None
    pick = lambda **kw: select_fwd_config(table, 128, 128, True, False, **kw)  # noqa: E731
    assert pick(dtype="bfloat16", seqlen_q=8192).tile_n == 64 and pick(seqlen_q=8192).family == "tma"
    assert pick(dtype="float16", seqlen_q=8192).tile_n == 48
    assert pick(dtype="bfloat16", seqlen_q=1024).family == "cpasync"  # the short-sequence entry
    assert pick(dtype="bfloat16", seqlen_q=1025).family == "tma"
    assert pick(dtype="bfloat16").family == "tma"  # unknown seqlen: not the short-sequence entry
    # memoized per seqlen bucket, not per seqlen: both sides of the limit stay right on a second call
    assert pick(dtype="bfloat16", seqlen_q=512).family == "cpasync" and pick(dtype="bfloat16", seqlen_q=4096).family == "tma"
    with pytest.raises(ValueError, match="seqlen_q_max"):
        parse_fwd_table({"schema": 1, "fwd": [entry(128, "none", seqlen_q_max=0)]})
    # the same config may be listed once per seqlen_q_max, not twice for the same one
    parse_fwd_table({"schema": 1, "fwd": [entry(128, "none", seqlen_q_max=512), entry(128, "none")]})
    with pytest.raises(ValueError, match="duplicate"):
        parse_fwd_table({"schema": 1, "fwd": [entry(128, "none", seqlen_q_max=512), entry(128, "none", seqlen_q_max=512)]})


def test_driver_table_choice_reads_dtype_and_dense_seqlen():
    import torch

    from flash_attn_sm120 import driver

    bf, fp = (torch.zeros(2, 4096, 4, 128, dtype=dt) for dt in (torch.bfloat16, torch.float16))
    want_bf = select_fwd_config(load_fwd_table(), 128, 128, True, False, dtype="bfloat16", seqlen_q=4096)
    want_fp = select_fwd_config(load_fwd_table(), 128, 128, True, False, dtype="float16", seqlen_q=4096)
    assert driver.table_config(bf, bf, True, False) == want_bf
    assert driver.table_config(fp, fp, True, False) == want_fp
    assert want_fp.dtype_error("float16", 128) is None
    packed = torch.zeros(4096, 4, 128, dtype=torch.bfloat16)  # varlen: seqlen unknown
    assert driver.table_config(packed, packed, True, False, cu_seqlens_q=torch.zeros(3, dtype=torch.int32)) == \
        select_fwd_config(load_fwd_table(), 128, 128, True, False, dtype="bfloat16", varlen=True)


def test_pingpong_and_lpt_are_tma_options():
    assert FwdConfig(256, 128, 64, 2, family="tma", pingpong=True).error(128, 128) is None
    assert "two MMA warpgroups" in FwdConfig(128, 64, 64, 2, family="tma", pingpong=True).error(128, 128)
    assert "TMA-family schedule" in FwdConfig(256, 128, 64, 2, pingpong=True).error(128, 128)
    assert "TMA-family option" in FwdConfig(128, 64, 64, 1, lpt=False).error(128, 128)
    assert FwdConfig(256, 128, 64, 2, family="tma", pingpong=True, lpt=False).name == "tma-w8-128x64-s2-pp-nolpt"
    row = entry(128, "none", family="tma", num_threads=256, tile_m=128, tile_n=64, num_stages=2, pingpong=True, lpt=True)
    (e,) = parse_fwd_table({"schema": 1, "fwd": [row]})
    assert e.config.pingpong and e.config.lpt is True
