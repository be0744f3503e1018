"""Kernel-path registry: every way the package can compute a forward, how to force it, what it supports.

A *kernel path* is the dispatcher's own choice (flash_attn_sm120/configs/sm120_fwd.toml, then its fallbacks; through
the public API, decode-shaped calls use the decode table) or one forced configuration of a kernel
family. The correctness gate (tests/test_fuzz_gpu.py) fuzzes
every path listed here and scripts/sanitize.py runs compute-sanitizer over a few shapes of each
family; neither names a path itself, so a new kernel family (TMA, SplitKV, paged, sparse, ...)
joins both by adding ONE entry to `BASE_PATHS`, with no new test code.

Entry format, `KernelPath(name, family, config, supports)`:

    name      unique id; appears in test ids and in the fuzz summary
    family    a key of flash_attn_sm120.kernels.FAMILIES, or "dispatch" for the dispatcher's choice
    config    how to force the path:
                None                              the dispatcher's choice (nothing forced)
                FwdConfig(...)                    that config for every problem
                callable(head_dim, head_dim_v)    -> FwdConfig, for configs that depend on the head dims
              (forced with `driver.force_config(cfg)` or `driver.forward(..., config=cfg)`)
    supports  `Supports(...)`: what the fuzz suite may draw for the path. `head_dims` is a
              candidate set: dims at which the forced config is not implementable on SM120
              (FwdConfig.error) are dropped automatically. Boolean features are drawn only when
              True: mixed_head_dims (head_dim_v != head_dim), causal, local (sliding windows),
              varlen (cu_seqlens / seqused layouts), pack_gqa, softcap, backward (through the
              public API's autograd; dims from backward_head_dims), paged (page_table K/V) and
              splits (num_splits > 1), the last two through the public API only.

Example: a family that runs head dims 64/96/128 without varlen or GQA packing would add

    KernelPath("tma-w8-128x64-s2", "tma", FwdConfig(256, 128, 64, 2, family="tma"),
               Supports(head_dims=(64, 96, 128), mixed_head_dims=False, varlen=False, pack_gqa=False))

A family may pack only some GQA ratios (the TMA family: tile_m a multiple of the ratio);
`KernelPath.packs` says whether an explicit pack_gqa=True runs as asked.

Every entry of flash_attn_sm120/configs/sm120_fwd.toml also becomes a path, "table-d<bucket>-<mask>", restricted to
its head-dim bucket (`kernel_paths()` reads the table on each call).

`BACKWARD_GAPS` lists backward cases the fuzz suite must not draw, by execution mode (none today).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Union

from flash_attn_sm120.config import (
    HEAD_DIM_BUCKETS,
    FwdConfig,
    TableEntry,
    load_fwd_table,
    select_fwd_config,
    upstream_fwd_config,
)

ALL_HEAD_DIMS = tuple(range(8, 257, 8))
# Head dims upstream's backward is tested at (flash-attn-4 tests/cute: d <= 128)
BACKWARD_HEAD_DIMS = (64, 96, 128)

# Backward cases the fuzz suite must not draw, per mode. Empty since the backward is this package's
# own in both modes (driver_bwd.py): the SM90 backward's gaps (varlen, d64 non-causal) no longer
# apply in emulation, and causal seqlen_q > seqlen_k is covered (tests/test_bwd_gpu.py).
BACKWARD_GAPS: dict[str, frozenset] = {
    "emulated": frozenset(),
    "sm120": frozenset(),
}

ConfigSpec = Union[None, FwdConfig, Callable[[int, int], FwdConfig]]


@dataclass(frozen=True)
class Supports:
    head_dims: tuple[int, ...] = ALL_HEAD_DIMS
    mixed_head_dims: bool = True
    dtypes: tuple[str, ...] = ("float16", "bfloat16")
    causal: bool = True
    local: bool = True
    varlen: bool = True
    pack_gqa: bool = True
    softcap: bool = True
    backward: bool = True
    backward_head_dims: tuple[int, ...] = BACKWARD_HEAD_DIMS
    paged: bool = False
    splits: bool = False
    sinks: bool = True  # learnable_sink (through the public API; the kernels fold it in, kernels/sink_fold.py)
    mods: bool = True  # score_mod / mask_mod / aux data (testing_mods.MODS, through the public API)
    # block-sparse lists (testing_sparse.CASES, the public API): the dispatcher's own choice only, since a
    # forced config need not divide the sparse block
    block_sparse: bool = False
    # the (q, k) storage layouts (testing.Q_LAYOUTS x K_LAYOUTS) a varlen path runs; None: all of them
    layouts: Optional[tuple[tuple[str, str], ...]] = None

    def allows_layout(self, q_layout: str, k_layout: str) -> bool:
        """Whether this path runs q and k/v stored so (dense always; varlen layouts when `varlen`)."""
        if (q_layout, k_layout) == ("dense", "dense"):
            return True
        return self.varlen and (self.layouts is None or (q_layout, k_layout) in self.layouts)


@dataclass(frozen=True)
class KernelPath:
    name: str
    family: str
    config: ConfigSpec = None
    supports: Supports = field(default_factory=Supports)

    def config_for(self, head_dim: int, head_dim_v: int) -> Optional[FwdConfig]:
        """The config to force at these head dims, or None for the dispatcher's choice."""
        if self.config is None or isinstance(self.config, FwdConfig):
            return self.config
        return self.config(head_dim, head_dim_v)

    def resolved_config(self, head_dim: int, head_dim_v: int, causal: bool = False, local: bool = False) -> FwdConfig:
        """The config that actually runs (the dispatcher's choice resolved); ValueError if none fits."""
        cfg = self.config_for(head_dim, head_dim_v)
        if cfg is None:
            return select_fwd_config(load_fwd_table(), head_dim, head_dim_v, causal, local)
        return cfg

    def error(self, head_dim: int, head_dim_v: int) -> Optional[str]:
        """Why this path cannot run these head dims on SM120, or None if it can."""
        try:
            return self.resolved_config(head_dim, head_dim_v).error(head_dim, head_dim_v)
        except ValueError as e:
            return str(e)

    def head_dims(self) -> tuple[int, ...]:
        """Candidate head dims (head_dim == head_dim_v) that this path can run."""
        return tuple(d for d in self.supports.head_dims if self.error(d, d) is None)

    def packs(self, qhead_per_kvhead: int, head_dim: int, head_dim_v: int) -> bool:
        """Whether an explicit pack_gqa=True runs packed on this path at this GQA ratio (a forced
        config the family cannot pack raises; the dispatcher would fall back to cp.async)."""
        if not self.supports.pack_gqa:
            return False
        if self.family != "tma" or qhead_per_kvhead == 1:
            return True
        from flash_attn_sm120.kernels.fwd_tma import pack_gqa_error  # lazy: imports the DSL

        return pack_gqa_error(self.resolved_config(head_dim, head_dim_v).tile_m, qhead_per_kvhead) is None

    def force(self, head_dim: int, head_dim_v: int):
        """Context manager under which the public API runs this path."""
        cfg = self.config_for(head_dim, head_dim_v)
        if cfg is None:
            return contextlib.nullcontext()
        from flash_attn_sm120 import driver  # compiles nothing; kept lazy so paths.py stays light

        return driver.force_config(cfg)


def _upstream_config(head_dim: int, head_dim_v: int) -> FwdConfig:
    return upstream_fwd_config(max(head_dim, head_dim_v))


# What a forced config of a family can run (the dispatcher sends the rest to the cp.async entry)
# TMA: varlen through ragged descriptors, K/V packed (cu_seqlens_k, with or without seqused_k) and q
# packed or padded, GQA packed or not; seqused_k alone goes to cp.async (fwd_tma_rules.varlen_error)
TMA_LAYOUTS = (("packed", "packed"), ("padded", "packed"))
FAMILY_LIMITS: dict[str, dict] = {
    "tma": dict(head_dims=(64, 96, 128), mixed_head_dims=False, varlen=True, layouts=TMA_LAYOUTS),
}


BASE_PATHS: tuple[KernelPath, ...] = (
    KernelPath("cpasync-table", "dispatch", None, Supports(block_sparse=True)),
    KernelPath("cpasync-w8-128x96-s1", "cpasync", FwdConfig(256, 128, 96, 1)),
    KernelPath("cpasync-w4-64x64-s2", "cpasync", FwdConfig(128, 64, 64, 2)),
    KernelPath("cpasync-w4-64x32-s3", "cpasync", FwdConfig(128, 64, 32, 3)),  # 3-stage ring; d <= 192
    KernelPath("upstream-config", "cpasync", _upstream_config),
    # TMA producer warpgroup + 8 mma.sync warps (kernels/fwd_tma.py): d 64/96/128, varlen with packed K/V
    KernelPath("tma-w8-128x64-s2", "tma", FwdConfig(256, 128, 64, 2, family="tma"), Supports(**FAMILY_LIMITS["tma"])),
    # the same family with the persistent tile order (kernels/persistent_scheduler.py): d64/d96, whose
    # 256-row tile fits 99 KB; varlen q runs it one CTA per tile
    KernelPath("tma-w8-256x64-s2-pers", "tma", FwdConfig(256, 256, 64, 2, family="tma", persistent=True),
               Supports(**dict(FAMILY_LIMITS["tma"], head_dims=(64, 96)))),
    # persistent with two Q slots and the dynamic tile order (a per-call counter): d64, whose two 256-row Q
    # slots fit 99 KB with two K/V stages
    KernelPath("tma-w8-256x64-s2-pers-q2-dyn", "tma",
               FwdConfig(256, 256, 64, 2, family="tma", persistent=True, q_stages=2, dynamic=True),
               Supports(**dict(FAMILY_LIMITS["tma"], head_dims=(64,)))),
    # SplitKV + paged K/V (kernels/fwd_splitkv.py through the public API); paged rows need d % 16 == 0
    KernelPath("splitkv-w4-64x64", "splitkv", FwdConfig(128, 64, 64, 1),
               Supports(head_dims=tuple(range(16, 257, 16)), splits=True, paged=True)),
)


def _bucket_dims(bucket: int) -> tuple[int, ...]:
    lower = max([b for b in HEAD_DIM_BUCKETS if b < bucket], default=0)
    return tuple(d for d in ALL_HEAD_DIMS if lower < d <= bucket)


def table_paths(table: Iterable[TableEntry]) -> tuple[KernelPath, ...]:
    """One path per table entry, restricted to the head dims of its bucket and what its family runs.

    The first entry of a (bucket, mask) is "table-d<bucket>-<mask>"; a later entry of another family
    (the fallback for calls the first refuses) is "table-d<bucket>-<mask>-<family>".
    """
    paths, seen = [], set()
    for e in table:
        key = (e.head_dim, e.mask)
        name = f"table-d{e.head_dim}-{e.mask}" + (f"-{e.config.family}" if key in seen else "")
        seen.add(key)
        limits = dict(FAMILY_LIMITS.get(e.config.family, {}))
        family_dims = limits.pop("head_dims", ALL_HEAD_DIMS)
        dims = tuple(d for d in _bucket_dims(e.head_dim) if d in family_dims)
        # what the driver refuses a forced config at any of these dims: fp16 where the tile spills (that
        # path draws bfloat16 only; fp16 runs the cp.async entry, its own path) and varlen where the tile
        # spills with it (varlen calls run the next entry)
        if any(e.config.dtype_error("float16", d) for d in dims):
            limits["dtypes"] = ("bfloat16",)
        if any(e.config.varlen_error(d) for d in dims):
            limits["varlen"] = False
        paths.append(KernelPath(name, e.config.family, e.config, Supports(head_dims=dims, **limits)))
    return tuple(paths)


def kernel_paths(table: Optional[Iterable[TableEntry]] = None) -> tuple[KernelPath, ...]:
    """The base paths plus one per entry of the config table (default: flash_attn_sm120/configs/sm120_fwd.toml)."""
    paths = BASE_PATHS + table_paths(load_fwd_table() if table is None else table)
    names = [p.name for p in paths]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate kernel path names: {sorted(n for n in names if names.count(n) > 1)}")
    return paths


def get_path(name: str, table: Optional[Iterable[TableEntry]] = None) -> KernelPath:
    for p in kernel_paths(table):
        if p.name == name:
            return p
    raise KeyError(f"no kernel path {name!r}; known: {[p.name for p in kernel_paths(table)]}")
