"""What the GPU fuzz suite runs: a bounded, seeded set of static cases and hypothesis strategies for the rest.

A compile costs seconds and its key holds the static parameters (dtype, head dims, GQA ratio and
packing, mask kind, softcap, LSE, varlen layout, kernel config) while sequence lengths, batch,
KV heads, window sizes and the softmax scale are runtime values. So:

  * `static_cases` draws, from the run's seed, a fixed list of `FuzzCase`s (kernel path x API x
    `AttnCase`): every registry path at least once, and every other static dimension cycled
    through its values in shuffled order so each value appears about equally often;
  * `problems(fuzz_case, plan)` is the hypothesis strategy for the dynamic part (`AttnProblem`),
    which roams freely: lengths 1..max (tile boundaries +-1 weighted in), seqlen_q != seqlen_k,
    empty sequences in varlen layouts, window sizes including 0, NaN padding.

Deterministic backward cases (`AttnCase.deterministic`, plan.det_cases of them, appended to the backward
cases) each aim at one of driver_bwd.deterministic_plan's dQ orderings (`FuzzCase.det_order`): since the
ordering enters the compile key, their dense problems keep the lengths that select it (at least two
m_blocks and two n_blocks, so the CTAs' additions interleave). See DETERMINISTIC.

What a path supports (flash_attn_sm120.paths.Supports) bounds both; upstream's backward gaps
(paths.BACKWARD_GAPS) are never drawn.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Sequence

from hypothesis import strategies as st

from flash_attn_sm120.paths import BACKWARD_GAPS, KernelPath
from flash_attn_sm120 import testing_sparse
from flash_attn_sm120.testing import MASKS, AttnCase, AttnProblem
from fuzz_profiles import FuzzPlan

TYPICAL_HEAD_DIMS = (64, 96, 128, 192, 256)
GQA_RATIOS = (1, 1, 2, 3, 4, 8)
PACK_GQA = (None, True, False)
SOFTCAPS = (0.0, 0.0, 0.0, 5.0, 30.0)
LAYOUTS = (
    ("dense", "dense"), ("dense", "dense"), ("packed", "packed"), ("padded", "padded"),
    ("packed", "padded"), ("padded", "packed"), ("dense", "padded"),
)
PAGED_LAYOUTS = (("dense", "paged"), ("packed", "paged"))
APIS = ("driver", "driver", "public")
# testing_mods.MODS names, "" (none) most often; score-mod ones never with softcap (upstream refuses both)
MODS = ("", "", "", "", "position", "alibi", "scalar", "document", "prefix", "prefix+position")
MASK_ONLY_MODS = ("document", "prefix")
# testing_sparse.CASES names, "" (none) most often; drawn on paths with Supports.block_sparse
SPARSE = ("", "random", "nofull", "q256")
SPARSE_HEAD_DIMS = (64, 96, 128)
# deterministic=True backward cases: (dQ ordering as testing.deterministic_order names it, mask, layouts, GQA
# ratios, modifier, block-sparse lists); plan.det_cases takes them in this order (cycling), so the fast plan's 4
# cover fixed point and the three turn orderings, the deep plan's 15 all of them. Fixed point serves varlen
# calls, dense calls without a mask (but those a rotated turns entry serves) and block-sparse lists, without a
# user score_mod; the turn orderings serve dense causal and windowed calls, with a score_mod ("position",
# "alibi": testing_mods.MODS) or not, the other dense and the varlen calls with one, the lists with one, the
# dense calls without a mask that a rotated turns entry serves, and windows with a user score_mod (the last rows).
DETERMINISTIC = (
    ("fixed", "local_lr", ("packed", "packed"), (2, 4), "", False),  # varlen GQA sliding window: fixed-point dQ
    ("descending+reversed", "causal", ("dense", "dense"), (2, 4), "", False),  # GQA causal: ordered dQ and dK/dV
    ("rotated", "none", ("dense", "dense"), (1, 2), "position", False),  # no mask, dense, n_blocks <= m_blocks
    ("ascending", "causal", ("packed", "packed"), (2, 4), "position", False),  # cu_seqlens_k + score_mod: ascending
    ("descending+reversed", "local_lr", ("dense", "dense"), (2, 4), "", False),  # dense sliding window: turns
    ("fixed", "none", ("padded", "packed"), (1, 2), "", False),  # varlen without a user score_mod: fixed point
    ("ascending", "none", ("dense", "dense"), (1, 3), "position", False),  # more n_blocks than m_blocks
    ("ascending", "causal", ("padded", "padded"), (1, 2), "alibi", False),  # seqused_k, causal: ascending
    ("fixed", "causal", ("dense", "dense"), (1, 8), "", True),  # block-sparse lists, fixed-point dQ
    ("rotated", "none", ("dense", "dense"), (4, 8), "alibi", False),  # rotated with a large group's dK/dV order
    ("descending+reversed", "causal", ("dense", "dense"), (1, 8), "alibi", False),
    ("lists", "causal", ("dense", "dense"), (1, 2), "position", True),  # block-sparse + score_mod: turns from the lists
    # no mask, dense, no score_mod: the rotated turns entry of a "none" key (config_bwd.rotated_turns_config), at a
    # head dim that has one; its lengths are sized on that entry's tile (bwd_tile)
    ("rotated", "none", ("dense", "dense"), (1, 2), "", False),
    # a window with a user score_mod (no fixed point): turns from the band's edges, descending (dense) and ascending
    ("descending+reversed", "local_lr", ("dense", "dense"), (1, 2), "position", False),
    ("ascending", "causal_l", ("packed", "packed"), (2, 4), "alibi", False),
    # varlen block-sparse lists (flash_attn_varlen_func's block_sparse_tensors_bwd, packed form): fixed point, and
    # the list turns with a score_mod
    ("fixed", "none", ("packed", "packed"), (1, 2), "", True),
    ("lists", "causal", ("packed", "packed"), (2, 4), "position", True),
)
DET_SPARSE = ("random", "q256", "nofull")  # the lists a "lists" case draws, in turn
TILE_EDGES = tuple(sorted({t + o for t in (16, 32, 64, 80, 96, 128, 192, 256, 512, 1024, 2048, 3072) for o in (-1, 0, 1)}))


@dataclass(frozen=True)
class FuzzCase:
    index: int
    path: KernelPath
    api: str  # "driver": driver.forward with NaN out/lse; "public": flash_attn_func / varlen (+ autograd)
    case: AttnCase
    det_order: str = ""  # deterministic cases: the dQ ordering their problems select (DETERMINISTIC)

    @property
    def id(self) -> str:
        kind = "det" if self.case.deterministic else "bwd" if self.case.backward else "fwd"
        return f"{kind}{self.index:03d}-{self.path.name}-{self.api}-{self.case.label}"


def _cycle(rng: random.Random, values: Sequence, n: int) -> list:
    """n values, each of `values` about equally often, shuffled per round."""
    out: list = []
    while len(out) < n:
        chunk = list(values)
        rng.shuffle(chunk)
        out.extend(chunk)
    return out[:n]


def _mask_supported(path: KernelPath, mask: str) -> bool:
    causal, left, right = MASKS[mask]
    if (left or right) and not path.supports.local:
        return False
    return not causal or path.supports.causal


def _pick_head_dims(rng, path: KernelPath, dims: Sequence[int], typical: bool, mixed: bool) -> tuple[int, int]:
    pool = [d for d in TYPICAL_HEAD_DIMS if d in dims] if typical else list(dims)
    d = rng.choice(pool or list(dims))
    dv = d
    if mixed and path.supports.mixed_head_dims:
        others = [x for x in path.head_dims() if x != d and path.error(d, x) is None]
        if others:
            dv = rng.choice(others)
    return d, dv


def static_cases(paths: Sequence[KernelPath], plan: FuzzPlan, seed: int, mode: str) -> tuple[list, list]:
    """(forward cases, backward cases) for a run; a pure function of its arguments."""
    rng = random.Random(seed)
    runnable = [p for p in paths if p.head_dims()]
    n = max(plan.fwd_cases, len(runnable))
    cols = {
        "path": _cycle(rng, runnable, n),
        "api": _cycle(rng, APIS, n),
        "dtype": _cycle(rng, ("bfloat16", "float16"), n),
        "typical": _cycle(rng, (True, False), n),
        "mixed": _cycle(rng, (False, False, False, True), n),
        "ratio": _cycle(rng, GQA_RATIOS, n),
        "pack": _cycle(rng, PACK_GQA, n),
        "mask": _cycle(rng, tuple(MASKS), n),
        "softcap": _cycle(rng, SOFTCAPS, n),
        "lse": _cycle(rng, (True, False), n),
        "layout": _cycle(rng, LAYOUTS, n),
        "sink": _cycle(rng, (False, False, True), n),
        "mods": _cycle(rng, MODS, n),
        "sparse": _cycle(rng, SPARSE, n),
    }
    fwd = []
    for i in range(n):
        path = cols["path"][i]
        s = path.supports
        d, dv = _pick_head_dims(rng, path, path.head_dims(), cols["typical"][i], cols["mixed"][i])
        ratio = cols["ratio"][i]
        mask = cols["mask"][i] if _mask_supported(path, cols["mask"][i]) else "none"
        layouts = tuple(lay for lay in LAYOUTS if s.allows_layout(*lay)) + (PAGED_LAYOUTS if s.paged else ())
        layout = cols["layout"][i] if cols["layout"][i] in layouts else rng.choice(layouts)
        if s.paged and rng.random() < 0.2:
            layout = rng.choice(PAGED_LAYOUTS)
        pack = (cols["pack"][i] if s.pack_gqa else False) if ratio > 1 else None
        if pack and not path.packs(ratio, d, dv):
            pack = None  # the path's tile cannot hold whole head groups: let the driver decide
        sink = cols["sink"][i] and s.sinks
        softcap = cols["softcap"][i] if s.softcap else 0.0
        mods = _mods(cols["mods"][i], s, softcap)
        sparse = cols["sparse"][i] if s.block_sparse else ""
        if sparse:  # the lists' limits: dense layout or varlen lists (packed), d 64/96/128 = dv, no window
            d = dv = d if d in SPARSE_HEAD_DIMS else rng.choice(SPARSE_HEAD_DIMS)
            if sparse in testing_sparse.VARLEN_CASES and i % 2 == 0:
                layout = ("packed", "packed")  # every other such case: varlen lists (no draw: the stream stays)
            if not testing_sparse.varlen_case_ok(sparse, *layout, backward=False):
                layout = ("dense", "dense")
            if layout[0] != "dense":
                pack = None  # varlen lists run their GQA heads unpacked (driver.choose_block_sparse)
            mask = mask if mask in ("none", "causal") else "none"
        api = "public" if layout[1] == "paged" or s.splits or sink or mods or sparse else cols["api"][i]
        case = AttnCase(
            dtype=cols["dtype"][i] if cols["dtype"][i] in s.dtypes else s.dtypes[0],
            head_dim=d, head_dim_v=dv, qhead_per_kvhead=ratio, pack_gqa=pack, mask=mask,
            softcap=softcap, return_lse=cols["lse"][i],
            q_layout=layout[0], k_layout=layout[1], sink=sink, mods=mods, block_sparse=sparse,
        )
        fwd.append(FuzzCase(i, path, api, case))
    bwd = _backward_cases(rng, runnable, plan.bwd_cases, mode)
    # drawn last, from the same generator: the other cases do not change with plan.det_cases
    return fwd, bwd + _deterministic_cases(rng, runnable, plan.det_cases, start=len(bwd))


def _mods(drawn: str, supports, softcap: float) -> str:
    if not drawn or not supports.mods:
        return ""
    return drawn if not softcap or drawn in MASK_ONLY_MODS else "document"


def _backward_cases(rng: random.Random, paths: Sequence[KernelPath], n: int, mode: str) -> list:
    gaps = BACKWARD_GAPS.get(mode, BACKWARD_GAPS["emulated"])
    def bwd_dims(path: KernelPath) -> list:
        return [d for d in path.supports.backward_head_dims if d in path.head_dims()]

    paths = [p for p in paths if p.supports.backward and bwd_dims(p)]
    if not paths or n <= 0:
        return []
    cols = {
        "path": _cycle(rng, paths, n),
        "dtype": _cycle(rng, ("bfloat16", "float16"), n),
        "ratio": _cycle(rng, (1, 2, 4), n),
        "mask": _cycle(rng, tuple(MASKS), n),
        "softcap": _cycle(rng, (0.0, 0.0, 5.0), n),
        "lse": _cycle(rng, (False, True), n),
        "layout": _cycle(rng, LAYOUTS, n),
        "sink": _cycle(rng, (False, True), n),
        "mods": _cycle(rng, MODS, n),
        "sparse": _cycle(rng, SPARSE, n),
    }
    out = []
    for i in range(n):
        path = cols["path"][i]
        s = path.supports
        d = rng.choice(bwd_dims(path))
        mask = cols["mask"][i] if _mask_supported(path, cols["mask"][i]) else "none"
        if "d64-noncausal" in gaps and d == 64 and mask == "none":
            mask = "causal"
        layout = cols["layout"][i] if "varlen" not in gaps and s.allows_layout(*cols["layout"][i]) else ("dense", "dense")
        softcap = cols["softcap"][i] if s.softcap else 0.0
        sparse = cols["sparse"][i] if s.block_sparse and d in SPARSE_HEAD_DIMS else ""
        if sparse:  # the backward lists' limits: dense layout or varlen lists (packed, both directions' lists);
            # causal applies inside the listed tiles
            if sparse in testing_sparse.VARLEN_CASES and "varlen" not in gaps and i % 2 == 0:
                layout = ("packed", "packed")  # every other such case: varlen lists (no draw: the stream stays)
            if not testing_sparse.varlen_case_ok(sparse, *layout, backward=True):
                layout = ("dense", "dense")
            mask = mask if mask in ("none", "causal") else "none"
        case = AttnCase(
            dtype=cols["dtype"][i] if cols["dtype"][i] in s.dtypes else s.dtypes[0],
            head_dim=d, head_dim_v=d, qhead_per_kvhead=cols["ratio"][i], pack_gqa=None, mask=mask,
            softcap=softcap, return_lse=cols["lse"][i],
            q_layout=layout[0], k_layout=layout[1], backward=True, sink=cols["sink"][i] and s.sinks,
            mods=_mods(cols["mods"][i], s, softcap), block_sparse=sparse,
        )
        out.append(FuzzCase(i, path, "public", case))
    return out


def _deterministic_cases(rng: random.Random, paths: Sequence[KernelPath], n: int, start: int) -> list:
    """n deterministic backward cases (indices from `start`), DETERMINISTIC's orderings in turn, on the
    dispatcher's path (the backward does not depend on the forward's config): dtype, head dim, GQA
    ratio, softcap and LSE cycled."""
    paths = [p for p in paths if p.supports.backward and _bwd_dims(p)]
    if not paths or n <= 0:
        return []
    path = next((p for p in paths if p.family == "dispatch"), paths[0])
    cols = {
        "dtype": _cycle(rng, ("bfloat16", "float16"), n),
        "d": _cycle(rng, _bwd_dims(path), n),
        "softcap": _cycle(rng, (0.0, 0.0, 5.0), n),
        "lse": _cycle(rng, (False, True), n),
    }
    out = []
    for i in range(n):
        order, mask, layout, ratios, mods, lists = DETERMINISTIC[i % len(DETERMINISTIC)]
        s = path.supports
        if not s.allows_layout(*layout):
            layout = ("dense", "dense")
        d = cols["d"][i]
        entry = order == "rotated" and mask == "none" and not mods  # the rotated turns entry's row
        if entry:
            dims, ratios = _rotated_entry_dims(path), _rotated_entry_ratios(ratios)
            d = dims[i % len(dims)] if dims else d
            order = order if dims else "fixed"  # no "none" key with a turns entry: the call adds in fixed point
        sparse = ""
        if lists and s.block_sparse:  # block-sparse lists (a head dim the lists take; packed: varlen lists)
            sparse = DET_SPARSE[(i // len(DETERMINISTIC)) % len(DET_SPARSE)]
            if not testing_sparse.varlen_case_ok(sparse, *layout, backward=True) and layout != ("dense", "dense"):
                sparse = sorted(testing_sparse.VARLEN_CASES)[0]
            d = d if d in SPARSE_HEAD_DIMS else SPARSE_HEAD_DIMS[i % len(SPARSE_HEAD_DIMS)]
        case = AttnCase(
            dtype=cols["dtype"][i] if cols["dtype"][i] in s.dtypes else s.dtypes[0],
            head_dim=d, head_dim_v=d, qhead_per_kvhead=rng.choice(ratios), pack_gqa=None,
            mask=mask if _mask_supported(path, mask) else "none",
            # (a score_mod excludes softcap; softcap keeps a call off the turns entries)
            softcap=cols["softcap"][i] if s.softcap and not (mods or entry) else 0.0,
            return_lse=cols["lse"][i], q_layout=layout[0], k_layout=layout[1], backward=True, deterministic=True,
            block_sparse=sparse, mods=mods,
        )
        out.append(FuzzCase(start + i, path, "public", case, det_order=order))
    return out


def _bwd_dims(path: KernelPath) -> list:
    return [d for d in path.supports.backward_head_dims if d in path.head_dims()]


def _rotated_entry_dims(path: KernelPath) -> list:
    """The path's backward head dims whose "none" key has a rotated turns entry."""
    from flash_attn_sm120.config_bwd import load_bwd_table, rotated_turns_config

    return [d for d in _bwd_dims(path) if rotated_turns_config(load_bwd_table(), d, d) is not None]


def _rotated_entry_ratios(ratios: tuple) -> tuple:
    """The row's GQA ratios that a rotated turns entry serves (MHA only unless ROTATED_ENTRIES_SERVE_GQA)."""
    from flash_attn_sm120.config_bwd import ROTATED_ENTRIES_SERVE_GQA

    return ratios if ROTATED_ENTRIES_SERVE_GQA else tuple(r for r in ratios if r == 1) or (1,)


def bwd_tile(case: AttnCase) -> tuple[int, int]:
    """(m_block, n_block) of the backward config the package picks for a case (its table, config_bwd, with
    the driver's entry kinds: testing.bwd_routing), before its lengths exist; a dense deterministic case
    without a mask, softcap or modifiers at a head dim with a rotated turns entry is sized on that entry, whose
    rotated order its "rotated" lengths (_det_dense_lengths) then fit."""
    from flash_attn_sm120.config_bwd import load_bwd_table, rotated_turns_config, select_bwd_config
    from flash_attn_sm120.testing import bwd_routing

    causal, local, _, kinds = bwd_routing(case)  # (no problem here: the case's own mask flags)
    if _aims_at_rotated_entry(case, kinds):  # sized on the entry its lengths will select
        cfg = rotated_turns_config(load_bwd_table(), case.head_dim, case.head_dim_v)
    else:
        cfg = select_bwd_config(load_bwd_table(), case.head_dim, case.head_dim_v, causal, local, **kinds)
    return cfg.m_block, cfg.n_block


def _aims_at_rotated_entry(case: AttnCase, kinds: dict) -> bool:
    """A dense deterministic case without a mask, softcap or modifiers at a head dim whose "none" key has a
    rotated turns entry serving its head ratio: the DETERMINISTIC row that aims at that entry."""
    from flash_attn_sm120.config_bwd import ROTATED_ENTRIES_SERVE_GQA, load_bwd_table, rotated_turns_config

    return (case.deterministic and case.is_dense and case.mask == "none" and not (case.softcap or case.mods
            or case.block_sparse) and (case.qhead_per_kvhead == 1 or ROTATED_ENTRIES_SERVE_GQA)
            and rotated_turns_config(load_bwd_table(), case.head_dim, case.head_dim_v) is not None
            and not kinds["modifiers"])


# ------------------------------------------------------------------------------------------------
# Dynamic part
# ------------------------------------------------------------------------------------------------


def seqlen(lo: int, hi: int) -> st.SearchStrategy[int]:
    """Lengths in [lo, hi]: small ones, tile edges +-1, and anything."""
    hi = max(lo, hi)
    edges = [x for x in TILE_EDGES if lo <= x <= hi]
    parts = [st.integers(lo, min(hi, lo + 80)), st.integers(lo, hi)]
    if edges:
        parts.insert(1, st.sampled_from(edges))
    return st.one_of(*parts)


def window_size(max_len: int, negative: bool = True) -> st.SearchStrategy[int]:
    """A window side: small, tile edges, anything; and (negative) upstream's one-sided negative
    bounds, which shift the band off the diagonal (both sides negative is no window at all)."""
    parts = [st.integers(0, 8), st.sampled_from((0, 15, 16, 63, 64, 127, 128, 256)),
             st.integers(0, max(8, max_len + 64))]
    if negative:
        parts += [st.integers(-8, -1), st.sampled_from((-1, -16, -63, -64, -65, -128)),
                  st.integers(-max(8, max_len + 64), -1)]
    return st.one_of(*parts)


def _det_dense_lengths(draw, order: str, tile: tuple[int, int], batch: int, q_hi: int, max_len: int, per_seq: int,
                       h: int) -> tuple[tuple, tuple]:
    """Dense (seqlens_q, seqlens_k) that select `order` (deterministic_plan) with at least two m_blocks and two
    n_blocks, within the budget (h * sq * sk <= per_seq) where the ordering allows: "rotated" n_blocks <=
    m_blocks, "ascending" (no mask, dense) n_blocks > m_blocks, "descending+reversed" (causal) any lengths."""
    m, n = tile
    if order == "ascending":  # the most m_blocks that leave room for one more n_block than m_blocks
        mb = 2
        while n * (mb + 1) + 1 <= max_len and h * m * (mb + 1) * (n * (mb + 1) + 1) <= per_seq:
            mb += 1
        q_hi = min(q_hi, m * mb)
    sq = draw(seqlen(min(m + 1, q_hi), q_hi), label="seqlen_q")
    mb = -(-sq // m)
    lo, cap = n + 1, min(max_len, max(n + 1, per_seq // (h * sq)))
    if order == "rotated":
        cap = min(cap, n * mb)  # n_blocks <= m_blocks
    elif order == "ascending":
        lo = n * mb + 1  # n_blocks > m_blocks
        cap = max(lo, cap)
    sk = draw(seqlen(min(lo, cap), cap), label="seqlen_k")
    return (sq,) * batch, (sk,) * batch


@st.composite
def problems(draw, fc: FuzzCase, plan: FuzzPlan):
    """The dynamic part of a problem for one static case, within the plan's size budget."""
    case, s = fc.case, fc.path.supports
    bwd = case.backward
    max_len = plan.max_seqlen_bwd if bwd else plan.max_seqlen
    budget = plan.bwd_work if bwd else plan.fwd_work
    hk = draw(st.integers(1, plan.max_kv_heads), label="nheads_kv")
    h = hk * case.qhead_per_kvhead
    batch = draw(st.integers(1, plan.max_batch), label="batch")
    per_seq = max(1, budget // batch)
    # backward: every sequence has keys (sk >= 1); rows a mask leaves empty (causal with sq > sk,
    # negative window sides) are drawn like the forward's since the backward is this package's own

    def k_len(sq: int, lo: int) -> int:
        cap = max(lo, min(max_len, per_seq // (h * max(sq, 1))))
        return draw(seqlen(lo, cap))

    q_var, k_var = case.q_layout != "dense", case.k_layout != "dense"
    q_lo = 0 if q_var else 1
    k_lo = 1 if bwd else (0 if k_var else 1)
    # sq <= sqrt(budget / h) leaves room for sk within the budget
    q_hi = max(1, min(max_len, math.isqrt(per_seq // h))) if bwd else max_len
    if fc.det_order and case.is_dense:  # the lengths that select the case's dQ ordering
        seqlens_q, seqlens_k = _det_dense_lengths(draw, fc.det_order, bwd_tile(case), batch, q_hi, max_len, per_seq, h)
    else:
        # a deterministic varlen case: its first sequence has several m_blocks and n_blocks, the others roam
        m, n = bwd_tile(case) if fc.det_order else (0, 0)
        if not q_var:
            sq = draw(seqlen(q_lo, q_hi), label="seqlen_q")
            seqlens_q = (sq,) * batch
        else:
            first = (draw(seqlen(min(m + 1, q_hi), q_hi), label="seqlen_q0"),) if fc.det_order else ()
            seqlens_q = first + tuple(draw(st.lists(seqlen(q_lo, q_hi), min_size=batch - len(first),
                                                    max_size=batch - len(first)), label="seqlens_q"))
        if not k_var:
            sk = k_len(max(seqlens_q), k_lo)
            seqlens_k = (sk,) * batch
        else:
            seqlens_k = tuple(k_len(sq, n + 1 if fc.det_order and i == 0 else k_lo) for i, sq in enumerate(seqlens_q))
    max_k = max(seqlens_k, default=1)
    left = draw(window_size(max_k), label="window_left") if case.has_window[0] else None
    # (a deterministic case keeps its dQ ordering: both sides negative would be no window at all, another order)
    both_negative_ok = not (fc.det_order and left is not None and left < 0)
    right = draw(window_size(max_k, negative=both_negative_ok), label="window_right") if case.has_window[1] else None
    scale = draw(st.one_of(st.none(), st.floats(0.02, 1.0, allow_nan=False, allow_infinity=False)), label="scale")
    pad = st.sampled_from((0, 0, 1, 8, 64, 129))
    return AttnProblem(
        seqlens_q=seqlens_q, seqlens_k=seqlens_k, nheads_kv=hk, window_left=left, window_right=right,
        softmax_scale=scale, pad_q=draw(pad, label="pad_q"), pad_k=draw(pad, label="pad_k"),
        page_size=draw(st.sampled_from((16, 64, 128)), label="page_size") if case.k_layout == "paged" else 64,
        num_splits=draw(st.sampled_from((1, 2, 3, 0)), label="num_splits") if s.splits else 1,
        seed=draw(st.integers(0, 2**31 - 1), label="seed"),
    )
