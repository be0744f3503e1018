"""Progress bars (CPU): the shared helper, the report's bar, and the GPU gate's log counter."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import gate_progress  # noqa: E402
import sm120_report  # noqa: E402

from flash_attn_sm120 import progress  # noqa: E402


class _Row:
    def __init__(self, i):
        self.i = i

    def to_dict(self):
        return {"i": self.i}


def test_report_jobs_run_under_a_bar_on_stderr(capsys, monkeypatch):
    monkeypatch.delenv(progress.ENV, raising=False)
    rows = sm120_report._run([lambda i=i: _Row(i) for i in range(3)], "sm_120a test configs")
    assert rows == [{"i": 0}, {"i": 1}, {"i": 2}]
    out, err = capsys.readouterr()
    assert out == ""  # stdout stays clean for --json
    assert "sm_120a test configs" in err and "3/3" in err


def test_bars_can_be_turned_off(capsys, monkeypatch):
    monkeypatch.setenv(progress.ENV, "0")
    assert list(progress.bar(range(4), desc="quiet")) == [0, 1, 2, 3]
    assert "quiet" not in capsys.readouterr().err


def test_write_goes_to_stdout(capsys):
    progress.write("a row")
    assert capsys.readouterr().out == "a row\n"


def test_gate_counter_reads_pytest_progress_lines(tmp_path):
    (tmp_path / "fuzz_0.log").write_text("....F.s                                   [ 40%]\n..\n")
    (tmp_path / "tests_00.log").write_text("x..E\nFAILED tests/test_x.py::t - boom\n2 passed in 3s\n")
    assert gate_progress.finished_tests(tmp_path) == (13, 2)


def test_gate_total_is_read_from_the_file_once_written(tmp_path):
    path = tmp_path / "total.txt"
    assert gate_progress.read_total(path) is None and gate_progress.read_total(None) is None
    path.write_text("412\n")
    assert gate_progress.read_total(path) == 412
    path.write_text("")  # being written
    assert gate_progress.read_total(path) is None
