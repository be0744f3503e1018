"""Patch 0004's configs module, flash_bwd_sm120_configs.py: the package's backward table, fallbacks and
selection rule (config_bwd.py) and its deterministic ordering rule (bwd_plans.deterministic_plan), lifted in
upstream's names, with the measured table as a literal. step_bwd.py writes it.
"""

from __future__ import annotations

import math
import re
import textwrap
from dataclasses import fields, replace
from pathlib import Path

from flash_attn_sm120 import config_bwd as pkg_config_bwd
from flash_attn_sm120 import bwd_plans as pkg_bwd_plans

from patchgen.core import (
    CUTE,
    MODE_COMMENT,
    ROOT,
    AnchorError,
    _join_defs,
    check_no_package_refs,
    rename,
    substitute,
    top_level_source,
    upstream_wording,
)

DEFAULT_BWD_TABLE = ROOT / "flash_attn_sm120" / "configs" / "sm120_bwd.toml"
CONFIGS_REL = f"{CUTE}/flash_bwd_sm120_configs.py"


def load_bwd_table(path: Path = DEFAULT_BWD_TABLE) -> tuple:
    return tuple(pkg_config_bwd.parse_bwd_table(pkg_config_bwd.tomllib.loads(Path(path).read_text())))


def _geomean(xs) -> float:
    xs = [float(x) for x in (xs if isinstance(xs, (list, tuple)) else [xs])]
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def _describe(c) -> str:
    swaps = [n for n, on in (("S/dP", c.sdp_swapab), ("dK/dV", c.dkv_swapab), ("dQ", c.dq_swapab)) if on]
    return (f"{c.num_warps} warps, {c.m_block}x{c.n_block}, Q/dO stages {c.stages_q}/{c.stages_do}, "
            f"atoms {c.atom_m_sdp}/{c.atom_n_dkv}/{c.atom_m_dq}" + (f", swapAB {'+'.join(swaps)}" if swaps else ""))


def _config_literal(c) -> str:
    args = ", ".join(f"{f.name}={getattr(c, f.name)!r}" for f in fields(c))
    return f"Sm120BwdConfig({args})"


# above an entry measured with V in registers, which this patch's interface cannot run (the tuned class
# runs upstream's step); the modifier patch (step_mods.py) turns it on and routes such entries to its class
VREG_MARK = "    #   measured with V in registers (the modifier step); V in shared memory on the tuned step"


def table_entry_literal(e, v_in_regs: bool) -> str:
    """One BwdTableEntry of the lifted table; an entry measured with V in registers carries VREG_MARK and
    v_in_regs as given (False: what the tuned class runs)."""
    c = replace(e.config, v_in_regs=v_in_regs and e.config.v_in_regs)
    lit = _config_literal(c)
    s, a = lit.index("stages_q"), lit.index("atom_m_sdp")
    end = ", modifiers=True" if e.modifiers else ""
    mark = VREG_MARK + "\n" if e.config.v_in_regs else ""
    return (f'{mark}    BwdTableEntry({e.head_dim}, "{e.mask}", {lit[:s].rstrip()}\n'
            f'        {lit[s:a].rstrip()}\n        {lit[a:]}{end}),')


def _table_literal(table) -> str:
    lines = ["SM120_BWD_TABLE: tuple[BwdTableEntry, ...] = ("]
    for e in table:
        p = e.provenance
        tf, up = p.get("tflops"), p.get("upstream_tflops")
        perf = "no TFLOPS recorded"
        if tf is not None:
            perf = f"{_geomean(tf):.1f} TFLOPS"
            if up:
                perf += f" vs {_geomean(up):.1f} before ({_geomean(tf) / _geomean(up):.2f}x)"
        kind = ", calls with user modifiers" if e.modifiers else ""
        lines.append(f"    # {e.head_dim}/{e.mask}{kind}: {_describe(e.config)}")
        lines.append(f"    #   {perf}; {p['gpu']}, {p['mode']}, {p['date']}")
        if p.get("note"):
            lines += [f"    #   {line}" for line in textwrap.wrap(str(p["note"]), 92)]
        lines.append(table_entry_literal(e, v_in_regs=False))
    lines.append(")")
    commands = sorted({str(e.provenance["command"]) for e in table})
    head = ["# The measured SM120 backward configs, one per (head-dim bucket, mask kind).", "#"]
    if table:
        head += ["# Measured with:"] + [f"#   {c}" for c in commands]
        head += MODE_COMMENT
    else:
        lines = [lines[0] + ")"]
    return "\n".join(head + lines) + "\n"


_BWD_CONFIGS_HEADER = '''"""SM120 backward configs: warps, tiles, stages and warp atom layouts per (head dim, mask), and
the rule that picks one.

The SM120 backward (flash_bwd_sm120_tuned.py) runs any feasible tiling; which is fastest depends on
the head dim and the mask, so the choice is data: SM120_BWD_TABLE holds one measured entry per
(head-dim bucket, mask kind). select_bwd_config is a pure function of the table and the problem's
static properties: exact (bucket, mask); for local, the causal entry; then the bucket's non-causal
entry; then BWD_FALLBACKS. An entry marked modifiers=True serves only calls with user modifiers
(score_mod, mask_mod, aux tensors: FlashAttentionBackwardSm120Mods's step, which holds more
registers), tried before its key's plain entry. An entry that cannot run the actual head dims
(bwd_config_error) is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Optional

from flash_attn.cute.flash_bwd_sm120_tuned import Sm120BwdConfig, bwd_config_error
from flash_attn.cute.flash_fwd_sm120_configs import head_dim_bucket, mask_kind

'''
_BWD_CONFIG_EDITS = (
    ("(config.TableEntry's fields, with a BwdConfig)", "(the forward TableEntry's fields, with a BwdConfig)"),
    ("# sm_120a up to d=192 (tests/test_bwd_codegen.py compiles each). Upstream's own SM120 config (4 warps,\n"
     "# 64x64) is not among them",
     "# sm_120a up to d=192. SM120's earlier default (4 warps,\n# 64x64) is not among them"),
    ("    # ~200 B. tests/test_bwd_codegen.py pins both.\n", "    # ~200 B.\n"),
)
_BWD_ADAPTER = '''

def sm120_bwd_config(head_dim: int, head_dim_v: int, causal: bool, local: bool,
                     modifiers: bool = False) -> Optional[Sm120BwdConfig]:
    """The backward config the interface runs on SM120 (select_bwd_config; modifiers: a call with user
    modifiers), or None where no config runs these head dims: the interface then keeps SM120's earlier
    default (4 warps, 64x64)."""
    try:
        return select_bwd_config(SM120_BWD_TABLE, head_dim, head_dim_v, causal, local, modifiers)
    except ValueError:
        return None
'''


# bwd_plans.deterministic_plan, lifted as sm120_bwd_deterministic_plan: the package's forced plan
# (force_deterministic_plan, a context manager of its benchmarks) becomes an argument
PLAN_WHERE = "flash_attn_sm120/bwd_plans.py (deterministic_plan)"
_PLAN_EDITS = (
    ("def deterministic_plan(num_sms: int, cfg: BwdConfig, causal: bool, seqlen_q: int, seqlen_k: int,\n"
     "                       index_tensors: tuple = (None, None, None, None), modifier_step: bool = True,\n"
     "                       fixed_point: bool = False, local: bool = False, rotated_entry: bool = False) -> dict:\n",
     "def sm120_bwd_deterministic_plan(num_sms: int, cfg: BwdConfig, causal: bool, seqlen_q: int, seqlen_k: int,\n"
     "                                 index_tensors: tuple = (None, None, None, None),\n"
     "                                 modifier_step: bool = False, fixed_point: bool = False,\n"
     "                                 local: bool = False, flags: Optional[dict] = None) -> dict:\n"),
    # (the rotated turns entries: this table leaves turns_only rows out, so no call has one)
    ("    * Fixed point, where the call allows it (`fixed_point`: fixed_point_allowed), for every call but a\n"
     "      dense causal one or one a rotated turns entry serves (`rotated_entry`): no order at all. Each dQ\n"
     "      contribution is added as a 64-bit fixed-point integer, whose sum",
     "    * Fixed point, where the call allows it (`fixed_point`: fixed_point_allowed), for every call but a\n"
     "      dense causal one: no order at all. Each dQ contribution is added as a 64-bit fixed-point integer,\n"
     "      whose sum"),
    ("    elif not dq_takes_turns(fixed_point, causal, local, dense, rotated_entry):\n",
     "    elif not dq_takes_turns(fixed_point, causal, local, dense):\n"),
    ("      whose sum has the same bits in any order (kernels/bwd_fixed_point.py); no CTA waits. Measured\n"
     "      against the turns (emulated, H200, same runs, session 33): packed documents 0.736x the default\n"
     "      backward against 0.375x (varlen calls can only take ascending turns); dense without a mask\n"
     "      +7% to +14% over the rotated turns.\n",
     "      whose sum has the same bits in any order (an int64 accumulator and per-head scales the interface\n"
     "      does not allocate: it passes fixed_point=False); no CTA waits. Windows take the turns below,\n"
     "      counted from their edges; fixed point serves here only when given (`flags`).\n"),
    ("    Otherwise (dense causal calls, where the descending turns measured 1-13% faster; dense calls without a\n"
     "    mask whose key has a turns entry that runs the rotated order, `rotated_entry`, where that entry's\n"
     "    tile measured +27% over fixed point at d96; calls with a user score_mod or score_mod_bwd, windows\n"
     "    included) turns (kernels/bwd_deterministic.py):\n",
     "    Otherwise turns:\n"),
    ("        return dict(FIXED_POINT_PLAN)\n",
     "        return {**dict.fromkeys(_ORDERING_FLAGS, False), \"dq_fixed_point\": True}\n"),
    ("), which needs this package's step (kernels/bwd_mods.py). With\n",
     "), which needs the modifier backward's step (FlashAttentionBackwardSm120Mods in\n"
     "    flash_bwd_sm120_mods.py; the interface passes modifier_step=True when it builds that class). With\n"),
    ("    \"\"\"How the deterministic backward orders its dQ additions.\n",
     "    \"\"\"How the deterministic backward orders its dQ additions: the ordering keywords of\n"
     "    FlashAttentionBackwardSm120Tuned (flash_bwd_sm120_tuned.py: dq_turn, rotated_turn,\n"
     "    ReversedNBlockScheduler), the interface's choice on SM120.\n"),
    ("    cu_seqlens_q/k, seqused_q/k.\"\"\"\n",
     "    cu_seqlens_q/k, seqused_q/k. `flags`: an ordering to run instead (benchmarks and tests of the\n"
     "    orderings; flags not given are off), refused where it could deadlock.\"\"\"\n"),
    ("    if _forced_plan:\n"
     "        plan = {f: bool(_forced_plan[-1].get(f, False)) for f in _ORDERING_FLAGS}\n",
     "    if flags is not None:\n"
     "        unknown = set(flags) - set(_ORDERING_FLAGS)\n"
     "        if unknown:\n"
     "            raise ValueError(f\"unknown deterministic ordering flags {sorted(unknown)}; \"\n"
     "                             f\"known: {_ORDERING_FLAGS}\")\n"
     "        plan = {f: bool(flags.get(f, False)) for f in _ORDERING_FLAGS}\n"),
    ("    # an order that can deadlock is refused, forced or not", "    # an order that can deadlock is refused, given or not"),
)


# bwd_plans.dq_takes_turns, lifted without its rotated turns entries (this table has no turns_only rows)
_TURNS_EDITS = (
    ("def dq_takes_turns(fixed_point: bool, causal: bool, local: bool, dense: bool,\n"
     "                   rotated_entry: bool = False) -> bool:\n",
     "def dq_takes_turns(fixed_point: bool, causal: bool, local: bool, dense: bool) -> bool:\n"),
    ("    rule: fixed point wherever the call allows it (`fixed_point`) but a dense causal or windowed call\n"
     "    (descending turns) and a dense call without a mask that its key's turns entry serves in the rotated order\n"
     "    (`rotated_entry`: the table has one whose rotated walk fits the call, rotated_entry_fits). dense: no\n"
     "    cu_seqlens or seqused. Windows, the same dense calls without a score_mod timed both ways in one process\n"
     "    (session 39, emulated on an H100, gate_2026-12-07_session39/w51b/det_windows.json): the descending turns\n"
     "    0.875 / 0.867 / 0.831x the default backward, fixed point 0.725 / 0.724 / 0.598x (172 vs 143, 172 vs 143,\n"
     "    109 vs 78 TFLOPS). Packed windows stay in fixed point (0.72x; ascending turns 0.26x, session 38).",
     "    rule: fixed point wherever the call allows it (`fixed_point`) but a dense causal or windowed call\n"
     "    (descending turns). dense: no cu_seqlens or seqused."),
    ("    rotated = rotated_entry and dense and not (causal or local)\n"
     "    return not fixed_point or (dense and (causal or local)) or rotated\n",
     "    return not fixed_point or (dense and (causal or local))\n"),
)


def render_plan_adapter() -> str:
    """SM120_BWD_ORDERING_FLAGS and sm120_bwd_deterministic_plan: the package's deterministic_plan (and
    its flag names) in upstream's names, the forced plan as an argument."""
    names = pkg_bwd_plans._ORDERING_FLAGS
    if not isinstance(names, tuple) or not all(isinstance(n, str) and n.isidentifier() for n in names):
        raise AnchorError(f"{PLAN_WHERE}: _ORDERING_FLAGS is not a tuple of keyword names")
    flags = ("# FlashAttentionBackwardSm120Tuned's deterministic ordering keywords\n"
             "SM120_BWD_ORDERING_FLAGS = (\n"
             + "".join(f"    {line}\n" for line in textwrap.wrap(" ".join(f'"{n}",' for n in names), 92))
             + ")\n")
    code = top_level_source(pkg_bwd_plans, "deterministic_plan")
    for old, new in _PLAN_EDITS:
        code = substitute(code, old, new, where=PLAN_WHERE)
    turns = top_level_source(pkg_bwd_plans, "dq_takes_turns")
    for old, new in _TURNS_EDITS:
        turns = substitute(turns, old, new, where=PLAN_WHERE)
    code = _join_defs([turns, top_level_source(pkg_bwd_plans, "rotated_walk_fits"), code])
    code = rename(code, "dq_takes_turns", "sm120_bwd_dq_takes_turns", where=PLAN_WHERE)
    code = rename(code, "rotated_walk_fits", "sm120_bwd_rotated_walk_fits", where=PLAN_WHERE)
    code = rename(code, "_ORDERING_FLAGS", "SM120_BWD_ORDERING_FLAGS", where=PLAN_WHERE)
    code = rename(code, "BwdConfig", "Sm120BwdConfig", where=PLAN_WHERE)
    left = re.search(r"_forced_plan|force_deterministic_plan|kernels/|driver_bwd|\bdeterministic_plan\b|rotated_entry",
                     code)
    if left:
        raise AnchorError(f"{PLAN_WHERE}: package-only name {left.group(0)!r} left in the lifted plan; "
                          "revisit _PLAN_EDITS in step_bwd.py")
    return "\n\n" + _join_defs([flags, upstream_wording(code)])


def render_bwd_configs_module(table) -> str:
    where = "flash_attn_sm120/config_bwd.py"
    # the patched interface builds FlashAttentionBackwardSm120Tuned, which refuses P/dS in registers (this
    # package's step runs it: driver_bwd.kernel_for); V in registers is lifted off (table_entry_literal) and
    # turned back on by the modifier patch, which routes it
    own_step = [f"{e.head_dim}/{e.mask}" for e in table if e.config.pds_in_regs]
    if own_step:
        raise AnchorError(f"{where}: table rows {own_step} keep P/dS in registers, which only the modifier step "
                          "runs; the patched interface builds the tuned class (route them in step_mods.py)")
    # a plain_mha_only / plain_only / turns_only row runs a tile only this package's routing takes (plain or turns calls)
    # (with V in registers on the modifier step); the patched interface never asks for one, so the row stays here
    table = tuple(e for e in table if not (e.plain_mha_only or e.plain_only or e.turns_only))
    code = _join_defs(top_level_source(pkg_config_bwd, n) for n in ("BWD_FALLBACKS", "BwdTableEntry", "select_bwd_config"))
    for old, new in _BWD_CONFIG_EDITS:
        code = substitute(code, old, new, where=where)
    code = rename(code, "BwdConfig", "Sm120BwdConfig", where=where)
    code = upstream_wording(code)
    adapter = _BWD_ADAPTER + render_plan_adapter()
    check_no_package_refs(_BWD_CONFIGS_HEADER + code + adapter, CONFIGS_REL)
    text = _BWD_CONFIGS_HEADER + "\n" + code + "\n\n" + _table_literal(table) + adapter
    if "flash_attn_sm120" in text:  # the table's comments quote its provenance (mode, GPU), nothing else
        raise AnchorError(f"{CONFIGS_REL}: the package is named in the table's comments")
    compile(text, "flash_bwd_sm120_configs.py", "exec")
    return text
