"""Shared test setup.

GPU tests carry @pytest.mark.gpu and are skipped without CUDA. On a GPU that is not SM120 they
run the SM120 kernels in emulation (FLASH_ATTN_SM120_EMULATE=1 is set for the test session),
which is this package's own switch, not one of FA4's variables.
"""

import os

import pytest

# Fuzz suite (tests/README.md): hypothesis profiles fast/deep, seed, and the per-path summary hooks.
import fuzz_profiles  # noqa: F401
from fuzz_report import pytest_report_header, pytest_terminal_summary  # noqa: F401

try:
    import torch

    HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover
    HAS_CUDA = False


def pytest_configure(config):
    if HAS_CUDA and torch.cuda.get_device_capability()[0] != 12:
        os.environ.setdefault("FLASH_ATTN_SM120_EMULATE", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (SM120, or SM80+ in SM120 emulation)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def hang_watchdog(request):
    """Ends the process with a report if the test hangs (an mbarrier/TMA wait that never completes):
    tests/watchdog.py, when that module is present. Request it with pytest.mark.usefixtures."""
    try:
        from watchdog import Watchdog
    except ImportError:  # the hang watchdog is optional
        yield None
        return
    capture = request.config.pluginmanager.getplugin("capturemanager")
    wd = Watchdog(before_report=(lambda: capture.suspend_global_capture(in_=False)) if capture else None)
    wd.arm(request.node.nodeid)
    yield wd
    wd.close()
