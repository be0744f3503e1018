"""The one file the research loop edits: config overrides, dispatch rules, custom kernels.

Run it (the harness in prepare.py does the timing, the correctness gate and the summary):

    python scripts/experiment.py > run.log 2>&1        # add --emulate on a non-SM120 GPU

It starts as a working copy of the shipped configuration (flash_attn_sm120/configs/sm120_fwd.toml): OVERRIDES is
empty, so every problem uses the table's config. An experiment changes OVERRIDES, `config_for`,
or adds a kernel subclass (register a new family in flash_attn_sm120/kernels/__init__.py, then name
it in a FwdConfig(family=...)). See program.md for the loop.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prepare import run, sm120_impl  # noqa: E402

from flash_attn_sm120.config import FwdConfig, head_dim_bucket, mask_kind  # noqa: E402,F401

DESCRIPTION = "baseline: the shipped table (the seed lineage's kept TMA causal entries are in flash_attn_sm120/configs/sm120_fwd.toml)"
TARGET_SET = "seed"  # the problems the loop optimizes (prepare.py --set)
SUBSET = ""  # only problems whose name contains this (e.g. "d256"); "" = the whole set
REFERENCES = "upstream_sm120"  # timed beside the experiment in the same process

# (head_dim bucket, mask) -> FwdConfig; buckets 64/96/128/192/256, masks none/causal/local.
OVERRIDES: dict = {}


def config_for(problem):
    """The config to run a problem with; None = the shipped table's choice."""
    key = (head_dim_bucket(problem.head_dim, problem.dv), mask_kind(problem.causal, problem.window != (None, None)))
    return OVERRIDES.get(key)


def candidates(info):
    return [sm120_impl("experiment", config_for, info)]


if __name__ == "__main__":
    run(candidates, ["--set", TARGET_SET, "--subset", SUBSET, "--references", REFERENCES] + sys.argv[1:],
        description=__doc__)
