#!/usr/bin/env python3
"""The wheel works from anywhere: build it, install it non-editable into a fresh venv, use it from /tmp.

  1. `pip wheel --no-deps` builds the package's wheel from a copy of the tracked files; it must hold every config table
     (flash_attn_sm120/configs/*.toml, package data);
  2. a fresh venv gets that wheel, non-editable and without dependencies; the dependencies come from
     the current environment's site directories, appended after the venv's own (an editable install
     of the repository there cannot take precedence: the probe checks where the package came from);
  3. from a temporary directory outside the repository, that venv's python imports the package (it
     must come from the venv), loads the forward, backward and decode tables, imports the torch.compile
     ops and the transformers integration, and runs `python -m flash_attn_sm120.explain` and the
     self-test's `--help`.

Exit status 0 on success; any failure names the step. `.ci/run` runs it after the test suite.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import tempfile
import venv
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TABLES = ("sm120_fwd.toml", "sm120_bwd.toml", "sm120_decode.toml")

PROBE = r"""
import sys
import flash_attn_sm120
from flash_attn_sm120.config import load_fwd_table
from flash_attn_sm120.config_bwd import load_bwd_table
from flash_attn_sm120.decode import load_decode_table
where = flash_attn_sm120.__file__
assert where.startswith(sys.argv[1]), f"imported {where}, not the wheel installed in {sys.argv[1]}"
import torch
from flash_attn_sm120 import compile_ops  # noqa: F401  (registers the custom ops)
assert hasattr(torch.ops.flash_attn_sm120, "fwd") and hasattr(torch.ops.flash_attn_sm120, "bwd")
try:
    import transformers  # noqa: F401
except ImportError:
    pass
else:
    from flash_attn_sm120.integrations import transformers as hf
    assert hf.NAME in transformers.AttentionInterface().valid_keys()
print(f"wheel package at {where}: {len(load_fwd_table())} forward, {len(load_bwd_table())} backward, "
      f"{len(load_decode_table())} decode entries; torch.compile ops registered")
"""


def run(cmd, **kw):
    print("+", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run(cmd, check=True, **kw)


def _tracked_copy(tmp: Path) -> Path:
    """The repository's tracked files in a fresh directory: an in-tree build (setuptools' build/) keeps
    files from earlier builds, which could hide a file the wheel no longer gets."""
    src = tmp / "src"
    files = subprocess.check_output(["git", "ls-files", "-z"], cwd=ROOT).decode().split("\0")
    for rel in filter(None, files):
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    return src


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="wheel-check-") as tmp:
        tmp = Path(tmp)
        run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp / "dist"), str(_tracked_copy(tmp))])
        wheel = next((tmp / "dist").glob("flash_attn_sm120-*.whl"))
        names = zipfile.ZipFile(wheel).namelist()
        missing = [t for t in TABLES if f"flash_attn_sm120/configs/{t}" not in names]
        if missing:
            print(f"FAIL: the wheel {wheel.name} lacks {missing}")
            return 1
        env_dir = tmp / "venv"
        venv.EnvBuilder(with_pip=True).create(env_dir)
        py = env_dir / "bin" / "python"
        run([py, "-m", "pip", "install", "-q", "--no-deps", str(wheel)])
        venv_site = Path(subprocess.check_output([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                                 text=True).strip())
        # the current environment's site directories, appended after the venv's own (so the wheel's copy
        # is found first; the probe asserts it) and processed as site dirs (the DSL adds its packages
        # through a .pth file there)
        adds = "; ".join(f"site.addsitedir({d!r})" for d in site.getsitepackages())
        (venv_site / "zz_dependencies.pth").write_text(f"import site; {adds}\n")
        outside = tmp / "elsewhere"
        outside.mkdir()
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        run([py, "-c", PROBE, str(env_dir)], cwd=outside, env=env)
        run([py, "-m", "flash_attn_sm120.explain", "--seqlen-q", "1", "--seqlen-k", "32768", "--num-splits", "0"],
            cwd=outside, env=env, stdout=subprocess.DEVNULL)
        run([py, "-m", "flash_attn_sm120.selftest", "--help"], cwd=outside, env=env, stdout=subprocess.DEVNULL)
    print("wheel check: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
