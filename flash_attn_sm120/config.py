"""Forward kernel configs: a dataclass, the TOML table in configs/, and a pure selection rule.

The table (flash_attn_sm120/configs/sm120_fwd.toml) is data: one entry per (head_dim bucket, mask kind) with the
kernel family, warps, tiles, stages and the provenance of the measurement that chose it.
`select_fwd_config` is a pure function of the table and the problem's static properties, so it is
tested on a CPU; the driver calls it once per compile key.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Optional

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from flash_attn_sm120.kernels import FAMILIES
from flash_attn_sm120.kernels.fwd_tma import (
    dynamic_error,
    fp16_register_error,
    persistent_error,
    pingpong_error,
    q_stages_error,
    smem_bytes as tma_smem_bytes,
    tma_config_error,
    varlen_register_error,
)

HEAD_DIM_BUCKETS = (64, 96, 128, 192, 256)
MASK_KINDS = ("none", "causal", "local")
CONFIG_DIR = Path(__file__).resolve().parent / "configs"
FWD_TABLE_PATH = CONFIG_DIR / "sm120_fwd.toml"
TABLE_ENV = "FLASH_ATTN_SM120_FWD_TABLE"  # path of another table to use (experiments, searches)
# comma list of kernel families the table may choose (default: all). "cpasync" keeps a real SM120 on
# upstream's kernel family until the TMA family has run there (see kernels/fwd_tma.py, RISK).
FAMILIES_ENV = "FLASH_ATTN_SM120_FAMILIES"


@dataclass(frozen=True)
class FwdConfig:
    """Static tiling of one forward kernel."""

    num_threads: int = 128
    tile_m: int = 128
    tile_n: int = 64
    num_stages: int = 1
    q_in_regs: bool = False
    family: str = "cpasync"
    pingpong: bool = False  # TMA family, 8 MMA warps: the two warpgroups take turns at the tensor pipe
    # TMA family tile order: None = longest-first (LPT) for causal masks, grid order otherwise;
    # True/False force it (the scheduling half of a causal gain, measured apart from TMA)
    lpt: Optional[bool] = None
    # TMA family: one wave of CTAs walks every tile, its K/V and Q loads for the next tile under the
    # current tile's epilogue (kernels/persistent_scheduler.py); varlen q keeps one CTA per tile
    persistent: bool = False
    # TMA family, persistent: Q slots. 2 = the producer loads the next tile's Q under this tile's main loop
    # (the epilogue's sO takes the retiring slot), at one more Q tile of shared memory
    q_stages: int = 1
    # TMA family, persistent: each CTA's next tile from a global counter (kernels/persistent_scheduler.py), so
    # that CTAs finishing early take more tiles, instead of a fixed stride
    dynamic: bool = False

    @property
    def num_warps(self) -> int:
        return self.num_threads // 32

    @property
    def name(self) -> str:
        q = "-qreg" if self.q_in_regs else ""
        pp = "-pp" if self.pingpong else ""
        lpt = "" if self.lpt is None else "-lpt" if self.lpt else "-nolpt"
        pers = "-pers" if self.persistent else ""
        q2 = f"-q{self.q_stages}" if self.q_stages != 1 else ""
        dyn = "-dyn" if self.dynamic else ""
        return (f"{self.family}-w{self.num_warps}-{self.tile_m}x{self.tile_n}-s{self.num_stages}"
                f"{q}{pp}{lpt}{pers}{q2}{dyn}")

    def error(self, head_dim: int, head_dim_v: int) -> Optional[str]:
        if self.family not in FAMILIES:
            return f"unknown kernel family {self.family!r} (known: {', '.join(FAMILIES)})"
        if self.lpt is not None and self.family != "tma":
            return f"lpt is a TMA-family option (upstream's cp.async kernel has its own grid order), not one of {self.family!r}"
        if self.persistent:
            if self.family != "tma":
                return f"persistent is a TMA-family option, not one of family {self.family!r}"
            err = persistent_error(self.pingpong)
            if err is not None:
                return err
        if self.pingpong:
            if self.family != "tma":
                return f"pingpong is a TMA-family schedule, not one of family {self.family!r}"
            err = pingpong_error(self.num_threads)
            if err is not None:
                return err
        if self.dynamic:
            if self.family != "tma":
                return f"dynamic is a TMA-family option, not one of family {self.family!r}"
            err = dynamic_error(self.dynamic, self.persistent)
            if err is not None:
                return err
        if self.q_stages != 1:
            if self.family != "tma":
                return f"q_stages is a TMA-family option, not one of family {self.family!r}"
            err = q_stages_error(self.q_stages, self.persistent)
            if err is not None:
                return err
            return tma_config_error(head_dim, head_dim_v, self.tile_m, self.tile_n, self.num_stages,
                                    self.num_threads, self.q_in_regs, q_stages=self.q_stages)
        return FAMILIES[self.family].config_error(
            head_dim, head_dim_v, self.tile_m, self.tile_n, self.num_stages, self.num_threads, self.q_in_regs
        )

    def dtype_error(self, dtype: str, head_dim: int) -> Optional[str]:
        """Why this config cannot run `dtype` ("float16"/"bfloat16") at `head_dim` without spills, or None."""
        if self.family == "tma" and dtype == "float16":
            return fp16_register_error(head_dim, self.tile_m, self.tile_n, self.num_threads)
        return None

    def varlen_error(self, head_dim: int) -> Optional[str]:
        """Why this config cannot run a varlen call (cu_seqlens / seqused) at `head_dim` without spills,
        or None."""
        if self.family == "tma":
            return varlen_register_error(head_dim, self.tile_m, self.tile_n, self.num_threads)
        return None

    def smem_bytes(self, head_dim: int, head_dim_v: int) -> int:
        if self.q_stages != 1:
            return tma_smem_bytes(head_dim, head_dim_v, self.tile_m, self.tile_n, self.num_stages, self.q_in_regs,
                                  q_stages=self.q_stages)
        return FAMILIES[self.family].smem_bytes(
            head_dim, head_dim_v, self.tile_m, self.tile_n, self.num_stages, self.q_in_regs
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_row(cls, raw: dict, default_family: str = "cpasync") -> "FwdConfig":
        """A config from a TOML table row (KeyError names a missing required key)."""
        return cls(
            num_threads=int(raw["num_threads"]),
            tile_m=int(raw["tile_m"]),
            tile_n=int(raw["tile_n"]),
            num_stages=int(raw.get("num_stages", 1)),
            q_in_regs=bool(raw.get("q_in_regs", False)),
            family=str(raw.get("family", default_family)),
            pingpong=bool(raw.get("pingpong", False)),
            lpt=None if raw.get("lpt") is None else bool(raw["lpt"]),
            persistent=bool(raw.get("persistent", False)),
            q_stages=int(raw.get("q_stages", 1)),
            dynamic=bool(raw.get("dynamic", False)),
        )


_NAME_FLAGS = {"qreg": ("q_in_regs", True), "pp": ("pingpong", True), "lpt": ("lpt", True),
               "nolpt": ("lpt", False), "pers": ("persistent", True),
               "q2": ("q_stages", 2), "dyn": ("dynamic", True)}


def config_from_name(name: str) -> FwdConfig:
    """The config a `FwdConfig.name` names ("tma-w8-256x64-s2-qreg-pers"); ValueError names a bad part."""
    parts = name.split("-")
    try:
        family, warps, tile, stages = parts[:4]
        tile_m, tile_n = (int(x) for x in tile.split("x"))
        if not (warps.startswith("w") and stages.startswith("s")):
            raise ValueError
        kw = dict(num_threads=32 * int(warps[1:]), tile_m=tile_m, tile_n=tile_n, num_stages=int(stages[1:]),
                  family=family)
    except ValueError:
        raise ValueError(f"config name {name!r} is not FAMILY-wW-MxN-sS[-qreg][-pp][-lpt|-nolpt][-pers][-q2][-dyn]") from None
    for flag in parts[4:]:
        if flag not in _NAME_FLAGS:
            raise ValueError(f"config name {name!r}: unknown flag {flag!r} (known: {', '.join(_NAME_FLAGS)})")
        field_name, value = _NAME_FLAGS[flag]
        kw[field_name] = value
    cfg = FwdConfig(**kw)
    if cfg.name != name:  # flags out of order or repeated, a padded number: one spelling per config
        raise ValueError(f"config name {name!r} is not in canonical form; write {cfg.name!r}")
    return cfg


# upstream's own SM120 choice (flash_attn/cute/interface.py, _get_fwd_config): 4 warps, 1 stage
def upstream_fwd_config(head_dim: int) -> FwdConfig:
    return FwdConfig(128, 128, 128 if head_dim <= 64 else 64, 1, False)


# Tried in order when the table has no entry for a problem. 4 warps, 64x64, 1 stage fits 99 KB and
# compiles without spills on sm_120a for every head dim up to 256 (tests/test_codegen.py checks it);
# upstream's own tiles are not used as fallbacks because they spill above d=96 (104 B at d=128,
# 832 B at d=192) or do not fit at all (d=256).
_FALLBACKS = (
    FwdConfig(128, 64, 64, 1, False),
    FwdConfig(128, 64, 32, 1, False),
)


@dataclass(frozen=True)
class TableEntry:
    head_dim: int  # bucket upper bound
    mask: str
    config: FwdConfig
    provenance: dict = field(default_factory=dict, compare=False, hash=False)
    # the entry serves only calls with seqlen_q <= this (None: any); short sequences fill fewer tiles
    seqlen_q_max: Optional[int] = None

    def serves(self, seqlen_q: Optional[int]) -> bool:
        """Whether a call of `seqlen_q` query rows (None: unknown, e.g. varlen) may use this entry."""
        return self.seqlen_q_max is None or (seqlen_q is not None and seqlen_q <= self.seqlen_q_max)


def head_dim_bucket(head_dim: int, head_dim_v: int) -> int:
    d = max(head_dim, head_dim_v)
    for b in HEAD_DIM_BUCKETS:
        if d <= b:
            return b
    raise ValueError(f"head dim {d} is above the largest supported bucket {HEAD_DIM_BUCKETS[-1]}")


def mask_kind(causal: bool, local: bool) -> str:
    return "local" if local else "causal" if causal else "none"


def check_entry_key(where: str, head_dim: int, mask: str) -> None:
    """A table row's (bucket, mask) key, as the forward and backward tables have it."""
    if head_dim not in HEAD_DIM_BUCKETS:
        raise ValueError(f"{where}: head_dim {head_dim} is not a bucket {HEAD_DIM_BUCKETS}")
    if mask not in MASK_KINDS:
        raise ValueError(f"{where}: mask {mask!r} not in {MASK_KINDS}")


def checked_provenance(where: str, raw: dict) -> dict:
    """A measured row's provenance (gpu, mode, date, command), copied."""
    prov = raw.get("provenance")
    if not isinstance(prov, dict) or not {"gpu", "mode", "date", "command"} <= prov.keys():
        raise ValueError(f"{where}: provenance needs gpu, mode, date, command")
    return dict(prov)


def parse_fwd_table(data: dict) -> list[TableEntry]:
    """Validate and convert a parsed TOML document into entries (raises ValueError on bad data)."""
    if data.get("schema") != 1:
        raise ValueError(f"config table schema must be 1, got {data.get('schema')!r}")
    entries = []
    seen = set()
    for i, raw in enumerate(data.get("fwd", [])):
        where = f"fwd entry {i}"
        try:
            head_dim, mask = int(raw["head_dim"]), str(raw["mask"])
            cfg = FwdConfig.from_row(raw)
        except KeyError as e:
            raise ValueError(f"{where}: missing key {e}") from None
        check_entry_key(where, head_dim, mask)
        err = cfg.error(head_dim, head_dim)
        if err:
            raise ValueError(f"{where} ({head_dim}, {mask}): {err}")
        prov = checked_provenance(where, raw)
        seqlen_q_max = raw.get("seqlen_q_max")
        if seqlen_q_max is not None and (not isinstance(seqlen_q_max, int) or seqlen_q_max < 1):
            raise ValueError(f"{where}: seqlen_q_max must be a positive integer, got {seqlen_q_max!r}")
        # a (bucket, mask) lists entries in order: the first that a call can run is chosen, so later
        # ones serve the calls an earlier one refuses (a dtype, varlen on the TMA family, a longer
        # sequence than a short-sequence entry's seqlen_q_max)
        if (head_dim, mask, seqlen_q_max, cfg) in seen:
            raise ValueError(f"{where}: duplicate entry {cfg.name} for ({head_dim}, {mask}, seqlen_q_max={seqlen_q_max})")
        seen.add((head_dim, mask, seqlen_q_max, cfg))
        entries.append(TableEntry(head_dim, mask, cfg, prov, seqlen_q_max))
    return entries


def load_fwd_table(path: Path | str | None = None) -> tuple[TableEntry, ...]:
    """The shipped table, or `path`, or the file named by FLASH_ATTN_SM120_FWD_TABLE; restricted to the
    kernel families named by FLASH_ATTN_SM120_FAMILIES when that is set (e.g. "cpasync")."""
    return _load_cached(str(path or os.environ.get(TABLE_ENV) or FWD_TABLE_PATH),
                        os.environ.get(FAMILIES_ENV, "").replace(" ", ""))


@lru_cache(maxsize=8)
def _load_cached(path: str, families: str = "") -> tuple[TableEntry, ...]:
    with open(path, "rb") as f:
        entries = tuple(parse_fwd_table(tomllib.load(f)))
    if not families:
        return entries
    allowed = set(families.split(","))
    unknown = allowed - set(FAMILIES)
    if unknown:
        raise ValueError(f"{FAMILIES_ENV}: unknown kernel families {sorted(unknown)} (known: {', '.join(FAMILIES)})")
    return tuple(e for e in entries if e.config.family in allowed)


def family_entries(family: str, table: Optional[Iterable[TableEntry]] = None) -> tuple[TableEntry, ...]:
    """The table's entries of one kernel family (default table: load_fwd_table()). The cp.async
    entries are the dispatcher's fallback for calls another family refuses, and the best configs of
    upstream's kernel family (the yardstick of a new one)."""
    return _family_entries(tuple(load_fwd_table() if table is None else table), family)


@lru_cache(maxsize=16)
def _family_entries(table: tuple, family: str) -> tuple[TableEntry, ...]:
    return tuple(e for e in table if e.config.family == family)


# (id(table), dims, flags) -> (table, config): the selection runs on every forward call and its tables
# are long-lived tuples; keeping the table in the value guards against a reused id
_SELECT_MEMO: dict = {}


def select_fwd_config(
    table: Iterable[TableEntry],
    head_dim: int,
    head_dim_v: int,
    causal: bool,
    local: bool,
    dtype: Optional[str] = None,
    seqlen_q: Optional[int] = None,
    varlen: bool = False,
) -> FwdConfig:
    """The table's config for this problem, or the first fallback that fits; pure (memoized for tuples).

    Lookup order: exact (bucket, mask); for local, the causal entry; then the bucket's non-causal
    entry; then the fallbacks (spill-free on sm_120a). Within a key, entries are tried in table
    order; an entry is skipped when its config cannot run the actual head dims, when `dtype` is
    given and the config cannot run it (FwdConfig.dtype_error), for a varlen call when the config
    spills with varlen (FwdConfig.varlen_error), or when its seqlen_q_max is below `seqlen_q` (an
    entry with seqlen_q_max needs a known seqlen_q).
    """
    if not isinstance(table, tuple):
        return _select_uncached(table, head_dim, head_dim_v, causal, local, dtype, seqlen_q, varlen)
    # the seqlen part of the key: the smallest seqlen_q_max that serves the call (bounded memo)
    serving = None
    if seqlen_q is not None:
        serving = next((m for m in _seqlen_limits(table) if seqlen_q <= m), None)
    key = (id(table), head_dim, head_dim_v, bool(causal), bool(local), dtype, serving, bool(varlen))
    hit = _SELECT_MEMO.get(key)
    if hit is not None and hit[0] is table:
        return hit[1]
    cfg = _select_uncached(table, head_dim, head_dim_v, causal, local, dtype, seqlen_q, varlen)
    if len(_SELECT_MEMO) > 4096:
        _SELECT_MEMO.clear()
    _SELECT_MEMO[key] = (table, cfg)
    return cfg


# id(table) -> (table, its entries' seqlen_q_max values, ascending): read on every forward call, so
# computed once per table rather than by a scan of the table per call
_LIMITS_MEMO: dict = {}


def _seqlen_limits(table: tuple) -> tuple[int, ...]:
    hit = _LIMITS_MEMO.get(id(table))
    if hit is not None and hit[0] is table:
        return hit[1]
    limits = tuple(sorted({e.seqlen_q_max for e in table if e.seqlen_q_max is not None}))
    if len(_LIMITS_MEMO) > 64:
        _LIMITS_MEMO.clear()
    _LIMITS_MEMO[id(table)] = (table, limits)
    return limits


def _select_uncached(table: Iterable[TableEntry], head_dim: int, head_dim_v: int, causal: bool, local: bool,
                     dtype: Optional[str] = None, seqlen_q: Optional[int] = None,
                     varlen: bool = False) -> FwdConfig:
    bucket = head_dim_bucket(head_dim, head_dim_v)
    kind = mask_kind(causal, local)
    by_key: dict = {}
    for e in table:  # entries of one key in table order: the first that runs this call is chosen
        if e.serves(seqlen_q):
            by_key.setdefault((e.head_dim, e.mask), []).append(e.config)
    order = [kind] + (["causal"] if kind == "local" else []) + ["none"]
    for m in order:
        for cfg in by_key.get((bucket, m), ()):
            if cfg.error(head_dim, head_dim_v) is None and (
                dtype is None or cfg.dtype_error(dtype, max(head_dim, head_dim_v)) is None
            ) and (not varlen or cfg.varlen_error(max(head_dim, head_dim_v)) is None):
                return cfg
    for cfg in _FALLBACKS:
        if cfg.error(head_dim, head_dim_v) is None:
            return cfg
    raise ValueError(f"no SM120 forward config fits head dims ({head_dim}, {head_dim_v})")
