"""GPU correctness gate: hypothesis fuzzing of every kernel path in flash_attn_sm120.paths.

Runs on an SM120 GPU, or in SM120 emulation on another SM80+ GPU (conftest sets
FLASH_ATTN_SM120_EMULATE=1 there). Per run, `fuzz_cases.static_cases` draws a bounded, seeded
list of static cases (one compile key each: path x API x dtype x head dims x GQA x mask x softcap x
LSE x layout); for each, hypothesis draws `examples` dynamic problems (batch, per-sequence
lengths, KV heads, windows, scale, NaN padding, data seed). Each example:

  forward   driver.forward with NaN-filled out/lse and the path's config forced, or the public
            flash_attn_func / flash_attn_varlen_func under driver.force_config with the driver's
            own allocations NaN-filled; then flash_attn_sm120.testing.check_forward: every valid
            element finite (so written), out within upstream's rule of the fp32 reference, LSE
            -inf exactly on empty rows and within the rule elsewhere, nothing written into a
            strided out buffer's gaps, and no recompilation for a new size;
  backward  the public API's autograd (upstream's backward after this package's forward) vs
            torch autograd through an fp32 reference: dq, dk, dv within upstream's rule;
  deterministic  (test_det<index>_...) a backward with deterministic=True, run twice on the same
            forward: dq, dk, dv bitwise equal and within the rule; each case's problems keep the
            lengths of one dQ ordering (fuzz_cases.DETERMINISTIC). Only these:
            FLASH_ATTN_SM120_FUZZ=fast pytest tests/test_fuzz_gpu.py -k test_det

Each static case is its own test, test_<case id> (e.g. test_fwd003_cpasync_w8_128x96_s1_driver_...),
with a hypothesis seed derived from the run's seed and the case. Unsupported head dims must raise
a ValueError naming the head dim. A hang trips the watchdog (tests/watchdog.py). Profiles, seeds
and replay: tests/README.md and tests/fuzz_profiles.py.
"""

from __future__ import annotations

import os
import re
import zlib
from collections import defaultdict

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("hypothesis")
from hypothesis import given, seed, strategies as st  # noqa: E402

import fuzz_report  # noqa: E402
from flash_attn.cute.interface import _resolve_causal_local_window  # noqa: E402
from flash_attn_sm120 import driver, flash_attn_func, testing  # noqa: E402
from flash_attn_sm120.device import execution_mode  # noqa: E402
from flash_attn_sm120.paths import kernel_paths  # noqa: E402
from fuzz_cases import FuzzCase, problems, static_cases  # noqa: E402
from fuzz_profiles import FUZZ_SEED, active_plan, active_profile, gpu_settings, shard  # noqa: E402
from watchdog import Watchdog  # noqa: E402

pytestmark = pytest.mark.gpu

PLAN = active_plan()
MODE = execution_mode()  # "cpu" without CUDA: cases are still listed (and skipped)
SHARD = shard()
_FWD, _BWD = static_cases(kernel_paths(), PLAN, FUZZ_SEED, "emulated" if MODE == "cpu" else MODE)
FWD_CASES = [c for c in _FWD if c.index % SHARD[1] == SHARD[0]]
BWD_CASES = [c for c in _BWD if c.index % SHARD[1] == SHARD[0]]
fuzz_report.RUN_INFO.update(
    profile=active_profile(), seed=FUZZ_SEED, shard=f"{SHARD[0]}/{SHARD[1]}", mode=MODE,
    fwd_cases=len(FWD_CASES), bwd_cases=len(BWD_CASES), fwd_examples=PLAN.fwd_examples,
    bwd_examples=PLAN.bwd_examples, det_cases=sum(c.case.deterministic for c in BWD_CASES),
    det_examples=PLAN.det_examples,
)
_compiles_per_case: dict[str, int] = defaultdict(int)
_mask_kinds_per_case: dict[str, set] = defaultdict(set)


@pytest.fixture
def watchdog(request):
    capture = request.config.pluginmanager.getplugin("capturemanager")
    wd = Watchdog(report_path=os.environ.get(fuzz_report.REPORT_ENV),
                  before_report=(lambda: capture.suspend_global_capture(in_=False)) if capture else None)
    wd.arm(request.node.nodeid)
    yield wd
    wd.close()


def _compiles() -> int:
    """Forward compiles so far, over every driver that counts them."""
    total = driver.compile_count["fwd"]
    try:
        from flash_attn_sm120 import driver_splitkv

        total += sum(driver_splitkv.compile_count.values())
    except (ImportError, AttributeError):
        pass
    return total


def _run_example(fc: FuzzCase, problem: testing.AttnProblem, watchdog: Watchdog, nodeid: str) -> None:
    case = fc.case
    kind = "bwd" if case.backward else "fwd"
    fuzz_report.record_case(fc.path.name, fc.id)
    watchdog.arm(f"{nodeid} with {problem}")
    before = _compiles()
    passed = False
    try:
        testing.run_case(fc.path, fc.api, case, problem)
        compiled = _compiles() - before
        fuzz_report.record_compiles(fc.path.name, compiled)
        _compiles_per_case[fc.id] += compiled
        # driver API: one config, one key per mask kind per case. A window value may change the mask
        # kind, as upstream resolves it (a right window of 0 with no left window is causal; a
        # causal case with a left window is local), and each kind is its own kernel. Any other
        # dynamic size or value must not recompile. (The public API may also take the decode route
        # for seqlen_q <= 16, with its own config, so it is not counted.)
        _mask_kinds_per_case[fc.id].add(_resolve_causal_local_window(case.causal, *problem.window(case))[:2])
        assert fc.api != "driver" or _compiles_per_case[fc.id] <= len(_mask_kinds_per_case[fc.id]), (
            f"{fc.id}: {_compiles_per_case[fc.id]} forward compiles for one static case and "
            f"{len(_mask_kinds_per_case[fc.id])} mask kind(s): a dynamic size or value entered the compile key"
            " (every new size would recompile)"
        )
        passed = True
    except Exception as e:
        if hasattr(e, "add_note"):
            e.add_note(
                "replay: FLASH_ATTN_SM120_EMULATE=1 python -c \"from flash_attn_sm120.testing import *;"
                f" print(run_case({fc.path.name!r}, {fc.api!r}, {case!r}, {problem!r}))\""
            )
        raise
    finally:
        fuzz_report.record_example(fc.path.name, kind, passed)
        watchdog.arm(nodeid)


def _fuzz_test(fc: FuzzCase, examples: int):
    """One test per static case, with its own hypothesis seed (derived from the run's) and database key."""

    def test(data, watchdog, request):
        problem = data.draw(problems(fc, PLAN), label="problem")
        _run_example(fc, problem, watchdog, request.node.nodeid)

    test.__name__ = test.__qualname__ = "test_" + re.sub(r"[^0-9A-Za-z]+", "_", fc.id)
    test.__doc__ = f"{fc.id}: {examples} examples"
    test._hypothesis_internal_add_digest = fc.id.encode()  # database key per case, as for parametrize
    test = given(data=st.data())(test)
    test = seed(FUZZ_SEED ^ zlib.crc32(fc.id.encode()))(test)
    return gpu_settings(examples)(test)


for _fc in FWD_CASES + BWD_CASES:
    _t = _fuzz_test(_fc, PLAN.det_examples if _fc.case.deterministic else
                    PLAN.bwd_examples if _fc.case.backward else PLAN.fwd_examples)
    globals()[_t.__name__] = _t
del _fc, _t


_BAD_HEAD_DIMS = st.one_of(
    st.integers(1, 300).filter(lambda d: d % 8 != 0),
    st.integers(33, 64).map(lambda m: 8 * m),  # multiples of 8 above 256
)


@gpu_settings(PLAN.fwd_examples * 4)
@seed(FUZZ_SEED)
@given(d=_BAD_HEAD_DIMS, which=st.sampled_from(("head_dim", "head_dim_v")), dtype=st.sampled_from(("float16", "bfloat16")))
def test_unsupported_head_dims_raise(d, which, dtype, watchdog):
    """CUDA tensors with a head dim the kernels do not take: a ValueError naming it, no kernel work."""
    dt = getattr(torch, dtype)
    dq, dv = (d, 64) if which == "head_dim" else (64, d)
    q = torch.randn(1, 16, 2, dq, device="cuda", dtype=dt)
    k = torch.randn(1, 16, 2, dq, device="cuda", dtype=dt)
    v = torch.randn(1, 16, 2, dv, device="cuda", dtype=dt)
    before = driver.compile_count["fwd"]
    with pytest.raises(ValueError, match=rf"{which}={d}\b"):
        flash_attn_func(q, k, v)
    assert driver.compile_count["fwd"] == before
