"""No undefined name anywhere in the package, including code only a GPU call reaches (pyflakes).

A name left over from an edit in a branch that CPU tests cannot run (e.g. flash_attn_varlen_func's
deterministic backward check) otherwise shows up only on a GPU, as a NameError."""

from pathlib import Path

import pytest

pyflakes_api = pytest.importorskip("pyflakes.api")
from pyflakes.messages import UndefinedName  # noqa: E402
from pyflakes.reporter import Reporter  # noqa: E402

PACKAGE = Path(__file__).resolve().parents[1] / "flash_attn_sm120"


class _Collect(Reporter):
    def __init__(self):
        super().__init__(None, None)
        self.found = []

    def flake(self, message):
        if isinstance(message, UndefinedName):
            self.found.append(str(message))

    def syntaxError(self, filename, msg, lineno, offset, text):  # noqa: N802 (pyflakes' API)
        self.found.append(f"{filename}:{lineno}: {msg}")

    def unexpectedError(self, filename, msg):  # noqa: N802
        self.found.append(f"{filename}: {msg}")


def test_the_package_has_no_undefined_names():
    reporter = _Collect()
    for path in sorted(PACKAGE.rglob("*.py")):
        pyflakes_api.check(path.read_text(), str(path), reporter)
    assert not reporter.found, "\n".join(reporter.found)
