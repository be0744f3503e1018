"""The first-run self-test on a CPU: its check matrix is valid, and without a GPU it says so."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flash_attn_sm120 import selftest
from flash_attn_sm120.paths import get_path


@pytest.mark.parametrize("family", sorted(selftest.ADVICE))
def test_each_family_has_valid_checks_on_registered_paths(family):
    checks = selftest._checks(family)
    assert checks
    for path_name, api, case, problem in checks:
        path = get_path(path_name)  # raises for an unknown path
        assert api in ("driver", "public")
        cfg = path.config_for(case.head_dim, case.head_dim_v)
        if path.family != "dispatch":  # a forced config must be implementable at the check's head dims
            assert cfg.error(case.head_dim, case.head_dim_v) is None, (path_name, case.label)
        assert len(problem.seqlens_q) == len(problem.seqlens_k)
        if case.q_layout == "dense":
            assert len(set(problem.seqlens_q)) == 1, "a dense batch has one length"


def test_family_paths_are_the_family_they_claim():
    fams = {f: {get_path(p).family for p, *_ in selftest._checks(f)} for f in ("cpasync", "tma", "splitkv")}
    assert fams["tma"] == {"tma"} and fams["splitkv"] == {"splitkv"}
    assert fams["cpasync"] <= {"cpasync", "dispatch"}


def test_unknown_family_is_refused():
    with pytest.raises(ValueError, match="unknown self-test family"):
        selftest._checks("wgmma")


def test_hang_advice_names_the_switch_for_tma():
    assert "FLASH_ATTN_SM120_FAMILIES=cpasync" in selftest.ADVICE["tma"]


def test_cli_without_gpu_explains_and_exits_2():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = subprocess.run([sys.executable, "-m", "flash_attn_sm120.selftest", "--no-timing"], capture_output=True,
                          text=True)
    assert proc.returncode == 2
    assert "no CUDA GPU" in proc.stderr
    assert "Warning" not in proc.stderr


def test_help_describes_every_public_option():
    proc = subprocess.run([sys.executable, "-m", "flash_attn_sm120.selftest", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0
    for opt in ("--out", "--families", "--timeout", "--no-timing", "--reps", "--subset"):
        assert opt in proc.stdout
    assert "--child" not in proc.stdout


def test_a_family_past_its_timeout_is_reported_as_a_hang_with_advice():
    """The child cannot even import in 0.05 s: the parent kills it and reports a hang, with the switch."""
    (entry,) = selftest.run_checks(["tma"], timeout_s=0.05, log=lambda *_: None)
    assert entry["status"] == "hang" and "FLASH_ATTN_SM120_FAMILIES=cpasync" in entry["advice"]
    assert "stderr_tail" in entry


def test_a_failing_family_reports_every_check_and_why():
    """On a CPU every check fails (the kernels need CUDA): each row says so, and the family is a failure."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    (entry,) = selftest.run_checks(["splitkv"], timeout_s=300, log=lambda *_: None)
    assert entry["status"] == "fail"
    assert len(entry["checks"]) == len(selftest._checks("splitkv"))
    assert all(c["status"] == "fail" and c["detail"] for c in entry["checks"])
