"""Patch 0003: the TMA forward family on SM120 (a producer warpgroup feeding mma.sync warps).

Lifts the package's TMA family as upstream's `flash_fwd_sm120_tma.py`. The package splits it by
job: `kernels/fwd_tma.py` (the docstring, the class's constructor and host side), its pure rules
(`fwd_tma_rules.py`), its GEMM helpers (`mma_sync_utils.py`) and one mixin per role of the kernel
(`fwd_tma_kernel.py`, `fwd_tma_producer.py`, `fwd_tma_mainloop.py`, `fwd_tma_epilogue.py`).
Upstream keeps one module per kernel with one class (flash_fwd_sm90.py), so this step folds them
(fold.py): one import block, the rules and helpers at module level, and each mixin's methods
appended to the class body under a section comment, in role order. What only the package needs is
left out: SM120 emulation padding (`emulation.py`), the driver's compile-key check, the search's
proposed configs (`fwd_tma_proposals.py`), the re-export list.

With it go the block-sparse walk it imports (`kernels/fwd_block_sparse.py` as
`flash_fwd_sm120_block_sparse.py`: the class takes upstream's lists, which the interface gives it
only from patch 0006 on); the family is registered in `flash_fwd_sm120_configs.py` so that the
table's TMA entries appear, and `interface.py` runs them for the calls the family takes (dense,
unsplit, unpaged, GQA packed only in whole head groups per tile, no sink, no block sparsity); every
other call gets the table's cp.async entry of the same key, as in the package's driver.
"""

from __future__ import annotations

import ast
import inspect
import re
from typing import Optional

from flash_attn_sm120 import hardware
from flash_attn_sm120.kernels import fwd_block_sparse as pkg_fwd_block_sparse
from flash_attn_sm120.kernels import fwd_tma as pkg_fwd_tma
from flash_attn_sm120.kernels import fwd_tma_epilogue, fwd_tma_kernel, fwd_tma_mainloop, fwd_tma_producer
from flash_attn_sm120.kernels import fwd_tma_rules, mma_sync_utils, ordered_scheduler, persistent_scheduler

from patchgen import fold
from patchgen.core import (
    CUTE,
    EMULATED_NOTE,
    UPSTREAM_DISTRIBUTION,
    AnchorError,
    Context,
    _node_lines,
    apply_edits,
    check_no_package_refs,
    commit_message,
    measurement_table,
    rename,
    substitute,
    upstream_wording,
)
from patchgen.step_fwd_table import FamilySpec, render_configs_module
from patchgen.step_splitkv import patch_configs_for_decode

WHERE = "flash_attn_sm120/kernels/fwd_tma.py"
BLOCK_SPARSE_WHERE = "flash_attn_sm120/kernels/fwd_block_sparse.py"
BLOCK_SPARSE_REL = f"{CUTE}/flash_fwd_sm120_block_sparse.py"

# The package modules folded into flash_fwd_sm120_tma.py (fold.py): the rules and the GEMM helpers
# as module-level code before the class, in this order; the class of fwd_tma.py; then the methods of
# each role's mixin appended to the class body, in this order (kernel entry, producer, MMA warps,
# epilogue), so that upstream gets one class in one module as flash_fwd_sm90.py is.
LIBRARY_MODULES = (fwd_tma_rules, mma_sync_utils, persistent_scheduler, ordered_scheduler)
MIXIN_MODULES = (fwd_tma_kernel, fwd_tma_producer, fwd_tma_mainloop, fwd_tma_epilogue)
FOLDED_MODULES = LIBRARY_MODULES + (pkg_fwd_tma,) + MIXIN_MODULES
# package imports of the folded modules -> what flash_fwd_sm120_tma.py imports instead; () for the
# package-only parts whose use the edits below remove (emulation padding, the search's proposals)
_UPSTREAM_IMPORTS = {
    ("flash_attn_sm120", "hardware"): (
        ("flash_attn.cute.flash_fwd_sm120", "SM120_SMEM_PER_BLOCK_MAX"),
        ("flash_attn.cute.flash_fwd_sm120", "SM120_STATIC_SMEM"),
        ("flash_attn.cute.flash_fwd_sm120_splits", "REGS_PER_SM"),
        ("flash_attn.cute.flash_fwd_sm120_splits", "sm120_occupancy"),
    ),
    ("flash_attn_sm120.kernels", "fwd_block_sparse"): (("flash_attn.cute", "flash_fwd_sm120_block_sparse as fwd_block_sparse"),),
    ("flash_attn_sm120.kernels", "sink_fold"): (("flash_attn.cute", "flash_fwd_sm120_sink as sink_fold"),),
    ("flash_attn_sm120.kernels.emulation", "emulation_storage"): (),
    ("flash_attn_sm120.kernels.fwd_tma_proposals", "ALL_MASKS"): (),
    ("flash_attn_sm120.kernels.fwd_tma_proposals", "PROPOSED_CONFIGS"): (),
    ("flash_attn_sm120.kernels.persistent_scheduler", "PersistentTileScheduler"): (),
    ("flash_attn_sm120.kernels.persistent_scheduler", "persistent_grid"): (),
    ("flash_attn_sm120.kernels.ordered_scheduler", "WorkOrderedTileScheduler"): (),
    ("flash_attn_sm120.kernels.ordered_scheduler", "split_tile_order"): (),
}
# the docstring's map of the package modules: upstream has one module
_CODE_MAP_PARAGRAPH = "Where the code lives:"
# the class body's pointer to the mixins, where their methods are folded in
_DEVICE_SIDE_POINTER = (
    "    # device side: `kernel` (TmaKernelMixin), `load` (TmaProducerMixin), `mma` and its blocks\n"
    "    # (TmaMainloopMixin), `epilogue` (TmaEpilogueMixin)\n"
)
_MIXIN_BASES = (
    "class FlashAttentionForwardSm120Tma(\n"
    "    TmaKernelMixin, TmaProducerMixin, TmaMainloopMixin, TmaEpilogueMixin, FlashAttentionForwardSm120\n"
    "):\n"
)

_TMA_DOC_EDITS = (
    ("`apply_score_mod`), mask_mod, LSE output, learnable sinks (one more term in the final softmax's row\n"
     "sums, sink_fold.load_row_sinks), block sparsity (the producer and the MMA warps walk the listed K/V\n"
     "tiles instead of the n_block range: fwd_block_sparse.py), varlen (below). Refused with\n"
     "NotImplementedError (the driver routes these to the cp.async family): seqused_k without\n"
     "cu_seqlens_k, pack_gqa when tile_m is not a multiple of qhead_per_kvhead, paged KV.\n"
     "`unsupported_reason(statics)` states the rule for the driver.\n",
     "`apply_score_mod`), mask_mod, LSE output, learnable sinks (one more term in the final softmax's row\n"
     "sums, flash_fwd_sm120_sink.load_row_sinks), block sparsity (the producer and the MMA warps walk the\n"
     "listed K/V tiles instead of the n_block range: flash_fwd_sm120_block_sparse.py), varlen (below).\n"
     "Refused with NotImplementedError (the interface gives these the cp.async entry instead): seqused_k\n"
     "without cu_seqlens_k, pack_gqa when tile_m is not a multiple of qhead_per_kvhead, paged KV.\n"),
    ("through quack's `tma_get_copy_fn`, which groups them). SM120 emulation on an H200 (sm_90a) cannot\n"
     "show an SM120-only hang, so the first runs on a real SM120 must use a timeout\n"
     "(scripts/smoke_tma.py guards every call). The shipped table chooses this family for causal d64/d96/d128\n"
     "on emulated measurements, with a cp.async entry after each TMA entry as the fallback;\n"
     "FLASH_ATTN_SM120_FAMILIES=cpasync restricts the table to the cp.async family (fwd_cpasync.py) until\n"
     "the family has run on a real SM120.\n",
     "through quack's `tma_get_copy_fn`, which groups them). This kernel was measured on an sm_90a GPU\n"
     "held to SM120's occupancy, which cannot show an SM120-only hang: run it on a real SM120 under a\n"
     "timeout before relying on it. Every table entry of this family has a cp.async entry after it.\n"),
    ("    Constructor: the same as FlashAttentionForwardSm120CpAsync. `num_threads` counts the MMA warps'\n"
     "    threads; the launch adds a producer warpgroup (128 threads). `emulate_host_smem`: a hardware.EmulationHost\n"
     "    (the host driver's shared-memory numbers) of a non-SM120 GPU running the kernel in SM120\n"
     "    emulation (shared memory is padded so it fits no more CTAs per SM than SM120); None on SM120.\n",
     "    Constructor: the same as FlashAttentionForwardSm120. `num_threads` counts the MMA warps'\n"
     "    threads; the launch adds a producer warpgroup (128 threads).\n"),
    ("        emulate_host_smem: Optional[hardware.EmulationHost] = None,\n", ""),
    ("        self.emulate_host_smem = emulate_host_smem\n", ""),
    ("        # filled in at trace time, read by the codegen report and the tests\n"
     "        self.smem_bytes_unpadded: Optional[int] = None\n"
     "        self.smem_bytes_launched: Optional[int] = None\n"
     "        self.launch_threads: Optional[int] = None\n", ""),
    ("        return emulation_storage(self, SharedStorageTma, self.num_threads_total)\n",
     "        return SharedStorageTma\n"),
    ("PRODUCER_REGS = 24", f"MAX_REGS_PER_THREAD = {hardware.MAX_REGS_PER_THREAD}\n"
     f"SM120_NUM_SMS = {hardware.DEFAULT_NUM_SMS}  # a persistent launch's default wave (RTX PRO 6000)\n"
     "PRODUCER_REGS = 24"),
)
_TMA_RENAMES = (
    ("hardware.DSL_STATIC_SMEM", "SM120_STATIC_SMEM"),
    ("hardware.SMEM_PER_BLOCK_MAX", "SM120_SMEM_PER_BLOCK_MAX"),
    ("hardware.sm120_occupancy", "sm120_occupancy"),
    ("hardware.REGS_PER_SM", "REGS_PER_SM"),
    ("hardware.MAX_REGS_PER_THREAD", "MAX_REGS_PER_THREAD"),
    ("hardware.DEFAULT_NUM_SMS", "SM120_NUM_SMS"),
    ("smem_bytes", "sm120_tma_smem_bytes"),
    ("FwdConfig", "Sm120FwdConfig"),  # the config type of flash_fwd_sm120_configs.py
)
# package-only definitions left out: the driver's compile-key check and the re-export list
_DROP_TOP_LEVEL = ("unsupported_reason", "__all__")
_DROP_METHODS = ("unsupported_reason", "supports")
# the package's modules, which the folded module's comments must not name (as files or qualified names)
_PACKAGE_MODULE_REFS = re.compile(r"(?<![\w/])(fwd_tma\w*|mma_sync_utils|fwd_cpasync|emulation|sink_fold|hardware)\.py\b"
                                  r"|\b(fwd_tma\w*|mma_sync_utils)\.\w")


def _drop_definitions(text: str) -> str:
    """Remove the package-only top-level definitions and class methods (with the comments above)."""
    tree = ast.parse(text)
    spans = []
    for node in tree.body:
        names = [node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else [
            t.id for t in getattr(node, "targets", [getattr(node, "target", None)]) if isinstance(t, ast.Name)]
        if set(names) & set(_DROP_TOP_LEVEL):
            spans.append(_node_lines(node) if isinstance(node, ast.FunctionDef) else (node.lineno - 1, node.end_lineno))
        if isinstance(node, ast.ClassDef) and node.name == "FlashAttentionForwardSm120Tma":
            spans += [_node_lines(m) for m in node.body if isinstance(m, ast.FunctionDef) and m.name in _DROP_METHODS]
    found = len(spans)
    if found != len(_DROP_TOP_LEVEL) + len(_DROP_METHODS):
        raise RuntimeError(f"{WHERE}: expected {len(_DROP_TOP_LEVEL) + len(_DROP_METHODS)} package-only definitions, found {found}")
    lines = text.splitlines(keepends=True)
    for start, end in sorted(spans, reverse=True):
        while start > 0 and lines[start - 1].lstrip().startswith("#"):
            start -= 1  # the comment block above a definition goes with it
        while end < len(lines) and not lines[end].strip():
            end += 1  # and the blank lines after it
        del lines[start:end]
    return "".join(lines)


def _drop_paragraph(doc: str, first_words: str, where: str) -> str:
    """The docstring without the paragraph (up to the next blank line or the end) that opens with
    `first_words`."""
    start = doc.find("\n\n" + first_words)
    if start < 0:
        raise AnchorError(f"{where}: no docstring paragraph opening with {first_words!r}")
    end = doc.find("\n\n", start + 2)
    return doc[:start] + (doc[end:] if end >= 0 else "\n")


def _where(module) -> str:
    return f"flash_attn_sm120/kernels/{module.__name__.rsplit('.', 1)[1]}.py"


def fold_tma_modules(sources: Optional[dict] = None) -> str:
    """The TMA family's package modules as one module, still in the package's names: fwd_tma's
    docstring (less its map of the package modules), one import block, the rules and the GEMM
    helpers, and the class with each mixin's methods in its body (`sources`: {module name: text}
    replacing a module's current source, for tests)."""
    sources = sources or {}
    text_of = {m: sources.get(m.__name__.rsplit(".", 1)[1]) or inspect.getsource(m) for m in FOLDED_MODULES}
    parts = {m: fold.split_module(text_of[m], _where(m)) for m in FOLDED_MODULES}
    doc = _drop_paragraph(parts[pkg_fwd_tma][0], _CODE_MAP_PARAGRAPH, WHERE)
    imports = fold.merge_imports(
        [(_where(m), parts[m][1]) for m in FOLDED_MODULES],
        folded=tuple(m.__name__ for m in FOLDED_MODULES), replaced=_UPSTREAM_IMPORTS, package="flash_attn_sm120",
    )
    library = [fold.banner(fold.summary(parts[m][0])) + "\n\n" + parts[m][2] for m in LIBRARY_MODULES]
    methods = []
    for m in MIXIN_MODULES:
        cls_name, source = fold.mixin_methods(text_of[m], _where(m))
        if cls_name not in _MIXIN_BASES:
            raise AnchorError(f"{_where(m)}: {cls_name} is not among the bases {_MIXIN_BASES.strip()!r}; revisit step_tma.py")
        methods.append(fold.banner(fold.summary(parts[m][0]), indent="    ") + "\n" + source)
    cls = substitute(parts[pkg_fwd_tma][2], _MIXIN_BASES, "class FlashAttentionForwardSm120Tma(FlashAttentionForwardSm120):\n",
                     where=WHERE)
    cls = substitute(cls, _DEVICE_SIDE_POINTER, "\n".join(methods), where=WHERE)
    return f'"""{doc}"""\n\n{imports}\n\n' + "\n\n".join(p.rstrip("\n") + "\n" for p in library + [cls])


def render_tma_module(sources: Optional[dict] = None) -> str:
    """flash_fwd_sm120_tma.py: the package's TMA kernel modules folded into one (fold_tma_modules)
    in upstream's names, without the package-only parts (`sources`: as fold_tma_modules takes)."""
    text = fold_tma_modules(sources)
    for old, new in _TMA_DOC_EDITS:
        text = substitute(text, old, new, where=WHERE)
    text = _drop_definitions(text)
    text = substitute(text, '    family = "tma"\n\n', "", where=WHERE)
    # the comments name the block-sparse walk's module by its upstream name (the import keeps the alias)
    text = substitute(text, "fwd_block_sparse.py)", "flash_fwd_sm120_block_sparse.py)", where=WHERE, count=2)
    for old, new in _TMA_RENAMES:
        text = rename(text, old, new, where=WHERE)
    text = text.replace("(as upstream sm90)", "(as FlashAttentionForwardSm90)")
    text = text.replace(
        "Same call convention as upstream's FlashAttentionForwardSm80.__call__.",
        "Same call convention as FlashAttentionForwardSm80.__call__.")
    check_no_package_refs(text, WHERE)
    left = sorted({m.group(0) for m in _PACKAGE_MODULE_REFS.finditer(text)})
    if left:
        raise AnchorError(f"{WHERE}: the folded module still names the package's modules: {left}")
    compile(text, "flash_fwd_sm120_tma.py", "exec")
    return text


_BLOCK_SPARSE_MODULE_EDITS = (  # wording inside upstream (no package name is left to rewrite)
    ("Upstream's block sparsity (flash_attn.cute.block_sparsity; FlexAttention's BlockMask) gives, for\n",
     "Block sparsity (flash_attn.cute.block_sparsity; FlexAttention's BlockMask) gives, for\n"),
    ("(as upstream's SM90 kernel\napplies it)", "(as the SM90 kernel\napplies it)"),
    ("as `create_block_mask` and upstream's\n`compute_block_sparsity` write them and as upstream's SM90/SM100 kernels assume.",
     "as `create_block_mask` and\n`compute_block_sparsity` write them and as the SM90/SM100 kernels assume."),
    ("broadcast over heads, as upstream requires)", "broadcast over heads, as the interface requires)"),
    ("(the sink's logit with a learnable sink), upstream's\nconvention for fully masked rows.",
     "(the sink's logit with a learnable sink), the\nother kernels' convention for fully masked rows."),
    ("(upstream's indexing helpers)", "(block_sparse_utils' indexing helpers)"),
)


def render_block_sparse_module(source: Optional[str] = None) -> str:
    """flash_fwd_sm120_block_sparse.py: the TMA family's block-sparse walk (`source`: the package
    module's text, for tests; by default its current source)."""
    text = inspect.getsource(pkg_fwd_block_sparse) if source is None else source
    for old, new in _BLOCK_SPARSE_MODULE_EDITS:
        text = substitute(text, old, new, where=BLOCK_SPARSE_WHERE)
    text = upstream_wording(text)  # any later "upstream" in the package's comments
    imported = {n.module for n in ast.parse(text).body if isinstance(n, ast.ImportFrom)}
    foreign = sorted(m for m in imported if m.split(".")[0] not in ("__future__", "typing", "cutlass", "flash_attn"))
    if foreign:
        raise AnchorError(f"{BLOCK_SPARSE_WHERE}: imports {foreign}, which {BLOCK_SPARSE_REL} cannot; revisit step_tma.py")
    check_no_package_refs(text, BLOCK_SPARSE_REL)
    compile(text, "flash_fwd_sm120_block_sparse.py", "exec")
    return text


_CPASYNC_TABLE = (
    "\n\n# the table without the TMA family: calls that family does not take (varlen, paged, split, GQA\n"
    "# packing it cannot tile, sinks, block sparsity) get the cp.async entry of the same key\n"
    "SM120_FWD_TABLE_CPASYNC: tuple[TableEntry, ...] = tuple(e for e in SM120_FWD_TABLE if e.config.family == \"cpasync\")\n"
    "\n\n"
    "def sm120_tma_fp16_ok(head_dim: int, head_dim_v: int, causal: bool, local: bool) -> bool:\n"
    "    \"\"\"Whether the table's choice for these head dims and mask, if a TMA entry, runs float16 without\n"
    "    spills (flash_fwd_sm120_tma.fp16_register_error); if not, float16 calls get the cp.async entry.\"\"\"\n"
    "    from flash_attn.cute.flash_fwd_sm120_tma import fp16_register_error\n"
    "\n"
    "    cfg = select_fwd_config(SM120_FWD_TABLE, head_dim, head_dim_v, causal, local)\n"
    "    return cfg.family != \"tma\" or fp16_register_error(\n"
    "        max(head_dim, head_dim_v), cfg.tile_m, cfg.tile_n, cfg.num_threads\n"
    "    ) is None\n"
    "\n\n"
    "def sm120_tma_varlen_ok(head_dim: int, head_dim_v: int, causal: bool, local: bool) -> bool:\n"
    "    \"\"\"Whether the table's choice for these head dims and mask, if a TMA entry, runs a varlen call\n"
    "    without spills (flash_fwd_sm120_tma.varlen_register_error); if not, varlen calls get the cp.async\n"
    "    entry.\"\"\"\n"
    "    from flash_attn.cute.flash_fwd_sm120_tma import varlen_register_error\n"
    "\n"
    "    cfg = select_fwd_config(SM120_FWD_TABLE, head_dim, head_dim_v, causal, local)\n"
    "    return cfg.family != \"tma\" or varlen_register_error(\n"
    "        max(head_dim, head_dim_v), cfg.tile_m, cfg.tile_n, cfg.num_threads\n"
    "    ) is None\n"
    "\n\n"
    "def sm120_tma_packs(qhead_per_kvhead: int) -> bool:\n"
    "    \"\"\"Whether every TMA entry of the table can pack this many query heads per KV head: the family's\n"
    "    Q/O TMA boxes hold whole head groups, so tile_m must be a multiple of qhead_per_kvhead.\"\"\"\n"
    "    return all(e.config.tile_m % qhead_per_kvhead == 0 for e in SM120_FWD_TABLE if e.config.family == \"tma\")\n"
)
_TMA_ADAPTER_EDITS = (
    ("    max_seqlen_q: Optional[int] = None,\n) -> Sm120FwdConfig:\n",
     "    max_seqlen_q: Optional[int] = None,\n    tma_ok: bool = False,\n) -> Sm120FwdConfig:\n"),
    ("    entry, others the table's choice (select_fwd_config). With an explicit tile_mn:",
     "    entry, others the table's choice (select_fwd_config; TMA entries only when tma_ok, the call being\n"
     "    one the TMA family takes). With an explicit tile_mn:"),
    ("        cfg = select_fwd_config(SM120_FWD_TABLE, head_dim, head_dim_v, causal, local)\n",
     "        table = SM120_FWD_TABLE if tma_ok else SM120_FWD_TABLE_CPASYNC\n"
     "        cfg = select_fwd_config(table, head_dim, head_dim_v, causal, local)\n"),
)


def patch_configs_for_tma(ctx: Context) -> list:
    """Re-render flash_fwd_sm120_configs.py with the TMA family, re-apply the decode table, and give
    the selection a TMA switch. Returns the TMA entries that joined the table."""
    rel = f"{CUTE}/flash_fwd_sm120_configs.py"
    module, kept = render_configs_module(ctx)
    ctx.write(rel, module)
    patch_configs_for_decode(ctx)
    text = ctx.read(rel)
    text = substitute(text, "\n\n\nDECODE_MAX_SEQLEN_Q = 16\n", _CPASYNC_TABLE + "\n\nDECODE_MAX_SEQLEN_Q = 16\n", where=rel)
    for old, new in _TMA_ADAPTER_EDITS:
        text = substitute(text, old, new, where=rel)
    ctx.write(rel, text)
    return [e for e in kept if e.config.family == "tma"]


_TMA_INTERFACE_EDITS = (
    (
        "import of the SM120 TMA kernel",
        "from flash_attn.cute.flash_fwd_sm120_configs import sm120_fwd_config\n",
        "from flash_attn.cute.flash_fwd_sm120_configs import (\n"
        "    sm120_fwd_config,\n"
        "    sm120_tma_fp16_ok,\n"
        "    sm120_tma_packs,\n"
        "    sm120_tma_varlen_ok,\n"
        ")\n"
        "from flash_attn.cute.flash_fwd_sm120_tma import FlashAttentionForwardSm120Tma\n",
    ),
    (
        "_get_fwd_config takes the TMA switch",
        "    intra_wg_overlap: Optional[bool] = None,\n"
        ") -> FwdConfig:\n",
        "    intra_wg_overlap: Optional[bool] = None,\n"
        "    sm120_tma_ok: bool = False,\n"
        ") -> FwdConfig:\n",
    ),
    (
        "SM120 tiles with the TMA switch",
        "            sm120_cfg = sm120_fwd_config(head_dim, head_dim_v, causal, local, max_seqlen_q=max_seqlen_q)\n",
        "            sm120_cfg = sm120_fwd_config(\n"
        "                head_dim, head_dim_v, causal, local, max_seqlen_q=max_seqlen_q, tma_ok=sm120_tma_ok\n"
        "            )\n",
    ),
    (
        "SM120 split count with the TMA switch",
        "                sm120_fwd_config(head_dim, head_dim_v, causal, local, tile_mn=tile_mn, max_seqlen_q=max_seqlen_q),\n",
        "                sm120_fwd_config(\n"
        "                    head_dim, head_dim_v, causal, local, tile_mn=tile_mn, max_seqlen_q=max_seqlen_q,\n"
        "                    tma_ok=sm120_tma_ok,\n"
        "                ),\n",
    ),
    (
        "which SM120 calls the TMA family takes",
        "            pack_gqa = False\n"
        "\n"
        "    fwd_cfg = _get_fwd_config(\n"
        "        arch=arch,\n",
        "            pack_gqa = False\n"
        "\n"
        "    # SM120: the TMA family takes unsplit, unpaged calls without sinks, block sparsity or broadcast\n"
        "    # (stride-0) q/k/v; varlen with packed K/V (seqused_k only with cu_seqlens_k) where its tile does\n"
        "    # not spill with varlen; GQA heads packed when its tiles hold whole head groups; float16 where\n"
        "    # its tile does not spill in float16. The others get the table's cp.async entry\n"
        "    sm120_varlen = any(t is not None for t in (cu_seqlens_q, cu_seqlens_k, seqused_q))\n"
        "    sm120_tma_ok = (\n"
        "        arch // 10 == 12\n"
        "        and q is not None and k is not None\n"
        "        and (seqused_k is None or cu_seqlens_k is not None)\n"
        "        and (not sm120_varlen or sm120_tma_varlen_ok(head_dim, head_dim_v, causal, local))\n"
        "        and page_table is None and num_splits == 1\n"
        "        and (not pack_gqa or qhead_per_kvhead == 1 or sm120_tma_packs(qhead_per_kvhead))\n"
        "        and (q.dtype != torch.float16 or sm120_tma_fp16_ok(head_dim, head_dim_v, causal, local))\n"
        "        and learnable_sink is None and block_sparse_tensors is None\n"
        "        and not any(any(get_broadcast_dims(t)) for t in (q, k, v))\n"
        "    )\n"
        "    fwd_cfg = _get_fwd_config(\n"
        "        arch=arch,\n",
    ),
    (
        "_get_fwd_config call passes the TMA switch",
        "        intra_wg_overlap=intra_wg_overlap,\n"
        "    )\n"
        "    mla_fwd_cls = None\n",
        "        intra_wg_overlap=intra_wg_overlap,\n"
        "        sm120_tma_ok=sm120_tma_ok,\n"
        "    )\n"
        "    mla_fwd_cls = None\n",
    ),
    (
        "SM120 warps and stages with the TMA switch",
        "            head_dim, head_dim_v, causal, local, tile_mn=tile_mn, max_seqlen_q=max_seqlen_q\n"
        "        )\n"
        "        num_threads = sm120_fwd_cfg.num_threads\n",
        "            head_dim, head_dim_v, causal, local, tile_mn=tile_mn, max_seqlen_q=max_seqlen_q,\n"
        "            tma_ok=sm120_tma_ok,\n"
        "        )\n"
        "        num_threads = sm120_fwd_cfg.num_threads\n",
    ),
    (
        "the family joins the compile key",
        "        compile_key += (sm120_fwd_cfg.num_stages, sm120_fwd_cfg.q_in_regs)\n",
        "        compile_key += (sm120_fwd_cfg.num_stages, sm120_fwd_cfg.q_in_regs, sm120_fwd_cfg.family)\n",
    ),
    (
        "SM120 class for TMA entries",
        "            sm120_fwd_cls, sm120_split_kwargs = FlashAttentionForwardSm120, {}\n",
        "            sm120_fwd_cls, sm120_split_kwargs = FlashAttentionForwardSm120, {}\n"
        "            if sm120_fwd_cfg.family == \"tma\":\n"
        "                sm120_fwd_cls = FlashAttentionForwardSm120Tma\n",
    ),
)


def step_sm120_tma(ctx: Context) -> str:
    """Patch 3: the TMA forward family, chosen by the table where it measured faster."""
    ctx.families["tma"] = FamilySpec(
        "flash_attn.cute.flash_fwd_sm120_tma", "FlashAttentionForwardSm120Tma", "tma_config_error",
        "sm120_tma_smem_bytes",
    )
    ctx.write(BLOCK_SPARSE_REL, render_block_sparse_module())
    ctx.write(f"{CUTE}/flash_fwd_sm120_tma.py", render_tma_module())
    entries = patch_configs_for_tma(ctx)
    rel = f"{CUTE}/interface.py"
    ctx.write(rel, apply_edits(ctx.read(rel), _TMA_INTERFACE_EDITS, rel))
    modes = sorted({str(e.provenance["mode"]) for e in entries})
    measured = []
    if entries:
        measured = [
            "Measured (TFLOPS: geometric mean over the bucket's problems, causal counted as half the work; "
            "before: SM120's previous 4-warp, 1-stage cp.async config on the same problems, GPU and mode):",
            measurement_table(ctx, entries),
        ]
        if "emulated" in modes:
            measured.append(EMULATED_NOTE + ", and an SM120-only hang (cutlass #3189) cannot show there.")
        measured += ["Commands:", "\n".join(f"  {c}" for c in sorted({str(e.provenance['command']) for e in entries}))]
    return commit_message(
        "[Cute,Sm120] TMA forward family: a producer warpgroup feeding 8 mma.sync warps",
        "SM120 has no wgmma and no tcgen05, but it has TMA and transaction mbarriers. This family loads Q "
        "once and K/V into mbarrier rings with TMA from one producer warp (its warpgroup drops to 24 "
        "registers with setmaxnreg), while 4 or 8 MMA warps run the FlashAttention-2 loop with "
        "ldmatrix + mma.sync; warps of 16 rows overlap block j's QK^T with block j-1's PV, and the "
        "epilogue stores O through shared memory with one TMA store.",
        "What changes:",
        [
            "flash_fwd_sm120_tma.py (new): FlashAttentionForwardSm120Tma, a subclass of the SM120 forward "
            "with the same call convention; head dims 64/96/128 (equal), causal, local, GQA and MQA "
            "(packed when tile_m is a multiple of the query heads per KV head: the Q/O TMA boxes then "
            "hold whole head groups, through pack_gqa.make_packgqa_tiled_tma_atom), softcap / score_mod, "
            "mask_mod, LSE, learnable sinks (flash_fwd_sm120_sink.py's fold, in the final softmax) and "
            "block-sparse lists (flash_fwd_sm120_block_sparse.py, new: the producer warp loads only the "
            "listed K/V tiles, mask-list tiles take the mask_mod and full-list tiles do not, a sparse "
            "block may span several Q and K/V tiles). The interface routes neither to it here: a call "
            "with a sink takes the cp.async entry, and block sparsity stays refused on SM120 until a later "
            "patch of this series. Varlen runs through ragged TMA descriptors (quack's "
            "create_ragged_tensor_for_tma): O is stored with each sequence's seqlen_q as TMA's bound (GQA "
            "packed or not), and "
            "packed K/V (cu_seqlens_k) load with seqlen_k (or seqused_k) as the bound, so rows past it are "
            "zero-filled and never enter P V; tiles come from SingleTileVarlenScheduler. It refuses "
            "seqused_k without cu_seqlens_k, paged KV and packed GQA ratios its tile cannot hold with "
            "NotImplementedError. One or more K/V slots (one frees the shared memory for "
            "256x48 tiles at d=128); float16 is refused where it spills (fp16_register_error). Causal "
            "tiles run longest first (SingleTileLPTScheduler, as FlashAttentionForwardSm90; lpt forces "
            "either order), and pingpong (off by default, 8 MMA warps) lets the two MMA warpgroups take "
            "turns at the tensor pipe under NamedBarrierFwd's warp scheduler barriers, as FA3 does.",
            "flash_fwd_sm120_configs.py: the family is registered (tma_config_error: 4 or 8 MMA warps, "
            "1 KB-aligned buffers and mbarriers within 99 KB), so the table's TMA entries appear; "
            "SM120_FWD_TABLE_CPASYNC holds the rest, and sm120_fwd_config(..., tma_ok) picks between them.",
            "interface.py: a call the family takes (unsplit, unpaged, no sink, no block sparsity, "
            "no broadcast q/k/v; varlen with packed K/V where the entry does not spill with varlen: "
            "sm120_tma_varlen_ok; GQA packed only at ratios every TMA entry's tile_m is a multiple of: "
            "sm120_tma_packs; float16 only where the entry does not spill: sm120_tma_fp16_ok) gets the "
            "table's entry, any other the cp.async entry of the same key; the family joins the compile key.",
        ],
        *measured,
        "Tested:",
        [
            "Correctness (flash_attn_sm120's hypothesis suite and compute-sanitizer memcheck/racecheck, in "
            "the mode above): the family's paths against an fp32 reference with poisoned outputs, 0 "
            "mismatches, 0 sanitizer errors.",
            f"This patch applied to {UPSTREAM_DISTRIBUTION} {ctx.upstream_version}: the table's TMA entries "
            "compile for sm_120a with fake tensors on a CPU (UTMALDG and HMMA present, no local memory), and "
            "_get_fwd_config picks the TMA tiles only for calls the family takes.",
            "Not yet run on a real SM120 GPU: do that, under a timeout, before merging.",
        ],
    )
