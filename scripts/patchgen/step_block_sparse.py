"""Patch 0006: block sparsity (FlexAttention's BlockMask lists) on SM120, forward and backward.

Forward: the TMA family (patch 0003's `flash_fwd_sm120_tma.py`, with `flash_fwd_sm120_block_sparse.py`)
already walks upstream's lists; this step lets `interface.py` give them to it. `_flash_attn_fwd`
on SM120 with `block_sparse_tensors` runs the TMA class with a config whose tile divides the sparse
block (the package's `block_sparse.CONFIGS` and its choice, lifted into `flash_fwd_sm120_configs.py`),
the q/kv subtile factors from upstream's own `normalize_block_sparse_config` (allow_kv_subtile), and
refuses what the family does not take (seqused_k without cu_seqlens_k, paged KV, stride-0 q/k/v,
other head dims); upstream's varlen lists run on a tile of one sparse Q block.

Backward: lifts `flash_attn_sm120/kernels/bwd_block_sparse.py` as upstream's
`flash_bwd_sm120_block_sparse.py` (a subclass of patch 0005's modifier backward that walks the
Q-direction lists) and makes `_flash_attn_bwd` on SM120 build it for `block_sparse_tensors`, with
one Q/dO stage on the table's tile or SM120's earlier default tile, whichever divides the sparse
block, as the package's `block_sparse_bwd.plan` does (varlen refused by
name: `block_sparse_bwd.check_block_sparse`, lifted, called without per-sequence lists, as upstream's
`_flash_attn_bwd` refuses varlen lists on every GPU; the package's varlen lists, block_sparse_bwd.py,
are not in the patch; deterministic lists take their dQ turns from `block_sparse.dq_turns`, lifted,
as the package's driver does).

The interface edits live in `step_block_sparse_interface.py`; this file lifts the modules, renders the
config helpers and writes the patch. The commit message quotes the session record of the GPU tests
(`configs/measurements/2026-12-01_session11.md`) and refuses to be generated if that record no longer
says what it quotes.
"""

from __future__ import annotations

import inspect
import re
import textwrap
from dataclasses import fields, replace
from functools import partial
from pathlib import Path
from typing import Optional

from flash_attn_sm120 import block_sparse as pkg_block_sparse
from flash_attn_sm120 import config as pkg_config
from flash_attn_sm120 import block_sparse_bwd as pkg_block_sparse_bwd
from flash_attn_sm120.kernels import bwd_block_sparse as pkg_bwd_block_sparse
from flash_attn_sm120.kernels import bwd_tiling as pkg_bwd_tiling

from patchgen.core import (
    CUTE,
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
from patchgen.step_block_sparse_interface import _BS_INTERFACE_EDITS  # (also make_patches', tests')
from patchgen.step_bwd_configs import _config_literal

WHERE = "flash_attn_sm120/kernels/bwd_block_sparse.py"
BWD_REL = f"{CUTE}/flash_bwd_sm120_block_sparse.py"
FWD_CONFIGS_REL = f"{CUTE}/flash_fwd_sm120_configs.py"
BWD_CONFIGS_REL = f"{CUTE}/flash_bwd_sm120_configs.py"
# the session record the message quotes: the block-sparse GPU tests
DEFAULT_SESSION_RECORD = ROOT / "configs" / "measurements" / "2026-12-01_session11.md"

# ------------------------------------------------------------------------- the backward module
# the deterministic helpers the walk calls (bwd_deterministic.X), lifted into flash_bwd_sm120_tuned.py by 0004
_DET_NAMES = ("call_if", "release_after_barrier", "release_unfenced", "spin")
_MODULE_EDITS = (  # on the package module's whole source: wording inside upstream, upstream's imports
    ("The backward lists are upstream's Q-direction ones (`block_sparse_tensors_bwd`: FlexAttention's\n",
     "The backward lists are the Q-direction ones (`block_sparse_tensors_bwd`: FlexAttention's\n"),
    ("How the walk is made without a new mainloop. Upstream's SM80/SM120 backward kernel loops\n",
     "How the walk is made without a new mainloop. The SM80/SM120 backward kernel loops\n"),
    ("    block's tiles past seqlen_q dropped) run the modifier step (bwd_mods.py) on the listed tile,\n"
     "    with the mask_mod on mask-list tiles only;\n",
     "    block's tiles past seqlen_q dropped) run the modifier step (flash_bwd_sm120_mods.py) on the\n"
     "    listed tile, with the mask_mod on mask-list tiles only;\n"),
    ("    \"\"\"The modifier backward walking upstream's Q-direction block-sparse lists (module docstring).\"\"\"\n",
     "    \"\"\"The modifier backward walking the Q-direction block-sparse lists (module docstring).\"\"\"\n"),
    ("from flash_attn.cute import utils as fa_utils\n"
     "from flash_attn.cute.block_sparse_utils import sparse_physical_n_block_forward\n"
     "from flash_attn.cute.tile_scheduler import SingleTileScheduler\n"
     "from flash_attn.cute.utils import AuxData\n"
     "\n"
     "from flash_attn_sm120.kernels import bwd_deterministic\n"
     "from flash_attn_sm120.kernels.bwd_mods import FlashAttentionBackwardSm120Mods\n"
     "from flash_attn_sm120.kernels.bwd_sm120 import FlashAttentionBackwardSm120Tuned\n"
     "from flash_attn_sm120.kernels.fwd_block_sparse import _tiles_in_list\n"
     "from flash_attn_sm120.kernels.ordered_scheduler import WorkOrderedTileScheduler, split_tile_order\n",
     "from flash_attn.cute import utils as fa_utils\n"
     "from flash_attn.cute.block_sparse_utils import sparse_physical_n_block_forward\n"
     "from flash_attn.cute.flash_bwd_sm120_mods import FlashAttentionBackwardSm120Mods\n"
     "from flash_attn.cute.flash_bwd_sm120_tuned import (\n"
     "    FlashAttentionBackwardSm120Tuned,\n"
     + "".join(f"    {n},\n" for n in sorted(_DET_NAMES)) +
     ")\n"
     "from flash_attn.cute.flash_fwd_sm120_block_sparse import _tiles_in_list\n"
     "from flash_attn.cute.flash_fwd_sm120_tma import WorkOrderedTileScheduler, split_tile_order\n"
     "from flash_attn.cute.tile_scheduler import SingleTileScheduler\n"
     "from flash_attn.cute.utils import AuxData\n"),
    ("list first (WorkOrderedTileScheduler in ordered_scheduler.py). A K/V block",
     "list first (WorkOrderedTileScheduler in flash_fwd_sm120_tma.py). A K/V block"),
    ("        # K/V tiles launched longest list first, in an order the host computes (ordered_scheduler.py); the\n"
     "        # order tensor arrives as the last aux tensor\n",
     "        # K/V tiles launched longest list first, in an order the host computes (WorkOrderedTileScheduler);\n"
     "        # the order tensor arrives as the last aux tensor\n"),
)
_PACKAGE_NAMES = ("bwd_mods.py", "bwd_sm120.py", "fwd_block_sparse.py", "driver_bwd", "bwd_deterministic",
                  "this package")  # none may be left
_LIFTED = ("with_lists", "split_lists", "_nth_listed", "FlashAttentionBackwardSm120BlockSparse")


def render_bwd_block_sparse_module(source: Optional[str] = None) -> str:
    """flash_bwd_sm120_block_sparse.py: the package's block-sparse backward in upstream's names
    (`source`: the package module's text, for tests; by default its current source)."""
    text = inspect.getsource(pkg_bwd_block_sparse) if source is None else source
    for old, new in _MODULE_EDITS:
        text = substitute(text, old, new, where=WHERE)
    used = set(re.findall(r"(?<![\w.])bwd_deterministic\.(\w+)", text))
    if not used <= set(_DET_NAMES):
        raise AnchorError(f"{WHERE}: the walk calls bwd_deterministic.{sorted(used - set(_DET_NAMES))}; add them to _DET_NAMES")
    text = re.sub(r"(?<![\w.])bwd_deterministic\.(\w+)", r"\1", text)
    text = upstream_wording(text)  # any later "upstream" in the package's comments
    for name in _LIFTED:
        if not re.search(rf"^(def|class) {name}\b", text, re.M):
            raise AnchorError(f"{WHERE}: no top-level definition {name!r}")
    for name in _PACKAGE_NAMES:
        if name in text:
            raise AnchorError(f"{WHERE}: package-only name {name!r} left in {BWD_REL}")
    check_no_package_refs(text, BWD_REL)
    compile(text, "flash_bwd_sm120_block_sparse.py", "exec")
    return text


# ------------------------------------------------------------- the forward's config (host side)
_BS_WHERE = "flash_attn_sm120/block_sparse.py"
# the package's block-sparse config choice, lifted in this order with these names
_FWD_LIFTED = (
    ("CONFIGS", "SM120_BLOCK_SPARSE_CONFIGS"),
    ("VARLEN_Q_SPILLS", "SM120_BLOCK_SPARSE_VARLEN_Q_SPILLS"),
    ("_inferred", "_sm120_inferred_block"),
    ("is_varlen_form", "sm120_is_varlen_block_sparse"),
    ("sparse_block_size", "sm120_sparse_block_size"),
    ("divides", "sm120_tile_divides_block"),
    ("forward_candidates", "sm120_block_sparse_candidates"),
    ("no_config_error", "sm120_block_sparse_refusal"),
    ("MASK_BLOCK_WEIGHT", "SM120_MASK_BLOCK_WEIGHT"),
    ("FULL_BLOCK_WEIGHT", "SM120_FULL_BLOCK_WEIGHT"),
    ("_ORDER_CACHE", "_sm120_order_cache"),
    ("_ORDER_CACHE_SIZE", "_SM120_ORDER_CACHE_SIZE"),
    ("_PINNED", "_SM120_PINNED_ORDERS"),
    ("longest_first_order", "sm120_block_sparse_tile_order"),
    ("_count", "_sm120_count"),
    ("_cacheable", "_sm120_order_cacheable"),
    ("_capturing", "_sm120_capturing"),
    ("_pin", "_sm120_pin_order"),
)
_FWD_LIFT_EDITS = (
    ("(upstream's rule for Q; KV from a full-width index tensor)",
     "(get_sparse_q_block_size's rule for Q; KV from a full-width index tensor)"),
    # the head-group order is the package's benchmark switch (block_sparse.head_groups): not lifted
    (", grid: bool = False, head_group: int = 0) -> torch.Tensor:", ", grid: bool = False) -> torch.Tensor:"),
    ("(the grid's own order); `head_group` > 0: longest first within each group\n"
     "    of that many consecutive (batch, head) pairs, the groups in grid order. Tile m",
     "(the grid's own order). Tile m"),
    ("and layout), grid and head_group, so that a", "and layout) and grid, so that a"),
    ("tiles_per_sparse_row, grid, head_group)", "tiles_per_sparse_row, grid)"),
    ("elif head_group:\n"
     "        # longest first, then (stable) by group: group-major, descending work inside a group, ties in grid order\n"
     "        by_work = torch.sort(work.reshape(-1), descending=True, stable=True).indices\n"
     "        group = torch.div(_count(work, work.numel()), num_block * head_group, rounding_mode=\"floor\")\n"
     "        order = by_work[torch.sort(group[by_work], stable=True).indices].to(torch.int32)\n"
     "    else:", "else:"),
)
_FWD_CONFIG_FIELDS = ("num_threads", "tile_m", "tile_n", "num_stages", "q_in_regs", "family")  # Sm120FwdConfig's
_FWD_SELECT = '''

def sm120_block_sparse_config(
    head_dim: int,
    head_dim_v: int,
    block_size: Tuple[int, int],
    fp16: bool = False,
    tile_mn: Optional[Tuple[int, int]] = None,
    varlen_q: bool = False,
) -> Sm120FwdConfig:
    """The TMA config of a block-sparse call on SM120 (flash_fwd_sm120_block_sparse.py walks the lists):
    the first of SM120_BLOCK_SPARSE_CONFIGS for the head dim whose tile divides the sparse block (and is
    tile_mn, when given) that runs these head dims and, in float16, does not spill (fp16_register_error).
    varlen_q (varlen lists: one Q tile per sparse block, as normalize_block_sparse_config requires): the
    tile_m must be the sparse Q block. NotImplementedError or ValueError (sm120_block_sparse_refusal) when
    none does."""
    from flash_attn.cute.flash_fwd_sm120_tma import fp16_register_error

    reasons = []
    candidates = sm120_block_sparse_candidates(head_dim, head_dim_v, block_size, varlen_q=varlen_q)
    if varlen_q and candidates and not any(cfg.tile_m == block_size[0] for cfg in candidates):
        rows = sorted({cfg.tile_m for cfg in candidates})
        raise ValueError(
            f"varlen block sparsity needs the sparse Q block to be one kernel tile ({rows} rows at head dim "
            f"{head_dim}), got block_size {tuple(block_size)}"
        )
    for cfg in candidates:
        if tile_mn is not None and (cfg.tile_m, cfg.tile_n) != tuple(tile_mn):
            reasons.append(f"tile_mn={tuple(tile_mn)} is not the tile of {cfg.name}")
            continue
        if varlen_q and cfg.tile_m != block_size[0]:
            reasons.append(f"varlen lists need tile_m == {block_size[0]} ({cfg.name})")
            continue
        err = cfg.error(head_dim, head_dim_v)
        if err is None and fp16:
            err = fp16_register_error(max(head_dim, head_dim_v), cfg.tile_m, cfg.tile_n, cfg.num_threads)
        if err is None:
            return cfg
        reasons.append(err)
    raise sm120_block_sparse_refusal(block_size, head_dim, head_dim_v, reasons)
'''


def render_fwd_block_sparse_configs() -> str:
    """The block-sparse section of flash_fwd_sm120_configs.py: the package's configs and their choice."""
    names = [f.name for f in fields(pkg_config.FwdConfig)]
    if tuple(names[: len(_FWD_CONFIG_FIELDS)]) != _FWD_CONFIG_FIELDS:  # CONFIGS writes them positionally
        raise AnchorError(f"flash_attn_sm120/config.py: FwdConfig's fields are {names}, expected {_FWD_CONFIG_FIELDS} first")
    text = _join_defs(top_level_source(pkg_block_sparse, old) for old, _new in _FWD_LIFTED)
    for old, new in _FWD_LIFT_EDITS:
        text = substitute(text, old, new, where=_BS_WHERE)
    text = rename(text, "FwdConfig", "Sm120FwdConfig", where=_BS_WHERE)
    for old, new in _FWD_LIFTED:
        constant = re.fullmatch(r"_?[A-Z][A-Z0-9_]*", old) is not None  # else a function, renamed where called
        pattern = rf"(?<![\w.]){old}\b" if constant else rf"(?<![\w.]){re.escape(old)}(?=\()"
        if not re.search(pattern, text):
            raise AnchorError(f"{_BS_WHERE}: {old!r} not found")
        text = re.sub(pattern, new, text)
    text = (
        "\n\n\n# Block sparsity (flash_fwd_sm120_block_sparse.py): the TMA family walks the lists with a tile that\n"
        "# divides the sparse block (tile_m | sparse_block_q, tile_n | sparse_block_kv); the interface takes its\n"
        "# config from here instead of the table.\n#\n" + text + _FWD_SELECT.rstrip("\n")
    )
    check_no_package_refs(text, FWD_CONFIGS_REL)
    return text


_FWD_CONFIGS_EDITS = (
    ("import of the block-sparse helpers",
     "from flash_attn.cute.flash_fwd_sm120 import FlashAttentionForwardSm120, sm120_config_error, sm120_fwd_smem_bytes\n",
     "from flash_attn.cute.block_sparsity import (\n"
     "    BlockSparseTensorsTorch,\n"
     "    NormalizedBlockSparseConfig,\n"
     "    ceildiv,\n"
     "    get_sparse_q_block_size,\n"
     ")\n"
     "from flash_attn.cute.flash_fwd_sm120 import FlashAttentionForwardSm120, sm120_config_error, sm120_fwd_smem_bytes\n"),
    ("imports of the tile order",
     "from dataclasses import asdict, dataclass, field\n",
     "import weakref\n"
     "from collections import OrderedDict\n"
     "from dataclasses import asdict, dataclass, field\n"),
    ("torch, for the tile order",
     "from typing import Any, Callable, Iterable, Optional, Tuple\n",
     "from typing import Any, Callable, Iterable, Optional, Tuple\n"
     "\n"
     "import torch  # the block-sparse tile order\n"),
)


def patch_fwd_configs(ctx: Context) -> None:
    text = apply_edits(ctx.read(FWD_CONFIGS_REL), _FWD_CONFIGS_EDITS, FWD_CONFIGS_REL)
    anchor = "\n\n\nDECODE_MAX_SEQLEN_Q = 16\n"
    text = substitute(text, anchor, render_fwd_block_sparse_configs() + anchor, where=FWD_CONFIGS_REL)
    compile(text, FWD_CONFIGS_REL, "exec")
    ctx.write(FWD_CONFIGS_REL, text)


# ------------------------------------------------------------ the backward's config (host side)
_PLAN_RULE = (  # what block_sparse_bwd.plan does, as sm120_bwd_block_sparse_config restates it
    "check_block_sparse(deterministic, varlen, turns_from_lists=True, per_sequence_lists=True)",
    "if tensors.block_size is None:",
    "candidates = [cfg] if config_given else [c for c in (preferred,) if c is not None] + [",
    "cfg, upstream_bwd_config(q.shape[-1])]",
    # a table entry runs with one Q / dO stage (a given config may keep two: no such path in the patch)
    "stages = 2 if config_given and not deterministic else 1",
    "c = replace(c, stages_q=min(c.stages_q, stages), stages_do=min(c.stages_do, stages), v_in_regs=False)",
    "if bq % c.m_block or bk % c.n_block or bwd_config_error(",
)


def bwd_default_config():
    """SM120's earlier default backward tile (the package's upstream_bwd_config) with one Q/dO stage:
    the same for every head dim once the stages are one."""
    one = {replace(pkg_bwd_tiling.upstream_bwd_config(d), stages_q=1, stages_do=1, v_in_regs=False)
           for d in (32, 64, 96, 128, 192, 256)}
    if len(one) != 1:
        raise AnchorError("flash_attn_sm120/kernels/bwd_tiling.py: upstream_bwd_config's tile now depends on the head "
                          "dim; revisit sm120_bwd_block_sparse_config in step_block_sparse.py")
    return one.pop()


def _wrapped_literal(cfg) -> str:
    """Sm120BwdConfig(...) over lines of at most 100 characters."""
    args = _config_literal(cfg)[len("Sm120BwdConfig("):-1]
    return "Sm120BwdConfig(\n" + textwrap.fill(args, 100, initial_indent="    ", subsequent_indent="    ") + "\n)"


def render_bwd_block_sparse_configs(plan_source: Optional[str] = None) -> str:
    """The block-sparse section of flash_bwd_sm120_configs.py: the refusals (lifted) and the config rule
    (`plan_source`: block_sparse_bwd.plan's text, for tests; by default its current source)."""
    rule = inspect.getsource(pkg_block_sparse_bwd.plan) if plan_source is None else plan_source
    for said in _PLAN_RULE:
        if said not in rule:
            raise AnchorError(f"flash_attn_sm120/block_sparse_bwd.py: plan no longer has {said!r}; revisit "
                              "sm120_bwd_block_sparse_config in step_block_sparse.py")
    check = rename(top_level_source(pkg_block_sparse_bwd, "check_block_sparse"), "check_block_sparse",
                   "sm120_check_block_sparse_bwd", where="flash_attn_sm120/block_sparse_bwd.py")
    turns = _join_defs(top_level_source(pkg_block_sparse, n) for n in ("dq_turns", "_valid_or"))
    for old, new in (("dq_turns", "sm120_bwd_block_sparse_dq_turns"), ("_valid_or", "_sm120_valid_or")):
        turns = re.sub(rf"(?<![\w.]){old}\b", new, turns)
    turns = substitute(turns, "(kernels/bwd_block_sparse.py)", "(flash_bwd_sm120_block_sparse.py)", where=_BS_WHERE)
    check = check.rstrip("\n") + "\n\n\n" + turns.rstrip("\n") + "\n\n"
    # the walk's own config where the table's would serve (block_sparse_bwd.SPARSE_BWD_CONFIGS and its rule)
    preferred_map = (
        "# The list walk's own config where the table's would serve: a dense-layout, non-deterministic call\n"
        "# without a causal/local mask, a score_mod (softcap's included) or aux tensors (a mask_mod is fine).\n"
        "# d128: 32x128 with 8 warps along N for dK/dV, spill-free in the walk; 1.05-1.06x the table's tile\n"
        "# on 10% random and window + global lists (kernel time)\n"
        "SM120_BWD_BLOCK_SPARSE_PREFERRED: dict[int, Sm120BwdConfig] = {\n"
        + "".join(f"    {d}: " + textwrap.indent(_wrapped_literal(c), "    ").lstrip() + ",\n"
                  for d, c in pkg_block_sparse_bwd.SPARSE_BWD_CONFIGS.items()) + "}\n")
    preferred_rule = top_level_source(pkg_block_sparse_bwd, "sparse_preferred_config")
    preferred_rule = rename(preferred_rule, "SPARSE_BWD_CONFIGS", "SM120_BWD_BLOCK_SPARSE_PREFERRED", where=_BS_WHERE)
    preferred_rule = rename(preferred_rule, "sparse_preferred_config", "sm120_bwd_block_sparse_preferred",
                            where=_BS_WHERE)
    preferred_rule = rename(preferred_rule, "BwdConfig", "Sm120BwdConfig", where=_BS_WHERE)
    check += preferred_map + "\n\n" + preferred_rule.rstrip("\n") + "\n\n"
    text = (
        "\n\n# Block sparsity (flash_bwd_sm120_block_sparse.py): the walk reads its loop counter as a list position;\n"
        "# it runs one Q and one dO stage (the faster at 10% density) and V in shared memory, on a tile that\n"
        "# divides the sparse block: the table's, else SM120's earlier default tile with one stage\n"
        f"SM120_BWD_BLOCK_SPARSE_DEFAULT = {_wrapped_literal(bwd_default_config())}\n"
        "\n\n" + check + '''

def sm120_bwd_block_sparse_config(
    cfg: Optional[Sm120BwdConfig], head_dim: int, head_dim_v: int, block_size: Optional[tuple],
    preferred: Optional[Sm120BwdConfig] = None,
) -> Sm120BwdConfig:
    """The config of a block-sparse backward on SM120: `preferred` (sm120_bwd_block_sparse_preferred's, or
    None), then `cfg` (the table's, or None), with one Q and one dO stage and V in shared memory, else
    SM120_BWD_BLOCK_SPARSE_DEFAULT, the first whose tile divides the sparse block `block_size` (the lists'
    BlockMask BLOCK_SIZE, required) and runs the head dims."""
    if block_size is None:
        raise ValueError(
            "the SM120 block-sparse backward needs block_sparse_tensors.block_size (the BlockMask's BLOCK_SIZE)"
        )
    bq, bk = (int(x) for x in block_size)
    candidates = [c for c in (preferred, cfg) if c is not None] + [SM120_BWD_BLOCK_SPARSE_DEFAULT]
    for c in candidates:
        c = replace(c, stages_q=1, stages_do=1, v_in_regs=False)
        if bq % c.m_block == 0 and bk % c.n_block == 0 and bwd_config_error(head_dim, head_dim_v, c) is None:
            return c
    tiles = ", ".join(dict.fromkeys(f"({c.m_block}, {c.n_block})" for c in candidates))
    raise ValueError(
        f"block_sparse_tensors: sparse block {(bq, bk)} is not a multiple of an SM120 backward tile ({tiles})"
    )
''')
    check_no_package_refs(text, BWD_CONFIGS_REL)
    return text


def patch_bwd_configs(ctx: Context) -> None:
    text = ctx.read(BWD_CONFIGS_REL)
    text = substitute(text, "from dataclasses import dataclass, field\n",
                      "from dataclasses import dataclass, field, replace\n\nimport torch  # the block-sparse dQ turns\n",
                      where=BWD_CONFIGS_REL)
    text = text.rstrip("\n") + "\n" + render_bwd_block_sparse_configs()
    compile(text, BWD_CONFIGS_REL, "exec")
    ctx.write(BWD_CONFIGS_REL, text)


# ------------------------------------------------------------------------------ the record quoted
_quote = partial(quote_record, step="step_block_sparse.py")


def session_facts(path: Path = DEFAULT_SESSION_RECORD) -> dict:
    """What the message quotes, read from the session record (AnchorError where it says otherwise)."""
    path = Path(path)
    if not path.is_file():
        raise AnchorError(f"{path}: the session record the block-sparsity patch quotes is missing")
    text = path.read_text()
    gpu = _quote(r"Every GPU number: (one NVIDIA H200 in SM120 emulation)", text, "the GPU and mode", path)
    tests = _quote(r"GPU tests \(`(tests/test_block_sparse_gpu\.py)`, fp32 reference of the dense mask the lists mean, "
                   r"poisoned outputs\s+and gradients\): (\d+) passed \(`([^`]+)`\)", text, "the GPU tests' result", path)
    cover = _quote(r"They cover (.+?)\.\n- ", text, "what the GPU tests cover", path)
    return dict(
        gpu=gpu.group(1), test_file=tests.group(1), tests=int(tests.group(2)), log=tests.group(3),
        cover=re.sub(r"\bupstream's\s+", "", " ".join(cover.group(1).split())),  # upstream's own names
        record=path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name,
    )


def step_sm120_block_sparse(ctx: Context, record_path: Path = DEFAULT_SESSION_RECORD) -> str:
    """Patch 6: block-sparse lists on SM120, the forward in the TMA family and the backward's walk."""
    f = session_facts(record_path)
    ctx.write(BWD_REL, render_bwd_block_sparse_module())
    patch_fwd_configs(ctx)
    patch_bwd_configs(ctx)
    rel = f"{CUTE}/interface.py"
    ctx.write(rel, apply_edits(ctx.read(rel), _BS_INTERFACE_EDITS, rel))
    dims = "/".join(str(d) for d in pkg_block_sparse.CONFIGS)
    return commit_message(
        "[Cute,Sm120] Block sparsity: the TMA forward walks the lists, the backward its Q-direction lists",
        "FlexAttention's BlockMask lists (BlockSparseTensorsTorch) were refused on SM120 in both "
        "directions. The TMA forward family already walks them (flash_fwd_sm120_block_sparse.py); this "
        "patch lets the interface give them to it, and adds a backward that walks the Q-direction lists "
        "inside the SM80/SM120 backward mainloop.",
        "What changes:",
        [
            "interface.py, forward: on SM120 a call with block_sparse_tensors runs "
            "FlashAttentionForwardSm120Tma, unsplit (num_splits is a hint), with the q/kv subtile factors "
            "of normalize_block_sparse_config (allow_kv_subtile now includes SM120) and the first "
            f"SM120_BLOCK_SPARSE_CONFIGS entry for the head dim ({dims}, head_dim == head_dim_v) whose "
            "tile divides the sparse block and, in float16, does not spill; GQA heads stay packed "
            "only where that tile holds whole head groups (and, as before, the lists are shared by "
            "every head, and never with varlen q). Upstream's varlen lists (2-D, cu_total_m_blocks, "
            "cu_block_idx_offsets with varlen K, and block_size given) run on a tile whose tile_m is the "
            "sparse Q block, as normalize_block_sparse_config requires; the TMA class reads each "
            "sequence's first Q block and index entry through SeqlenInfoQK. With a dense q the tiles "
            "launch longest list first (sm120_block_sparse_tile_order, a stable descending sort of each "
            "tile's weighted list length, read by the TMA class's WorkOrderedTileScheduler and passed as "
            "the last aux tensor): the hardware dispatches CTAs in launch order, so a window with global "
            "tokens no longer leaves its long global rows to the last wave. seqused_k without "
            "cu_seqlens_k, paged KV, stride-0 q/k/v and other head dims are refused by name.",
            "flash_fwd_sm120_configs.py: SM120_BLOCK_SPARSE_CONFIGS (at d64/d96 4 MMA warps of 32 rows "
            "with one K/V stage, two CTAs per SM; then 8 MMA warps of 16 rows, then 4 warps on 64x64 "
            "for 64-row sparse blocks; the table's TMA entries are not used: the "
            "block-sparse loop keeps two index lists live, and the R=2 and Q-in-registers d=128 tiles "
            "spill with it), sm120_block_sparse_config, and sm120_sparse_block_size (the lists' "
            "block_size, else inferred from their shapes where that is unambiguous, else an error "
            "asking for it).",
            "flash_bwd_sm120_block_sparse.py (new): FlashAttentionBackwardSm120BlockSparse, a subclass "
            "of FlashAttentionBackwardSm120Mods. It reads the mainloop's m_block counter as a position "
            "in the CTA's list (mask list, then full list, ascending; the last sparse block's tiles "
            "past seqlen_q dropped): a listed position runs the modifier step on the listed Q tile, "
            "with the mask_mod on mask-list tiles only, and its next-tile loads fetch the next listed "
            "tile; positions past the list do nothing (the list counts are read once, into registers "
            "allocated before the loop: re-reading them at every position cost the walk a third of its "
            "time at 10% density). Up to two Q and two dO stages. The lists travel as the last aux "
            "tensors.",
            "interface.py, backward: on SM120 block_sparse_tensors (the Q-direction lists) build that "
            "class instead of the assertion \"Block sparsity backward not supported on SM 12.0\", on "
            "the table's tile with one Q/dO stage, else SM120's earlier 4-warp 64x64 tile, whichever "
            "divides the sparse block (flash_bwd_sm120_configs.sm120_bwd_block_sparse_config; the "
            "lists must give block_size). A causal mask or local window applies inside every listed "
            "tile (the class builds its mainloop without it, so that the walk covers every list "
            "position). Without deterministic=True its K/V tiles launch longest list first "
            "(sm120_block_sparse_tile_order on the Q-direction lists, the last aux tensor). "
            "deterministic=True takes each list entry's dQ turn from the lists "
            "(sm120_bwd_block_sparse_dq_turns: ascending K/V blocks, in the dq_write_order fields; a "
            "given dq_write_order or spt is not needed) and the fused_turns ordering; varlen is "
            "refused with NotImplementedError. The K/V subtile factor joins the compile key. Other "
            "archs are unchanged.",
        ],
        "Tested:",
        [
            f"Correctness (flash_attn_sm120's own forward and backward, the same kernel code, {f['gpu']}): "
            f"{f['test_file']}, {f['tests']} tests against the fp32 reference of the dense mask the lists "
            f"mean, with poisoned outputs and gradients, all passed ({f['log']}, recorded in "
            f"{f['record']}). They cover {f['cover']}.",
            f"This patch applied to {UPSTREAM_DISTRIBUTION} {ctx.upstream_version}: the TMA class compiles "
            "for sm_120a with fake tensors on a CPU for every SM120_BLOCK_SPARSE_CONFIGS entry with mask "
            "and full lists and K/V subtiles, and the block-sparse backward with full lists, without local "
            "memory; _flash_attn_fwd and _flash_attn_bwd run on fake CUDA tensors with block-sparse lists "
            "and build those classes with the expected tiles and subtile factors, and refuse what they "
            "do not take.",
            "The patched upstream's block sparsity has not run on a GPU yet (its GPU test is written, not "
            "run), and not on a real SM120: do that before merging.",
        ],
    )
