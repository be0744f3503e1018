"""Progress bars for the long jobs (codegen report, config search, benchmarks, the GPU gate).

tqdm on stderr, so a script's stdout (tables, JSON) stays clean for pipes. On a terminal the bar
redraws often; in a log it is rewritten at most every 10 s. FLASH_ATTN_SM120_PROGRESS=0 turns
bars off. `write` prints a line above an open bar (tqdm.write), to stdout.
"""

from __future__ import annotations

import os
import sys
from typing import Iterable, Optional, TypeVar

from tqdm import tqdm

ENV = "FLASH_ATTN_SM120_PROGRESS"
T = TypeVar("T")


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def bar(iterable: Optional[Iterable[T]] = None, desc: str = "", total: Optional[int] = None,
        unit: str = "it") -> "tqdm[T]":
    """A progress bar over iterable (or a manual one with total, advanced by .update)."""
    tty = sys.stderr.isatty()
    return tqdm(iterable, desc=desc, total=total, unit=unit, file=sys.stderr, disable=not enabled(),
                mininterval=0.2 if tty else 10.0, dynamic_ncols=tty, leave=True)


def write(line: str) -> None:
    """print(line) that does not tear an open bar."""
    tqdm.write(line, file=sys.stdout)
    sys.stdout.flush()
