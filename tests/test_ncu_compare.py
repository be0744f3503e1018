"""scripts/ncu_compare.py on a CPU: reading ncu's raw CSV and the side-by-side table."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import ncu_compare  # noqa: E402


def _csv(kernels: list[tuple[str, float, float]]) -> str:
    metrics = ncu_compare.all_metrics()
    head = ["ID", "Process ID", "Process Name", "Kernel Name", "Block Size"] + metrics
    units = ["", "", "", "", ""] + ["" for _ in metrics]
    lines = ["==PROF== Connected to process 1 (python3)", "some application output, with a comma",
             ",".join(f'"{h}"' for h in head), ",".join(f'"{u}"' for u in units)]
    for i, (name, duration, stall) in enumerate(kernels):
        vals = []
        for m in metrics:
            if m == ncu_compare.DURATION:
                vals.append(f"{duration:,.0f}")
            elif "long_scoreboard" in m:
                vals.append(str(stall))
            elif "barrier" in m:
                vals.append("5")
            else:
                vals.append("1")
        lines.append(",".join(f'"{v}"' for v in [str(i), "1", "python3", name, "(256, 1, 1)"] + vals))
    return "\n".join(lines) + "\n==PROF== Disconnected from process 1\n"


def test_parse_skips_app_output_and_units_and_reads_numbers():
    rows = ncu_compare.parse_ncu_csv(_csv([("preprocess", 4000.0, 0.1), ("attention_fwd", 1_250_000.0, 7.0)]))
    assert [r["Kernel Name"] for r in rows] == ["preprocess", "attention_fwd"]
    assert rows[1][ncu_compare.DURATION] == 1_250_000.0  # "1,250,000" with thousands separators
    assert rows[0]["Block Size"] == "(256, 1, 1)"  # a quoted value with commas stays one field


def test_main_kernel_is_the_longest():
    rows = ncu_compare.parse_ncu_csv(_csv([("a", 10.0, 0.0), ("b", 30.0, 0.0), ("c", 20.0, 0.0)]))
    assert ncu_compare.main_kernel(rows)["Kernel Name"] == "b"
    assert ncu_compare.main_kernel([]) is None
    assert ncu_compare.parse_ncu_csv("no csv here") == []


def test_table_ranks_stalls_by_the_candidate_and_shows_every_metric():
    a = ncu_compare.main_kernel(ncu_compare.parse_ncu_csv(_csv([("mine", 2000.0, 9.0)])))
    b = ncu_compare.main_kernel(ncu_compare.parse_ncu_csv(_csv([("theirs", 3000.0, 1.0)])))
    text = ncu_compare.format_comparison(("table", "upstream"), (a, b), top_stalls=2)
    for label, _ in ncu_compare.METRICS:
        assert label in text
    stall_lines = text.split("top warp stalls")[1].splitlines()[1:]
    assert stall_lines[0].split()[0] == "long_scoreboard" and stall_lines[1].split()[0] == "barrier"
    assert "2.00" in text and "3.00" in text  # durations in us


def test_problems_by_shape_and_sparse_orders():
    """--problem takes a plain shape beside the seed/real names; sparse:<density> takes a launch order suffix."""
    import pytest

    p = ncu_compare.find_problem("b1s32768h16d128", False)
    assert (p.batch, p.seqlen_q, p.seqlen_k, p.nheads, p.nheads_kv, p.head_dim, p.causal) == (
        1, 32768, 32768, 16, 16, 128, False)
    assert ncu_compare.find_problem("b2s8192h64k8d128", True).nheads_kv == 8
    assert ncu_compare.find_problem("b4s2048h32d64", True).name == "b4s2048h32d64-causal"  # a seed problem
    with pytest.raises(SystemExit, match="not a seed/real problem"):
        ncu_compare.find_problem("s8192d128", False)
    assert ncu_compare._sparse_order("0.1") == (0.1, None)
    assert ncu_compare._sparse_order("0.25:grid")[0] == 0.25
    density, order = ncu_compare._sparse_order("0.1:hg2")
    with order():
        from flash_attn_sm120 import block_sparse
        assert block_sparse._order_forced[-1] == 2
    assert block_sparse._order_forced[-1] is False
    for bad in ("0.1:lpt", "0.1:hg0"):
        with pytest.raises(SystemExit, match="the order is"):
            ncu_compare._sparse_order(bad)
