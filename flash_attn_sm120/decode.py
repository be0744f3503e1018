"""Decode configs: which problems are decode-shaped and which tiles they get (pure, CPU-tested).

A forward is decode-shaped when every sequence has at most DECODE_MAX_SEQLEN_Q query tokens
(generation steps, speculative decoding). Its M tile then holds the whole GQA group of one KV
head (pack_gqa) and its time is the read of K and V, so it gets its own table,
flash_attn_sm120/configs/sm120_decode.toml, instead of the prefill table (flash_attn_sm120/configs/sm120_fwd.toml); the dispatcher
(driver_splitkv.py) picks one or the other per call. Entries are keyed by head-dim bucket and
carry provenance; "unmeasured" entries say why they were chosen.

The same file's `[[prefill]]` entries serve paged / split *prefill* where the forward table's
entry for the (bucket, mask) cannot run in the splitkv family (its TMA entries): keyed and
selected like sm120_fwd.toml (config.parse_fwd_table's rules), family "splitkv" only.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Optional

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from flash_attn_sm120.config import (
    CONFIG_DIR,
    HEAD_DIM_BUCKETS,
    FwdConfig,
    TableEntry,
    head_dim_bucket,
    mask_kind,
    parse_fwd_table,
)

DECODE_TABLE_PATH = CONFIG_DIR / "sm120_decode.toml"
DECODE_MAX_SEQLEN_Q = 16
DECODE_FAMILY = "splitkv"


@dataclass(frozen=True)
class DecodeEntry:
    head_dim: int  # bucket upper bound
    config: FwdConfig
    provenance: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def measured(self) -> bool:
        return self.provenance.get("status") != "unmeasured"


def is_decode(max_seqlen_q: Optional[int]) -> bool:
    """Decode-shaped: a known query length of 1..DECODE_MAX_SEQLEN_Q tokens per sequence."""
    return max_seqlen_q is not None and 1 <= max_seqlen_q <= DECODE_MAX_SEQLEN_Q


def parse_decode_table(data: dict) -> list[DecodeEntry]:
    """Validate a parsed decode TOML document (ValueError on bad data)."""
    if data.get("schema") != 1:
        raise ValueError(f"decode table schema must be 1, got {data.get('schema')!r}")
    entries, seen = [], set()
    for i, raw in enumerate(data.get("decode", [])):
        where = f"decode entry {i}"
        try:
            head_dim = int(raw["head_dim"])
            cfg = FwdConfig.from_row(raw, DECODE_FAMILY)
        except KeyError as e:
            raise ValueError(f"{where}: missing key {e}") from None
        if head_dim not in HEAD_DIM_BUCKETS:
            raise ValueError(f"{where}: head_dim {head_dim} is not a bucket {HEAD_DIM_BUCKETS}")
        if cfg.family != DECODE_FAMILY:
            raise ValueError(f"{where}: family must be {DECODE_FAMILY!r}, got {cfg.family!r}")
        err = cfg.error(head_dim, head_dim)
        if err:
            raise ValueError(f"{where} (d={head_dim}): {err}")
        prov = raw.get("provenance")
        if not isinstance(prov, dict):
            raise ValueError(f"{where}: provenance table missing")
        if prov.get("status") == "unmeasured":
            if not prov.get("reason"):
                raise ValueError(f"{where}: an unmeasured entry needs a reason")
        elif not {"gpu", "mode", "date", "command"} <= prov.keys():
            raise ValueError(f"{where}: provenance needs gpu, mode, date, command (or status='unmeasured' + reason)")
        if head_dim in seen:
            raise ValueError(f"{where}: duplicate entry for d={head_dim}")
        seen.add(head_dim)
        entries.append(DecodeEntry(head_dim, cfg, dict(prov)))
    return entries


def load_decode_table(path: Path | str | None = None) -> tuple[DecodeEntry, ...]:
    return _load_cached(str(path or DECODE_TABLE_PATH))


@lru_cache(maxsize=8)
def _document(path: str) -> dict:
    """The parsed TOML file; its `[[decode]]` and `[[prefill]]` loaders share one read."""
    with open(path, "rb") as f:
        return tomllib.load(f)


@lru_cache(maxsize=8)
def _load_cached(path: str) -> tuple[DecodeEntry, ...]:
    return tuple(parse_decode_table(_document(path)))


def select_decode_config(table: Iterable[DecodeEntry], head_dim: int, head_dim_v: int) -> Optional[FwdConfig]:
    """The decode table's config for these head dims, or None (caller falls back to prefill's)."""
    bucket = head_dim_bucket(head_dim, head_dim_v)
    for e in table:
        if e.head_dim == bucket and e.config.error(head_dim, head_dim_v) is None:
            return e.config
    return None


def parse_prefill_table(data: dict) -> list[TableEntry]:
    """Validate the `[[prefill]]` entries of a parsed decode TOML document (ValueError on bad data)."""
    entries = parse_fwd_table({"schema": data.get("schema"), "fwd": data.get("prefill", [])})
    for e in entries:
        if e.config.family != DECODE_FAMILY:
            raise ValueError(
                f"prefill entry ({e.head_dim}, {e.mask}): family must be {DECODE_FAMILY!r}, got {e.config.family!r}"
            )
    return entries


def load_prefill_table(path: Path | str | None = None) -> tuple[TableEntry, ...]:
    return _load_prefill_cached(str(path or DECODE_TABLE_PATH))


@lru_cache(maxsize=8)
def _load_prefill_cached(path: str) -> tuple[TableEntry, ...]:
    return tuple(parse_prefill_table(_document(path)))


def select_prefill_config(
    table: Iterable[TableEntry], head_dim: int, head_dim_v: int, causal: bool, local: bool
) -> Optional[FwdConfig]:
    """The splitkv prefill entry of this (bucket, mask) (local: else the causal one), or None."""
    bucket = head_dim_bucket(head_dim, head_dim_v)
    kind = mask_kind(causal, local)
    for m in (kind, "causal") if kind == "local" else (kind,):
        for e in table:
            if (e.head_dim, e.mask) == (bucket, m) and e.config.error(head_dim, head_dim_v) is None:
                return e.config
    return None
