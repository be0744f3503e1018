"""Patch 0002: SplitKV, paged KV and the decode table for the SM120 forward.

Lifts whole modules: `flash_attn_sm120/kernels/fwd_splitkv.py` becomes upstream's
`flash_fwd_sm120_splitkv.py` (its paged K/V loaders and rules, `fwd_splitkv_paged.py`, become
`flash_fwd_sm120_paged.py`), `splitkv.py` with the occupancy model of `hardware.py` becomes
`flash_fwd_sm120_splits.py`, and `decode.py` with `flash_attn_sm120/configs/sm120_decode.toml` becomes
`SM120_DECODE_TABLE` in `flash_fwd_sm120_configs.py`; `interface.py` loses its "not supported on
SM 12.0" asserts for paged KV and SplitKV.
"""

from __future__ import annotations

import ast
import inspect

from flash_attn_sm120 import decode as pkg_decode
from flash_attn_sm120 import hardware
from flash_attn_sm120 import splitkv as pkg_splitkv
from flash_attn_sm120.kernels import fwd_splitkv as pkg_fwd_splitkv
from flash_attn_sm120.kernels import fwd_splitkv_paged as pkg_fwd_splitkv_paged
from flash_attn_sm120.kernels import sink_fold as pkg_sink_fold

from patchgen.core import (
    CUTE,
    UPSTREAM_DISTRIBUTION,
    AnchorError,
    Context,
    _describe,
    _join_defs,
    apply_edits,
    check_no_package_refs,
    commit_message,
    rename,
    substitute,
    top_level_source,
    upstream_wording,
)


# the package's kernel module, as upstream's flash_fwd_sm120_splitkv.py: (anchor, replacement)
_SPLITKV_MODULE_EDITS = (
    ('"""SM120 forward, splitkv family: SplitKV and paged KV on the cp.async + mma.sync kernel.\n',
     '"""SM120 forward with SplitKV and paged KV: the cp.async + mma.sync kernel of flash_fwd_sm120.py.\n'),
    ("Algorithm. The cp.async family's FlashAttention-2 mainloop",
     "Algorithm. FlashAttentionForwardSm120's FlashAttention-2 mainloop"),
    ("two generalizations that upstream FA4 refuses on SM 12.0:", "two generalizations SM 12.0 lacked:"),
    ("  Upstream's `FlashAttentionForwardCombine` then merges", "  `FlashAttentionForwardCombine` then merges"),
    ("so the MMA side is unchanged. Upstream's\n  `PagedKVManager` (flash_attn/cute/paged_kv.py)",
     "so the MMA side is unchanged.\n  `PagedKVManager` (paged_kv.py)"),
    ("written by upstream's bf16/fp16 epilogue", "written by the SM80 bf16/fp16 epilogue"),
    ("work as in\nthe cp.async family. Shared memory and its SM120-emulation padding are the cp.async family's.\n",
     "work as in\nFlashAttentionForwardSm120, with the same tiles, rules (sm120_config_error) and shared memory.\n"),
    ("folded into the output tile before the epilogue (sink_fold.py)",
     "folded into the output tile before the epilogue (flash_fwd_sm120_sink.py)"),
    ("from flash_attn_sm120.kernels import sink_fold\nfrom flash_attn_sm120.kernels.fwd_cpasync import "
     "FlashAttentionForwardSm120CpAsync\n",
     "from flash_attn.cute import flash_fwd_sm120_sink as sink_fold\n"
     "from flash_attn.cute.flash_fwd_sm120 import FlashAttentionForwardSm120\n"),
    ("from flash_attn_sm120.kernels.fwd_splitkv_paged import KVTileLoaders\n",
     "from flash_attn.cute.flash_fwd_sm120_paged import KVTileLoaders\n"),
    ('    family = "splitkv"\n\n', ""),
)

# the package's split rule (splitkv.py) and SM120 occupancy model (hardware.py), as upstream's
# flash_fwd_sm120_splits.py
_SPLITS_DOC_EDITS = (
    ("`num_splits` keeps upstream FA4's meaning:", "`num_splits` keeps the interface's meaning:"),
    ("(from hardware.py's SM120 occupancy model for\nthe chosen config; the SM count is the GPU's own, so in "
     "emulation it is the host's)",
     "(from the SM120 occupancy model below\nfor the chosen config; the SM count is the GPU's own)"),
)
_SPLITS_CODE_EDITS = (
    ("# Upstream's heuristic caps splits at 128; its combine kernel takes at most 256.",
     "# num_splits_heuristic caps splits at 128; the combine kernel takes at most 256."),
    ("Measured (H200, SM120 emulation, CUDA\n# graphs, configs/measurements/2026-11-29_decode_splits_emulated.md)",
     "Measured (an H200 held to SM120's\n# CTAs per SM, CUDA graphs; see the commit that added this file)"),
    ('"""Upstream\'s meaning: 1 off, n > 1 that many (clamped), <= 0 chosen."""',
     '"""The interface\'s meaning: 1 off, n > 1 that many (clamped), <= 0 chosen."""'),
)
_SPLITS_NAMES = ("MAX_SPLITS", "MIN_N_BLOCKS_TO_SPLIT", "FULL_GRID_SHARE", "EFFICIENCY_SLACK", "MIN_WAVES",
                 "MAX_BLOCKS_PER_SPLIT", "MIN_BLOCKS_PER_SPLIT")
_SPLITS_DEFS = ("useful_max_splits", "clamp_num_splits", "choose_num_splits", "resolve_num_splits")
_OCCUPANCY_NAMES = ("SMEM_PER_SM", "SMEM_PER_BLOCK_MAX", "SMEM_RESERVED_PER_CTA", "THREADS_PER_SM", "REGS_PER_SM",
                    "REG_ALLOC_UNIT_PER_WARP", "MAX_CTAS_PER_SM")
_OCCUPANCY_DEFS = ("Occupancy", "regs_per_cta", "sm120_occupancy")

_SPLITS_ADAPTER = '''

def sm120_num_splits(
    num_splits: int,
    cfg: Sm120FwdConfig,
    head_dim: int,
    head_dim_v: int,
    *,
    total_mblocks: int,
    n_blocks: int,
    num_sms: int,
) -> int:
    """The interface's num_splits resolved for an SM120 forward running `cfg` (its CTAs per SM)."""
    smem = cfg.smem_bytes(head_dim, head_dim_v) + SM120_STATIC_SMEM
    ctas_per_sm = sm120_occupancy(smem, cfg.num_threads).ctas_per_sm
    return resolve_num_splits(
        num_splits, total_mblocks=total_mblocks, n_blocks=n_blocks, num_sms=num_sms, ctas_per_sm=ctas_per_sm
    )
'''


def render_splitkv_module() -> str:
    """flash_fwd_sm120_splitkv.py: the package's splitkv kernel module in upstream's names."""
    where = "flash_attn_sm120/kernels/fwd_splitkv.py"
    text = inspect.getsource(pkg_fwd_splitkv)
    for old, new in _SPLITKV_MODULE_EDITS:
        text = substitute(text, old, new, where=where)
    text = rename(text, "FlashAttentionForwardSm120CpAsync", "FlashAttentionForwardSm120", where=where)
    text = upstream_wording(text)
    check_no_package_refs(text, where)
    return text


def render_paged_module() -> str:
    """flash_fwd_sm120_paged.py: the splitkv kernel's K/V tile loaders (dense or paged) and the paged rules."""
    where = "flash_attn_sm120/kernels/fwd_splitkv_paged.py"
    text = upstream_wording(inspect.getsource(pkg_fwd_splitkv_paged))
    check_no_package_refs(text, where)
    compile(text, "flash_fwd_sm120_paged.py", "exec")
    return text


def render_sink_module() -> str:
    """flash_fwd_sm120_sink.py: the learnable-sink fold of the SM120 forward kernels, as is."""
    where = "flash_attn_sm120/kernels/sink_fold.py"
    text = upstream_wording(inspect.getsource(pkg_sink_fold))
    check_no_package_refs(text, where)
    return text


def render_splits_module() -> str:
    """flash_fwd_sm120_splits.py: the SM120 split rule with the occupancy model it needs."""
    where = "flash_attn_sm120/splitkv.py"
    doc = ast.get_docstring(ast.parse(inspect.getsource(pkg_splitkv)), clean=False)
    for old, new in _SPLITS_DOC_EDITS:
        doc = substitute(doc, old, new, where=where)
    occupancy = "".join(top_level_source(hardware, n) for n in _OCCUPANCY_NAMES)
    occupancy_defs = _join_defs(top_level_source(hardware, n) for n in _OCCUPANCY_DEFS)
    constants = "".join(top_level_source(pkg_splitkv, n) for n in _SPLITS_NAMES)
    defs = _join_defs(top_level_source(pkg_splitkv, n) for n in _SPLITS_DEFS)
    code = (
        "# SM120 resources per SM (compute capability 12.0, as the CUDA occupancy calculator models them)\n"
        + occupancy + "\n\n" + occupancy_defs + "\n\n" + constants + "\n\n" + defs
    )
    for old, new in _SPLITS_CODE_EDITS:
        code = substitute(code, old, new, where=where)
    text = (
        f'"""{doc}"""\n\n'
        "from __future__ import annotations\n\n"
        "import math\n"
        "from dataclasses import dataclass\n"
        "from functools import lru_cache\n"
        "from typing import TYPE_CHECKING\n\n"
        "from flash_attn.cute.flash_fwd_sm120 import SM120_STATIC_SMEM\n\n"
        "if TYPE_CHECKING:  # a type only: flash_fwd_sm120_configs imports the kernel modules that import this one\n"
        "    from flash_attn.cute.flash_fwd_sm120_configs import Sm120FwdConfig\n\n\n"
        + code + "\n" + _SPLITS_ADAPTER
    )
    text = upstream_wording(text)
    check_no_package_refs(text, where)
    return text


def _decode_table_literal(ctx: Context) -> str:
    lines = [
        "# Decode-shaped problems (every sequence has at most DECODE_MAX_SEQLEN_Q query tokens) read K and V",
        "# once with the GQA group packed into one M tile: their own table, chosen before SM120_FWD_TABLE.",
        "SM120_DECODE_TABLE: tuple[DecodeEntry, ...] = (",
    ]
    for e in ctx.decode_table:
        c, p = e.config, e.provenance
        lines.append(f"    # d<={e.head_dim}: {_describe(c)}")
        if e.measured:
            lines.append(f"    #   measured: {p['gpu']}, {p['mode']}, {p['date']}")
        else:
            lines.append("    #   not measured yet (chosen by its shared memory: one CTA per SM, two K/V stages)")
        lines.append(
            f"    DecodeEntry({e.head_dim}, Sm120FwdConfig(num_threads={c.num_threads}, tile_m={c.tile_m}, "
            f"tile_n={c.tile_n}, num_stages={c.num_stages},\n        q_in_regs={c.q_in_regs})),"
        )
    lines.append(")")
    return "\n".join(lines) + "\n"


_DECODE_ADAPTER_EDITS = (
    ("    tile_mn: Optional[Tuple[int, int]] = None,\n) -> Sm120FwdConfig:\n",
     "    tile_mn: Optional[Tuple[int, int]] = None,\n    max_seqlen_q: Optional[int] = None,\n) -> Sm120FwdConfig:\n"),
    ("    The table's choice (select_fwd_config). With an explicit tile_mn:",
     "    Decode-shaped problems (an int max_seqlen_q of 1..DECODE_MAX_SEQLEN_Q) take SM120_DECODE_TABLE's\n"
     "    entry, others the table's choice (select_fwd_config). With an explicit tile_mn:"),
    ("    cfg = select_fwd_config(SM120_FWD_TABLE, head_dim, head_dim_v, causal, local)\n",
     "    cfg = None\n"
     "    if isinstance(max_seqlen_q, int) and is_decode(max_seqlen_q):\n"
     "        cfg = select_decode_config(SM120_DECODE_TABLE, head_dim, head_dim_v)\n"
     "    if cfg is None:\n"
     "        cfg = select_fwd_config(SM120_FWD_TABLE, head_dim, head_dim_v, causal, local)\n"),
)


def patch_configs_for_decode(ctx: Context) -> None:
    """flash_fwd_sm120_configs.py: the decode table and its rule, read first for decode shapes."""
    rel = f"{CUTE}/flash_fwd_sm120_configs.py"
    where = "flash_attn_sm120/decode.py"
    defs = [top_level_source(pkg_decode, n) for n in ("DECODE_MAX_SEQLEN_Q", "DecodeEntry", "is_decode",
                                                       "select_decode_config")]
    code = _join_defs(defs)
    code = rename(code, "FwdConfig", "Sm120FwdConfig", where=where)
    code = upstream_wording(code)
    check_no_package_refs(code, where)
    text = ctx.read(rel)
    anchor = "\ndef sm120_fwd_config(\n"
    text = substitute(text, anchor, "\n" + code + "\n\n" + _decode_table_literal(ctx) + "\n" + anchor, where=rel)
    for old, new in _DECODE_ADAPTER_EDITS:
        text = substitute(text, old, new, where=rel)
    ctx.write(rel, text)


_SPLITKV_INTERFACE_EDITS = (
    (
        "imports of the SM120 SplitKV kernel and split rule",
        "from flash_attn.cute.flash_fwd_sm120_configs import sm120_fwd_config\n",
        "from flash_attn.cute.flash_fwd_sm120_configs import sm120_fwd_config\n"
        "from flash_attn.cute.flash_fwd_sm120_paged import (\n"
        "    MAX_PAGE_SIZE as SM120_MAX_PAGE_SIZE,\n"
        "    PAGE_SIZE_MULTIPLE as SM120_PAGE_SIZE_MULTIPLE,\n"
        "    paged_head_dim_error,\n"
        "    paged_tile_error,\n"
        ")\n"
        "from flash_attn.cute.flash_fwd_sm120_splitkv import FlashAttentionForwardSm120SplitKV\n"
        "from flash_attn.cute.flash_fwd_sm120_splits import sm120_num_splits\n",
    ),
    (
        "decode tiles in _get_fwd_config",
        "            sm120_cfg = sm120_fwd_config(head_dim, head_dim_v, causal, local)\n",
        "            sm120_cfg = sm120_fwd_config(head_dim, head_dim_v, causal, local, max_seqlen_q=max_seqlen_q)\n",
    ),
    (
        "SM120 num_splits in _get_fwd_config",
        "    if arch // 10 == 12:\n"
        "        assert num_splits <= 1, \"SM120 forward only supports num_splits=1\"\n"
        "        num_splits = 1\n"
        "    elif num_splits < 1:\n",
        "    if arch // 10 == 12:\n"
        "        # SM120 SplitKV: 1 = off, n > 1 = n (at most one split per key block), < 1 = chosen from\n"
        "        # the SM count and the CTAs per SM of the config (flash_fwd_sm120_splits.py)\n"
        "        if num_splits != 1:\n"
        "            num_splits = sm120_num_splits(\n"
        "                num_splits,\n"
        "                sm120_fwd_config(head_dim, head_dim_v, causal, local, tile_mn=tile_mn, max_seqlen_q=max_seqlen_q),\n"
        "                head_dim,\n"
        "                head_dim_v,\n"
        "                total_mblocks=total_mblocks,\n"
        "                n_blocks=num_n_blocks,\n"
        "                num_sms=get_num_sms_for_selection(device.index, arch) if num_splits < 1 else 0,\n"
        "            )\n"
        "    elif num_splits < 1:\n",
    ),
    (
        "decode warps and stages in _flash_attn_fwd",
        "        sm120_fwd_cfg = sm120_fwd_config(head_dim, head_dim_v, causal, local, tile_mn=tile_mn)\n",
        "        sm120_fwd_cfg = sm120_fwd_config(\n"
        "            head_dim, head_dim_v, causal, local, tile_mn=tile_mn, max_seqlen_q=max_seqlen_q\n"
        "        )\n",
    ),
    (
        "SM120 paged KV / SplitKV asserts",
        "            assert page_table is None, \"Paged KV not supported on SM 12.0 in this PR\"\n"
        "            assert not is_split_kv, \"SplitKV not supported on SM 12.0 in this PR\"\n",
        "            # paged KV and SplitKV: the same mainloop with page-table gathers and a split axis\n"
        "            sm120_fwd_cls, sm120_split_kwargs = FlashAttentionForwardSm120, {}\n"
        "            if page_table is not None or is_split_kv:\n"
        "                if page_table is not None:\n"
        "                    assert page_size % SM120_PAGE_SIZE_MULTIPLE == 0 and page_size <= SM120_MAX_PAGE_SIZE, (\n"
        "                        f\"SM120 paged KV needs a page size that is a multiple of {SM120_PAGE_SIZE_MULTIPLE} \"\n"
        "                        f\"up to {SM120_MAX_PAGE_SIZE}, got {page_size}\"\n"
        "                    )\n"
        "                    hdim_error = paged_head_dim_error(head_dim, head_dim_v)\n"
        "                    assert hdim_error is None, hdim_error\n"
        "                    # the page gathers fill a tile only in whole passes of rows (e.g. not 48 keys at d=112)\n"
        "                    tile_error = paged_tile_error(num_threads, tile_n, head_dim, head_dim_v)\n"
        "                    assert tile_error is None, f\"SM120 paged KV with the table's {tile_n}-key tile: {tile_error}\"\n"
        "                sm120_fwd_cls = FlashAttentionForwardSm120SplitKV\n"
        "                sm120_split_kwargs = dict(is_split_kv=is_split_kv)\n",
    ),
    (
        "SM120 class choice",
        "            fa_fwd = FlashAttentionForwardSm120(\n",
        "            fa_fwd = sm120_fwd_cls(\n",
    ),
    (
        "SM120 SplitKV constructor argument",
        "                has_aux_tensors=aux_tensors is not None,\n"
        "            )\n"
        "        else:\n"
        "            raise ValueError(\n",
        "                has_aux_tensors=aux_tensors is not None,\n"
        "                **sm120_split_kwargs,\n"
        "            )\n"
        "        else:\n"
        "            raise ValueError(\n",
    ),
)

# decode benchmark rows the message quotes: (batch, seqlen_k)
DECODE_ROWS = ((1, 4096), (1, 32768), (1, 131072), (8, 32768), (64, 4096))


def decode_measurement_table(bench: dict) -> tuple[str, list[str]]:
    """The message's decode table from a bench_decode.py JSON (CUDA-graph GPU times)."""
    rows = {(r["variant"], r.get("batch"), r.get("seqlen_k")): r for r in bench["rows"] if r.get("kind") == "decode"}
    header = ("b", "seqlen_k", "splits", "before ms", "split ms", "paged64 ms", "speedup", "KV GB/s", "% of copy")
    out = []
    for b, sk in DECODE_ROWS:
        up, split, paged = (rows.get((v, b, sk)) for v in ("upstream", "ours-dense", "ours-paged64"))
        if up is None or split is None:
            continue
        out.append((
            str(b), f"{sk // 1024}k", str(split["num_splits_auto"]), f"{up['graph_ms']:.3f}", f"{split['graph_ms']:.3f}",
            f"{paged['graph_ms']:.3f}" if paged else "-", f"{up['graph_ms'] / split['graph_ms']:.1f}x",
            f"{split['graph_kv_bandwidth_GBps']:.0f}", f"{100 * split['graph_frac_of_copy']:.0f}%",
        ))
    if not out:
        raise AnchorError("decode benchmark JSON has none of the rows the SplitKV patch quotes")
    widths = [max(len(r[i]) for r in out + [header]) for i in range(len(header))]
    fmt = lambda r: "  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    prefill = [r for r in bench["rows"] if r.get("kind") == "prefill" and "paged_over_dense" in r]
    notes = [f"page size {r['page_size']}: {r['paged_over_dense']:.3f}x" for r in prefill]
    return "\n".join([fmt(header)] + [fmt(r) for r in out]), notes


def step_sm120_splitkv_paged(ctx: Context) -> str:
    """Patch 2: SplitKV, paged KV and decode configs for the SM120 forward."""
    ctx.write(f"{CUTE}/flash_fwd_sm120_sink.py", render_sink_module())
    ctx.write(f"{CUTE}/flash_fwd_sm120_paged.py", render_paged_module())
    ctx.write(f"{CUTE}/flash_fwd_sm120_splitkv.py", render_splitkv_module())
    ctx.write(f"{CUTE}/flash_fwd_sm120_splits.py", render_splits_module())
    patch_configs_for_decode(ctx)
    rel = f"{CUTE}/interface.py"
    ctx.write(rel, apply_edits(ctx.read(rel), _SPLITKV_INTERFACE_EDITS, rel))

    measured = []
    if ctx.decode_bench is not None:
        table, prefill = decode_measurement_table(ctx.decode_bench)
        bench = ctx.decode_bench
        measured = [
            f"Measured ({bench['device']}, mode {bench['mode']}, {str(bench['date'])[:10]}; bf16, seqlen_q 1, "
            "32 query heads on 8 KV heads, d=128, dense KV; times are CUDA-graph replays, i.e. GPU time; "
            "before: this SM120 forward without splits (4 warps, 128x64); split: this patch's decode "
            "config and automatic split count, combine included; paged64: the same over a shuffled "
            f"page table of 64-token pages; copy: a device-to-device copy timed in the same run, "
            f"{bench['copy_bandwidth_GBps']:.0f} GB/s):",
            table,
        ]
        if prefill:
            measured.append("Paged prefill (b=4, 4096 tokens, causal) against the same problem with dense "
                            "KV: " + ", ".join(prefill) + " the dense time.")
        if bench["mode"] == "emulated":
            measured.append(
                "Mode emulated: the SM120 kernels on a bigger GPU with each CTA's shared memory padded so "
                "that no more CTAs are resident per SM than on SM120; the SM count (and so the split count) "
                f"is that GPU's ({bench['num_sms']}). Not SM120 numbers."
            )
        measured += ["Command (in flash_attn_sm120):", f"  {bench['command']}"]
    decode_lines = [
        f"d<={e.head_dim}: {_describe(e.config)} ({'measured' if e.measured else 'not measured yet'})"
        for e in ctx.decode_table
    ]
    return commit_message(
        "[Cute,Sm120] SplitKV, paged KV and decode configs for the SM120 forward",
        "The SM120 forward asserted on paged KV and on num_splits > 1 (\"not supported on SM 12.0\"), "
        "so inference engines on RTX PRO 6000 / RTX 5090 had no paged cache and no split-KV decode "
        "there. A decode step at batch 1 runs one CTA per KV head: 8 CTAs on a 188-SM GPU.",
        "What changes:",
        [
            "flash_fwd_sm120_splitkv.py (new): FlashAttentionForwardSm120SplitKV, a subclass of the SM120 "
            "forward with the same tiles and mainloop plus (a) a split axis: CTA (m_block, head, split) "
            "walks an even share of the key blocks (BlockInfo's split ranges) and writes fp32 partial "
            "O and LSE for FlashAttentionForwardCombine; an empty split writes LSE = -inf; prefetches "
            "never cross the split's first block; and (b) paged K/V: each tile is gathered row by row "
            "through the page table with PagedKVManager into the same swizzled smem tile (16-byte "
            "cp.async, rows past the sequence zero-filled), so any page size that is a multiple of 16 "
            "up to 512 works.",
            "flash_fwd_sm120_paged.py (new): the SplitKV kernel's K/V tile loaders (dense tiles or "
            "page gathers) and the rules for paged calls (page sizes, head dims, tiles the gather "
            "divides).",
            "flash_fwd_sm120_splits.py (new): the split count for num_splits < 1. It counts CTA slots "
            "as SMs x CTAs per SM (an SM120 occupancy model: 100 KB of shared memory per SM, 1 KB "
            "reserved per CTA, 1536 threads) and takes the fewest splits within 95% of the best wave "
            "efficiency; long KV starts at two waves of splits of at most 64 blocks (each keeping 16). "
            "An explicit num_splits is clamped to the number of key blocks.",
            "flash_fwd_sm120_configs.py: SM120_DECODE_TABLE, chosen for problems with at most "
            f"{pkg_decode.DECODE_MAX_SEQLEN_Q} query tokens per sequence: " + "; ".join(decode_lines) + ".",
            "interface.py: on SM120, page_table and num_splits != 1 are accepted (page size and head "
            "dims checked with a clear message) and run the new class; FlashAttentionForwardCombine "
            "merges the splits as on the other archs.",
        ],
        *measured,
        "Tested:",
        [
            "Correctness (flash_attn_sm120's hypothesis suite, deep profile, on the GPU and mode above): "
            "the split and paged paths against an fp32 reference over the gathered dense KV, with "
            "outputs poisoned with NaN first: random page sizes, shuffled page tables, seqused_k, split "
            "counts, GQA ratios, decode and prefill lengths, causal and local, varlen Q; 0 mismatches. "
            "compute-sanitizer memcheck and racecheck clean on the split and paged kernels.",
            f"This patch applied to {UPSTREAM_DISTRIBUTION} {ctx.upstream_version}: the SplitKV kernel "
            "(split and paged, GQA packed) compiles for sm_120a with fake tensors on a CPU without "
            "local memory; _get_fwd_config's split count equals the package's for decode shapes on "
            "188 SMs; and on an SM90 GPU with the SM120 dispatch forced (_arch=120) the patched "
            "flash_attn_func matches an fp32 reference for split, paged and paged-split calls.",
        ],
    )

