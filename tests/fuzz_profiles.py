"""Fuzz profiles (`fast`, `deep`), the run's seed and shard: imported by tests/conftest.py.

A profile is a hypothesis settings profile (examples per static case, no deadline since a first
example compiles, failure blobs printed for replay) plus a `FuzzPlan`: how many static cases
(compile keys) the run draws and how large the dynamic sizes get. Selection, first match wins:

    pytest --hypothesis-profile deep ...          (hypothesis' own option)
    FLASH_ATTN_SM120_FUZZ=deep pytest ...         (this package's variable)
    neither: the plan is `fast` and hypothesis keeps its default profile

Other variables (all optional):
    FLASH_ATTN_SM120_FUZZ_SEED=<int>|random   seed of the static cases and of hypothesis (default 0);
                                              printed in the header and the summary
    FLASH_ATTN_SM120_FUZZ_SHARD=i/n           run only static cases with index % n == i
    FLASH_ATTN_SM120_FUZZ_PLAN=k=v,...        override plan fields, e.g. fwd_cases=40,fwd_examples=4
    FLASH_ATTN_SM120_FUZZ_SHRINK=1            let hypothesis shrink a failure (off by default: shrinking
                                              reruns a failing GPU example for up to minutes)
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, fields, replace

FUZZ_ENV = "FLASH_ATTN_SM120_FUZZ"
SEED_ENV = "FLASH_ATTN_SM120_FUZZ_SEED"
SHARD_ENV = "FLASH_ATTN_SM120_FUZZ_SHARD"
PLAN_ENV = "FLASH_ATTN_SM120_FUZZ_PLAN"
SHRINK_ENV = "FLASH_ATTN_SM120_FUZZ_SHRINK"


@dataclass(frozen=True)
class FuzzPlan:
    name: str
    fwd_cases: int  # static forward cases (each compiles once); raised to the number of paths
    bwd_cases: int  # static backward cases (forward + upstream backward compiles)
    fwd_examples: int  # hypothesis examples per forward case
    bwd_examples: int
    max_seqlen: int  # seqlen_q / seqlen_k upper bound, forward
    max_seqlen_bwd: int
    max_batch: int
    max_kv_heads: int
    fwd_work: int  # cap on sum(h * sq * sk) per example (reference cost)
    bwd_work: int
    cpu_examples: int  # CPU property tests (tests/test_properties.py)
    # deterministic=True backward cases (fuzz_cases.DETERMINISTIC: one per dQ ordering first) and their examples
    det_cases: int = 0
    det_examples: int = 0


PLANS = {
    # ~27 compile keys: about 4-5 minutes on one H200 in emulation, compiles included
    "fast": FuzzPlan("fast", 20, 4, 8, 4, 2048, 1024, 4, 3, 1 << 25, 1 << 23, 200, det_cases=4, det_examples=3),
    # ~120 compile keys, ~3100 examples: shard it (FLASH_ATTN_SM120_FUZZ_SHARD) over GPUs or commands
    "deep": FuzzPlan("deep", 96, 16, 30, 12, 3072, 1536, 5, 4, 1 << 26, 1 << 24, 2000, det_cases=17, det_examples=8),
}


def _register_hypothesis_profiles() -> None:
    try:
        from hypothesis import HealthCheck, settings
    except ImportError:  # hypothesis is a dev dependency; without it the fuzz tests are not collected
        return
    common = dict(
        deadline=None,
        print_blob=True,
        phases=_phases(),
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture,
                               HealthCheck.filter_too_much],
    )
    for name, plan in PLANS.items():
        settings.register_profile(name, max_examples=plan.fwd_examples, **common)
    wanted = os.environ.get(FUZZ_ENV)
    if wanted:
        if wanted not in PLANS:
            raise ValueError(f"{FUZZ_ENV}={wanted!r}: choose one of {sorted(PLANS)}")
        settings.load_profile(wanted)


def _phases():
    from hypothesis import Phase

    phases = [Phase.explicit, Phase.reuse, Phase.generate]
    if os.environ.get(SHRINK_ENV, "0") not in ("0", ""):
        phases.append(Phase.shrink)
    return phases


def gpu_settings(max_examples: int):
    """Settings for one GPU fuzz test (explicit, so they hold whatever profile is loaded)."""
    from hypothesis import HealthCheck, settings

    return settings(
        max_examples=max_examples,
        deadline=None,  # a first example compiles for seconds
        print_blob=True,
        phases=_phases(),
        suppress_health_check=list(HealthCheck),
    )


def active_profile() -> str:
    """'fast' or 'deep': hypothesis' loaded profile if it is one of ours, else the variable, else fast."""
    try:
        from hypothesis import settings

        current = settings._current_profile  # set by --hypothesis-profile or load_profile
    except ImportError:
        current = None
    if current in PLANS:
        return current
    return os.environ.get(FUZZ_ENV) or "fast"


def active_plan() -> FuzzPlan:
    plan = PLANS[active_profile()]
    overrides = os.environ.get(PLAN_ENV, "").strip()
    if overrides:
        known = {f.name for f in fields(FuzzPlan)} - {"name"}
        values = {}
        for item in overrides.split(","):
            key, _, value = item.partition("=")
            if key.strip() not in known:
                raise ValueError(f"{PLAN_ENV}: unknown field {key!r} (known: {sorted(known)})")
            values[key.strip()] = int(value)
        plan = replace(plan, **values)
    return plan


def _resolve_seed() -> int:
    raw = os.environ.get(SEED_ENV, "0").strip()
    if raw == "random":
        seed = random.SystemRandom().randrange(2**31)
        os.environ[SEED_ENV] = str(seed)  # one seed per run, also for child processes
        return seed
    return int(raw)


def shard() -> tuple[int, int]:
    raw = os.environ.get(SHARD_ENV, "0/1")
    i, _, n = raw.partition("/")
    i, n = int(i), int(n or 1)
    if not 0 <= i < n:
        raise ValueError(f"{SHARD_ENV}={raw!r}: need i/n with 0 <= i < n")
    return i, n


FUZZ_SEED = _resolve_seed()
_register_hypothesis_profiles()
