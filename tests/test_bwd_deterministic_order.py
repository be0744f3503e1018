"""The deterministic backward's dQ orderings (kernels/bwd_deterministic.py) on a CPU.

The rotated order's two formulas (rotated_m_block, rotated_turn_of) are the kernel's own code run on
ints: checked against the order's definition (turns follow arrival, by walk step, then n_block), for
freedom from deadlock under random CTA speeds, and for no waiting in lockstep. The descending order
with the reversed (shortest-first) launch is simulated with fewer resident CTAs than n_blocks. Then
driver_bwd.deterministic_plan's choices and refusals, and sm_120a codegen of the new orderings. Windows:
the CTAs' walks and the m_blocks' contributors agree (the turns' premise), and their turns never deadlock.
"""

import random

import pytest

from flash_attn_sm120 import codegen, driver_bwd
from flash_attn_sm120.kernels.bwd_deterministic import (dq_groups, group_of, hook_plan, rotated_m_block, rotated_turn_of,
                                                       step_points, turn_in_range)
from flash_attn_sm120.kernels.bwd_tiling import BwdConfig

DQ_GROUPS = dq_groups(True)
SHAPES = [(m, n) for m in range(1, 41) for n in range(1, m + 1)] + [(128, 128), (128, 17), (300, 188)]


def test_rotated_turns_follow_arrival():
    for m_blocks, n_blocks in SHAPES:  # (one test: 823 shapes)
        _check_rotated_turns(m_blocks, n_blocks)


def _check_rotated_turns(m_blocks, n_blocks):
    step_of = {}
    for n in range(n_blocks):
        walk = [rotated_m_block(t, n, m_blocks, n_blocks) for t in range(m_blocks)]
        assert sorted(walk) == list(range(m_blocks)), "a CTA visits every m_block once"
        assert rotated_turn_of(walk[0], n, m_blocks, n_blocks) == 0, "a CTA's first m_block is its turn 0"
        step_of.update({(n, i): t for t, i in enumerate(walk)})
    for i in range(m_blocks):
        by_arrival = sorted(range(n_blocks), key=lambda n: (step_of[(n, i)], n))
        assert [rotated_turn_of(i, n, m_blocks, n_blocks) for n in by_arrival] == list(range(n_blocks))
        # distinct arrival steps: in lockstep no two CTAs meet at an m_block, so nobody waits
        assert len({step_of[(n, i)] for n in range(n_blocks)}) == n_blocks


def _simulate(walks, turns, launch_order, capacity, seed):
    """Event simulation: CTAs launch in `launch_order` into `capacity` slots, walk their m_blocks at
    random speeds, and add at m_block i only when its counter equals their turn. True if all finish."""
    rng = random.Random(seed)
    counter, pos, pending, running = {}, {n: 0 for n in walks}, list(launch_order), []
    done = 0
    while pending or running:
        while pending and len(running) < capacity:
            running.append(pending.pop(0))
        progressed = False
        rng.shuffle(running)
        for n in list(running):
            if pos[n] == len(walks[n]):
                running.remove(n)
                done += 1
                progressed = True
                continue
            i = walks[n][pos[n]]
            if counter.get(i, 0) == turns[(n, i)] and rng.random() < 0.7:
                counter[i] = counter.get(i, 0) + 1
                pos[n] += 1
                progressed = True
        if not progressed and not any(counter.get(walks[n][pos[n]], 0) == turns[(n, walks[n][pos[n]])]
                                      for n in running if pos[n] < len(walks[n])):
            return False
    return done == len(walks)


@pytest.mark.parametrize("m_blocks,n_blocks", [(8, 8), (13, 5), (16, 3), (9, 9)])
def test_rotated_order_finishes_at_random_speeds(m_blocks, n_blocks):
    walks = {n: [rotated_m_block(t, n, m_blocks, n_blocks) for t in range(m_blocks)] for n in range(n_blocks)}
    turns = {(n, i): rotated_turn_of(i, n, m_blocks, n_blocks) for n in walks for i in walks[n]}
    for seed in range(20):
        assert _simulate(walks, turns, list(range(n_blocks)), n_blocks, seed)


def _causal(n_blocks):
    """Causal, square, m_block == n_block: CTA n walks m_blocks n..N-1; descending turns at m_block i."""
    walks = {n: list(range(n, n_blocks)) for n in range(n_blocks)}
    return walks, {(n, i): i - n for n in walks for i in walks[n]}  # n_max(i) - 1 - n, n_max(i) = i + 1


def test_descending_turns_need_the_reversed_launch_when_not_resident():
    walks, turns = _causal(12)
    for seed in range(10):  # shortest first: every wait is for a CTA launched earlier
        assert _simulate(walks, turns, list(reversed(range(12))), capacity=4, seed=seed)
    # the ascending launch deadlocks once a head's n_blocks outnumber the resident CTAs (why it needed them)
    assert not _simulate(walks, turns, list(range(12)), capacity=4, seed=0)


def _protocol(walk, turn_at, stages, late, deferred=True):
    """One CTA's waits and releases in program order, as compute_one_m_block places them: the
    kernel's own hook_plan / step_points, and upstream's step order (the release's hooked load, then
    the wait's; a hooked load happens only when step + k < m_block_max)."""
    (_, ahead), (_, release_ahead) = hook_plan(*stages)
    m_min, m_max = 0, len(walk)  # steps of the walk (the kernel's m_block_min .. m_block_max)
    ops = []
    for step, m in enumerate(walk):
        pts = step_points(step, m_min, m_max, ahead, release_ahead, late)
        previous = walk[step - 1] if step else None
        if deferred and pts["release_first"]:
            ops.append(("release", previous))
        if pts["wait_first"]:
            ops.append(("wait", m, turn_at(m)))
        if deferred and step + release_ahead < m_max and pts["release_in_hook"]:
            ops.append(("release", previous))
        if not late and step + ahead < m_max:
            ops.append(("wait", m, turn_at(m)))
        if late:
            ops.append(("wait", m, turn_at(m)))
        if not deferred or step == m_max - 1:
            ops.append(("release", m))
    return ops


def _replay(programs, launch_order, capacity):
    """Counters only grow, so whether a set of CTAs can finish does not depend on timing: run every
    resident CTA as far as it gets, launch into freed slots, repeat. True if all finish."""
    flag, pc, pending, running = {}, {n: 0 for n in programs}, list(launch_order), []
    while True:
        while pending and len(running) < capacity:
            running.append(pending.pop(0))
        moved = False
        for n in list(running):
            ops = programs[n]
            while pc[n] < len(ops):
                op = ops[pc[n]]
                if op[0] == "wait" and flag.get(op[1], 0) != op[2]:
                    break
                if op[0] == "release":
                    assert op[1] is not None, "a release of the m_block before the walk"
                    flag[op[1]] = flag.get(op[1], 0) + 1
                pc[n] += 1
                moved = True
            if pc[n] == len(ops):
                running.remove(n)
                moved = True  # (a CTA with an empty walk, a window's, finishes without an op)
        if not pending and not running:
            return True
        if not moved:
            return False


STAGES = [(1, 1), (2, 1), (2, 2), (1, 2)]


@pytest.mark.parametrize("stages", STAGES)
@pytest.mark.parametrize("late,deferred", [(False, True), (True, True), (False, False)])
def test_rotated_protocol_never_deadlocks(stages, late, deferred):
    """Every stage count, M <= 24, N <= M, all of a head's CTAs resident (the plan's condition).
    (This caught the 2/2-stage crossing: a wait before the step while the release still rode a hook.)"""
    for m_blocks in range(1, 25):
        for n_blocks in range(1, m_blocks + 1):
            programs = {n: _protocol([rotated_m_block(t, n, m_blocks, n_blocks) for t in range(m_blocks)],
                                     lambda i, n=n: rotated_turn_of(i, n, m_blocks, n_blocks), stages, late, deferred)
                        for n in range(n_blocks)}
            assert _replay(programs, list(range(n_blocks)), n_blocks), (stages, m_blocks, n_blocks)


@pytest.mark.parametrize("stages", STAGES)
@pytest.mark.parametrize("late", [False, True])
def test_causal_and_ascending_protocols_never_deadlock(stages, late):
    """Causal walks (CTA n from its diagonal block): descending turns with the reversed launch, and
    ascending turns with the usual launch, with fewer resident CTAs than n_blocks."""
    for n_blocks in (1, 2, 5, 12):
        walks = {n: list(range(n, n_blocks)) for n in range(n_blocks)}
        descending = {n: _protocol(walks[n], lambda i, n=n: i - n, stages, late) for n in walks}
        ascending = {n: _protocol(walks[n], lambda i, n=n: n, stages, late) for n in walks}
        for capacity in (1, 3, n_blocks):
            assert _replay(descending, list(reversed(range(n_blocks))), capacity)
            assert _replay(ascending, list(range(n_blocks)), capacity)


CFG = BwdConfig(256, 64, 64, 2, 1, atom_m_sdp=2, atom_n_dkv=4, atom_m_dq=2)
NONE = (None, None, None, None)


def test_plan_per_problem():
    plan = driver_bwd.deterministic_plan(132, CFG, True, 8192, 8192, NONE)
    assert plan["dq_descending"] and plan["reverse_n_blocks"] and not plan["dq_rotated"]
    plan = driver_bwd.deterministic_plan(132, CFG, True, 64 * 500, 64 * 500, NONE)  # more than resident: same
    assert plan["dq_descending"] and plan["reverse_n_blocks"]
    plan = driver_bwd.deterministic_plan(132, CFG, False, 8192, 8192, NONE)
    assert plan["dq_rotated"] and not plan["reverse_n_blocks"] and not plan["dq_descending"]
    for sq, sk in ((1000, 2000), (64 * 140, 64 * 140)):  # more n_blocks than m_blocks / than resident
        assert not any(driver_bwd.deterministic_plan(132, CFG, False, sq, sk, NONE)[f]
                       for f in ("dq_rotated", "reverse_n_blocks", "dq_descending"))
    varlen = (object(), object(), None, None)
    assert not driver_bwd.deterministic_plan(132, CFG, False, 8192, 8192, varlen)["dq_rotated"]
    plan = driver_bwd.deterministic_plan(132, CFG, True, 8192, 8192, varlen)
    assert not plan["reverse_n_blocks"] and not plan["dq_descending"]
    assert not driver_bwd.deterministic_plan(132, CFG, False, 8192, 8192, (None, None, object(), None))["dq_rotated"]
    plan = driver_bwd.deterministic_plan(132, CFG, True, 100, 256, (None, None, None, object()))  # seqused_k
    assert not plan["dq_descending"] and not plan["reverse_n_blocks"]
    for c in (True, False):  # the turns on the step's own barriers; upstream's step: CUTLASS's release, deferred
        plan = driver_bwd.deterministic_plan(132, CFG, c, 4096, 4096, NONE)
        assert plan["fused_turns"] and not (plan["barrier_release"] or plan["release_deferred"] or plan["dq_split"])
        plan = driver_bwd.deterministic_plan(132, CFG, c, 4096, 4096, NONE, modifier_step=False)
        assert plan["barrier_release"] and plan["release_deferred"] and not plan["fused_turns"]


@pytest.mark.parametrize("causal,flags,sq,sk,match", [
    (True, dict(dq_rotated=True), 4096, 4096, "rotated"),
    (False, dict(dq_rotated=True), 1000, 2000, "rotated"),
    (False, dict(dq_rotated=True), 64 * 140, 64 * 140, "rotated"),
    (False, dict(reverse_n_blocks=True), 64 * 140, 64 * 140, "reversed"),
    (True, dict(dq_descending=True), 64 * 140, 64 * 140, "descending"),
    (False, dict(dq_descending=True, reverse_n_blocks=True), 64 * 140, 64 * 140, "reversed"),
])
def test_forced_orders_that_can_deadlock_are_refused(causal, flags, sq, sk, match):
    with driver_bwd.force_deterministic_plan(**flags), pytest.raises(ValueError, match=match):
        driver_bwd.deterministic_plan(132, CFG, causal, sq, sk, NONE)
    with driver_bwd.force_deterministic_plan(dq_descending=True, reverse_n_blocks=True), \
            pytest.raises(ValueError, match="seqused_k"):
        driver_bwd.deterministic_plan(132, CFG, True, 100, 256, (None, None, None, object()))
    with pytest.raises(ValueError, match="unknown"):
        driver_bwd.force_deterministic_plan(dq_sideways=True)


@pytest.mark.skipif(codegen.find_tool("cuobjdump") is None, reason="needs cuobjdump")
@pytest.mark.parametrize("causal,ordering", [
    (False, dict(dq_rotated=True, barrier_release=True, release_deferred=True)),
    (True, dict(dq_descending=True, reverse_n_blocks=True, barrier_release=True, release_deferred=True)),
    (False, dict(dq_rotated=True, barrier_release=True, release_deferred=True, fetch_early=True, fetch_relaxed=True)),
    (True, dict(dq_descending=True, reverse_n_blocks=True, release_deferred=True, warp_turns=True)),
    (False, dict(dq_rotated=True, barrier_release=True, release_deferred=True, late_dq_adds=True)),
    (False, dict(dq_rotated=True, barrier_release=True, release_deferred=True, diag_no_wait=True)),
    (True, dict(dq_descending=True, reverse_n_blocks=True, diag_no_sync=True)),
    (False, dict(dq_rotated=True, dq_split=True, fused_turns=True)),
    (True, dict(dq_descending=True, reverse_n_blocks=True, dq_split=True, fused_turns=True)),
])
def test_orderings_compile_for_sm120a_without_spills_and_keep_reds(causal, ordering):
    """The barrier release keeps the dQ adds fire-and-forget REDs (a fence per thread makes ptxas
    turn them into returning ATOMGs), and the orderings add no spills to the d128 entry's tile."""
    res, hist, _ = codegen.inspect_cubin(codegen.compile_bwd_cubin(CFG, 128, causal=causal, deterministic=True,
                                                                   ordering=ordering)[0])
    assert res["stack"] == 0 and res["local"] == 0 and hist.get("LDL", 0) == 0, res
    assert hist.get("REDG", 0) >= 32 and hist.get("ATOMG", 0) == 0, hist


def test_timing_diagnostics_are_refused_outside_the_deterministic_kernel():
    """diag_no_wait / diag_no_sync time the ordered kernel without its waits; they make no sense (and
    must not silently run) on the default kernel, and they exclude each other."""
    from flash_attn_sm120.kernels.bwd_sm120 import FlashAttentionBackwardSm120Tuned
    import cutlass

    with pytest.raises(ValueError, match="diagnostics of the deterministic kernel"):
        FlashAttentionBackwardSm120Tuned(cutlass.BFloat16, 128, 128, 1, CFG, diag_no_wait=True)
    with pytest.raises(ValueError, match="alternatives"):
        FlashAttentionBackwardSm120Tuned(cutlass.BFloat16, 128, 128, 1, CFG, deterministic=True,
                                         diag_no_wait=True, diag_no_sync=True)


def _grouped_rotated(m_blocks, n_blocks, groups):
    """dq_split's rotated order as the kernel computes it: CTA n in group n % G walks its group's
    rotation (bwd_deterministic.rotated / rotated_turn with group_of). Per CTA: (group, walk, turns)."""
    out = {}
    for n in range(n_blocks):
        g, j, members = group_of(n, n_blocks, groups)
        walk = [rotated_m_block(t, j, m_blocks, members) for t in range(m_blocks)]
        out[n] = (g, walk, {i: rotated_turn_of(i, j, m_blocks, members) for i in walk})
    return out


@pytest.mark.parametrize("m_blocks,n_blocks", [(m, n) for m in range(1, 26) for n in range(1, m + 1)][::3]
                         + [(64, 64), (128, 128), (128, 17)])
def test_grouped_rotated_turns_follow_arrival_with_slack(m_blocks, n_blocks):
    """Each dQ group is its own rotated order over its own CTAs: within a group the turns at an
    m_block follow arrival, every group member visits it once, and (the point of the split) the CTA a
    turn waits for arrived at least G steps earlier when the group has M / G members or fewer."""
    plan = _grouped_rotated(m_blocks, n_blocks, DQ_GROUPS)
    for g in range(DQ_GROUPS):
        members = [n for n in plan if plan[n][0] == g]
        assert len(members) == group_of(g, n_blocks, DQ_GROUPS)[2]
        for i in range(m_blocks):
            arrival = sorted(members, key=lambda n: plan[n][1].index(i))
            assert [plan[n][2][i] for n in arrival] == list(range(len(members)))
            steps = [plan[n][1].index(i) for n in arrival]
            if len(members) * DQ_GROUPS <= m_blocks:
                assert all(b - a >= DQ_GROUPS for a, b in zip(steps, steps[1:])), (g, i, steps)


def test_grouped_orders_never_deadlock():
    """dq_split with the fused protocol (release the previous m_block, wait for this one, release the
    last at the walk's end): rotated (all resident) and causal descending with the reversed launch
    and ascending with the usual launch (few resident CTAs); counters are per (group, m_block)."""
    def fused(n, walk, turn):
        ops = []
        for step, i in enumerate(walk):
            if step:
                ops.append(("release", (n % DQ_GROUPS, walk[step - 1])))
            ops.append(("wait", (n % DQ_GROUPS, i), turn(i)))
        return ops + ([("release", (n % DQ_GROUPS, walk[-1]))] if walk else [])

    for m_blocks in range(1, 19):
        for n_blocks in range(1, m_blocks + 1):
            plan = _grouped_rotated(m_blocks, n_blocks, DQ_GROUPS)
            programs = {n: fused(n, plan[n][1], plan[n][2].__getitem__) for n in plan}
            assert _replay(programs, list(range(n_blocks)), n_blocks), (m_blocks, n_blocks)
    for n_blocks in (1, 2, 5, 12):
        walks = {n: list(range(n, n_blocks)) for n in range(n_blocks)}  # n_max(i) = i + 1
        descending = {n: fused(n, walks[n], lambda i, n=n: (i - n) // DQ_GROUPS) for n in walks}
        ascending = {n: fused(n, walks[n], lambda i, n=n: n // DQ_GROUPS) for n in walks}
        for capacity in (1, 3, n_blocks):
            assert _replay(descending, list(reversed(range(n_blocks))), capacity)
            assert _replay(ascending, list(range(n_blocks)), capacity)


def test_split_and_fused_flags_need_the_modifier_step_and_a_dense_problem():
    from flash_attn_sm120.kernels.bwd_sm120 import FlashAttentionBackwardSm120Tuned
    import cutlass

    for flag in ("dq_split", "fused_turns"):
        with pytest.raises(ValueError, match="modifier step"):
            FlashAttentionBackwardSm120Tuned(cutlass.BFloat16, 128, 128, 1, CFG, deterministic=True, **{flag: True})
    with driver_bwd.force_deterministic_plan(dq_split=True), pytest.raises(ValueError, match="dense dQ"):
        driver_bwd.deterministic_plan(132, CFG, False, 1000, 1000, (object(), object(), None, None))
    assert driver_bwd.kernel_for(cutlass.BFloat16, 128, 128, 1, CFG, driver_bwd.Mods(), deterministic=True,
                                 dq_split=True).dq_groups == DQ_GROUPS > 1


@pytest.mark.skipif(codegen.find_tool("cuobjdump") is None, reason="needs cuobjdump")
def test_fused_fetch_fence_turns_the_adds_into_returning_atomics():
    """fused_fetch's fence.acq_rel (thread 0 only, when its early read showed the turn) is enough for
    ptxas to make every dQ add a returning ATOMG (as a per-thread fence does); pinned so that a
    timing of fused_fetch is read with that in mind. Spill-free all the same."""
    res, hist, _ = codegen.inspect_cubin(codegen.compile_bwd_cubin(
        CFG, 128, causal=False, deterministic=True, ordering=dict(dq_rotated=True, fused_turns=True, fused_fetch=True))[0])
    assert res["stack"] == 0 and res["local"] == 0 and hist.get("LDL", 0) == 0, res
    assert hist.get("ATOMG", 0) >= 32, hist


@pytest.mark.skipif(codegen.find_tool("cuobjdump") is None, reason="needs cuobjdump")
def test_fused_turns_gqa_epilogue_keeps_reds():
    """With GQA the ordered dK/dV epilogue releases too: under fused_turns it takes the barrier release,
    so its adds (and the dQ adds) stay REDs (a review caught the fenced release there)."""
    res, hist, _ = codegen.inspect_cubin(codegen.compile_bwd_cubin(
        CFG, 128, causal=True, deterministic=True, qhead_per_kvhead=2,
        ordering=dict(dq_descending=True, reverse_n_blocks=True, fused_turns=True))[0])
    assert res["stack"] == 0 and hist.get("ATOMG", 0) == 0 and hist.get("REDG", 0) >= 96, hist


# ------------------------------------------------------------------------------------------------
# Windows (a user score_mod with deterministic=True: no fixed point, so turns; session 38)
# ------------------------------------------------------------------------------------------------

def _windows(rng, count):
    """Resolved masks as upstream's _resolve_causal_local_window leaves them: (causal, left, right), None an
    unbounded side; one negative side is a real bound (upstream's meaning, e.g. right = -1: keys strictly
    before the diagonal)."""
    fixed = [(True, None, None), (False, 0, 0), (False, None, -1), (False, -1, None), (False, 100, 0),
             (False, 0, 100), (False, 37, 5), (False, 200, None), (False, None, 3)]
    drawn = [(False, rng.choice([None, rng.randint(-20, 300)]), rng.choice([None, rng.randint(-20, 300)]))
             for _ in range(count)]
    both_negative = lambda w: w[1] is not None and w[2] is not None and w[1] < 0 and w[2] < 0  # no window  # noqa: E731
    return fixed + [w for w in drawn if w != (False, None, None) and not both_negative(w)]


def _window_walks(tile_m, tile_n, sq, sk, causal, left, right, grid_extra=0):
    """Each CTA's walk (upstream's BlockInfo.get_m_block_min_max) and the m_blocks' contributors
    (get_n_block_min_max): upstream's own methods run on ints (their undecorated functions), as the kernel
    builds its BlockInfo (kernels/bwd_sm120.py: the mask's windows, no pack_gqa, no split). grid_extra: CTAs
    past the keys (seqused_k: the grid is sized on the storage, sk the used keys), which walk as well."""
    from types import SimpleNamespace

    from flash_attn.cute.block_info import BlockInfo

    info = BlockInfo(tile_m, tile_n, causal, left is not None or right is not None, False, left, right)
    seqlen = SimpleNamespace(seqlen_q=sq, seqlen_k=sk)
    n_range = lambda m: tuple(BlockInfo.get_n_block_min_max.__wrapped__(info, seqlen, m))  # noqa: E731
    m_range = lambda n: tuple(BlockInfo.get_m_block_min_max.__wrapped__(info, seqlen, n))  # noqa: E731
    n_blocks, m_blocks = -(-sk // tile_n), -(-sq // tile_m)
    walks = {n: list(range(*m_range(n))) for n in range(n_blocks + grid_extra)}
    return walks, n_range, m_blocks


def test_the_walks_and_the_contributors_of_a_window_agree():
    """The turns count the CTAs in [n_block_min, n_block_max) of an m_block; a CTA that visits the m_block
    outside that range, or one inside it that does not, would wait forever (or leave a turn untaken). Both
    ranges are the tiles that meet the mask's band, so they agree: checked over windows (one-sided, negative
    sides), tiles and sequence lengths, against the band itself computed element by element where small."""
    rng = random.Random(38)
    for causal, left, right in _windows(rng, 40):
        for tile_m, tile_n in ((64, 64), (32, 64), (64, 128), (32, 128), (128, 64)):
            for sq, sk in ((200, 200), (130, 517), (517, 130), (64, 64), (1, 300), (333, 1)):
                walks, n_range, m_blocks = _window_walks(tile_m, tile_n, sq, sk, causal, left, right)
                for m in range(m_blocks):
                    visitors = [n for n, walk in walks.items() if m in walk]
                    lo, hi = n_range(m)
                    assert visitors == list(range(lo, hi)), (causal, left, right, tile_m, tile_n, sq, sk, m)
                band = left is None or right is None or left + right >= 0  # (else no element: the ranges are per side)
                if band and sq * sk <= 200 * 200:  # the band, element by element (full tiles: padded rows and keys count)
                    offset = sk - sq
                    for n, walk in walks.items():
                        for m in range(m_blocks):
                            meets = any((causal and j <= i + offset) or (not causal and
                                        (right is None or j <= i + offset + right) and
                                        (left is None or j >= i + offset - left))
                                        for i in range(m * tile_m, (m + 1) * tile_m)
                                        for j in range(n * tile_n, (n + 1) * tile_n))
                            assert (m in walk) == meets, (causal, left, right, tile_m, tile_n, sq, sk, m, n)


@pytest.mark.parametrize("stages", STAGES)
@pytest.mark.parametrize("late", [False, True])
def test_window_turns_never_deadlock(stages, late):
    """A window's turns as the plan takes them: descending (n_max(m) - 1 - n) with the reversed launch
    (dense calls), ascending from the window's left edge (n - n_min(m)) with the usual launch (varlen,
    seqused_k), each with fewer resident CTAs than n_blocks; and every turn of an m_block is taken once."""
    rng = random.Random(7)
    for causal, left, right in _windows(rng, 12):
        for sq, sk in ((640, 640), (300, 700), (700, 300)):
            walks, n_range, _ = _window_walks(64, 64, sq, sk, causal, left, right)
            descending = {n: _protocol(w, lambda i, n=n: turn_in_range(n, *n_range(i), True), stages, late)
                          for n, w in walks.items()}
            ascending = {n: _protocol(w, lambda i, n=n: turn_in_range(n, *n_range(i), False), stages, late)
                         for n, w in walks.items()}
            n_blocks = len(walks)
            for capacity in (1, 3, n_blocks):
                assert _replay(descending, list(reversed(range(n_blocks))), capacity), (causal, left, right, sq, sk)
                assert _replay(ascending, list(range(n_blocks)), capacity), (causal, left, right, sq, sk)
            if any(n_range(i)[0] > 0 for w in walks.values() for i in w):  # the turns must count from the edge
                plain = {n: _protocol(w, lambda i, n=n: n, stages, late) for n, w in walks.items()}
                assert not _replay(plain, list(range(n_blocks)), n_blocks), (left, right, sq, sk)
            # seqused_k: two more CTAs past the used keys (the ascending order's case) take turns after the others
            used, _, _ = _window_walks(64, 64, sq, sk, causal, left, right, grid_extra=2)
            ascending = {n: _protocol(w, lambda i, n=n: turn_in_range(n, *n_range(i), False), stages, late)
                         for n, w in used.items()}
            for capacity in (1, 3, len(used)):
                assert _replay(ascending, list(range(len(used))), capacity), (causal, left, right, sq, sk)
            after = {}
            for n, w in used.items():
                for i in w:
                    after.setdefault(i, []).append(turn_in_range(n, *n_range(i), False))
            assert all(sorted(t) == list(range(len(t))) for t in after.values())
            turns = {}
            for n, w in walks.items():
                for i in w:
                    turns.setdefault(i, []).append((turn_in_range(n, *n_range(i), True),
                                                    turn_in_range(n, *n_range(i), False)))
            for t in turns.values():  # each order's turns at an m_block: 0 .. k-1, each taken once
                assert sorted(d for d, _ in t) == sorted(a for _, a in t) == list(range(len(t)))


def test_plan_for_a_window_with_a_user_score_mod():
    """No fixed point (a user score_mod_bwd has no bound), so turns: descending with the reversed launch
    for a dense call, ascending (counted from the window's edge in the kernel) with cu_seqlens_k or
    seqused_k; dq_split is refused with a window. Without a score_mod: dense windows the same descending
    turns, varlen ones fixed point."""
    plan = driver_bwd.deterministic_plan(132, CFG, False, 4096, 4096, NONE, local=True)
    assert plan["dq_descending"] and plan["reverse_n_blocks"] and plan["fused_turns"] and not plan["dq_fixed_point"]
    for index in ((object(), object(), None, None), (None, None, None, object())):
        plan = driver_bwd.deterministic_plan(132, CFG, False, 4096, 4096, index, local=True)
        assert not (plan["dq_descending"] or plan["reverse_n_blocks"] or plan["dq_rotated"]) and plan["fused_turns"]
    # without a user score_mod: dense windows keep the descending turns (faster than fixed point, session 38),
    # varlen and seqused ones take fixed point
    plan = driver_bwd.deterministic_plan(132, CFG, False, 4096, 4096, NONE, local=True, fixed_point=True)
    assert plan["dq_descending"] and plan["reverse_n_blocks"] and not plan["dq_fixed_point"]
    for index in ((object(), object(), None, None), (None, None, None, object())):
        assert driver_bwd.deterministic_plan(132, CFG, False, 4096, 4096, index, local=True,
                                             fixed_point=True)["dq_fixed_point"]
    with driver_bwd.force_deterministic_plan(dq_descending=True, reverse_n_blocks=True, dq_split=True,
                                             fused_turns=True), pytest.raises(ValueError, match="dq_split"):
        driver_bwd.deterministic_plan(132, CFG, False, 4096, 4096, NONE, local=True)
