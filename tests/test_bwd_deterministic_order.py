"""The deterministic backward's dQ orderings (kernels/bwd_deterministic.py) on a CPU.

The rotated order's two formulas (rotated_m_block, rotated_turn_of) are the kernel's own code run on
ints: checked against the order's definition (turns follow arrival, by walk step, then n_block), for
freedom from deadlock under random CTA speeds, and for no waiting in lockstep. The descending order
with the reversed (shortest-first) launch is simulated with fewer resident CTAs than n_blocks. Then
driver_bwd.deterministic_plan's choices and refusals, and sm_120a codegen of the new orderings.
"""

import random

import pytest

from flash_attn_sm120 import codegen, driver_bwd
from flash_attn_sm120.kernels.bwd_deterministic import rotated_m_block, rotated_turn_of
from flash_attn_sm120.kernels.bwd_sm120 import BwdConfig

SHAPES = [(m, n) for m in range(1, 41) for n in range(1, m + 1)] + [(128, 128), (128, 17), (300, 188)]


@pytest.mark.parametrize("m_blocks,n_blocks", SHAPES)
def test_rotated_turns_follow_arrival(m_blocks, n_blocks):
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
    assert all(driver_bwd.deterministic_plan(132, CFG, c, 4096, 4096, NONE)[f]
               for c in (True, False) for f in ("barrier_release", "release_deferred"))


@pytest.mark.parametrize("causal,flags,sq,sk,match", [
    (True, dict(dq_rotated=True), 4096, 4096, "rotated"),
    (False, dict(dq_rotated=True), 1000, 2000, "rotated"),
    (False, dict(dq_rotated=True), 64 * 140, 64 * 140, "rotated"),
    (False, dict(reverse_n_blocks=True), 64 * 140, 64 * 140, "reversed"),
    (True, dict(dq_descending=True), 64 * 140, 64 * 140, "descending"),
])
def test_forced_orders_that_can_deadlock_are_refused(causal, flags, sq, sk, match):
    with driver_bwd.force_deterministic_plan(**flags), pytest.raises(ValueError, match=match):
        driver_bwd.deterministic_plan(132, CFG, causal, sq, sk, NONE)
    with pytest.raises(ValueError, match="unknown"):
        driver_bwd.force_deterministic_plan(dq_sideways=True)


@pytest.mark.skipif(codegen.find_tool("cuobjdump") is None, reason="needs cuobjdump")
@pytest.mark.parametrize("causal,ordering", [
    (False, dict(dq_rotated=True, barrier_release=True, release_deferred=True)),
    (True, dict(dq_descending=True, reverse_n_blocks=True, barrier_release=True, release_deferred=True)),
    (False, dict(dq_rotated=True, barrier_release=True, release_deferred=True, fetch_early=True, fetch_relaxed=True)),
    (True, dict(dq_descending=True, reverse_n_blocks=True, release_deferred=True, warp_turns=True)),
    (False, dict(dq_rotated=True, barrier_release=True, release_deferred=True, late_dq_adds=True)),
])
def test_orderings_compile_for_sm120a_without_spills_and_keep_reds(causal, ordering):
    """The barrier release keeps the dQ adds fire-and-forget REDs (a fence per thread makes ptxas
    turn them into returning ATOMGs), and the orderings add no spills to the d128 entry's tile."""
    res, hist, _ = codegen.inspect_cubin(codegen.compile_bwd_cubin(CFG, 128, causal=causal, deterministic=True,
                                                                   ordering=ordering)[0])
    assert res["stack"] == 0 and res["local"] == 0 and hist.get("LDL", 0) == 0, res
    assert hist.get("REDG", 0) >= 32 and hist.get("ATOMG", 0) == 0, hist
