"""Backward kernel configs: the TOML table in flash_attn_sm120/configs/sm120_bwd.toml and a pure selection rule.

Mirrors config.py for the backward. The table is data: one entry per (head_dim bucket, mask kind) with
a `kernels.bwd_tiling.BwdConfig` (warps, m/n tiles, Q/dO stages, warp atom layouts, swapAB flags, V in
registers) and the provenance of the measurement that chose it (scripts/config_search.py, stage
bwd-*). An entry marked `modifiers = true` serves only the calls with user modifiers (score_mod,
mask_mod, aux tensors: the modifier step, kernels/bwd_mods.py, which holds more registers), where the
plain entry of its key does not suit that step. An entry marked `plain_mha_only = true` serves only
plain MHA calls (`plain_mha`: one query head per KV head, dense, non-deterministic, no window, no
modifiers or softcap): a tile measured faster there that spills on sm_120a in the other calls its key
serves; those take the key's other entry. An entry marked `plain_only = true` serves the plain calls of
any head ratio (`plain`: dense, non-deterministic, no window, modifiers or softcap; GQA included): a tile
measured faster there that spills in a deterministic call. An entry marked `turns_only = true` serves only
the deterministic calls whose dQ adds take turns (no window, softcap or user modifiers, not under a forced
plan): on a causal key the dense causal calls (bwd_plans.dq_takes_turns); on a "none" key the dense MHA calls
without a mask whose rotated order it runs (`rotated_turns_config`, bwd_plans.rotated_entry_fits), which
would otherwise add dQ in fixed point (GQA too: ROTATED_ENTRIES_SERVE_GQA). Such a tile is measured faster
for the turns (fewer turns per FLOP at n_block 128) and may spill with fixed-point dQ; the key's other entry
serves the key's other calls (packed or seqused; without a mask, those the rotated order does not admit).
`select_bwd_config` is a pure function of the table and the problem's static properties.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field, fields
from functools import lru_cache
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from flash_attn_sm120.config import (
    CONFIG_DIR,
    check_entry_key,
    checked_provenance,
    head_dim_bucket,
    mask_kind,
)
from flash_attn_sm120.kernels.bwd_tiling import BwdConfig, bwd_config_error

BWD_TABLE_PATH = CONFIG_DIR / "sm120_bwd.toml"
BWD_TABLE_ENV = "FLASH_ATTN_SM120_BWD_TABLE"  # path of another table (experiments, searches)
# Whether a "none" key's turns entry (the rotated turns) serves GQA calls too: on since
# tests/test_bwd_deterministic_gpu.py::test_the_turns_entries_on_gqa passed with the d96 one forced on GQA 8:2
# (bf16 and fp16: bitwise over 3 runs and against fp32; session 37, w46, H100). The causal turns entries
# serve GQA since that test passed for them (session 35, w43a).
ROTATED_ENTRIES_SERVE_GQA = True
# Tried in order when the table has no entry that runs the head dims: within 99 KB and spill-free on
# sm_120a up to d=192 (tests/test_bwd_codegen.py compiles each). Upstream's own SM120 config (4 warps,
# 64x64) is not among them: it spills at d=128 and does not fit above.
BWD_FALLBACKS = (
    BwdConfig(256, 64, 64, 1, 1, atom_m_sdp=2, atom_n_dkv=4, atom_m_dq=2),  # d <= 128 (not 96)
    BwdConfig(256, 64, 64, 1, 1, atom_m_sdp=2, atom_n_dkv=4, atom_m_dq=4),  # d = 96
    BwdConfig(256, 64, 32, 1, 1, atom_m_sdp=4, atom_n_dkv=2, atom_m_dq=4),  # d <= 192
    # d > 192: no 8-warp tile fits 99 KB there, and every 4-warp one runs out of registers. The first
    # spills least on sm_120a (16-24 B of stack) but needs a padded head dim that is a multiple of 64;
    # the second serves the rest (d 200-224), chosen when upstream's preprocess, covering 64 rows per
    # pass there, made a 32-row tile race (before preprocess_multiple widened the pass), and it spills
    # ~200 B. tests/test_bwd_codegen.py pins both.
    BwdConfig(128, 32, 32, 1, 1, atom_m_sdp=2, atom_n_dkv=1, atom_m_dq=1),
    BwdConfig(128, 64, 32, 1, 1, atom_m_sdp=4, atom_n_dkv=2, atom_m_dq=2),
)


@dataclass(frozen=True)
class BwdTableEntry:
    """A row of the backward table (config.TableEntry's fields, with a BwdConfig)."""

    head_dim: int  # bucket upper bound
    mask: str
    config: BwdConfig
    provenance: dict = field(default_factory=dict, compare=False, hash=False)
    modifiers: bool = False  # an entry for calls with user modifiers only (the modifier step)
    plain_mha_only: bool = False  # an entry for plain MHA calls only (dense, MHA, no window, modifiers or determinism)
    plain_only: bool = False  # an entry for plain calls only (plain_mha_only's, any number of query heads per KV head)
    turns_only: bool = False  # an entry for deterministic calls whose dQ takes turns only

    @property
    def key(self) -> tuple:
        """(head_dim, mask, modifiers, plain_mha_only, plain_only, turns_only): unique in a table."""
        return (self.head_dim, self.mask, self.modifiers, self.plain_mha_only, self.plain_only,
                self.turns_only)

    @property
    def kind(self) -> str:
        """"", "mods", "mha", "plain" or "turns": the calls beside its key's others that the entry serves."""
        return ("mods" if self.modifiers else "mha" if self.plain_mha_only else "plain" if self.plain_only
                else "turns" if self.turns_only else "")


def config_from_row(raw: dict) -> BwdConfig:
    """A BwdConfig from a TOML row: every BwdConfig field is required (the table says what it runs)."""
    missing = [f.name for f in fields(BwdConfig) if f.name not in raw]
    if missing:
        raise KeyError(", ".join(missing))
    return BwdConfig(**{f.name: bool(raw[f.name]) if isinstance(f.default, bool) else int(raw[f.name])
                        for f in fields(BwdConfig)})


def bwd_config_from_name(name: str) -> BwdConfig:
    """The BwdConfig that BwdConfig.name printed (benchmarks and the command line name configs this way)."""
    m = re.fullmatch(r"bwd-w(\d+)-(\d+)x(\d+)-q(\d)do(\d)-a(\d)(\d)(\d)(?:-swap([skq]+))?(-vreg)?", name)
    if m is None:
        raise ValueError(f"not a backward config name: {name!r} (e.g. bwd-w8-64x64-q2do1-a242[-swapsk][-vreg])")
    warps, mb, nb, sq, sdo, a1, a2, a3, swaps, vreg = m.groups()
    swaps = swaps or ""
    return BwdConfig(int(warps) * 32, int(mb), int(nb), int(sq), int(sdo), "s" in swaps, "k" in swaps, "q" in swaps,
                     int(a1), int(a2), int(a3), vreg is not None)


def parse_bwd_table(data: dict) -> list[BwdTableEntry]:
    """Validate a parsed TOML document into entries (ValueError names the entry and the problem)."""
    if data.get("schema") != 1:
        raise ValueError(f"backward config table schema must be 1, got {data.get('schema')!r}")
    entries, seen = [], set()
    for i, raw in enumerate(data.get("bwd", [])):
        where = f"bwd entry {i}"
        try:
            head_dim, mask = int(raw["head_dim"]), str(raw["mask"])
            cfg = config_from_row(raw)
        except KeyError as e:
            raise ValueError(f"{where}: missing key(s) {e}") from None
        check_entry_key(where, head_dim, mask)
        modifiers, plain_mha_only = raw.get("modifiers", False), raw.get("plain_mha_only", False)
        plain_only, turns_only = raw.get("plain_only", False), raw.get("turns_only", False)
        flags = (("modifiers", modifiers), ("plain_mha_only", plain_mha_only), ("plain_only", plain_only),
                 ("turns_only", turns_only))
        for key, value in flags:
            if not isinstance(value, bool):
                raise ValueError(f"{where}: {key} must be true or false, got {value!r}")
        if modifiers + plain_mha_only + plain_only + turns_only > 1:
            raise ValueError(f"{where}: an entry serves calls with modifiers, plain MHA calls, plain calls or "
                             "deterministic calls, one of them")
        for key, value in (("plain_mha_only", plain_mha_only), ("plain_only", plain_only)):
            if value and mask == "local":
                raise ValueError(f"{where}: {key} excludes windows; a local entry would serve no call")
        if turns_only and mask == "local":
            raise ValueError(f"{where}: turns_only serves dense causal calls and dense calls without a mask (the "
                             "only ones whose dQ takes turns without modifiers); a 'local' entry would serve no call")
        err = bwd_config_error(head_dim, head_dim, cfg)
        if err:
            raise ValueError(f"{where} ({head_dim}, {mask}): {err}")
        prov = checked_provenance(where, raw)
        entry = BwdTableEntry(head_dim, mask, cfg, prov, modifiers=modifiers, plain_mha_only=plain_mha_only,
                              plain_only=plain_only, turns_only=turns_only)
        if entry.key in seen:
            kind = "".join(f", {k}" for k, v in flags if v)
            raise ValueError(f"{where}: duplicate entry for ({head_dim}, {mask}{kind})")
        seen.add(entry.key)
        entries.append(entry)
    return entries


def load_bwd_table(path: Path | str | None = None) -> tuple[BwdTableEntry, ...]:
    """The shipped table, or `path`, or the file named by FLASH_ATTN_SM120_BWD_TABLE."""
    return _load_cached(str(path or os.environ.get(BWD_TABLE_ENV) or BWD_TABLE_PATH))


@lru_cache(maxsize=8)
def _load_cached(path: str) -> tuple[BwdTableEntry, ...]:
    with open(path, "rb") as f:
        return tuple(parse_bwd_table(tomllib.load(f)))


def rotated_turns_config(table: tuple, head_dim: int, head_dim_v: int) -> BwdConfig | None:
    """The head dims' "none" key's turns entry, if it has one that runs them: a dense call without a mask
    whose rotated dQ order it fits (bwd_plans.rotated_entry_fits) takes its turns there."""
    entry = {e.key: e.config for e in table}.get((head_dim_bucket(head_dim, head_dim_v), "none", False, False,
                                                   False, True))
    return entry if entry is not None and bwd_config_error(head_dim, head_dim_v, entry) is None else None


def entry_kinds(*, deterministic: bool, causal: bool, local: bool, qhead_per_kvhead: int, packed: bool,
                seqused: bool, block_sparse: bool, score_mod: bool, user_mods: bool, fixed_point: bool,
                plan_forced: bool, rotated_entry: bool = False) -> dict:
    """Which of the table's special entries a call may take: select_bwd_config's keywords (modifiers,
    plain_mha, plain, turns), from the call's resolved causal/local flags. The driver's rule, and its
    tests' (testing.deterministic_order, the fuzz cases).

    * modifiers: user modifiers (score_mod / mask_mod / aux tensors) or the block-sparse walk: the
      modifier step.
    * plain: dense or packed, not deterministic, no window, softcap (its pair is a score_mod) or modifiers;
      packed calls only with GQA (the plain tile ran +4.4% over the key's entry on packed GQA d128 causal
      but -2% on packed MHA, 2026-12-06_bwd_varlen_emulated.json). plain_mha: plain, dense and MHA (the
      plain-MHA tile spills 8 B with cu_seqlens: bwd_ldsm_probe.py --variants varlen,varlen_gqa).
    * turns: deterministic, dQ in turns (bwd_plans.dq_takes_turns: dense causal, no window, or dense without a
      mask on a rotated entry, `rotated_entry`: rotated_turns_config and rotated_entry_fits; `fixed_point`: the
      call allows fixed point), no softcap, modifiers or block sparsity, not under a forced plan; any head
      ratio (test_the_turns_entries_on_gqa passed for both keys; ROTATED_ENTRIES_SERVE_GQA gates the
      rotated ones)."""
    from flash_attn_sm120.bwd_plans import dq_takes_turns

    plain = (not (seqused or block_sparse or deterministic or local or score_mod or user_mods)
             and (not packed or qhead_per_kvhead > 1))
    rotated_entry = rotated_entry and (qhead_per_kvhead == 1 or ROTATED_ENTRIES_SERVE_GQA)
    turns = (deterministic and not (block_sparse or score_mod or user_mods or plan_forced)
             and dq_takes_turns(fixed_point, causal, local, dense=not (packed or seqused), rotated_entry=rotated_entry))
    return dict(modifiers=user_mods or block_sparse, plain_mha=plain and qhead_per_kvhead == 1 and not packed,
                plain=plain, turns=turns)


@lru_cache(maxsize=1024)
def select_bwd_config(table: tuple, head_dim: int, head_dim_v: int, causal: bool, local: bool,
                      modifiers: bool = False, plain_mha: bool = False, plain: bool = False,
                      turns: bool = False) -> BwdConfig:
    """The table's config for this problem, else the first fallback that runs; pure.

    Lookup order as the forward's: exact (bucket, mask); local tries causal; then the bucket's
    non-causal entry; then BWD_FALLBACKS. With `modifiers` (a call with user modifiers), each key's
    modifier entry comes before its plain one; with `plain_mha` (one query head per KV head, dense,
    non-deterministic, no window, modifiers or softcap), the exact key's plain_mha_only entry does, and
    with `plain` (the same for any head ratio; plain_mha implies it) then its plain_only entry; with
    `turns` (a deterministic call whose dQ takes turns) and no modifiers, its turns_only entry. A config
    that cannot run the actual head dims is skipped.
    """
    plain = plain or plain_mha
    bucket = head_dim_bucket(head_dim, head_dim_v)
    kind = mask_kind(causal, local)
    by_key = {e.key: e.config for e in table}
    for m in [kind] + (["causal"] if kind == "local" else []) + ["none"]:
        first = [by_key.get((bucket, m, True, False, False, False))] * modifiers
        first += [by_key.get((bucket, m, False, True, False, False))] * (plain_mha and not modifiers and m == kind)
        first += [by_key.get((bucket, m, False, False, True, False))] * (plain and not modifiers and m == kind)
        first += [by_key.get((bucket, m, False, False, False, True))] * (turns and not modifiers and m == kind)
        for cfg in first + [by_key.get((bucket, m, False, False, False, False))]:
            if cfg is not None and bwd_config_error(head_dim, head_dim_v, cfg) is None:
                return cfg
    for cfg in BWD_FALLBACKS:
        if bwd_config_error(head_dim, head_dim_v, cfg) is None:
            return cfg
    raise ValueError(f"no SM120 backward config fits head dims ({head_dim}, {head_dim_v}) in 99 KB of shared memory")

