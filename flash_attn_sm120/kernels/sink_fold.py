"""Learnable sinks folded into a forward kernel's output tile, in registers, before its epilogue.

A learnable sink (gpt-oss) is one extra softmax column per query head h with logit sink[h]
(natural-log units, not scaled) and no value. A kernel that has finished a row's softmax holds the
row's normalized output O (fp32 accumulators) and its LSE; the sink's result is then exact:

    LSE' = logaddexp(LSE, sink[h])          O' = O * exp(LSE - LSE')

A fully masked row (LSE = -inf) gets LSE' = sink[h] and O' = 0, and a sink of -inf changes
nothing, as the interface defines sinks. Done here, on the tile in registers, it costs a few
instructions per row and no pass over O in memory.

With SplitKV, only split 0 folds the sink in (`active`): the combine's logsumexp over the splits
then counts it once per row. With packed GQA a tile's rows interleave the query heads of one KV
head, and each row takes its own head's sink (`load_learnable_sink`).

A kernel that owns its final softmax can count the sink there instead (`finalize_with_sinks` with
`load_row_sinks`): one more term per row sum and no pass over O; the fold after the softmax made the
compiler reschedule one TMA mainloop (+5% on a 0.25 ms problem, measured), the final-softmax route +2.7%.
FA4's `Softmax.finalize(sink_val=...)` scales the sink's term by the row's max, which overflows to
inf when the sink exceeds the row's largest score by more than ~88 (a score_mod such as ALiBi far
from the diagonal): LSE = inf. `finalize_with_sinks` takes the larger of the two as the reference.

A kernel whose mainloop cannot take the sink as an argument (the SM80 mainloop) gets it as the last
of the aux tensors (`with_sink`), a kernel argument like any aux tensor; `split_sink` takes it back
off before a score_mod sees the list.
"""

from __future__ import annotations

import math
import operator
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from flash_attn.cute import utils as fa_utils
from flash_attn.cute.softmax import Softmax, load_learnable_sink
from flash_attn.cute.utils import AuxData
from quack import layout_utils

_LOG2_E = math.log2(math.e)
_LN_2 = math.log(2.0)


def with_sink(aux_data: AuxData, learnable_sink) -> AuxData:
    """Plain Python (trace time): aux_data with the sink tensor appended (unchanged without one)."""
    if learnable_sink is None:
        return aux_data
    return AuxData(list(aux_data.tensors or []) + [learnable_sink], aux_data.scalars)


def split_sink(aux_data: AuxData, has_sink: bool) -> tuple[AuxData, Optional[object]]:
    """Plain Python (trace time): (the user's aux_data, the sink tensor) from `with_sink`'s result."""
    if not has_sink:
        return aux_data, None
    tensors = list(aux_data.tensors)
    sink = tensors.pop()
    return AuxData(tensors or None, aux_data.scalars), sink


@cute.jit
def load_row_sinks(
    mSink: cute.Tensor,
    thr_mma_pv: cute.ThrMma,
    tile_m: cutlass.Constexpr[int],
    tile_hdimv: cutlass.Constexpr[int],
    m_block: Int32,
    head_idx: Int32,
    qhead_per_kvhead: cutlass.Constexpr[int],
    pack_gqa: cutlass.Constexpr[bool],
) -> cute.Tensor:
    """The sink logit of each accumulator row this thread holds (fp32 registers). head_idx: the query
    head, or the KV head when packed. SplitKV loads it before its mainloop (the latency hides under it), the
    TMA family just before its final softmax (where it loads it made no measured difference there)."""
    taccOcO = layout_utils.reshape_acc_to_mn(thr_mma_pv.partition_C(cute.make_identity_tensor((tile_m, tile_hdimv))))
    row_sinks = cute.make_rmem_tensor(cute.size(taccOcO, mode=[0]), Float32)
    for r in cutlass.range(cute.size(row_sinks), unroll_full=True):
        row_sinks[r] = load_learnable_sink(mSink, head_idx, m_block * tile_m + taccOcO[r, 0][0], qhead_per_kvhead,
                                           pack_gqa)
    return row_sinks


@cute.jit
def fold_sink(acc_O: cute.Tensor, lse: cute.Tensor, row_sinks: cute.Tensor, active: cutlass.Boolean = True):
    """acc_O (normalized, the PV product's accumulators) and lse (natural log, one per accumulator row)
    of one tile, in place, with each row's sink (load_row_sinks) folded in; inactive: unchanged."""
    acc_O_mn = layout_utils.reshape_acc_to_mn(acc_O)
    assert cute.size(acc_O_mn, mode=[0]) == cute.size(lse) == cute.size(row_sinks)
    # branch-free (selects only): both -inf, an empty row without a sink, stays O = 0 and LSE = -inf
    for r in cutlass.range(cute.size(lse), unroll_full=True):
        sink = row_sinks[r] if active else -Float32.inf
        lse_row = lse[r]
        hi = lse_row if lse_row > sink else sink
        hi = hi if hi != -Float32.inf else Float32(0.0)
        total = (cute.math.exp2((lse_row - hi) * _LOG2_E, fastmath=True)
                 + cute.math.exp2((sink - hi) * _LOG2_E, fastmath=True))
        lse_new = hi + cute.math.log2(total, fastmath=True) * _LN_2  # log2(0) = -inf
        scale = cute.math.exp2((lse_row - lse_new) * _LOG2_E, fastmath=True)
        scale = scale if lse_new != -Float32.inf else Float32(1.0)
        acc_O_mn[r, None].store(acc_O_mn[r, None].load() * scale)
        lse[r] = lse_new


@cute.jit
def finalize_with_sinks(softmax: Softmax, row_sinks: cute.Tensor) -> cute.Tensor:
    """Softmax.finalize with each row's sink counted, safe for any sink: returns the rows' O scale and
    leaves each row's LSE (natural log) in softmax.row_sum, as finalize does.

    Per row, in log2 units: m = the row's max score, s = the sink; against hi = max(m, s),
    total = row_sum * 2^(m - hi) + 2^(s - hi), O scale = 2^(m - hi) / total, LSE = hi + log2(total).
    An empty row (m = -inf) gets O = 0 and LSE = s; with s = -inf too, LSE = -inf."""
    row_sum, row_max = softmax.row_sum, softmax.row_max
    row_sum.store(fa_utils.warp_reduce(row_sum.load(), operator.add, width=4))  # the quad's partial sums
    row_scale = cute.make_fragment_like(row_max, Float32)
    for r in cutlass.range(cute.size(row_sum), unroll_full=True):
        m = row_max[r] * softmax.scale_log2
        s = row_sinks[r] * _LOG2_E
        hi = m if m > s else s
        hi = hi if hi != -Float32.inf else Float32(0.0)
        kept = cute.math.exp2(m - hi, fastmath=True)
        total = row_sum[r] * kept + cute.math.exp2(s - hi, fastmath=True)
        empty = total == 0.0 or total != total
        row_scale[r] = cute.arch.rcp_approx(total if not empty else Float32(1.0)) * kept
        row_sum[r] = (hi + cute.math.log2(total, fastmath=True)) * _LN_2 if not empty else -Float32.inf
    return row_scale
