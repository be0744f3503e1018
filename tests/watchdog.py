"""Hang watchdog for GPU tests: a kernel that never finishes fails loudly instead of eating the machine.

A hung kernel blocks the test process inside a CUDA synchronisation forever; pytest cannot time
it out from the inside. `Watchdog.arm(label)` (re)starts a countdown of `seconds`; when it runs
out, a timer thread writes

    WATCHDOG: <label> still running after <seconds> s: a kernel probably hangs. ...

to stderr (and to FLASH_ATTN_SM120_FUZZ_REPORT + ".hang" when that is set), dumps every thread's
Python stack with faulthandler and ends the process with exit code 3 (os._exit: the stuck CUDA
call is never returned to). Under pytest, stderr is captured into a file that dies with the
process, so the fixture passes `before_report` = the capture manager's suspend_global_capture:
the message then reaches the real stderr. A second, GIL-free backstop
(faulthandler.dump_traceback_later, exit code 1) fires `backstop` seconds later in case the stuck
call holds the GIL; it writes to the ".hang" file when there is one.

The fuzz suite arms it per GPU test (fixture, label = the test id) and re-arms it per example
(label = the test id and the example), so `seconds` bounds one example, compile included.
Default 300 s; FLASH_ATTN_SM120_WATCHDOG_S overrides (0 disables).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
from typing import Callable, Optional

WATCHDOG_ENV = "FLASH_ATTN_SM120_WATCHDOG_S"
EXIT_CODE = 3


def default_seconds() -> float:
    return float(os.environ.get(WATCHDOG_ENV, "300"))


class Watchdog:
    def __init__(self, seconds: Optional[float] = None, backstop: float = 60.0, report_path: Optional[str] = None,
                 before_report: Optional[Callable[[], None]] = None):
        self.seconds = default_seconds() if seconds is None else seconds
        self.backstop = backstop
        self.report_path = report_path
        self.before_report = before_report
        self._timer: Optional[threading.Timer] = None
        self._backstop_file = None
        self.label = ""

    def arm(self, label: str) -> None:
        """Start (or restart) the countdown for `label`."""
        self.disarm()
        if self.seconds <= 0:
            return
        self.label = label
        self._timer = threading.Timer(self.seconds, self._fire, args=(label,))
        self._timer.daemon = True
        self._timer.start()
        if self.report_path and self._backstop_file is None:
            try:
                self._backstop_file = open(self.report_path + ".hang", "a")
            except OSError:
                self._backstop_file = None
        out = self._backstop_file or sys.__stderr__
        faulthandler.dump_traceback_later(self.seconds + self.backstop, exit=True, file=out)

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            faulthandler.cancel_dump_traceback_later()

    def close(self) -> None:
        self.disarm()
        if self._backstop_file is not None:
            self._backstop_file.close()
            # nothing hung: remove the empty file (under pytest-xdist another worker may have already)
            with contextlib.suppress(FileNotFoundError):
                if self.report_path and os.path.getsize(self.report_path + ".hang") == 0:
                    os.remove(self.report_path + ".hang")
            self._backstop_file = None

    def _fire(self, label: str) -> None:
        msg = (
            f"\nWATCHDOG: {label} still running after {self.seconds:.0f} s: a kernel probably hangs."
            f" Killing the test process (exit code {EXIT_CODE}); Python stacks follow.\n"
        )
        if self.before_report is not None:
            try:
                self.before_report()
            except Exception:  # report anyway
                pass
        os.write(2, msg.encode())
        if self.report_path:
            try:
                with open(self.report_path + ".hang", "a") as f:
                    f.write(msg)
            except OSError:
                pass
        faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
        os.write(2, msg.encode())  # again at the end, where a truncated log tail shows it
        os._exit(EXIT_CODE)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
