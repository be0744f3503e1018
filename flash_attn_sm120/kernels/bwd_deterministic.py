"""Deterministic backward: every fp32 accumulator gets its additions in one fixed order.

The backward adds into two shared fp32 accumulators with atomics, in whatever order the CTAs happen
to arrive: dQ (every n_block CTA of a head adds its dS K into the m_block rows it visits) and, with
GQA, dK/dV (the query heads of one KV head add into its tiles). fp32 addition is not associative,
so the result changes from run to run in the last bits.

With `deterministic=True` a semaphore per accumulator tile fixes the order, as upstream's SM90 and
SM100 backwards do. A CTA waits until the tile's counter shows its turn, adds, and increments it.
Which turn a CTA gets at an m_block (driver_bwd.deterministic_plan chooses):

  * ascending, turn = n_block - n_min(m) (n_min: 0, or a window's left edge): the launch order of a
    head's n_block CTAs, so a CTA only ever waits for one launched before it. Costly at the start: CTA n
    waits for n predecessors' critical sections.
  * descending (causal, a window), turn = n_max(m) - 1 - n_block: the CTA on the diagonal (the band's
    right edge) reaches an m_block first. With the n_blocks launched shortest first
    (ReversedNBlockScheduler) every wait is again for an earlier-launched CTA; with the usual launch it
    needs a head's n_blocks resident.
  * rotated (no mask, n_blocks <= m_blocks, a head's n_blocks resident): CTA n walks the m_blocks
    cyclically from n * M // N, so no two CTAs reach an m_block at the same step, and in steady state
    a turn has come before it is asked for (rotated_m_block, rotated_turn_of).
  * dK/dV (GQA), per (batch, KV head, n_block): query head j of the group adds at turn j.

dq_split: the n_block CTAs add into dq_groups(True) = G dQ accumulators (CTA n into n % G), each with
its own turns among its own CTAs, summed in a fixed order before the postprocess. In each order above
the CTA a turn waits for then reaches the m_block G steps earlier instead of one, which is
the slack a release needs to arrive before it is waited for. It costs G - 1 more fp32 dQ
accumulators (dense problems only).

fused_turns: the wait (thread 0 spinning) right before the step's last barrier ahead of the dQ
adds, and the previous m_block's release (thread 0's increment) right after the step's barrier
ahead of the dP product, where the step's copies have landed (all of them with one dO stage): the
protocol adds no barrier of its own (the modifier step places both). With fused_fetch thread 0
reads the flag (relaxed) after the step's barrier ahead of the dV product, and at the wait only
fences when that read showed the turn (spin): the read's latency hides under the dV product.

Where the waits and releases sit (kernels/bwd_sm120.py, compute_one_m_block): upstream's step runs
the dQ product with a hook after its first k-slice (the next Q or dO load); the wait rides on that
hook, so the adds that follow are ordered. The release is either at the end of the m_block (a fence
per thread, a CTA barrier, one increment: `release`; or CUTLASS's barrier then one release
increment: `release_after_barrier`), or deferred to the next m_block's earlier hook, where the loads
the release's fence would wait for have landed. With `warp_turns` every warp waits and releases on
its own (acquire_warp / release_warp, no CTA barrier; the counter then counts warps).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from flash_attn.cute import barrier
from flash_attn.cute.block_info import BlockInfo
from flash_attn.cute.tile_scheduler import SingleTileScheduler


def dq_groups(dq_split: bool) -> int:
    """How many dQ accumulators the CTAs add into: 2 with dq_split (CTA n into n % 2), else 1."""
    return 2 if dq_split else 1


def group_of(n_block, n_blocks, groups: int):
    """(group, index in the group, CTAs in the group) of CTA n_block with `groups` dQ accumulators
    (n_block % groups; plain arithmetic, kernel and tests alike). groups = 1: (0, n_block, n_blocks)."""
    group = n_block % groups
    return group, n_block // groups, (n_blocks - group + groups - 1) // groups


def turn_in_range(n_block, n_block_min, n_block_max, descending: bool):
    """CTA n_block's turn among the CTAs [n_block_min, n_block_max) that add into an m_block (plain arithmetic:
    Int32 in the kernel, int in the tests): descending from n_block_max - 1, else ascending from n_block_min."""
    return n_block_max - 1 - n_block if descending else n_block - n_block_min


@cute.jit
def dq_turn(block_info: BlockInfo, seqlen, m_block: Int32, n_block: Int32,
            descending: cutlass.Constexpr[bool], groups: cutlass.Constexpr[int] = 1) -> Int32:
    """This n_block's turn among the CTAs of its group adding into m_block's dQ rows (ascending:
    the group's members below it, from the m_block's n_block_min, which a window's left edge raises;
    descending: those above it, up to the m_block's n_block_max). The CTAs that visit m_block (upstream's
    get_m_block_min_max) are exactly [n_block_min, n_block_max) of get_n_block_min_max: both ranges are
    the tiles that meet the mask's band (tests/test_bwd_deterministic_order.py checks it on upstream's
    BlockInfo and replays the protocol on those ranges)."""
    turn = n_block // groups
    if const_expr(descending or block_info.is_local):  # (ascending with groups > 1: no window, n_block_min 0)
        n_block_min, n_block_max = block_info.get_n_block_min_max(seqlen, m_block)
        turn = turn_in_range(n_block, n_block_min, n_block_max, descending) // groups
    return turn


@cute.jit
def acquire(flag: cute.Pointer, turn: Int32) -> None:
    """Every thread of the CTA waits until the flag equals `turn` (thread 0 spins, then a barrier)."""
    tidx, _, _ = cute.arch.thread_idx()
    barrier.wait_eq(flag, tidx, 0, turn)
    cute.arch.barrier()


@cute.jit
def wait_turn(flag: cute.Pointer, turn: Int32, state: Int32, fetched: cutlass.Constexpr[bool]) -> None:
    """acquire(), or acquire_fetched() from the early read `state` when `fetched`."""
    if const_expr(fetched):
        acquire_fetched(flag, turn, state)
    else:
        acquire(flag, turn)


@cute.jit
def call_if(pred, fn) -> None:
    """fn() when the (CTA-uniform) predicate holds: a wait or release off upstream's hooks."""
    if pred:
        fn()


@cute.jit
def release(flag: cute.Pointer) -> None:
    """After this CTA's atomics: make them visible, then pass the turn on (flag += 1)."""
    tidx, _, _ = cute.arch.thread_idx()
    cute.arch.fence_acq_rel_gpu()
    cute.arch.barrier()
    barrier.arrive_inc(flag, tidx, 0, 1)


def hook_plan(stages_q: int, stages_do: int) -> tuple:
    """Which of upstream's hooked loads the wait and the deferred release ride on, with the lookahead
    k of each (upstream's step makes that load only when step + k < m_block_max):
    ((wait's load, k), (release's load, k)). The release's hook always comes first in the step
    (dP's product with 2+ Q stages, dK's with 1), the wait's in the dQ product."""
    if stages_q == 1:
        return ("load_Q_LSE", 1), ("load_dO_dPsum", stages_do)
    return ("load_dO_dPsum", stages_do), ("load_Q_LSE", stages_q - 1)


def step_points(step, m_block_min, m_block_max, ahead: int, release_ahead: int, late: bool) -> dict:
    """Where step `step` of a walk over [m_block_min, m_block_max) waits and releases (plain
    arithmetic: Int32 in the kernel, int in the tests that replay the protocol).

    wait_first: the wait's hooked load does not happen (or the adds come late), so the wait comes
    before the step (late: after the dK product instead, at the adds). release_first /
    release_in_hook: the previous m_block's deferred release before the step, or on its hook. A
    release must precede this step's wait: when the wait comes first, so does the release (with 2/2
    Q/dO stages the wait's lookahead exceeds the release's, and the two would otherwise cross)."""
    has_previous = step > m_block_min
    if late:
        return dict(wait_first=False, release_first=has_previous & (step + release_ahead >= m_block_max),
                    release_in_hook=has_previous)
    wait_first = step + ahead >= m_block_max
    return dict(wait_first=wait_first,
                release_first=has_previous & ((step + release_ahead >= m_block_max) | wait_first),
                release_in_hook=has_previous & (step + ahead < m_block_max))


class ReversedNBlockScheduler(SingleTileScheduler):
    """Upstream's one-tile-per-CTA scheduler with the n_blocks launched last to first.

    For causal attention the last n_blocks see the fewest m_blocks, so this is shortest-first (SPT)
    launch order. With the descending dQ turns it makes every wait a wait for a CTA launched earlier:
    deadlock-free without the head's CTAs all being resident, and no CTA of a later head waits for
    the stragglers of its own head to start (what stalled the ascending launch, measured)."""

    @staticmethod
    def create(params, ctx=None, *, loc=None, ip=None):
        block_idx, head_idx, batch_idx = cute.arch.block_idx()
        return ReversedNBlockScheduler(params, (params.num_block - 1 - block_idx, head_idx, batch_idx), loc=loc, ip=ip)


def rotated_m_block(step, n_block, m_blocks, n_blocks):
    """The m_block CTA n_block visits at `step` of its walk in the rotated order: it starts at
    n_block * m_blocks // n_blocks and walks the m_blocks cyclically. Plain arithmetic, so that the
    kernel (Int32) and the tests (int) run the same formula."""
    return (step + n_block * m_blocks // n_blocks) % m_blocks


def rotated_turn_of(m_block, n_block, m_blocks, n_blocks):
    """CTA n_block's turn at m_block in the rotated order (n_blocks <= m_blocks; kernel and tests alike).

    CTA n starts at s(n) = n * M // N, so at m_block i the CTAs arrive in the order of their distance
    (i - s(n)) mod M: first the last CTA to start at or before i, n*(i) = ceil((i + 1) * N / M) - 1,
    then n*(i) - 1, ..., wrapping to N - 1. Turn = (n*(i) - n) mod N. Every CTA's first block is its
    turn 0, and a CTA at step t waits only for CTAs at steps < t: with all of a head's CTAs resident,
    and each step's release before the next step's wait (step_points), no deadlock; in steady state
    no wait at all."""
    last_started = ((m_block + 1) * n_blocks + m_blocks - 1) // m_blocks - 1
    return (last_started - n_block + n_blocks) % n_blocks


@cute.jit
def rotated(step: Int32, m_blocks: Int32, groups: cutlass.Constexpr[int] = 1) -> Int32:
    """This CTA's m_block at `step` (n_block: the CTA's x index, n_blocks: the grid's x size, as
    upstream's dense scheduler lays them out). With dQ groups each group walks its own rotation."""
    _, index, members = group_of(cute.arch.block_idx()[0], cute.arch.grid_dim()[0], groups)
    return rotated_m_block(step, index, m_blocks, members)


@cute.jit
def rotated_turn(m_block: Int32, m_blocks: Int32, groups: cutlass.Constexpr[int] = 1) -> Int32:
    _, index, members = group_of(cute.arch.block_idx()[0], cute.arch.grid_dim()[0], groups)
    return rotated_turn_of(m_block, index, m_blocks, members)


@cute.jit
def spin(flag: cute.Pointer, turn: Int32, fetched=None) -> None:
    """fused_turns' wait: thread 0 spins (acquire reads) until the flag shows the turn. No barrier of
    its own: it sits right before a barrier of the step that precedes the dQ adds.

    `fetched` (fused_fetch): thread 0's relaxed read of the flag from earlier in the step. When it
    already shows the turn, a fence.acq_rel makes that read an acquire (the PTX memory model's fence
    pattern: the predecessor's release synchronizes with the fence), with no second round trip to
    memory; otherwise the acquire spin as without it."""
    tidx, _, _ = cute.arch.thread_idx()
    if const_expr(fetched is None):
        barrier.wait_eq(flag, tidx, 0, turn)
    else:
        if tidx == 0:
            if fetched == turn:
                cute.arch.fence_acq_rel_gpu()
            else:
                barrier.wait_eq(flag, tidx, 0, turn)


@cute.jit
def release_unfenced(flag: cute.Pointer) -> None:
    """fused_turns' release: thread 0's release increment right after a barrier of the step that
    follows the dQ adds being released (cumulative over that barrier, as release_after_barrier)."""
    tidx, _, _ = cute.arch.thread_idx()
    barrier.arrive_inc(flag, tidx, 0, 1)


@dsl_user_op
def ld_relaxed(flag: cute.Pointer, *, loc=None, ip=None) -> Int32:
    """A relaxed gpu-scope read of a flag: no acquire, so no wait for it at the read (LDG.STRONG.GPU
    without the CCTL.IVALL and the scoreboard wait that an acquire adds)."""
    value = llvm.inline_asm(T.i32(), [flag.toint(loc=loc, ip=ip).ir_value()], "ld.relaxed.gpu.global.b32 $0, [$1];",
                            "=r,l", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return Int32(value)


@cute.jit
def fetch(flag: cute.Pointer, relaxed: cutlass.Constexpr[bool] = False) -> Int32:
    """Thread 0 reads the flag early (CUTLASS's Semaphore::fetch, with acquire); others get -1.

    `relaxed`: a relaxed read, consumed later by acquire_fetched. When it already shows the turn, the
    adds that follow are ordered after the predecessor's only by their control dependency on the
    value read: GPUs perform no store or reduction speculatively, but the PTX memory model does not
    promise that ordering, so no shipped plan uses it. A read that does not show the turn falls back
    to acquire reads."""
    tidx, _, _ = cute.arch.thread_idx()
    state = Int32(-1)
    if tidx == 0:
        if const_expr(relaxed):
            state = ld_relaxed(flag)
        else:
            state = barrier.ld_acquire(flag)
    return state


@cute.jit
def acquire_fetched(flag: cute.Pointer, turn: Int32, state: Int32) -> None:
    """acquire(), starting from an early fetch: no second read when the turn had already come."""
    tidx, _, _ = cute.arch.thread_idx()
    if tidx == 0:
        while state != turn:
            state = barrier.ld_acquire(flag)
    cute.arch.barrier()


@cute.jit
def release_after_barrier(flag: cute.Pointer) -> None:
    """release() as CUTLASS's Semaphore::release: a CTA barrier, then thread 0's release increment.

    Release is cumulative over the barrier, so the other threads' atomics need no fence of their own
    (release() fences every thread, which makes ptxas turn their REDs into returning ATOMGs)."""
    cute.arch.barrier()
    release_unfenced(flag)


# Warp-granular turns: every warp waits and releases on its own, with no CTA barrier. A CTA's turn
# is complete when all its warps have released (the flag counts warps: turn t begins at t * num_warps).
# Each element of the dQ tile belongs to one thread, so only the CTAs' order matters, not the warps'.

@cute.jit
def acquire_warp(flag: cute.Pointer, turn: Int32, num_warps: cutlass.Constexpr[int]) -> None:
    """Lane 0 of this warp waits until every warp of the previous turns has released (a monotone
    counter: >=, since this CTA's own faster warps may already have released), then the warp syncs."""
    if cute.arch.lane_idx() == 0:
        seen = barrier.ld_acquire(flag)
        while seen < turn * num_warps:
            seen = barrier.ld_acquire(flag)
    cute.arch.sync_warp()


@cute.jit
def release_warp(flag: cute.Pointer) -> None:
    """After this warp's adds: a warp sync (ordering its lanes' adds before lane 0), then lane 0's
    release increment (cumulative over the sync, as release_after_barrier over the CTA barrier)."""
    cute.arch.sync_warp()
    if cute.arch.lane_idx() == 0:
        barrier.red_release(flag, 1)
