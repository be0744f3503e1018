"""The first-run self-test in emulation: every family passes, and it writes its prepare.py-format JSON."""

import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu


def test_selftest_passes_and_writes_its_json(tmp_path):
    out = tmp_path / "selftest.json"
    proc = subprocess.run([sys.executable, "-m", "flash_attn_sm120.selftest", "--out", str(out), "--reps", "5",
                           "--subset", "b2s4096h16d128", "--timeout", "400"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["mode"] in ("sm120", "emulated") and doc["set"] == "seed"
    assert doc["selftest"]["passed"] is True
    fams = {f["family"]: f for f in doc["selftest"]["families"]}
    assert set(fams) == {"cpasync", "tma", "splitkv", "backward"}
    assert all(f["status"] == "ok" and f["checks"] for f in fams.values())
    assert any("deterministic" in c["check"] for c in fams["backward"]["checks"])
    impls = {r["impl"] for r in doc["rows"]}
    assert {"sm120_table", "upstream_sm120"} <= impls
    assert all(r["status"] == "ok" for r in doc["rows"])
    assert doc["summary"]["vs_upstream_sm120"]["geomean"] > 0
    assert doc["occupancy_verified"] is True
    assert "PASSED" in proc.stdout
