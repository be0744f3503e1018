"""Deterministic backward: every fp32 accumulator gets its additions in one fixed order.

The backward adds into two shared fp32 accumulators with atomics, in whatever order the CTAs happen
to arrive: dQ (every n_block CTA of a head adds its dS K into the m_block rows it visits) and, with
GQA, dK/dV (the query heads of one KV head add into its tiles). fp32 addition is not associative,
so the result changes from run to run in the last bits.

With `deterministic=True` a semaphore per accumulator tile fixes the order, as upstream's SM90 and
SM100 backwards do:

  * dQ, per (batch, head, m_block): the CTA of n_block n adds its part when the semaphore equals its
    turn, then increments it. Ascending turns (turn = n) follow the launch order of the n_block CTAs,
    so a CTA only ever waits for one launched before it. For causal attention, descending turns
    (turn = n_max(m) - 1 - n, n_max from upstream's BlockInfo) make the waits vanish: the CTA on the
    diagonal reaches an m_block first. A CTA waits there for CTAs launched after it, so the driver
    picks descending only when every n_block CTA of a head fits on the GPU at once (no deadlock).
  * dK/dV (GQA), per (batch, KV head, n_block): query head j of the group adds at turn j, in launch
    order too.

Where the wait sits: upstream's mainloop (`compute_one_m_block`) runs the dQ product with a hook
called after its first k-slice (the next Q or dO load); the wait goes into that hook, so the
section held under the semaphore is most of the dQ product plus its atomics, not the whole m_block.
On the last m_blocks the hook's load does not happen, and the wait comes before the m_block. The
release follows the m_block: a fence per thread, a CTA barrier, then one release increment.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from flash_attn.cute import barrier
from flash_attn.cute.block_info import BlockInfo


@cute.jit
def dq_turn(block_info: BlockInfo, seqlen, m_block: Int32, n_block: Int32,
            descending: cutlass.Constexpr[bool]) -> Int32:
    """This n_block's turn among the CTAs adding into m_block's dQ rows."""
    turn = n_block
    if const_expr(descending):
        _, n_block_max = block_info.get_n_block_min_max(seqlen, m_block)
        turn = n_block_max - 1 - n_block
    return turn


@cute.jit
def acquire(flag: cute.Pointer, turn: Int32) -> None:
    """Every thread of the CTA waits until the flag equals `turn` (thread 0 spins, then a barrier)."""
    tidx, _, _ = cute.arch.thread_idx()
    barrier.wait_eq(flag, tidx, 0, turn)
    cute.arch.barrier()


@cute.jit
def acquire_if(pred, flag: cute.Pointer, turn: Int32) -> None:
    if pred:
        acquire(flag, turn)


@cute.jit
def release(flag: cute.Pointer) -> None:
    """After this CTA's atomics: make them visible, then pass the turn on (flag += 1)."""
    tidx, _, _ = cute.arch.thread_idx()
    cute.arch.fence_acq_rel_gpu()
    cute.arch.barrier()
    barrier.arrive_inc(flag, tidx, 0, 1)
