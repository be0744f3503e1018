"""The shipped forward table against an earlier one, side by side, plus TMA tile-order attribution.

Issue 18's rule for table changes: the `real` problem set is never slower than the previous shipped
table beyond the measured spread. This times, in one prepare.py run with occupancy verified and each
candidate gated against fp32:

  table      the shipped table (flash_attn_sm120/configs/sm120_fwd.toml), as flash_attn_func runs it
  previous   the table file given by --previous (e.g. a copy kept under configs/measurements/), read
             by the dispatcher during each of its calls (FLASH_ATTN_SM120_FWD_TABLE, this process only)

With --lpt it also times, on causal problems, the table's TMA choice with its longest-first tile
order forced off (`FwdConfig.lpt=False`), so the causal gain over the cp.async family (grid order,
upstream's scheduler) splits into its scheduling part and its TMA part.

  FLASH_ATTN_SM120_EMULATE=1 python scripts/compare_tables.py --previous configs/measurements/2026-12-01_fwd_table_before_session12.toml --set real --json out.json
  FLASH_ATTN_SM120_EMULATE=1 python scripts/compare_tables.py --previous ... --lpt --set seed --subset causal
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import prepare  # noqa: E402

from flash_attn_sm120.config import TABLE_ENV, load_fwd_table, select_fwd_config  # noqa: E402


def _choice(table, p):
    """What driver.table_config picks for a bench problem under `table` (dtype and dense seqlen keys)."""
    seqlen_q = None if p.is_varlen else p.seqlen_q
    return select_fwd_config(table, p.head_dim, p.dv, p.causal, p.window != (None, None), dtype=p.dtype,
                             seqlen_q=seqlen_q, varlen=p.is_varlen)


def _under_table(impl, path: Path):
    """`impl` with the dispatcher reading another table file for the duration of each call, so its
    routing (fallbacks for what a family refuses) is the one that table shipped with."""
    fwd = impl.fwd

    def run(p, x, out):
        before = os.environ.get(TABLE_ENV)
        os.environ[TABLE_ENV] = str(path)
        try:
            return fwd(p, x, out)
        finally:
            if before is None:
                os.environ.pop(TABLE_ENV, None)
            else:
                os.environ[TABLE_ENV] = before

    impl.fwd = run
    return impl


def candidates_for(previous: Path, lpt: bool):
    def candidates(info) -> list:
        load_fwd_table(previous)  # a bad file fails here, before any timing
        impls = [prepare.sm120_impl("table", lambda p: None, info),
                 _under_table(prepare.sm120_impl("previous", lambda p: None, info), previous.resolve())]
        if lpt:
            def no_lpt(p):
                cfg = _choice(load_fwd_table(), p)
                return replace(cfg, lpt=False) if cfg.family == "tma" else None

            impl = prepare.sm120_impl("table-tma-nolpt", no_lpt, info)
            impl.supports = lambda p: p.causal and not p.is_varlen and _choice(load_fwd_table(), p).family == "tma"
            impls.append(impl)
        return impls

    return candidates


if __name__ == "__main__":
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--previous", type=Path, required=True)
    ap.add_argument("--lpt", action="store_true")
    own, rest = ap.parse_known_args()
    if "--set" not in rest:
        rest = ["--set", "real"] + rest
    if "--references" not in rest:
        rest = ["--references", "upstream_sm120,sm120_cpasync_table"] + rest
    prepare.run(candidates_for(own.previous, own.lpt), rest, description=__doc__)
