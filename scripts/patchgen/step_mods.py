"""Patch 0005: score_mod / score_mod_bwd / mask_mod / aux tensors in the SM120 backward.

Lifts the package's modifier backward (`flash_attn_sm120/kernels/bwd_mods.py`, a subclass of the
tuned backward that patch 0004 lifts as `flash_bwd_sm120_tuned.py`) as upstream's
`flash_bwd_sm120_mods.py`, and edits `interface.py` so that `_flash_attn_bwd` on SM120 builds it
whenever a call has a user score_mod/score_mod_bwd (not the softcap pair), a mask_mod or aux
tensors, as the package's driver does (`driver_bwd.Mods.user`). The commit message quotes the
session record of the GPU tests and the fuzz run (`configs/measurements/2026-12-01_session10.md`)
and refuses to be generated if that record no longer says what it quotes.
"""

from __future__ import annotations

import inspect
import re
from functools import partial
from pathlib import Path
from typing import Optional

from flash_attn_sm120 import driver_bwd as pkg_driver_bwd
from flash_attn_sm120.kernels import bwd_mods as pkg_bwd_mods

from patchgen.core import (
    CUTE,
    ROOT,
    UPSTREAM_DISTRIBUTION,
    AnchorError,
    Context,
    apply_edits,
    check_no_package_refs,
    commit_message,
    quote_record,
    substitute,
    upstream_wording,
)
from patchgen.step_bwd_configs import CONFIGS_REL, VREG_MARK, load_bwd_table, table_entry_literal

WHERE = "flash_attn_sm120/kernels/bwd_mods.py"
MODS_REL = f"{CUTE}/flash_bwd_sm120_mods.py"
# the session record the message quotes: the modifier GPU tests and the fuzz run with modifier cases
DEFAULT_SESSION_RECORD = ROOT / "configs" / "measurements" / "2026-12-01_session10.md"

_MODULE_EDITS = (  # on the package module's whole source: wording inside upstream, upstream's imports
    ("Why this exists: upstream's SM80/SM120 backward step calls",
     "Why this exists: the SM80/SM120 backward step calls"),
    ("wrong gradients there. Upstream's SM90/SM100 backwards pass the real indices.",
     "wrong gradients there. The SM90/SM100 backwards pass the real indices."),
    ("(FlashAttention-2's backward, as bwd_sm120.py):", "(FlashAttention-2's backward, as the tuned one):"),
    ("(without a mask_mod: upstream's causal / local / seqlen rule, bwd_mask.py)",
     "(without a mask_mod: the causal / local / seqlen rule, apply_mask_any_layout)"),
    ("(as upstream's SM90 backward does)", "(as the SM90 backward does)"),
    ("The modifier application is upstream's (`apply_score_mod_inner`, `apply_score_mod_bwd_inner`,\n"
     "`call_mask_mod`, by import). The rest of the step (loads, products, shared-memory hand-offs) is\n"
     "this package's restatement of upstream's SM80 step for the configurations bwd_sm120.py admits.\n",
     "The modifier application is the shared one (`apply_score_mod_inner`, `apply_score_mod_bwd_inner`,\n"
     "`call_mask_mod`, by import from softmax.py and mask.py). The rest of the step (loads, products,\n"
     "shared-memory hand-offs) restates FlashAttentionBackwardSm80's step for the configurations the\n"
     "tuned class admits.\n"),
    ("else upstream's SM80 forward rule", "else the SM80 forward's rule"),
    ("        # use_mask_mod=False: a block-sparse full tile (bwd_block_sparse.py), only the sequence bounds apply\n",
     "        # use_mask_mod=False: a tile of a block-sparse full list (the mask_mod does not apply there),\n"
     "        # only the sequence bounds do\n"),
    ("        # upstream's mask partial carries the CTA's indices",
     "        # the SM80 step's mask partial carries the CTA's indices"),
    ("the element lies outside the sequences (upstream's\n"
     "        mask_mod semantics: it replaces causal/local, and the sequence bounds still apply).",
     "the element lies outside the sequences (the\n"
     "        mask_mod semantics of SM90/SM100: it replaces causal/local, the sequence bounds still apply)."),
    ("        elif bwd_mask.tile_needs_mask(mask, m_block, n_block, True, self.mask_causal,\n"
     "                                      self.mask_local or not self.mask_where_needed):\n"
     "            bwd_mask.apply_mask_any_layout(mask, acc_S, m_block, n_block, thr_mma, mask_seqlen=True,\n"
     "                                           mask_causal=",
     "        elif tile_needs_mask(mask, m_block, n_block, True, self.mask_causal,\n"
     "                             self.mask_local or not self.mask_where_needed):\n"
     "            apply_mask_any_layout(mask, acc_S, m_block, n_block, thr_mma, mask_seqlen=True,\n"
     "                                  mask_causal="),
    ("from flash_attn.cute import utils as fa_utils\n",
     "from flash_attn.cute import utils as fa_utils\n"
     "from flash_attn.cute.flash_bwd_sm120_tuned import (\n"
     "    FlashAttentionBackwardSm120Tuned,\n"
     "    apply_mask_any_layout,\n"
     "    tile_needs_mask,\n"
     ")\n"),
    ("\n\nfrom flash_attn_sm120.kernels import bwd_fixed_point, bwd_mask\n"
     "from flash_attn_sm120.kernels.bwd_sm120 import DQ_WIDE_ELEMS, FlashAttentionBackwardSm120Tuned\n", "\n"),
    # the fixed-point dQ adds stay in the package (the patched interface allocates no int64 accumulator)
    ("        if const_expr(self.dq_fixed_point):  # deterministic: 64-bit fixed-point adds (bwd_fixed_point.py)\n"
     "            base, scale = self._dq_fixed\n"
     "            for i in cutlass.range(cute.size(acc_dQ_atomic), unroll_full=True):\n"
     "                address = bwd_fixed_point.int64_address(fa_utils.elem_pointer(tdQgdQaccum, i).toint(), base)\n"
     "                bwd_fixed_point.red_add_fixed(address, acc_dQ_atomic[i], scale)\n"
     "        elif const_expr(self.dq_wide_adds):  # runs of four consecutive floats (bwd_sm120._setup_attributes)\n"
     "            for j in cutlass.range(cute.size(acc_dQ_atomic) // DQ_WIDE_ELEMS, unroll_full=True):\n"
     "                i = j * DQ_WIDE_ELEMS\n"
     "                copy_utils.atomic_add_fp32x4(acc_dQ_atomic[i], acc_dQ_atomic[i + 1], acc_dQ_atomic[i + 2],\n"
     "                                             acc_dQ_atomic[i + 3], fa_utils.elem_pointer(tdQgdQaccum, i))\n"
     "        else:\n"
     "            for i in cutlass.range(cute.size(acc_dQ_atomic), unroll_full=True):\n"
     "                fa_utils.atomic_add_fp32(acc_dQ_atomic[i], fa_utils.elem_pointer(tdQgdQaccum, i))\n",
     "        if const_expr(self.dq_fixed_point):\n"
     "            raise NotImplementedError(\"dq_fixed_point: the int64 dQ accumulator is not allocated here\")\n"
     "        if const_expr(self.dq_wide_adds):\n"
     "            raise NotImplementedError(\"dq_wide_adds: upstream's postprocess reads one float per thread\")\n"
     "        for i in cutlass.range(cute.size(acc_dQ_atomic), unroll_full=True):\n"
     "            fa_utils.atomic_add_fp32(acc_dQ_atomic[i], fa_utils.elem_pointer(tdQgdQaccum, i))\n"),
    ("  (atomics into the fp32 accumulator, 16 bytes at a time with\n"
     "                                                dq_wide_adds; deterministic with dq_fixed_point: 64-bit\n"
     "                                                fixed point, bwd_fixed_point.py)\n",
     "  (atomics into the fp32 accumulator; dq_wide_adds and\n"
     "                                                dq_fixed_point: not in this module)\n"),
    ("offset to this CTA's accumulator), 16 bytes per reduction with dq_wide_adds.",
     "offset to this CTA's accumulator)."),
)
_PACKAGE_NAMES = ("bwd_mask", "bwd_sm120.py", "bwd_deterministic", "bwd_block_sparse", "driver_bwd", "this package")  # none may be left
_LIFTED = ("mod_vec_size", "FlashAttentionBackwardSm120Mods")  # the definitions the module must still hold


def render_mods_module(source: Optional[str] = None) -> str:
    """flash_bwd_sm120_mods.py: the package's modifier backward in upstream's names (`source`: the
    package module's text, for tests; by default its current source)."""
    text = inspect.getsource(pkg_bwd_mods) if source is None else source
    for old, new in _MODULE_EDITS:
        text = substitute(text, old, new, where=WHERE)
    text = upstream_wording(text)  # any later "upstream" in the package's comments
    for name in _LIFTED:
        if not re.search(rf"^(def|class) {name}\b", text, re.M):
            raise AnchorError(f"{WHERE}: no top-level definition {name!r}")
    for name in _PACKAGE_NAMES:
        if name in text:
            raise AnchorError(f"{WHERE}: package-only name {name!r} left in {MODS_REL}")
    check_no_package_refs(text, MODS_REL)
    compile(text, "flash_bwd_sm120_mods.py", "exec")
    return text


# ------------------------------------------------------------------------------ interface edits
_MODS_INTERFACE_EDITS = (
    (
        "import of the SM120 modifier backward",
        "from flash_attn.cute.flash_bwd_sm120_tuned import FlashAttentionBackwardSm120Tuned\n",
        "from flash_attn.cute.flash_bwd_sm120_tuned import FlashAttentionBackwardSm120Tuned\n"
        "from flash_attn.cute.flash_bwd_sm120_mods import FlashAttentionBackwardSm120Mods\n",
    ),
    (
        "which SM120 calls need the modifier backward",
        "    window_size = [window_size_left, window_size_right]\n",
        "    # SM120: a user's score_mod / score_mod_bwd (the softcap pair, made further down, is index-free),\n"
        "    # a mask_mod or aux tensors run FlashAttentionBackwardSm120Mods, which applies them at each\n"
        "    # element's (batch, head, q_idx, kv_idx); the SM80/SM120 step passes 0 for all four\n"
        "    sm120_mods = arch // 10 == 12 and (\n"
        "        any(f is not None for f in (score_mod, score_mod_bwd, mask_mod)) or bool(aux_tensors)\n"
        "    )\n"
        "    window_size = [window_size_left, window_size_right]\n",
    ),
    (
        "SM120 takes score_mod and mask_mod",
        "        assert score_mod is None and score_mod_bwd is None, \"score_mod backward not supported on SM 12.0\"\n"
        "        assert mask_mod is None, \"mask_mod backward not supported on SM 12.0\"\n",
        "        if mask_mod is not None:\n"
        "            # a mask_mod replaces causal / local, as the forward resolves it\n"
        "            causal, local, window_size_left, window_size_right = _resolve_causal_local_window(\n"
        "                causal, window_size_left, window_size_right, mask_mod\n"
        "            )\n",
    ),
    (
        "SM120 modifier calls take the table's modifier entries",
        "        sm120_bwd_cfg = sm120_bwd_config(head_dim, head_dim_v, causal, local)\n",
        "        sm120_bwd_cfg = sm120_bwd_config(head_dim, head_dim_v, causal, local, modifiers=sm120_mods)\n",
    ),
    (
        "SM120 modifiers need a tuned config",
        "        assert not deterministic or sm120_bwd_cfg is not None, (\n"
        "            \"deterministic backward not supported on SM 12.0 for these head dims\"\n"
        "        )\n",
        "        assert not deterministic or sm120_bwd_cfg is not None, (\n"
        "            \"deterministic backward not supported on SM 12.0 for these head dims\"\n"
        "        )\n"
        "        assert not sm120_mods or sm120_bwd_cfg is not None, (\n"
        "            \"score_mod / mask_mod / aux_tensors backward not supported on SM 12.0 for these head dims\"\n"
        "        )\n",
    ),
    (
        "the modifier class joins the compile key",
        "            deterministic,\n"
        "            tuple(sm120_det_plan.items()),\n",
        "            deterministic,\n"
        "            tuple(sm120_det_plan.items()),\n"
        "            sm120_mods,\n",
    ),
    (
        "SM120 deterministic calls take the modifier step's ordering",
        "            index_tensors=(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k),\n"
        "        )\n",
        "            index_tensors=(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k),\n"
        "            modifier_step=True,  # FlashAttentionBackwardSm120Mods runs deterministic calls (below)\n"
        "        )\n",
    ),
    (
        "SM120 builds the modifier class",
        "        if arch // 10 == 12 and sm120_bwd_cfg is not None:\n"
        "            fa_bwd_obj = FlashAttentionBackwardSm120Tuned(\n",
        "        if arch // 10 == 12 and sm120_bwd_cfg is not None:\n"
        "            sm120_bwd_cls, sm120_mod_kwargs = FlashAttentionBackwardSm120Tuned, {}\n"
        "            # deterministic: the modifier step places the dQ turns on its own barriers (fused_turns),\n"
        "            # where the tuned step's CTA-barrier release spills registers on the larger tiles; V in\n"
        "            # registers: only the modifier step takes dP's V from them (the tuned one re-reads sV)\n"
        "            if sm120_mods or deterministic or sm120_bwd_cfg.v_in_regs:\n"
        "                sm120_bwd_cls = FlashAttentionBackwardSm120Mods\n"
        "                sm120_mod_kwargs = dict(mask_mod=mask_mod, has_aux_tensors=aux_tensors is not None)\n"
        "            fa_bwd_obj = sm120_bwd_cls(\n",
    ),
    (
        "the modifier class takes mask_mod and has_aux_tensors",
        "                **sm120_det_plan,\n"
        "            )\n",
        "                **sm120_det_plan,\n"
        "                **sm120_mod_kwargs,\n"
        "            )\n",
    ),
)


# ------------------------------------------------------------------------------ the record quoted
_quote = partial(quote_record, step="step_mods.py")


def session_facts(path: Path = DEFAULT_SESSION_RECORD) -> dict:
    """What the message quotes, read from the session record (AnchorError where it says otherwise)."""
    text = Path(path).read_text()
    gpu = _quote(r"Every GPU number: (one NVIDIA H200 in SM120 emulation)", text, "the GPU and mode", path)
    tests = _quote(r"`tests/test_mods_bwd_gpu\.py` \((\d+) tests, fp32 reference, poisoned outputs/gradients\)"
                   r".*?All pass", text, "the modifier GPU tests' result", path)
    fuzz = _quote(r"Fast fuzz with doubled case counts \(`([^`]+)`\).*?Run 2 after the fixes: (\d+) cases, (\d+) failures",
                  text, "the fuzz run's result", path)
    return dict(
        gpu=gpu.group(1), tests=int(tests.group(1)),
        fuzz_command=" ".join(fuzz.group(1).split()), fuzz_cases=int(fuzz.group(2)), fuzz_failures=int(fuzz.group(3)),
        record=Path(path).relative_to(ROOT).as_posix() if Path(path).is_relative_to(ROOT) else Path(path).name,
    )


VREG_ON_MARK = "    #   measured with V in registers, which the modifier step runs (interface.py routes it)"


def enable_vreg_entries(configs_text: str, table) -> str:
    """The lifted table's entries measured with V in registers, turned on (the previous patch lifts them
    off: its tuned class runs upstream's step, which re-reads V from shared memory)."""
    for e in table:
        if e.config.v_in_regs and not (e.plain_mha_only or e.plain_only or e.turns_only):  # those rows are not lifted (step_bwd_configs)
            new = table_entry_literal(e, v_in_regs=True).replace(VREG_MARK, VREG_ON_MARK)
            configs_text = substitute(configs_text, table_entry_literal(e, v_in_regs=False), new, where=CONFIGS_REL)
    return configs_text


def step_sm120_mods(ctx: Context, record_path: Path = DEFAULT_SESSION_RECORD) -> str:
    """Patch 5: the SM120 backward applies score_mod, score_mod_bwd and mask_mod at each element's indices."""
    ctx.write(MODS_REL, render_mods_module())
    rel = f"{CUTE}/interface.py"
    ctx.write(rel, apply_edits(ctx.read(rel), _MODS_INTERFACE_EDITS, rel))
    ctx.write(CONFIGS_REL, enable_vreg_entries(ctx.read(CONFIGS_REL), load_bwd_table()))
    rule = inspect.getsource(pkg_driver_bwd.Mods)  # the rule the interface restates (sm120_mods)
    if "not self.from_softcap" not in rule or "self.aux_tensors is not None" not in rule:
        raise AnchorError("flash_attn_sm120/driver_bwd.py: Mods.user changed; revisit sm120_mods in step_mods.py")
    f = session_facts(record_path)
    return commit_message(
        "[Cute,Sm120] Backward with score_mod, score_mod_bwd, mask_mod and aux tensors",
        "SM120's backward (FlashAttentionBackwardSm80's m_block step) calls score_mod and score_mod_bwd "
        "with batch, head, q_idx and kv_idx all 0 and never applies mask_mod, so any modifier that "
        "depends on a position or on aux tensors indexed by one (ALiBi, relative bias, document masks, "
        "prefix-LM) gets wrong gradients on SM120; the interface therefore refused score_mod and "
        "mask_mod there. The SM90 and SM100 backwards pass the real indices. This patch gives the SM120 "
        "backward the same meaning.",
        "What changes:",
        [
            "flash_bwd_sm120_mods.py (new): FlashAttentionBackwardSm120Mods, a subclass of "
            "FlashAttentionBackwardSm120Tuned whose m_block step takes each element's (q_idx, kv_idx) "
            "from the S accumulator's partition of an identity tensor (right for any warp layout), "
            "applies score_mod, mask_mod and score_mod_bwd there with softmax.py's and mask.py's "
            "helpers (apply_score_mod_inner, call_mask_mod, apply_score_mod_bwd_inner), and wraps the "
            "indices into the sequence with aux tensors as the SM90 backward does. Same configs, "
            "padding and deterministic orderings as the tuned class, plus ones the tuned class's step "
            "cannot run: fused_turns (thread 0 waits for the dQ turn right before the barrier ahead of "
            "the dQ adds and releases the previous m_block's right after the one ahead of the dP "
            "product), which the interface's plan uses, and late_dq_adds (the dQ accumulator held "
            "across the dK product), which it does not. The step's "
            "use_mask_mod=False leaves the mask_mod out of a tile (for the full tiles of block-sparse "
            "lists).",
            "interface.py: _flash_attn_bwd on SM120 builds the modifier class, with mask_mod and "
            "has_aux_tensors, when a call has a user score_mod/score_mod_bwd, a mask_mod or aux "
            "tensors; the aux data is compiled and passed as for the other archs (AuxData). The "
            "softcap pair, which is index-free, keeps the tuned class. The choice joins the compile "
            "key, and such calls take the table's modifier entries (modifiers=True: the d128 "
            "non-causal one keeps the 8-warp 64x64 tile, where the 32x128 one spills 8 B in this "
            "step). A mask_mod replaces causal/local as the forward resolves it. deterministic=True "
            "builds the modifier class too, with sm120_bwd_deterministic_plan(modifier_step=True): "
            "the dQ turns on the step's own barriers (fused_turns), as the package's driver runs "
            "them; the tuned step's CTA-barrier release spills 88-104 B of registers at the 8-warp "
            "32x128 d128 tile (sm_120a, cuobjdump), the fused turns none. V in registers: the "
            "class's step takes dP's V from the registers the kernel's prologue fills (the SM80 step "
            "re-reads it from sV, whose memory the prologue lends to Q); the table entries measured "
            "with it, which the previous patch lifts with V in shared memory, are turned on "
            "(flash_bwd_sm120_configs.py) and run on this class. Other archs are unchanged; SM8x "
            "still refuses a user score_mod.",
        ],
        "Tested:",
        [
            f"Correctness (flash_attn_sm120's own backward, the same kernel code, {f['gpu']}): "
            f"tests/test_mods_bwd_gpu.py, {f['tests']} tests against an fp32 reference with poisoned "
            "outputs and gradients (position-dependent score_mod pairs, ALiBi over an aux tensor, aux "
            "scalars, document masks over an aux tensor, prefix-LM, a mask_mod replacing causal, an "
            "8-warp config, deterministic, varlen), all pass; the fuzz run with modifier cases, "
            f"{f['fuzz_cases']} cases, {f['fuzz_failures']} failures (command below). Both are recorded in "
            f"{f['record']}.",
        ],
        f"  {f['fuzz_command']}",
        [
            f"This patch applied to {UPSTREAM_DISTRIBUTION} {ctx.upstream_version}: the modifier class "
            "compiles for sm_120a with fake tensors on a CPU (a position-dependent score_mod pair and a "
            "mask_mod over an aux tensor) without local memory, and _flash_attn_bwd runs on fake CUDA "
            "tensors with score_mod, score_mod_bwd, mask_mod and aux_tensors and builds it.",
            "The patched upstream's modifier backward has not run on a GPU yet (its GPU test is written, "
            "not run), and not on a real SM120: do that before merging.",
        ],
    )
