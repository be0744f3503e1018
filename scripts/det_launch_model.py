"""A list-scheduling model of the deterministic causal backward's launch orders (no GPU).

The causal backward runs one CTA per (head, n_block); CTA n walks m_blocks n..N-1 (N - n steps). With
descending dQ turns (kernels/bwd_deterministic.py) CTA n adds into m_block i only after CTA n + 1 has, so
two launch orders are safe:

  * shortest first (ReversedNBlockScheduler, the shipped plan): every wait is for a CTA launched earlier,
    with any number of resident CTAs; but each head's longest CTA is its last, so the grid ends on long CTAs;
  * the usual order (a head's longest CTA first): a CTA may wait for one not yet launched, so it needs a
    head's n_blocks resident (bwd_plans.deterministic_plan refuses it otherwise); the longest CTAs go first.

The model: P slots (SMs x CTAs per SM), CTAs taken in launch order as slots free; a step costs 1 plus
uniform jitter in [0, jitter); the add at m_block i waits for the predecessor's add there plus `c` (the
critical section). It prints each order's makespan over the work's lower bound (total steps / P, jitter
included), e.g. `python scripts/det_launch_model.py --n-blocks 128 --heads 16 --slots 132`.
Predictions only, and wrong where measured: it put the usual order at +4% / +2% over the shipped one at b1 s8192
/ b2 s4096 d128 causal (132 slots); prepare.py's det_fused_resident variant measured it at 0.69x / 0.92x of the
shipped order (session 38, emulated on an H100). What the model leaves out (how the hardware hands a later
head's CTAs to freed SMs while its first CTAs spin) is what costs there.
"""

from __future__ import annotations

import argparse
import heapq
import random


def makespan(order: list[tuple[int, int]], n_blocks: int, slots: int, dependent: bool = True, c: float = 0.1,
             jitter: float = 0.2, seed: int = 0) -> float:
    """Finish time of the last CTA; inf when the order deadlocks (a CTA waits for one that never launches)."""
    rng = random.Random(seed)
    done: dict = {}
    waiters: dict = {}
    events: list = []
    launched = 0
    finished = 0
    t_end = 0.0

    def launch(t: float) -> None:
        nonlocal launched
        if launched < len(order):
            head, n = order[launched]
            launched += 1
            heapq.heappush(events, (t, head, n, n))

    def complete(head: int, n: int, m: int, t: float) -> None:
        nonlocal finished, t_end
        done[(head, n, m)] = t
        for (h2, n2, m2, ready) in waiters.pop((head, n, m), []):
            complete(h2, n2, m2, max(ready, t + c))
        if m + 1 < n_blocks:
            heapq.heappush(events, (t, head, n, m + 1))
        else:
            finished += 1
            t_end = max(t_end, t)
            launch(t)

    for _ in range(min(slots, len(order))):
        launch(0.0)
    while events:
        t, head, n, m = heapq.heappop(events)
        ready = t + 1 + rng.random() * jitter
        if dependent and n + 1 <= m:
            before = done.get((head, n + 1, m))
            if before is None:
                waiters.setdefault((head, n + 1, m), []).append((head, n, m, ready))
                continue
            ready = max(ready, before + c)
        complete(head, n, m, ready)
    return t_end if finished == len(order) else float("inf")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-blocks", type=int, default=128, help="n_blocks (= m_blocks) per head")
    ap.add_argument("--heads", type=int, default=16, help="batch x heads")
    ap.add_argument("--slots", type=int, default=132, help="resident CTAs (SMs x CTAs per SM)")
    ap.add_argument("--c", type=float, default=0.1, help="critical section, in steps")
    ap.add_argument("--jitter", type=float, default=0.2, help="a step's extra time, uniform in [0, jitter)")
    args = ap.parse_args(argv)
    n, heads = args.n_blocks, args.heads
    bound = heads * n * (n + 1) / 2 * (1 + args.jitter / 2) / args.slots
    orders = {"shortest first (shipped)": [(h, b) for h in range(heads) for b in reversed(range(n))],
              "usual (longest first per head)": [(h, b) for h in range(heads) for b in range(n)]}
    for name, order in orders.items():
        span = makespan(order, n, args.slots, c=args.c, jitter=args.jitter)
        print(f"{name:32s} {span / bound:.3f} of the lower bound")
    span = makespan(orders["usual (longest first per head)"], n, args.slots, dependent=False, jitter=args.jitter)
    print(f"{'usual, no turns (no waits)':32s} {span / bound:.3f}")


if __name__ == "__main__":
    main()
