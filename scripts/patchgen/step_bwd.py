"""Patch 0004: the SM120 backward from a measured table, and its deterministic path.

Lifts the package's backward (`flash_attn_sm120/kernels/bwd_sm120.py` with the layout-free mask of
`bwd_mask.py` and the semaphore ordering of `bwd_deterministic.py`) as upstream's
`flash_bwd_sm120_tuned.py`, without what only the package needs (SM120 emulation padding, the
driver's occupancy bookkeeping); renders the backward table (`flash_attn_sm120/configs/sm120_bwd.toml`)
with its fallbacks and selection rule (`config_bwd.py`) as `flash_bwd_sm120_configs.py`; and edits
`interface.py` so that `_flash_attn_bwd` on SM120 builds the tuned class with the table's config,
gives the postprocess the same thread layout, and runs `deterministic=True` with the semaphores and
dQ ordering the package's driver uses: `driver_bwd.deterministic_plan`, lifted into the configs module
as `sm120_bwd_deterministic_plan` (its forced plan an argument), its flags the kernel's keywords
(`check_plan_call` anchors the call and the keywords). Where no config runs the head dims, the
interface keeps SM120's earlier default and class.
"""

from __future__ import annotations

import ast
import inspect
import json
import math
import re
import textwrap
from dataclasses import fields
from pathlib import Path

from flash_attn_sm120 import config_bwd as pkg_config_bwd
from flash_attn_sm120 import driver_bwd as pkg_driver_bwd
from flash_attn_sm120.kernels import bwd_deterministic as pkg_bwd_det
from flash_attn_sm120.kernels import bwd_mask as pkg_bwd_mask
from flash_attn_sm120.kernels import bwd_sm120 as pkg_bwd

from patchgen.core import (
    CUTE,
    EMULATED_NOTE,
    MODE_COMMENT,
    ROOT,
    UPSTREAM_DISTRIBUTION,
    AnchorError,
    Context,
    _join_defs,
    apply_edits,
    check_no_package_refs,
    commit_message,
    quote_record,
    rename,
    substitute,
    top_level_source,
    upstream_wording,
)

WHERE = "flash_attn_sm120/kernels/bwd_sm120.py"
DET_WHERE = "flash_attn_sm120/kernels/bwd_deterministic.py"
DEFAULT_BWD_TABLE = ROOT / "flash_attn_sm120" / "configs" / "sm120_bwd.toml"
# the benchmark of the shipped backward table that the message quotes (prepare.py --set bwd --json)
DEFAULT_BWD_BENCH = ROOT / "configs" / "measurements" / "2026-12-02_bwd_table_session16_final_emulated.json"
# the same problems with deterministic=True (summary.deterministic_vs_table), in the same run as the
# table (the shipped orderings; an older run may add summary.det_session8_vs_table)
DEFAULT_DET_BENCH = ROOT / "configs" / "measurements" / "2026-12-02_bwd_table_session16_final_emulated.json"
# the session record of the orderings' GPU tests that the message quotes
DEFAULT_DET_RECORD = ROOT / "configs" / "measurements" / "2026-12-02_session13.md"
TUNED_REL = f"{CUTE}/flash_bwd_sm120_tuned.py"
CONFIGS_REL = f"{CUTE}/flash_bwd_sm120_configs.py"

_TUNED_DOC = '''"""SM120 backward with 4 or 8 warps, any feasible tile, stage count and warp atom layout, and a
deterministic mode; FlashAttentionBackwardSm120 with its configuration as data.

{algorithm}

FlashAttentionBackwardSm120Tuned adds, by subclassing FlashAttentionBackwardSm120:
  * Sm120BwdConfig, the tile/warp/stage/layout choice as data (flash_bwd_sm120_configs.py holds
    the measured table);
  * the exact shared-memory footprint of the SharedStorage (sm120_bwd_smem_bytes): the SM120
    `can_implement` counts Q, dO, K and V only, not sP, sdS, sLSE and sdPsum;
  * SM120 feasibility rules with a reason for each refusal (bwd_config_error), V in registers
    among them: it gives wrong dQ in the SM80/SM120 mainloop;
  * a causal/local mask that is right for any S/dP warp layout (layout_free): the R2P mask of
    AttentionMask.apply_mask assumes one warp along N, which only the earlier 4-warp config had;
  * varlen GQA dK/dV accumulated at the offsets the postprocess reads (epilogue);
  * deterministic: semaphore-ordered dQ and GQA dK/dV accumulation, in the dQ order the interface
    picks (sm120_bwd_deterministic_plan): ascending, descending with the n_blocks launched shortest
    first (dq_turn, ReversedNBlockScheduler), or rotated (rotated_turn); acquire, release.
Everything else (mainloop, atomics, GQA accumulation, varlen) is FlashAttentionBackwardSm120's.
"""
'''
_DOC_EDITS = (  # on the algorithm part of the package's module docstring
    ("SM120 backward, FA2 family: upstream's SM120 backward opened up to 4 or 8 warps, any tile, stage and atom layout.\n\n",
     ""),
    ("Upstream's\npreprocess kernel", "The\npreprocess kernel"),
)
_BODY_EDITS = (  # on the package module's code after its imports
    ("        # Upstream's SM80/SM120 mainloop takes no semaphores;", "        # The SM80/SM120 mainloop takes no semaphores;"),
    ("(upstream's FlashAttentionBackwardSm80 parameters)", "(FlashAttentionBackwardSm80's parameters)"),
    ("_HDIM_MULTIPLE = 32  # upstream pads", "_HDIM_MULTIPLE = 32  # the SM80/SM120 backward pads"),
    ("    # measured on the H200 (configs/measurements/2026-12-01_bwd_first_emulated.md): V in registers gives\n",
     "    # measured: V in registers gives\n"),
    ("    \"\"\"Upstream's SM120 backward with a BwdConfig, SM120 limits and emulation padding.\n"
     "\n"
     "    `emulate_host_smem`: a hardware.EmulationHost when the kernel runs in SM120 emulation on another\n"
     "    GPU (shared memory padded so that the host fits no more CTAs per SM than SM120); None on SM120.\n"
     "    \"\"\"\n"
     "\n"
     "    family = \"bwd\"\n",
     "    \"\"\"FlashAttentionBackwardSm120 with a Sm120BwdConfig, SM120 limits, a mask for any warp layout\n"
     "    and a deterministic mode. Its ordering keywords (SM120_BWD_ORDERING_FLAGS) are what\n"
     "    flash_bwd_sm120_configs.sm120_bwd_deterministic_plan returns; see dq_turn and rotated_turn.\"\"\"\n"),
    ("        emulate_host_smem: Optional[hardware.EmulationHost] = None,\n", ""),
    ("        self.emulate_host_smem = emulate_host_smem\n", ""),
    ("        self.dq_descending = dq_descending and is_causal  # bwd_deterministic.py: the dQ turn order\n",
     "        self.dq_descending = dq_descending and is_causal  # the dQ turn order (dq_turn)\n"),
    ("        # filled in at trace time, read by the occupancy check, the codegen report and the tests\n"
     "        self.smem_bytes_unpadded: Optional[int] = None\n"
     "        self.smem_bytes_launched: Optional[int] = None\n"
     "        self.launch_threads: Optional[int] = None\n"
     "\n"
     "    def _get_shared_storage_cls(self):\n"
     "        return emulation_storage(self, super()._get_shared_storage_cls(), self.num_threads)\n",
     ""),
    ("one warp along N of the S tile (bwd_mask.py)\n", "one warp along N of the S tile (layout_free)\n"),
    ("upstream's step (kernels/bwd_mods.py has its own)", "FlashAttentionBackwardSm120's step"),
    ("        # upstream's __call__ passes its tile scheduler class second to last; the shortest-first launch\n"
     "        # swaps in the same scheduler with the n_blocks reversed (dense problems only)\n",
     "        # FlashAttentionBackwardSm80.__call__ passes its tile scheduler class second to last; the\n"
     "        # shortest-first launch swaps in the same scheduler with the n_blocks reversed (dense only)\n"),
    ("\"reverse_n_blocks needs upstream's dense tile scheduler (no cu_seqlens_k)\"",
     "\"reverse_n_blocks needs the dense SingleTileScheduler (no cu_seqlens_k)\""),
    ("        # the dQ adds (and their wait) after the dK product, at the m_block's end: the modifier step's\n"
     "        # (kernels/bwd_mods.py) option, this package's own step; upstream's cannot reorder them\n",
     "        # the dQ adds (and their wait) after the dK product, at the m_block's end: an option of the\n"
     "        # modifier step (FlashAttentionBackwardSm120Mods); the SM80 step cannot reorder them\n"),
)
_DET_EDITS = (  # on the deterministic module's lifted definitions
    ("    \"\"\"Upstream's one-tile-per-CTA scheduler with the n_blocks launched last to first.\n",
     "    \"\"\"SingleTileScheduler (one tile per CTA) with the n_blocks launched last to first.\n"),
)
_DET_DOC_EDITS = (  # on its docstring, the section's comment: the package's module names in upstream's
    ("(driver_bwd.deterministic_plan chooses)", "(flash_bwd_sm120_configs.sm120_bwd_deterministic_plan chooses)"),
    ("(kernels/bwd_sm120.py, compute_one_m_block)", "(compute_one_m_block, below)"),
)
# the package's module names: none may be left in the upstream module (comments included)
_PACKAGE_MODULES = re.compile(r"\bdriver_bwd\b|\bkernels/|(?<![\w.])(bwd_sm120|bwd_deterministic|bwd_mask|bwd_mods)\b")
_DROP = ("upstream_bwd_config",)  # package-only: the benchmark's "before" config
_RENAMES = (
    ("BwdConfig", "Sm120BwdConfig"),  # the interface has an SM90 BwdConfig
    ("smem_bytes", "sm120_bwd_smem_bytes"),
    ("hardware.DSL_STATIC_SMEM", "SM120_STATIC_SMEM"),
    ("hardware.SMEM_PER_BLOCK_MAX", "SM120_SMEM_PER_BLOCK_MAX"),
    ("bwd_mask.layout_free", "layout_free"),
)
_REPLACED_IMPORTS = {  # package module -> what upstream imports instead (None: lifted into the file)
    "flash_attn_sm120": None,
    "flash_attn_sm120.kernels": None,
    "flash_attn_sm120.kernels.emulation": None,  # the padding goes with _get_shared_storage_cls
    "flash_attn_sm120.kernels.fwd_cpasync": ("flash_attn.cute.flash_fwd_sm120",
                                             ("SM120_SMEM_PER_BLOCK_MAX", "SM120_STATIC_SMEM", "_round_up")),
}


def _imports_and_body(module) -> tuple[dict, str, str]:
    """(imports {module or "": [names]}, docstring source, code after the imports) of a package module."""
    src = inspect.getsource(module)
    tree = ast.parse(src)
    lines = src.splitlines(keepends=True)
    imports: dict = {}
    last = 0
    doc = ""
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            doc = node.value.value
            last = node.end_lineno
        elif isinstance(node, ast.ImportFrom):
            mod = node.module
            if mod in _REPLACED_IMPORTS:
                repl = _REPLACED_IMPORTS[mod]
                if repl is not None:
                    imports.setdefault(repl[0], []).extend(repl[1])
            elif mod.startswith("flash_attn_sm120"):
                raise AnchorError(f"{module.__name__}: import from {mod} has no upstream counterpart")
            else:
                imports.setdefault(mod, []).extend(
                    f"{a.name} as {a.asname}" if a.asname else a.name for a in node.names)
            last = node.end_lineno
        elif isinstance(node, ast.Import):
            for a in node.names:
                imports.setdefault("", []).append(f"{a.name} as {a.asname}" if a.asname else a.name)
            last = node.end_lineno
        else:
            break
    return imports, doc, "".join(lines[last:]).lstrip("\n")


def _render_imports(parts: list[dict]) -> str:
    merged: dict = {}
    for imp in parts:
        for mod, names in imp.items():
            merged.setdefault(mod, [])
            merged[mod] += [n for n in names if n not in merged[mod]]
    future = ["from __future__ import annotations\n\n"] if "__future__" in merged else []
    plain = [f"import {n}\n" for n in merged.pop("", [])]
    merged.pop("__future__", None)
    std = [m for m in merged if m.split(".")[0] in ("dataclasses", "functools", "typing")]
    rest = [m for m in merged if m not in std]
    fmt = lambda m: f"from {m} import {', '.join(sorted(merged[m], key=str.lower))}\n"  # noqa: E731
    return "".join(future + [fmt(m) for m in std] + ["\n"] + [p for p in plain] + [fmt(m) for m in rest])


def _drop_top_level(text: str, names) -> str:
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    spans = [(n.lineno - 1, n.end_lineno) for n in tree.body
             if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in names]
    if len(spans) != len(names):
        raise AnchorError(f"{WHERE}: expected the package-only definitions {names}, found {len(spans)}")
    for start, end in sorted(spans, reverse=True):
        while end < len(lines) and not lines[end].strip():
            end += 1
        del lines[start:end]
    return "".join(lines)


def _doc_as_comment(doc: str, title: str) -> str:
    """A lifted module docstring as a comment block over its section."""
    body = upstream_wording(doc.replace("Upstream's SM120 backward", "FlashAttentionBackwardSm120")
                            .replace("upstream's SM90 and\nSM100", "the SM90 and\nSM100")
                            .replace("(measured on the H200: dQ errors", "(measured: dQ errors"))
    return f"# {'-' * 20} {title}\n" + "".join(f"# {l}".rstrip() + "\n" for l in body.strip().splitlines())


def _det_names() -> list[str]:
    """The deterministic module's top-level functions and classes, in its order (all are lifted)."""
    tree = ast.parse(inspect.getsource(pkg_bwd_det))
    names = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    other = [n for n in tree.body[1:] if not isinstance(n, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef))]
    if other:
        raise AnchorError(f"{DET_WHERE}: top-level code other than definitions at line {other[0].lineno}; "
                          "step_bwd.py lifts definitions only")
    return names


def render_tuned_module() -> str:
    """flash_bwd_sm120_tuned.py: the package's backward, mask and deterministic modules in upstream's names."""
    imp_bwd, doc_bwd, body = _imports_and_body(pkg_bwd)
    imp_mask, doc_mask, _ = _imports_and_body(pkg_bwd_mask)
    imp_det, doc_det, _ = _imports_and_body(pkg_bwd_det)
    algorithm = doc_bwd.split("\nThis module adds")[0]
    for old, new in _DOC_EDITS:
        algorithm = substitute(algorithm, old, new, where=f"{WHERE} (docstring)")
    if "\nThis module adds" not in doc_bwd:
        raise AnchorError(f"{WHERE}: docstring has no 'This module adds' list")
    for old, new in _BODY_EDITS:
        body = substitute(body, old, new, where=WHERE)
    body = _drop_top_level(body, _DROP)
    for old, new in _RENAMES:
        body = rename(body, old, new, where=WHERE)
    det_names = _det_names()
    for name in det_names:  # the kernel's uses of the deterministic module's definitions, lifted next to it
        body = re.sub(rf"(?<![\w.])bwd_deterministic\.{name}\b", name, body)
    left = re.search(r"(?<!\w)bwd_deterministic\b.{0,40}", body)
    if left:
        raise AnchorError(f"{WHERE}: a use of bwd_deterministic that is not one of its top-level definitions "
                          f"({left.group(0)!r})")
    body = upstream_wording(body)
    mask_defs = _join_defs(top_level_source(pkg_bwd_mask, n) for n in ("layout_free", "apply_mask_any_layout"))
    det_defs = _join_defs(top_level_source(pkg_bwd_det, n) for n in det_names)
    for old, new in _DET_EDITS:
        det_defs = substitute(det_defs, old, new, where=DET_WHERE)
    for old, new in _DET_DOC_EDITS:
        doc_det = substitute(doc_det, old, new, where=f"{DET_WHERE} (docstring)")
    cls_at = body.index("class FlashAttentionBackwardSm120Tuned(")
    text = (
        _TUNED_DOC.format(algorithm=upstream_wording(algorithm.strip()))
        + "\n" + _render_imports([imp_bwd, imp_mask, imp_det]) + "\n"
        + body[:cls_at].rstrip("\n") + "\n\n\n"
        + _doc_as_comment(doc_mask, "causal / local mask for any warp layout (layout_free)") + "\n\n"
        + upstream_wording(mask_defs).rstrip("\n") + "\n\n\n"
        + _doc_as_comment(doc_det, "deterministic accumulation") + "\n\n"
        + upstream_wording(det_defs).rstrip("\n") + "\n\n\n"
        + body[cls_at:]
    )
    check_no_package_refs(text, TUNED_REL)
    left = _PACKAGE_MODULES.search(text)
    if left:
        line = text[:left.start()].count("\n") + 1
        raise AnchorError(f"{TUNED_REL}: the package's module name {left.group(0)!r} left at line {line}; "
                          "add an edit in step_bwd.py")
    compile(text, "flash_bwd_sm120_tuned.py", "exec")
    return text


# ------------------------------------------------------------------------------ configs module
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
        lit = _config_literal(e.config)
        s, a = lit.index("stages_q"), lit.index("atom_m_sdp")
        end = ", modifiers=True" if e.modifiers else ""
        lines.append(f'    BwdTableEntry({e.head_dim}, "{e.mask}", {lit[:s].rstrip()}\n'
                     f'        {lit[s:a].rstrip()}\n        {lit[a:]}{end}),')
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


# driver_bwd.deterministic_plan, lifted as sm120_bwd_deterministic_plan: the package's forced plan
# (force_deterministic_plan, a context manager of its benchmarks) becomes an argument
PLAN_WHERE = "flash_attn_sm120/driver_bwd.py (deterministic_plan)"
_PLAN_EDITS = (
    ("def deterministic_plan(num_sms: int, cfg: BwdConfig, causal: bool, seqlen_q: int, seqlen_k: int,\n"
     "                       index_tensors: tuple = (None, None, None, None), modifier_step: bool = True) -> dict:\n",
     "def sm120_bwd_deterministic_plan(num_sms: int, cfg: BwdConfig, causal: bool, seqlen_q: int, seqlen_k: int,\n"
     "                                 index_tensors: tuple = (None, None, None, None),\n"
     "                                 modifier_step: bool = False, flags: Optional[dict] = None) -> dict:\n"),
    ("), which needs this package's step (kernels/bwd_mods.py). With\n",
     "), which needs the modifier backward's step (FlashAttentionBackwardSm120Mods in\n"
     "    flash_bwd_sm120_mods.py; the interface passes modifier_step=True when it builds that class). With\n"),
    ("    \"\"\"How the deterministic backward orders its dQ additions (kernels/bwd_deterministic.py).\n",
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


def render_plan_adapter() -> str:
    """SM120_BWD_ORDERING_FLAGS and sm120_bwd_deterministic_plan: the package's deterministic_plan (and
    its flag names) in upstream's names, the forced plan as an argument."""
    names = pkg_driver_bwd._ORDERING_FLAGS
    if not isinstance(names, tuple) or not all(isinstance(n, str) and n.isidentifier() for n in names):
        raise AnchorError(f"{PLAN_WHERE}: _ORDERING_FLAGS is not a tuple of keyword names")
    flags = ("# FlashAttentionBackwardSm120Tuned's deterministic ordering keywords\n"
             "SM120_BWD_ORDERING_FLAGS = (\n"
             + "".join(f"    {line}\n" for line in textwrap.wrap(" ".join(f'"{n}",' for n in names), 92))
             + ")\n")
    code = top_level_source(pkg_driver_bwd, "deterministic_plan")
    for old, new in _PLAN_EDITS:
        code = substitute(code, old, new, where=PLAN_WHERE)
    code = rename(code, "_ORDERING_FLAGS", "SM120_BWD_ORDERING_FLAGS", where=PLAN_WHERE)
    code = rename(code, "BwdConfig", "Sm120BwdConfig", where=PLAN_WHERE)
    left = re.search(r"_forced_plan|force_deterministic_plan|kernels/|driver_bwd|\bdeterministic_plan\b", code)
    if left:
        raise AnchorError(f"{PLAN_WHERE}: package-only name {left.group(0)!r} left in the lifted plan; "
                          "revisit _PLAN_EDITS in step_bwd.py")
    return "\n\n" + _join_defs([flags, upstream_wording(code)])


def render_bwd_configs_module(table) -> str:
    where = "flash_attn_sm120/config_bwd.py"
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


# ------------------------------------------------------------------------------ interface edits
_BWD_INTERFACE_EDITS = (
    (
        "import of the SM120 tuned backward",
        "from flash_attn.cute.flash_bwd_sm120 import FlashAttentionBackwardSm120\n",
        "from flash_attn.cute.flash_bwd_sm120 import FlashAttentionBackwardSm120\n"
        "from flash_attn.cute.flash_bwd_sm120_configs import sm120_bwd_config, sm120_bwd_deterministic_plan\n"
        "from flash_attn.cute.flash_bwd_sm120_tuned import FlashAttentionBackwardSm120Tuned\n"
        "from flash_attn.cute.flash_bwd_sm120_tuned import preprocess_multiple as sm120_bwd_preprocess_multiple\n",
    ),
    (
        "SM120 backward config from the table",
        "        assert deterministic is False, \"deterministic backward not supported on SM 12.0\"\n",
        "        # SM120: warps, tiles, stages, atom layouts and swaps from the measured backward table\n"
        "        # (flash_bwd_sm120_configs.py), run by FlashAttentionBackwardSm120Tuned; where no config\n"
        "        # runs the head dims, the earlier default above and FlashAttentionBackwardSm120\n"
        "        sm120_bwd_cfg = sm120_bwd_config(head_dim, head_dim_v, causal, local)\n"
        "        if sm120_bwd_cfg is not None:\n"
        "            m_block_size, n_block_size = sm120_bwd_cfg.m_block, sm120_bwd_cfg.n_block\n"
        "            num_stages_Q, num_stages_dO = sm120_bwd_cfg.stages_q, sm120_bwd_cfg.stages_do\n"
        "            SdP_swapAB, dKV_swapAB, dQ_swapAB = (\n"
        "                sm120_bwd_cfg.sdp_swapab, sm120_bwd_cfg.dkv_swapab, sm120_bwd_cfg.dq_swapab\n"
        "            )\n"
        "            AtomLayoutMSdP, AtomLayoutNdKV, AtomLayoutMdQ = (\n"
        "                sm120_bwd_cfg.atom_m_sdp, sm120_bwd_cfg.atom_n_dkv, sm120_bwd_cfg.atom_m_dq\n"
        "            )\n"
        "            V_in_regs = sm120_bwd_cfg.v_in_regs\n"
        "            num_threads = sm120_bwd_cfg.num_threads\n"
        "        if deterministic and local:\n"
        "            raise NotImplementedError(\n"
        "                \"deterministic=True with a sliding window (local attention) is not supported by the \"\n"
        "                \"SM120 backward yet; causal and full attention are\"\n"
        "            )\n"
        "        assert not deterministic or sm120_bwd_cfg is not None, (\n"
        "            \"deterministic backward not supported on SM 12.0 for these head dims\"\n"
        "        )\n",
    ),
    (
        "SM120 deterministic semaphores and dQ order",
        "    # The dedicated hd256 backward is deterministic without semaphores.\n"
        "    if deterministic and not use_dedicated_hd256_kernel:\n",
        "    sm120_det_plan = {}  # SM120's deterministic ordering: FlashAttentionBackwardSm120Tuned's keywords\n"
        "    if deterministic and arch // 10 == 12:\n"
        "        # SM120 (flash_bwd_sm120_tuned.py): int32 turn counters per (batch, head, m_block) for dQ\n"
        "        # and per (batch, KV head, n_block) for GQA dK/dV (dK's serves dV too); the dQ order:\n"
        "        # descending turns with the n_blocks launched shortest first for causal, the rotated\n"
        "        # order without a mask when a head's n_blocks are resident, else ascending\n"
        "        sm120_det_plan = sm120_bwd_deterministic_plan(\n"
        "            get_num_sms_for_selection(device.index, arch), sm120_bwd_cfg, causal, seqlen_q, seqlen_k,\n"
        "            index_tensors=(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k),\n"
        "        )\n"
        "        dQ_semaphore = torch.zeros(\n"
        "            batch_size, num_head, max(seqlen_q_rounded // m_block_size, 1), dtype=torch.int32, device=device\n"
        "        )\n"
        "        dK_semaphore = (\n"
        "            torch.zeros(\n"
        "                batch_size, num_head_kv, max(seqlen_k_rounded // n_block_size, 1), dtype=torch.int32,\n"
        "                device=device,\n"
        "            )\n"
        "            if qhead_per_kvhead > 1\n"
        "            else None\n"
        "        )\n"
        "        dV_semaphore = None\n"
        "    # The dedicated hd256 backward is deterministic without semaphores.\n"
        "    elif deterministic and not use_dedicated_hd256_kernel:\n",
    ),
    (
        "SM120 widens the preprocess pass for short tiles",
        "    _bwd_preprocess(\n"
        "        out, dout, dpsum, lse, lse_log2, dq_accum,\n"
        "        cu_seqlens_q, seqused_q, dlse,\n"
        "        dtype, head_dim, head_dim_v, m_block_size,\n"
        "        cu_total_m_blocks=cu_total_m_blocks_q,\n"
        "        fake_mode=fake_mode,\n"
        "        hdim_multiple_of=hdim_multiple_of,\n"
        "    )\n",
        "    # SM120: a preprocess pass must not cover more rows than a short m_block (its last m_block of a\n"
        "    # head would zero the next head's first dPsum rows); a wider head-dim multiple (a wider k-block,\n"
        "    # the columns past head_dim_v predicated off) covers fewer, and dQaccum, whose layout keeps\n"
        "    # hdim_multiple_of, is then zeroed here\n"
        "    preprocess_hdim_multiple = hdim_multiple_of\n"
        "    if arch // 10 == 12 and sm120_bwd_cfg is not None:\n"
        "        preprocess_hdim_multiple = sm120_bwd_preprocess_multiple(head_dim_v, m_block_size)\n"
        "    preprocess_zeroes_dq = preprocess_hdim_multiple == hdim_multiple_of\n"
        "    if not preprocess_zeroes_dq and dq_accum is not None:\n"
        "        dq_accum.zero_()\n"
        "    _bwd_preprocess(\n"
        "        out, dout, dpsum, lse, lse_log2, dq_accum if preprocess_zeroes_dq else None,\n"
        "        cu_seqlens_q, seqused_q, dlse,\n"
        "        dtype, head_dim, head_dim_v, m_block_size,\n"
        "        cu_total_m_blocks=cu_total_m_blocks_q,\n"
        "        fake_mode=fake_mode,\n"
        "        hdim_multiple_of=preprocess_hdim_multiple,\n"
        "    )\n",
    ),
    (
        "SM120 keeps its dK/dV semaphores",
        "    if deterministic and qhead_per_kvhead > 1 and not use_dedicated_hd256_kernel:\n",
        "    if deterministic and arch // 10 == 12:\n"
        "        pass  # set above\n"
        "    elif deterministic and qhead_per_kvhead > 1 and not use_dedicated_hd256_kernel:\n",
    ),
    (
        "the dQ ordering joins the compile key",
        "            dQ_single_wg,\n"
        "            deterministic,\n",
        "            dQ_single_wg,\n"
        "            deterministic,\n"
        "            tuple(sm120_det_plan.items()),\n",
    ),
    (
        "SM120 semaphores are 3-D",
        "        dQ_semaphore_tensor, dK_semaphore_tensor, dV_semaphore_tensor = [\n"
        "            utils.convert_from_dlpack_leading_static(t.detach(), leading_dim=3, alignment=4, stride_order=t.dim_order())\n"
        "            if t is not None else None\n"
        "            for t in (dQ_semaphore, dK_semaphore, dV_semaphore)\n"
        "        ]\n",
        "        dQ_semaphore_tensor, dK_semaphore_tensor, dV_semaphore_tensor = [\n"
        "            (\n"
        "                to_cute_tensor(t, assumed_align=4)  # SM120: (batch, head, block), read element-wise\n"
        "                if arch // 10 == 12\n"
        "                else utils.convert_from_dlpack_leading_static(\n"
        "                    t.detach(), leading_dim=3, alignment=4, stride_order=t.dim_order()\n"
        "                )\n"
        "            )\n"
        "            if t is not None else None\n"
        "            for t in (dQ_semaphore, dK_semaphore, dV_semaphore)\n"
        "        ]\n",
    ),
    (
        "SM120 builds the tuned class",
        "        if arch // 10 in [8, 12]:\n"
        "            flash_bwd_obj_cls = FlashAttentionBackwardSm120 if arch // 10 == 12 else FlashAttentionBackwardSm80\n",
        "        if arch // 10 == 12 and sm120_bwd_cfg is not None:\n"
        "            fa_bwd_obj = FlashAttentionBackwardSm120Tuned(\n"
        "                dtype,\n"
        "                head_dim,\n"
        "                head_dim_v,\n"
        "                qhead_per_kvhead,\n"
        "                sm120_bwd_cfg,\n"
        "                pack_gqa=pack_gqa,\n"
        "                is_causal=causal,\n"
        "                is_local=local,\n"
        "                score_mod=score_mod,\n"
        "                score_mod_bwd=score_mod_bwd,\n"
        "                deterministic=deterministic,\n"
        "                **sm120_det_plan,\n"
        "            )\n"
        "        elif arch // 10 in [8, 12]:\n"
        "            flash_bwd_obj_cls = FlashAttentionBackwardSm120 if arch // 10 == 12 else FlashAttentionBackwardSm80\n",
    ),
    (
        "SM120 postprocess in the main kernel's thread layout",
        "        else:\n"
        "            num_threads_post_dQ = 128\n"
        "            num_threads_post_dKV = 128\n",
        "        elif arch // 10 == 12:\n"
        "            # SM120: the postprocess reads the accumulators in the main kernel's thread layout\n"
        "            # (its warps, with the atom layouts and swaps passed below)\n"
        "            num_threads_post_dQ = num_threads_post_dKV = num_threads\n"
        "        else:\n"
        "            num_threads_post_dQ = 128\n"
        "            num_threads_post_dKV = 128\n",
    ),
)


def check_plan_call() -> None:
    """AnchorError unless the package calls deterministic_plan as the patched interface calls
    sm120_bwd_deterministic_plan (same arguments, the result as the kernel's keywords) and the kernel
    takes every ordering flag as a keyword."""
    sig = list(inspect.signature(pkg_driver_bwd.deterministic_plan).parameters)
    # (modifier_step keeps its patched default, False: the interface builds the tuned class)
    if sig != ["num_sms", "cfg", "causal", "seqlen_q", "seqlen_k", "index_tensors", "modifier_step"]:
        raise AnchorError(f"{PLAN_WHERE}: takes {sig}; revisit the interface's sm120_bwd_deterministic_plan call")
    backward = " ".join(inspect.getsource(pkg_driver_bwd.backward).split())
    call = ("**(deterministic_plan(device_info(q.device).num_sms, cfg, causal, seqlen_q, seqlen_k, index_tensors=( "
            "cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)) if deterministic else {})")
    if call not in backward:
        raise AnchorError("flash_attn_sm120/driver_bwd.py: backward() no longer calls deterministic_plan as the "
                          "patched interface does; revisit the interface edits in step_bwd.py")
    if "**ordering_flags(statics)" not in inspect.getsource(pkg_driver_bwd.make_kernel):
        raise AnchorError("flash_attn_sm120/driver_bwd.py: make_kernel no longer passes the plan as the kernel's keywords")
    kwargs = inspect.signature(pkg_bwd.FlashAttentionBackwardSm120Tuned.__init__).parameters
    missing = [f for f in pkg_driver_bwd._ORDERING_FLAGS if kwargs.get(f) is None or kwargs[f].default is not False]
    if missing:
        raise AnchorError(f"{WHERE}: FlashAttentionBackwardSm120Tuned takes no keyword {missing} defaulting to False")


# ------------------------------------------------------------------------------ the step
def _measurement_rows(table) -> str:
    header = ("d", "mask", "config", "TFLOPS", "before", "speedup", "GPU", "mode", "date")
    rows = []
    for e in table:
        p = e.provenance
        tf, up = p.get("tflops"), p.get("upstream_tflops")
        rows.append((
            str(e.head_dim), e.mask + (" (modifiers)" if e.modifiers else ""), _describe(e.config),
            f"{_geomean(tf):.1f}" if tf is not None else "-",
            f"{_geomean(up):.1f}" if up else "-",
            f"{_geomean(tf) / _geomean(up):.2f}x" if tf is not None and up else "-",
            str(p["gpu"]), str(p["mode"]), str(p["date"]),
        ))
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    fmt = lambda r: "  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(header)] + [fmt(r) for r in rows])


def _bench_block(bench: dict) -> list:
    vs = bench["summary"]["vs_upstream_sm120"]
    return [
        f"The shipped table against SM120's earlier backward on the same problems "
        f"({len(vs['ratios'])} problems, set {bench['set']}, {bench['gpu']}, mode {bench['mode']}: "
        f"{bench['mode_label']}, {bench['date'][:10]}): geometric mean {vs['geomean']:.2f}x, "
        f"lowest {vs['min']:.2f}x; all results checked against the reference "
        f"(correct: {str(bench['summary']['correct']).lower()}).",
        f"  {bench['command']}",
    ]


def det_test_facts(path: Path = DEFAULT_DET_RECORD) -> dict:
    """The orderings' GPU tests as the session record gives them (AnchorError where it says otherwise)."""
    text = Path(path).read_text()
    m = quote_record(r"`pytest -n \d+ (tests/test_bwd_deterministic_gpu\.py)` \(commit (\w+)\): \*\*(\d+) passed\*\*"
                     r".*?and (\d+) forced orderings\.", text, "the deterministic GPU tests' result", path, "step_bwd.py")
    return dict(test_file=m.group(1), commit=m.group(2), passed=int(m.group(3)), forced=int(m.group(4)))


def step_sm120_bwd(ctx: Context, table_path: Path = DEFAULT_BWD_TABLE, bench_path: Path = DEFAULT_BWD_BENCH) -> str:
    """Patch 4: the SM120 backward from the measured table, and deterministic=True on SM120."""
    det_tests = det_test_facts()
    table = load_bwd_table(table_path)
    ctx.write(TUNED_REL, render_tuned_module())
    ctx.write(CONFIGS_REL, render_bwd_configs_module(table))
    rel = f"{CUTE}/interface.py"
    ctx.write(rel, apply_edits(ctx.read(rel), _BWD_INTERFACE_EDITS, rel))
    bench = json.loads(Path(bench_path).read_text()) if bench_path and Path(bench_path).exists() else None
    det_bench = json.loads(DEFAULT_DET_BENCH.read_text()) if DEFAULT_DET_BENCH.exists() else None
    modes = sorted({str(e.provenance["mode"]) for e in table} | ({str(bench["mode"])} if bench else set()))
    before = pkg_bwd.upstream_bwd_config(128)
    measured = []
    if table:
        measured = [
            "Measured (TFLOPS: geometric mean over the bucket's problems, causal counted as half the work; "
            f"before: SM120's previous backward, {before.num_warps} warps, {before.m_block}x{before.n_block}, "
            "on the same problems, GPU and mode):",
            _measurement_rows(table),
        ]
        if bench:
            measured += _bench_block(bench)
        if det_bench:
            dv = det_bench["summary"]["deterministic_vs_table"]
            old = det_bench["summary"].get("det_session8_vs_table")
            measured.append(
                f"deterministic=True costs time: on the same {len(dv['ratios'])} problems ({det_bench['gpu']}, mode "
                f"{det_bench['mode']}, {det_bench['date'][:10]}) it runs at {dv['geomean']:.2f}x the table's speed "
                f"(geometric mean; lowest {dv['min']:.2f}x)"
                + (f"; the previous ordering (ascending turns, or descending for causal where a head's n_blocks "
                   f"were resident; a fence per thread before each release) ran at {old['geomean']:.2f}x on "
                   f"{len(old['ratios'])} of them in the same run" if old else "")
                + ". The rest is mostly barrier stalls: at each m_block the whole CTA waits for the one "
                "thread that reads or releases the flag.")
        if "emulated" in modes:
            measured.append(EMULATED_NOTE + ".")
        measured += ["Table commands:", "\n".join(f"  {c}" for c in sorted({str(e.provenance['command']) for e in table}))]
    check_plan_call()
    return commit_message(
        "[Cute,Sm120] Backward from a measured table (4 or 8 warps, any atom layout), deterministic mode",
        "SM120's backward ran one configuration for every head dim and mask: 4 warps, 64x64 tiles, all "
        "warps along M. At d=128 it spills registers, above d=128 it does not fit 99 KB, and "
        "deterministic=True was refused. This patch makes the configuration data, measured per head dim "
        "and mask, and adds a deterministic mode.",
        "What changes:",
        [
            "flash_bwd_sm120_tuned.py (new): FlashAttentionBackwardSm120Tuned, a subclass of "
            "FlashAttentionBackwardSm120 built from a Sm120BwdConfig (4 or 8 warps, m/n tiles, Q/dO "
            "stages, warp atom layouts of the three products, dQ swapAB), with SM120 rules that give a "
            "reason for each refusal (bwd_config_error: exact shared memory of the SharedStorage, tile "
            "multiples of each atom layout, the mainloop's own limits).",
            "flash_bwd_sm120_configs.py (new): SM120_BWD_TABLE, one measured entry per (head-dim bucket, "
            "mask), fallbacks that fit 99 KB up to d=256, and select_bwd_config (exact key; local tries "
            "causal; then the bucket's non-causal entry; then the fallbacks).",
            "interface.py: _flash_attn_bwd on SM120 builds the tuned class with the table's config; the "
            "postprocess reads the accumulators with the same warps, atom layout and swap; where no config "
            "runs the head dims the previous default and class stay. deterministic=True allocates int32 "
            "turn counters per (batch, head, m_block) for dQ and per (batch, KV head, n_block) for GQA "
            "dK/dV (3-D, not the 4-D SM90/SM100 ones) and picks the dQ ordering "
            "(sm120_bwd_deterministic_plan, the class's ordering keywords, part of the compile key); with "
            "a sliding window it raises NotImplementedError. The preprocess runs at the smallest "
            "head-dim multiple whose pass covers no more rows than m_block (preprocess_multiple: at the "
            "default multiple of 32 a pass covers 64 rows at d96, and a 32-row tile's last m_block of a "
            "head zeroed the next head's first dPsum rows, wrong gradients measured at b1 s4096 h16); "
            "dQaccum is then zeroed by the interface.",
        ],
        "Why the subclass changes more than the tiles (three problems of the SM80/SM120 mainloop):",
        [
            "Causal/local masking is wrong with more than one warp along N of the S tile: the R2P mask "
            "of AttentionMask.apply_mask assumes the accumulator layout of one warp along N, which only "
            "the previous 4x1 layout had. With 2 warps along N, dQ errors were of order 1. The tuned "
            "class masks by each element's own (row, col) (layout_free) whenever the layout has more "
            "than one warp along N.",
            "V in registers (V_in_regs) gives wrong dQ at 4 and 8 warps (measured): bwd_config_error "
            "refuses it, and no table entry uses it.",
            "Varlen GQA: the epilogue adds dK/dV into the fp32 accumulators from offset_k + batch * "
            "n_block while the postprocess reads them from that offset rounded down to n_block; they "
            "differ whenever a sequence starts off a tile boundary (wrong dK/dV). The tuned epilogue "
            "passes the offset that lands on the rounded one.",
        ],
        "Deterministic mode: a semaphore per accumulator tile fixes the order of the fp32 additions, as "
        "on SM90/SM100. GQA dK/dV: query head j of a group adds at turn j. dQ: the CTA of n_block n adds "
        "into an m_block's rows at its turn, in one of three orders (sm120_bwd_deterministic_plan):",
        [
            "causal, without cu_seqlens_k: descending turns (the CTA on the diagonal reaches an m_block "
            "first) with the n_blocks launched last to first (ReversedNBlockScheduler, shortest first), "
            "so that every wait is for a CTA launched earlier: no deadlock whatever the number of SMs;",
            "no mask, dense, a head's n_blocks at most its m_blocks and resident (at most one per SM): "
            "the rotated order, CTA n walking the m_blocks cyclically from n * M // N, where no two CTAs "
            "reach an m_block at the same step and in steady state no CTA waits;",
            "otherwise (causal with cu_seqlens_k; no mask with cu_seqlens or seqused, or with more "
            "n_blocks than m_blocks or SMs): ascending turns, the launch order.",
        ],
        "The wait sits inside the dQ product (on the load hooked after its first k-slice), so the "
        "section held is the dQ product and its atomics, not the m_block. The release is CUTLASS's "
        "Semaphore::release (a CTA barrier, then one release increment; no fence per thread, so the dQ "
        "adds stay fire-and-forget REDs), deferred to the next m_block's hook before its dQ product, "
        "where the loads the release would wait for have landed. Orderings that can deadlock are "
        "refused, whether chosen or given. The kernel also takes orderings the plan does not use (for "
        "benchmarks and tests): an early flag read (fetch_early, fetch_relaxed) and per-warp turns "
        "(warp_turns: each warp waits and releases on its own, no CTA barrier).",
        *measured,
        "Tested:",
        [
            "Correctness (flash_attn_sm120's own backward, the same kernel code, in the mode above): dQ/dK/dV "
            "against an fp32 reference across table entries, causal, local, varlen and GQA; compute-sanitizer "
            "memcheck/racecheck clean on four cases (before the orderings above). Deterministic: "
            f"{det_tests['test_file']}, {det_tests['passed']} passed: dq/dk/dv bitwise identical over three "
            "runs and within tolerance of fp32 autograd, for the plan's orderings (GQA causal, "
            "dense, rotated at several m/n block counts, varlen GQA causal, more n_blocks than SMs) and for "
            f"{det_tests['forced']} given ones (per-warp turns came after that run). The orderings' deadlock freedom is checked on a CPU too: the rotated order's "
            "formulas against its definition, and event simulations at random CTA speeds and with fewer "
            "resident CTAs than n_blocks.",
            f"This patch applied to {UPSTREAM_DISTRIBUTION} {ctx.upstream_version}: the tuned class compiles "
            "for sm_120a with fake tensors on a CPU for every table entry, and deterministic in the "
            "orderings the interface picks and two given ones, without local memory (the barrier release "
            "keeps the dQ adds REDs); sm120_bwd_deterministic_plan gives the package's plan on a grid of "
            "problems, refusals included; _flash_attn_bwd on fake CUDA tensors passes it to the kernel.",
            "The patched upstream's backward has not run on a GPU yet (its GPU test is written, not run), "
            "and not on a real SM120: do that before merging.",
        ],
    )
