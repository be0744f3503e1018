"""Named forward configs against the table's entries, per (head dim, mask) group, side by side (GPU).

The research loop's quickest question: does config X beat the shipped entry on the problems of its
group? Each --group names a head-dim bucket, a mask and configs (FwdConfig names); the run times the
table's entries of that (bucket, mask) and the named configs on the set's problems of the group, in
one prepare.py run (occupancy verified at every compile, every candidate gated against fp32), with
the set's references:

  FLASH_ATTN_SM120_EMULATE=1 python scripts/bench_configs.py --group 64:none=tma-w4-128x64-s1,tma-w4-128x48-s2 \\
      --group 96:none=tma-w4-128x32-s1 --reps 10 --no-ceiling --json out.json
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import prepare  # noqa: E402

from flash_attn_sm120.config import config_from_name, load_fwd_table  # noqa: E402


def parse_group(text: str) -> tuple[tuple[int, str], list]:
    """"64:none=NAME,NAME" -> ((64, "none"), [FwdConfig, ...]); ValueError names a bad part."""
    key, _, names = text.partition("=")
    bucket, _, mask = key.partition(":")
    if not bucket.isdigit() or mask not in ("none", "causal"):
        raise ValueError(f"--group {text!r}: expected BUCKET:none|causal=NAME[,NAME...]")
    return (int(bucket), mask), [config_from_name(n) for n in names.split(",") if n]


def group_candidates(info, groups: dict) -> list:
    """prepare.py implementations: per (bucket, mask), the table's entries then the extra configs."""
    impls = []
    for (bucket, mask), extra in groups.items():
        shipped = [e.config for e in load_fwd_table() if e.head_dim == bucket and e.mask == mask]
        seen = set()
        for cfg in shipped + list(extra):
            if cfg in seen:
                continue
            seen.add(cfg)
            tag = "table" if cfg in shipped else "cand"
            impl = prepare.sm120_impl(f"{bucket}-{mask}-{tag}-{cfg.name}", lambda p, cfg=cfg: cfg, info)
            impl.supports = lambda p, b=bucket, m=mask: max(p.head_dim, p.dv) == b and p.causal == (m == "causal")
            impls.append(impl)
    return impls


def run_seed_groups(make_candidates, argv: list, description: str) -> None:
    """prepare.run on the seed set against upstream's SM120 path unless argv names another --set /
    --references (the group benches' shared defaults)."""
    if "--set" not in argv:
        argv = ["--set", "seed"] + argv
    if "--references" not in argv:
        argv = ["--references", "upstream_sm120"] + argv
    prepare.run(make_candidates, argv, description=description)


if __name__ == "__main__":
    argv = sys.argv[1:]
    groups: dict = {}
    while "--group" in argv:
        i = argv.index("--group")
        key, configs = parse_group(argv[i + 1])
        groups.setdefault(key, []).extend(configs)
        del argv[i:i + 2]
    if not groups:
        raise SystemExit("name at least one --group BUCKET:MASK=NAME[,NAME...]")
    run_seed_groups(lambda info: group_candidates(info, groups), argv, __doc__)
