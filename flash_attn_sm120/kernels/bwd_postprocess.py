"""dQ postprocess for the wide dQ adds: upstream's SM80/SM120 postprocess, reading four floats per thread.

The main kernel adds dS K into an fp32 dQ accumulator, one tile of m_block x padded head dim per m_block.
Upstream's postprocess (`FlashAttentionBackwardPostprocess`, arch 120) walks those tiles: it copies a tile
to shared memory, hands thread t of T the elements t, t + T, t + 2T, ... (the order in which upstream's
main kernel adds them, one float per atomic), which are thread t's dQ MMA accumulator in register order;
then it scales, converts and stores dQ through shared memory.

With `dq_wide_adds` (kernels/bwd_sm120.py) the main kernel adds runs of DQ_WIDE_ELEMS = 4 consecutive
floats with one 16-byte reduction each: thread t's register elements 4j .. 4j + 3 live at
(j T + t) 4 .. (j T + t) 4 + 3 of the tile. The subclass below changes only the shared-to-register read
to that partition (four floats per thread); the tile walk, varlen offsets, conversion and stores are
upstream's. The GQA dK/dV accumulators keep upstream's layout and postprocess.
"""

from __future__ import annotations

from typing import Optional

import torch

import cutlass
import cutlass.cute as cute
from cutlass import Float32
from flash_attn.cute import copy_utils
from flash_attn.cute.flash_bwd_postprocess import FlashAttentionBackwardPostprocess
from flash_attn.cute.interface import BIN_BATCH_SEARCH_THRESH, _compute_tile_cumsum, make_fake_bwd_tensors
from quack.compile_utils import make_fake_tensor

from flash_attn_sm120.kernels.bwd_tiling import DQ_WIDE_ELEMS

POSTPROCESS_ARCH = 120  # the SM80/SM120 branch of upstream's postprocess (mma.sync accumulator layout)


class FlashAttentionBackwardPostprocessWide(FlashAttentionBackwardPostprocess):
    """Upstream's SM120 dQ postprocess for an accumulator written by the wide dQ adds."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.arch // 10 != POSTPROCESS_ARCH // 10:
            raise ValueError(f"the wide dQ postprocess is SM120's (arch {POSTPROCESS_ARCH}), got arch {self.arch}")
        if self.tile_m * self.tile_hdim % (DQ_WIDE_ELEMS * self.num_threads):
            raise ValueError(f"a {self.tile_m}x{self.tile_hdim} dQ tile does not split into {DQ_WIDE_ELEMS}-element "
                             f"pieces over {self.num_threads} threads")

    def _setup_attributes(self):
        super()._setup_attributes()
        self.s2r_tiled_copy_dQaccum = copy_utils.tiled_copy_1d(Float32, self.num_threads, DQ_WIDE_ELEMS)


_compiled: dict = {}


def fake_dq_tensors(dtype, has_cu_seqlens: bool, has_seqused: bool, has_cu_total_m_blocks: bool) -> tuple:
    """(mdQ, the fp32 dQ accumulator, cu_seqlens, seqused, cu_total_m_blocks): fake tensors with symbolic sizes,
    as upstream compiles its postprocess (the index tensors None where absent)."""
    tensors = make_fake_bwd_tensors(dtype, has_gqa=True, varlen_q=has_cu_seqlens, varlen_k=False)
    mQ, mdQ, mdQaccum = tensors[0], tensors[5], tensors[11]
    batch = mQ.shape[0] if not has_cu_seqlens else cute.sym_int()
    batch_plus_1 = cute.sym_int()
    cu_seqlens = make_fake_tensor(cutlass.Int32, (batch_plus_1,), divisibility=1) if has_cu_seqlens else None
    seqused = make_fake_tensor(cutlass.Int32, (batch,), divisibility=1) if has_seqused else None
    cu_total = make_fake_tensor(cutlass.Int32, (batch_plus_1,), divisibility=1) if has_cu_total_m_blocks else None
    return mdQ, mdQaccum, cu_seqlens, seqused, cu_total


def batch_lookup(cu_seqlens: Optional[torch.Tensor], seqused: Optional[torch.Tensor],
                 tile_m: int) -> Optional[torch.Tensor]:
    """Upstream's batch-lookup aid for its varlen scheduler (cumulative m-blocks per sequence) where a varlen
    call has more sequences than BIN_BATCH_SEARCH_THRESH, else None."""
    if cu_seqlens is None and seqused is None:
        return None
    batch = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else seqused.shape[0]
    if batch <= BIN_BATCH_SEARCH_THRESH:
        return None
    return _compute_tile_cumsum(cu_seqlens=cu_seqlens, seqused=seqused, tile_size=tile_m)[0]


def _compile(dtype, head_dim: int, tile_m: int, num_threads: int, atom_m_dq: int, dq_swapab: bool,
             has_cu_seqlens: bool, has_seqused: bool, has_cu_total_m_blocks: bool, hdim_multiple_of: int):
    """The postprocess for any shape of these static facts (fake tensors with symbolic sizes, as upstream's)."""
    mdQ, mdQaccum, cu_seqlens, seqused, cu_total = fake_dq_tensors(dtype, has_cu_seqlens, has_seqused,
                                                                   has_cu_total_m_blocks)
    kernel = FlashAttentionBackwardPostprocessWide(dtype, head_dim, POSTPROCESS_ARCH, tile_m, num_threads, atom_m_dq,
                                                   dq_swapab, hdim_multiple_of=hdim_multiple_of)
    return cute.compile(kernel, mdQaccum, mdQ, Float32(0.0), cu_seqlens, seqused, None, cu_total,
                        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True), options="--enable-tvm-ffi")


def postprocess_dq_wide(dq_accum: torch.Tensor, dq: torch.Tensor, scale: float, cu_seqlens: Optional[torch.Tensor],
                        seqused: Optional[torch.Tensor], dtype, head_dim: int, tile_m: int, num_threads: int,
                        atom_m_dq: int, dq_swapab: bool, hdim_multiple_of: int = 32) -> None:
    """dq = scale * dq_accum in dq's dtype, for an accumulator the wide dQ adds wrote (arguments as upstream's
    `_bwd_postprocess_convert` for dQ; compiled once per static key)."""
    cu_total = batch_lookup(cu_seqlens, seqused, tile_m)
    key = (dtype, head_dim, tile_m, num_threads, atom_m_dq, dq_swapab, cu_seqlens is not None, seqused is not None,
           cu_total is not None, hdim_multiple_of)
    if key not in _compiled:
        _compiled[key] = _compile(*key)
    _compiled[key](dq_accum, dq, scale, cu_seqlens, seqused, None, cu_total)
