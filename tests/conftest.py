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
