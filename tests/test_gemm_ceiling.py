"""scripts/gemm_ceiling.py (quack's SM120 GEMM as the same-class ceiling) and its plumbing into
scripts/prepare.py: the child's arguments and environment, the never-raising parent, the JSON
fields (`ceiling`, `of_ceiling`) and the table's "of ceiling" column. CPU tests use fake ceiling
dicts and a mocked child; the GPU test measures a small ceiling for real."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "scripts"))
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


gc = _load("gemm_ceiling")
prepare = _load("prepare")

OK = {"status": "ok", "tflops": 400.0, "ms": 2.75, "spread": 0.01, "size": 8192, "tile": "128x128",
      "pingpong": True, "persistent": True, "class": "GemmDefaultSm120", "dtype": "bfloat16", "mode": "emulated",
      "mode_label": "SM120 GEMM class emulated on NVIDIA H200"}


def _has_cuda():
    import torch

    return torch.cuda.is_available()


# ------------------------------------------------------------------------------ child arguments
def test_child_mode_arguments_parse():
    a = gc.parse_args(["--child", "--size", "2048", "--tile", "64x128", "--no-pingpong", "--reps", "7",
                       "--warmup", "2"])
    assert (a.child, a.size, a.tile, a.pingpong, a.persistent, a.reps, a.warmup, a.compile_only) == \
        (True, 2048, (64, 128), False, True, 7, 2, False)
    d = gc.parse_args([])
    assert (d.child, d.size, d.tile, d.pingpong, d.persistent) == (False, 8192, (128, 128), True, True)


@pytest.mark.parametrize("argv", [["--size", "7"], ["--size", "0"], ["--size", "x"], ["--tile", "128"],
                                  ["--tile", "100x128"], ["--reps", "0"], ["--target", "sm_90a"]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        gc.parse_args(argv)


@pytest.mark.parametrize("pingpong,persistent,compile_only,target", [
    (True, True, False, None), (False, True, False, None), (True, False, True, "sm_90a")])
def test_child_command_round_trips(pingpong, persistent, compile_only, target):
    cmd = gc.child_command(4096, (128, 64), pingpong, persistent, 11, 3, compile_only, target)
    assert cmd[0] == sys.executable and Path(cmd[1]) == ROOT / "scripts" / "gemm_ceiling.py"
    a = gc.parse_args(cmd[2:])
    assert (a.child, a.size, a.tile, a.pingpong, a.persistent, a.reps, a.warmup, a.compile_only, a.target) == \
        (True, 4096, (128, 64), pingpong, persistent, 11, 3, compile_only, target)


def test_child_env_is_a_copy_with_quack_arch():
    parent = {"PATH": "/bin", "CUTE_DSL_ARCH": "sm_120a", "FLASH_ATTN_SM120_EMULATE": "1"}
    before = dict(parent)
    env, notes = gc.child_env(parent)
    assert parent == before  # the caller's environment is untouched
    assert env["QUACK_ARCH"] == "sm_120" and env["QUACK_CACHE_ENABLED"] == "0"
    assert "CUTE_DSL_ARCH" not in env and "CUTE_DSL_ARCH=sm_120a" in notes[0]  # compiles for its own GPU
    assert env["PATH"] == "/bin" and env["FLASH_ATTN_SM120_EMULATE"] == "1"
    assert not any(k.startswith("FLASH_ATTENTION_") for k in env)  # FA4's variables are never set
    env, notes = gc.child_env(parent, compile_only=True)
    assert env["CUTE_DSL_ARCH"] == "sm_120a" and env["CUDA_VISIBLE_DEVICES"] == "" and notes == []


def test_parse_child_output_takes_the_last_marker_line():
    out = "quack says hi\n" + gc.MARKER + '{"status": "error"}\nnoise\n' + gc.MARKER + '{"status": "ok"}\ntrail\n'
    assert gc.parse_child_output(out) == {"status": "ok"}
    assert gc.parse_child_output("no result\n") is None
    assert gc.parse_child_output(gc.MARKER + "{broken") is None
    assert gc.parse_child_output(gc.MARKER + "[1, 2]") is None


def test_mode_names_follow_the_package_rule():
    from flash_attn_sm120.device import mode_for_capability

    for cap in [(12, 0), (12, 1), (9, 0), (8, 0), (8, 9), (10, 0)]:
        assert gc.mode_for(cap) == mode_for_capability(cap, True)
    assert gc.mode_label("emulated", "NVIDIA H200", (9, 0), 132, "sm_90a", 132).startswith(
        "SM120 GEMM class emulated on NVIDIA H200 (cc 9.0, 132 SMs")
    assert gc.mode_label("sm120", "RTX 5090", (12, 0), 170, "sm_120a", 170) == "SM120 native: RTX 5090 (cc 12.0, 170 SMs)"


def test_class_from_kernel_names():
    sm120 = "cutlass___call___quackgemm_default_epiGemmDefaultSm120_object_at__FakeTensorBFloat16"
    assert gc.class_from_names([sm120]) == "GemmDefaultSm120"
    assert gc.class_from_names(["kernel_quackgemm_default_epiGemmDefaultSm90_object"]) == "GemmDefaultSm90"
    assert gc.class_from_names(["something_else"]) is None
    assert gc.class_from_names([]) is None


def test_child_loads_the_benchmark_timer_by_path():
    """The child times with bench.py loaded by its path (no package import): its dataclasses must build."""
    b = gc._load_bench()
    assert b.__file__ == str(ROOT / "flash_attn_sm120" / "bench.py")
    assert b.gemm_flops(8192, 8192, 8192) == 2 * 8192**3
    assert b.rotations_for_bytes(3 * 2**27) == 2 and b.rotations_for_bytes(24 * 2**20) == 8
    assert b.summarize_times([1.0, 2.0, 3.0]).median_ms == 2.0
    assert b.Problem(1, 128, 128, 2, 2, 64).name == "b1s128h2d64"


def test_error_bound_is_prepares_rule():
    assert gc.error_bound(0.002) == pytest.approx(0.005)


# ------------------------------------------------------------------------------ the parent never raises
class _Run:
    """A stand-in for subprocess.run in gemm_ceiling: records the call, returns or raises."""

    def __init__(self, result=None, exc=None):
        self.result, self.exc, self.calls = result, exc, []

    def __call__(self, cmd, **kw):
        self.calls.append((cmd, kw))
        if self.exc is not None:
            raise self.exc
        return self.result


def test_measure_ceiling_parses_the_child(monkeypatch):
    child = dict(OK, rel_err=0.0011, err_bound=0.0055)
    run = _Run(subprocess.CompletedProcess([], 0, "cutlass noise\n" + gc.MARKER + json.dumps(child) + "\n", "warn"))
    monkeypatch.setattr(gc.subprocess, "run", run)
    monkeypatch.delenv("QUACK_ARCH", raising=False)
    r = gc.measure_ceiling(size=2048, tile=(128, 128), reps=5)
    assert r["status"] == "ok" and r["tflops"] == 400.0 and r["class"] == "GemmDefaultSm120"
    assert "stderr_tail" not in r and r["returncode"] == 0
    (cmd, kw), = run.calls
    assert "--child" in cmd and cmd[cmd.index("--size") + 1] == "2048" and cmd[cmd.index("--reps") + 1] == "5"
    assert kw["env"]["QUACK_ARCH"] == "sm_120" and "QUACK_ARCH" not in os.environ  # not leaked
    assert kw["timeout"] > 0


@pytest.mark.parametrize("result,exc,expect", [
    (subprocess.CompletedProcess([], -11, "", "Segmentation fault\n" + "x" * 5000), None, "without a result"),
    (subprocess.CompletedProcess([], 1, gc.MARKER + '{"status": "error", "error": "boom"}\n', "Traceback: boom"),
     None, "boom"),
    (None, subprocess.TimeoutExpired(["x"], 600, stderr=b"compiling..."), "ran past"),
    (None, OSError("no such interpreter"), "OSError"),
])
def test_measure_ceiling_failures_are_status_error(monkeypatch, result, exc, expect):
    monkeypatch.setattr(gc.subprocess, "run", _Run(result, exc))
    r = gc.measure_ceiling(size=2048)
    assert r["status"] == "error" and expect in r["error"]
    assert math.isnan(r["tflops"]) and r["size"] == 2048 and r["tile"] == "128x128"
    assert len(r.get("stderr_tail", "")) <= gc.TAIL
    if result is not None:
        assert r["stderr_tail"]
    assert math.isnan(prepare.of_ceiling(300.0, r))


def test_measure_ceiling_real_child_bad_size():
    """A size the child refuses: no result line, status error with the child's complaint."""
    before = dict(os.environ)
    r = gc.measure_ceiling(size=7, timeout=120)
    assert r["status"] == "error" and "positive multiple of 8" in r["stderr_tail"]
    assert r["returncode"] == 2 and dict(os.environ) == before


def test_measure_ceiling_real_child_without_gpu():
    if _has_cuda():
        pytest.skip("CPU-only behaviour (the GPU test measures)")
    before = os.environ.get("QUACK_ARCH")
    r = gc.measure_ceiling(size=2048, timeout=300)
    assert r["status"] == "error" and "no CUDA GPU" in r["error"]
    assert os.environ.get("QUACK_ARCH") == before


def test_compile_only_traces_the_sm120_class_for_hopper():
    """The measurement's exact quack call (bf16, (N, K) B, tile 128x128, cluster 1x1, ping-pong,
    persistent) traced and compiled for sm_90a, what an H200 compiles, with the GPU hidden."""
    r = gc.measure_ceiling(size=2048, compile_only=True, target="sm_90a", timeout=600)
    assert r["status"] == "ok", r.get("error")
    assert r["class"] == "GemmDefaultSm120" and "GemmDefaultSm120" in r["kernel"]
    assert r["dispatch_capability"] == [12, 0] and r["compile_target"] == "sm_90a" and r["compile_only"]
    assert "stopped_at" in r and math.isnan(prepare.of_ceiling(100.0, r))  # compiled, not timed: no ceiling


def test_format_result_lines():
    assert "400.0 TFLOPS" in gc.format_result(OK) and "[emulated]" in gc.format_result(OK)
    assert "pingpong persistent" in gc.format_result(OK)
    err = gc.base_result(8192, (128, 128), False, True) | {"error": "no CUDA GPU here"}
    assert gc.format_result(err).startswith("gemm ceiling: error") and "cooperative" in gc.format_result(err)
    bad = dict(OK, status="incorrect", tflops=float("nan"), rel_err=0.5, err_bound=0.005)
    assert "incorrect" in gc.format_result(bad)


# ------------------------------------------------------------------------------ prepare.py plumbing
def _rows():
    Row = prepare.Row
    return [Row("sm120_table", "candidate", "b1s8192h16d128", "emulated", "ok", ms=1.0, tflops=200.0),
            Row("sm120_table", "candidate", "b2s4096h16d96", "emulated", "error", detail="boom"),
            Row("upstream_sm120", "reference", "b1s8192h16d128", "emulated", "ok", ms=2.0, tflops=100.0,
                bwd_tflops=80.0)]


def _doc(rows):
    from dataclasses import asdict

    return {"command": "python scripts/prepare.py", "mode": "emulated", "summary": {"correct": True},
            "rows": [asdict(r) for r in rows]}


def test_of_ceiling():
    assert prepare.of_ceiling(200.0, OK) == pytest.approx(0.5)
    assert math.isnan(prepare.of_ceiling(200.0, None))
    assert math.isnan(prepare.of_ceiling(float("nan"), OK))
    for broken in (dict(OK, status="error"), dict(OK, status="incorrect"), dict(OK, tflops=float("nan")),
                   dict(OK, tflops=0.0), dict(OK, tflops=None), prepare.skipped_ceiling()):
        assert math.isnan(prepare.of_ceiling(200.0, broken))
        assert math.isnan(prepare.ceiling_tflops(broken))


def test_json_gets_the_ceiling_and_row_fractions():
    rows = _rows()
    old = _doc(rows)
    doc = prepare.with_ceiling(_doc(rows), OK)
    assert {k: v for k, v in doc.items() if k != "ceiling"}.keys() == old.keys()  # nothing else changes
    for k in ("tflops", "size", "tile", "pingpong", "class", "status", "ms", "spread"):
        assert k in doc["ceiling"]
    assert doc["ceiling"]["tflops"] == 400.0 and doc["ceiling"]["class"] == "GemmDefaultSm120"
    fr = [r["of_ceiling"] for r in doc["rows"]]
    assert fr[0] == pytest.approx(0.5) and math.isnan(fr[1]) and fr[2] == pytest.approx(0.25)
    assert doc["rows"][2]["bwd_of_ceiling"] == pytest.approx(0.2) and math.isnan(doc["rows"][0]["bwd_of_ceiling"])
    for r_old, r_new in zip(old["rows"], doc["rows"]):  # existing row fields as they were
        assert all(r_new[k] == r_old[k] or (r_new[k] != r_new[k] and r_old[k] != r_old[k]) for k in r_old)
    back = json.loads(json.dumps(doc))  # NaN round-trips as the rows' other NaN fields do
    assert math.isnan(back["rows"][1]["of_ceiling"])


def test_json_without_a_ceiling_has_the_fields_as_nan():
    doc = prepare.with_ceiling(_doc(_rows()), None)
    assert doc["ceiling"]["status"] == "skipped" and math.isnan(doc["ceiling"]["tflops"])
    assert all(math.isnan(r["of_ceiling"]) for r in doc["rows"])
    err = gc.base_result(8192, (128, 128), True, True) | {"error": "x", "stderr_tail": "tb"}
    doc = prepare.with_ceiling(_doc(_rows()), err)
    assert doc["ceiling"]["status"] == "error" and doc["ceiling"]["stderr_tail"] == "tb"
    assert all(math.isnan(r["of_ceiling"]) for r in doc["rows"])


def test_table_has_an_of_ceiling_column(capsys):
    prepare._print_table(_rows(), ceiling=OK)
    out = capsys.readouterr().out.splitlines()
    title, header, first, second = [line for line in out if line][:4]
    assert "400.0 TFLOPS GEMM ceiling" in title
    assert header.count("of ceiling") == 2  # one per implementation
    assert "200.0" in first and "50.0%" in first and "100.0" in first and "25.0%" in first
    assert "error" in second


def test_table_without_a_ceiling_is_unchanged(capsys):
    prepare._print_table(_rows())
    a = capsys.readouterr().out
    prepare._print_table(_rows(), ceiling=dict(OK, status="error"))
    b = capsys.readouterr().out
    assert a == b and "of ceiling" not in a and "%" not in a


def test_ceiling_summary_lines_leave_the_loop_summary_alone():
    rows = _rows()
    text = prepare.format_ceiling_summary(OK, rows, "candidate")
    assert "ceiling_tflops: 400.00" in text and "fwd_of_ceiling_peak: 0.500" in text
    assert "fwd_of_ceiling_geomean: 0.500" in text
    assert "bwd_of_ceiling_peak: 0.200" in prepare.format_ceiling_summary(OK, rows, "reference", "bwd_tflops")
    assert "ceiling_tflops: nan" in prepare.format_ceiling_summary(None, rows, "candidate")

    class Info:
        name, mode = "NVIDIA H200", "emulated"

    s = prepare.summarize(rows, Info)
    log = prepare.format_summary(s) + "\n" + text + "\n"
    with_lines, without = prepare.parse_summary(log), prepare.parse_summary(prepare.format_summary(s))
    assert repr(sorted(with_lines.items())) == repr(sorted(without.items()))  # (NaN != NaN: compare reprs)


def test_prepare_help_lists_the_ceiling_flags():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "prepare.py"), "--help"], capture_output=True,
                       text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0
    for flag in ("--ceiling", "--no-ceiling", "--ceiling-size"):
        assert flag in r.stdout
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gemm_ceiling.py"), "--help"], capture_output=True,
                       text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0 and "--no-pingpong" in r.stdout and "--compile-only" in r.stdout
    assert "[--child]" not in r.stdout  # internal: not in the usage


# ------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
def test_ceiling_on_the_gpu():
    before = dict(os.environ)
    r = gc.measure_ceiling(size=2048, reps=10, warmup=3, timeout=600)
    assert dict(os.environ) == before  # QUACK_ARCH lived in the child only
    assert r["status"] == "ok", (r.get("error"), r.get("stderr_tail"))
    assert r["class"] == "GemmDefaultSm120" and "GemmDefaultSm120" in r["kernel"]
    assert r["dispatch_capability"] == [12, 0]
    assert 1.0 < r["tflops"] < 5000.0 and r["ms"] > 0 and r["spread"] >= 0
    assert r["rel_err"] <= r["err_bound"] and r["rel_err_after_timing"] <= r["err_bound"]
    import torch

    cap = torch.cuda.get_device_capability()
    assert r["mode"] == ("sm120" if cap[0] == 12 else "emulated")
    assert r["mode_label"].startswith("SM120 native" if cap[0] == 12 else "SM120 GEMM class emulated on")
    assert r["grid_ctas"] and r["grid_ctas"] >= 1
