"""Patch 0004: the SM120 backward from a measured table, and its deterministic path.

Lifts the package's backward (`flash_attn_sm120/kernels/bwd_sm120.py`, its tiling rules of `bwd_tiling.py`
ahead of it, with the layout-free mask of
`bwd_mask.py` and the semaphore ordering of `bwd_deterministic.py`) as upstream's
`flash_bwd_sm120_tuned.py`, without what only the package needs (SM120 emulation padding, the
driver's occupancy bookkeeping); renders the backward table (`flash_attn_sm120/configs/sm120_bwd.toml`)
with its fallbacks and selection rule (`config_bwd.py`) as `flash_bwd_sm120_configs.py`; and edits
`interface.py` so that `_flash_attn_bwd` on SM120 builds the tuned class with the table's config,
gives the postprocess the same thread layout, and runs `deterministic=True` with the semaphores and
dQ ordering the package's driver uses: `driver_bwd.deterministic_plan`, lifted into the configs module
as `sm120_bwd_deterministic_plan` (its forced plan an argument), its flags the kernel's keywords
(`check_plan_call` anchors the call and the keywords). Where no config runs the head dims, the
interface keeps SM120's earlier default and class. The configs module is rendered by
`step_bwd_configs.py`, the interface edits live in `step_bwd_interface.py`; this file lifts the
kernel module and writes the patch.
"""

from __future__ import annotations

import ast
import inspect
import json
import re
from pathlib import Path

from flash_attn_sm120.kernels import bwd_deterministic as pkg_bwd_det
from flash_attn_sm120.kernels import bwd_mask as pkg_bwd_mask
from flash_attn_sm120.kernels import bwd_sm120 as pkg_bwd
from flash_attn_sm120.kernels import bwd_tiling as pkg_bwd_tiling

from patchgen.core import (
    CUTE,
    EMULATED_NOTE,
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

from patchgen.step_bwd_configs import (  # noqa: F401  (re-exported: make_patches, step_block_sparse, tests)
    CONFIGS_REL,
    DEFAULT_BWD_TABLE,
    _describe,
    _geomean,
    load_bwd_table,
    render_bwd_configs_module,
    render_plan_adapter,
)

from patchgen.step_bwd_interface import _BWD_INTERFACE_EDITS, check_plan_call  # noqa: F401  (re-exported)

WHERE = "flash_attn_sm120/kernels/bwd_sm120.py"
DET_WHERE = "flash_attn_sm120/kernels/bwd_deterministic.py"
# the benchmark of the shipped backward table that the message quotes (prepare.py --set bwd --json)
DEFAULT_BWD_BENCH = ROOT / "configs" / "measurements" / "2026-12-02_bwd_table_session16_final_emulated.json"
# the same problems with deterministic=True (summary.deterministic_vs_table), in the same run as the
# table (the shipped orderings; an older run may add summary.det_session8_vs_table)
DEFAULT_DET_BENCH = ROOT / "configs" / "measurements" / "2026-12-02_bwd_table_session16_final_emulated.json"
# the session record of the orderings' GPU tests that the message quotes
DEFAULT_DET_RECORD = ROOT / "configs" / "measurements" / "2026-12-02_session13.md"
TUNED_REL = f"{CUTE}/flash_bwd_sm120_tuned.py"

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
    ("    # measured on the H200 (configs/measurements/2026-12-01_bwd_first_emulated.md): dq_swapab fails to build\n",
     "    # measured: dq_swapab fails to build\n"),
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
    ("        self.dq_descending = dq_descending and (is_causal or is_local)  # bwd_deterministic.py: the dQ turn order\n",
     "        self.dq_descending = dq_descending and (is_causal or is_local)  # the dQ turn order (dq_turn)\n"),
    ("        # filled in at trace time, read by the occupancy check, the codegen report and the tests\n"
     "        self.smem_bytes_unpadded: Optional[int] = None\n"
     "        self.smem_bytes_launched: Optional[int] = None\n"
     "        self.launch_threads: Optional[int] = None\n",
     ""),
    ("        return emulation_storage(self, storage, self.num_threads)\n", "        return storage\n"),
    ("one warp along N of the S tile (bwd_mask.py)\n", "one warp along N of the S tile (layout_free)\n"),
    ("upstream's step (kernels/bwd_mods.py has its own)", "FlashAttentionBackwardSm120's step"),
    # the fixed-point adds stay in the package (step_mods.py): the scale as a plain load, no bwd_fixed_point
    ("            self._dq_fixed = (accumulator.iterator.toint(),\n"
     "                              bwd_fixed_point.head_scale(scales.iterator.toint(), kw[\"head_idx\"]))\n",
     "            self._dq_fixed = (accumulator.iterator.toint(), scales[kw[\"head_idx\"]])\n"),
    ("        # upstream's __call__ passes its tile scheduler class second to last; the shortest-first launch\n"
     "        # swaps in the same scheduler with the n_blocks reversed (dense problems only), the\n"
     "        # longest-first one the same scheduler re-ordered (dense causal problems)\n",
     "        # FlashAttentionBackwardSm80.__call__ passes its tile scheduler class second to last; the\n"
     "        # shortest-first launch swaps in the same scheduler with the n_blocks reversed (dense only),\n"
     "        # the longest-first one the same scheduler re-ordered (dense causal only)\n"),
    ("        self.mask_where_needed = mask_where_needed  # mask only tiles with a masked element (bwd_mask.where_needed)\n",
     "        self.mask_where_needed = mask_where_needed  # mask only tiles with a masked element (where_needed)\n"),
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
_PACKAGE_MODULES = re.compile(r"\bdriver_bwd\b|\bkernels/|(?<![\w.])(bwd_sm120|bwd_tiling|bwd_deterministic|bwd_mask|bwd_mods)\b")
# the mask module's definitions lifted next to the kernel (all of them)
MASK_DEFS = ("layout_free", "apply_mask_any_layout", "tile_needs_mask", "where_needed", "_apply_where_needed")
_DROP = ("upstream_bwd_config",)  # package-only: the benchmark's "before" config
_RENAMES = (
    ("BwdConfig", "Sm120BwdConfig"),  # the interface has an SM90 BwdConfig
    ("smem_bytes", "sm120_bwd_smem_bytes"),
    ("hardware.DSL_STATIC_SMEM", "SM120_STATIC_SMEM"),
    ("hardware.SMEM_PER_BLOCK_MAX", "SM120_SMEM_PER_BLOCK_MAX"),
    ("bwd_mask.layout_free", "layout_free"),
    ("bwd_mask.where_needed", "where_needed"),
)
_REPLACED_IMPORTS = {  # package module -> what upstream imports instead (None: lifted into the file)
    "flash_attn_sm120": None,
    "flash_attn_sm120.kernels": None,
    "flash_attn_sm120.kernels.emulation": None,  # the padding goes with _get_shared_storage_cls
    "flash_attn_sm120.kernels.bwd_tiling": None,  # lifted ahead of the kernel module's code
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
    std = sorted(m for m in merged if m.split(".")[0] in ("dataclasses", "functools", "typing"))
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
    imp_tiling, _doc_tiling, body_tiling = _imports_and_body(pkg_bwd_tiling)
    imp_bwd, doc_bwd, body = _imports_and_body(pkg_bwd)
    body = body_tiling.rstrip("\n") + "\n\n\n" + body  # one module upstream: the tiling rules, then the kernel
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
    mask_defs = _join_defs(top_level_source(pkg_bwd_mask, n) for n in MASK_DEFS)
    det_defs = _join_defs(top_level_source(pkg_bwd_det, n) for n in det_names)
    for old, new in _DET_EDITS:
        det_defs = substitute(det_defs, old, new, where=DET_WHERE)
    for old, new in _DET_DOC_EDITS:
        doc_det = substitute(doc_det, old, new, where=f"{DET_WHERE} (docstring)")
    cls_at = body.index("class FlashAttentionBackwardSm120Tuned(")
    text = (
        _TUNED_DOC.format(algorithm=upstream_wording(algorithm.strip()))
        + "\n" + _render_imports([imp_tiling, imp_bwd, imp_mask, imp_det]) + "\n"
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
    before = pkg_bwd_tiling.upstream_bwd_config(128)
    measured = []
    if table:
        measured = [
            "Measured (TFLOPS: geometric mean over the bucket's problems, causal counted as half the work; "
            f"before: SM120's previous backward, {before.num_warps} warps, {before.m_block}x{before.n_block}, "
            "on the same problems, GPU and mode):",
            # (the rows the patched table holds: the plain, plain-MHA and turns entries are this package's routing)
            _measurement_rows(tuple(e for e in table if not (e.plain_mha_only or e.plain_only or e.turns_only))),
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
            "a sliding window the turns count from the window's edges (dq_turn). The preprocess runs at the smallest "
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
            "V in registers (V_in_regs) gives wrong dQ at 4 and 8 warps (measured): the kernel copies V "
            "to registers and lends sV to Q, but the step re-reads V from sV for every dP. The tuned "
            "class refuses it; table entries measured with it (on the modifier step of the next patch, "
            "which reads the registers) run here with V in shared memory.",
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
