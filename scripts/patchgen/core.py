"""The machinery of scripts/make_patches.py: pristine upstream source, git, lifting package code
into upstream's names, anchored text edits, and commit messages (no patch step lives here).

Every helper raises AnchorError or UpstreamVersionError with a message naming the file and the
anchor, so a pin bump that moved upstream code fails loudly instead of producing a wrong patch.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import importlib.metadata
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from flash_attn_sm120 import config as pkg_config

ROOT = Path(__file__).resolve().parent.parent.parent
UPSTREAM_DISTRIBUTION = "flash-attn-4"
DEFAULT_TABLE = ROOT / "flash_attn_sm120" / "configs" / "sm120_fwd.toml"
# sm_120a prune results of every search round; a later round's row of the same key wins
DEFAULT_PRUNE = tuple(ROOT / "configs" / "measurements" / d / "prune_sm120a.jsonl" for d in ("search", "search_2"))
DEFAULT_OUT = ROOT / "upstream_patches"
DEFAULT_DECODE_TABLE = ROOT / "flash_attn_sm120" / "configs" / "sm120_decode.toml"
# the decode benchmark whose rows the SplitKV patch's message quotes (bench_decode.py --out)
DEFAULT_DECODE_BENCH = ROOT / "configs" / "measurements" / "2026-11-29_decode_emulated_run3.json"

AUTHOR_NAME = "flash_attn_sm120"
AUTHOR_EMAIL = "flash-attn-sm120@users.noreply.github.com"
FIXED_DATE = "2026-01-01T00:00:00+00:00"

# what the modes of a measurement mean, in the generated config tables (comments) and commit messages
MODE_COMMENT = ["# mode sm120: a real SM120 GPU; mode emulated: SM120 kernels on a bigger GPU with each CTA's",
                "# shared memory padded so that no more CTAs are resident per SM than on SM120."]
EMULATED_NOTE = ("Mode emulated: an sm_90a GPU with each CTA's shared memory padded so that no more CTAs are "
                 "resident per SM than on SM120. The speedup is the evidence; the absolute numbers are not SM120 "
                 "numbers")  # each message ends the sentence with what else emulation cannot show
CUTE = "flash_attn/cute"


class UpstreamVersionError(RuntimeError):
    """The installed upstream is missing or not the pinned version."""


class AnchorError(RuntimeError):
    """A text anchor or a lifted definition was not found where a step expects it."""


# ------------------------------------------------------------------------------ pristine source
def pinned_upstream(pyproject: Path = ROOT / "pyproject.toml") -> tuple[str, str]:
    """(distribution, version) of the FA4 pin in pyproject.toml (`flash-attn-4==X`)."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    for dep in deps:
        m = re.fullmatch(rf"\s*{re.escape(UPSTREAM_DISTRIBUTION)}\s*==\s*([^\s;]+)\s*", dep)
        if m:
            return UPSTREAM_DISTRIBUTION, m.group(1)
    raise UpstreamVersionError(f"pyproject.toml pins no exact {UPSTREAM_DISTRIBUTION}==VERSION dependency")


def check_upstream_version(expected: str, distribution: str = UPSTREAM_DISTRIBUTION) -> importlib.metadata.Distribution:
    """The installed upstream distribution if it is exactly `expected`; else UpstreamVersionError."""
    fix = f"install the pinned version: pip install '{distribution}=={expected}'"
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise UpstreamVersionError(
            f"patches are generated against {distribution}=={expected}, which is not installed; {fix}"
        ) from None
    if dist.version != expected:
        raise UpstreamVersionError(
            f"patches are generated against {distribution}=={expected}, but {distribution}=={dist.version} "
            f"is installed; {fix} (or move the pin, see CONTRIBUTING.md)"
        )
    return dist


def pristine_files(dist: importlib.metadata.Distribution) -> dict[str, bytes]:
    """{path under flash_attn/cute/: bytes} of the wheel, verified against its RECORD hashes."""
    files = {}
    for f in dist.files or ():
        path = str(f).replace(os.sep, "/")
        if not path.startswith(CUTE + "/") or "__pycache__" in path or path.endswith(".pyc"):
            continue
        data = Path(dist.locate_file(f)).read_bytes()
        if f.hash is not None:
            digest = base64.urlsafe_b64encode(hashlib.new(f.hash.mode, data).digest()).rstrip(b"=").decode()
            if digest != f.hash.value:
                raise UpstreamVersionError(
                    f"{path} differs from the {dist.metadata['Name']}=={dist.version} wheel (RECORD hash): "
                    "the installed upstream is not pristine; reinstall it"
                )
        files[path] = data
    if f"{CUTE}/interface.py" not in files:
        raise UpstreamVersionError(f"{dist.metadata['Name']} has no {CUTE}/interface.py: not the expected layout")
    return files


# ------------------------------------------------------------------------------------ git helpers
def _git_env(home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(
        HOME=str(home),
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_AUTHOR_NAME=AUTHOR_NAME,
        GIT_AUTHOR_EMAIL=AUTHOR_EMAIL,
        GIT_AUTHOR_DATE=FIXED_DATE,
        GIT_COMMITTER_NAME=AUTHOR_NAME,
        GIT_COMMITTER_EMAIL=AUTHOR_EMAIL,
        GIT_COMMITTER_DATE=FIXED_DATE,
        LC_ALL="C",
        TZ="UTC",
    )
    return env


def git(repo: Path, *args: str, input: Optional[bytes] = None) -> bytes:
    """Run git in `repo` with a fixed identity and no user/system configuration."""
    cmd = ["git", "-c", "core.abbrev=12", "-c", "diff.renames=false", "-c", "core.autocrlf=false", *args]
    res = subprocess.run(cmd, cwd=repo, env=_git_env(repo.parent), input=input, capture_output=True)
    if res.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed in {repo}:\n{res.stderr.decode(errors='replace')}")
    return res.stdout


def make_pristine_repo(repo: Path, files: dict[str, bytes], version: str) -> None:
    repo.mkdir(parents=True)
    git(repo, "init", "-q")
    for path, data in files.items():
        dest = repo / path
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", f"{UPSTREAM_DISTRIBUTION} {version} (pristine {CUTE})")


# ------------------------------------------------------------------------- source-lifting helpers
def quote_record(pattern: str, text: str, what: str, path: Path, step: str) -> re.Match:
    """The match of `pattern` in a session record's text, whose groups a commit message quotes; AnchorError
    naming the record and the step (a file under scripts/patchgen/) where the record no longer says it."""
    m = re.search(pattern, text, re.S)
    if m is None:
        raise AnchorError(f"{path}: the record no longer says {what} (pattern {pattern!r}); revisit {step}")
    return m


def substitute(text: str, old: str, new: str, *, where: str, count: int = 1) -> str:
    """Replace `old` by `new`, which must occur exactly `count` times (AnchorError otherwise)."""
    found = text.count(old)
    if found != count:
        first = old.strip().splitlines()[0] if old.strip() else repr(old)
        raise AnchorError(f"{where}: expected {count} occurrence(s) of the anchor {first!r}, found {found}")
    return text.replace(old, new)


def rename(text: str, old: str, new: str, *, where: str) -> str:
    """Rename the identifier `old` (whole words only); it must occur at least once."""
    pattern = rf"(?<![\w.]){re.escape(old)}\b"
    if not re.search(pattern, text):
        raise AnchorError(f"{where}: identifier {old!r} not found")
    return re.sub(pattern, new, text)


def top_level_source(module, name: str) -> str:
    """Source of a module's top-level def/class/assignment `name`, with the comment lines just above."""
    src = inspect.getsource(module)
    lines = src.splitlines()
    for node in ast.parse(src).body:
        names = []
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, ast.Assign):
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names = [node.target.id]
        if name in names:
            start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) - 1
            while start > 0 and lines[start - 1].lstrip().startswith("#"):
                start -= 1
            return "\n".join(lines[start : node.end_lineno]) + "\n"
    raise AnchorError(f"{module.__name__}: no top-level definition {name!r}")


def _method_node(tree: ast.Module, cls: str, method: str, where: str) -> ast.FunctionDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method:
                    return item
    raise AnchorError(f"{where}: no method {cls}.{method}")


def _node_lines(node: ast.FunctionDef) -> tuple[int, int]:
    """0-based [start, end) line span of a def including its decorators."""
    start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
    return start, node.end_lineno


def method_source(module, cls: str, method: str) -> tuple[str, ast.FunctionDef]:
    src = inspect.getsource(module)
    node = _method_node(ast.parse(src), cls, method, module.__name__)
    start, end = _node_lines(node)
    return "\n".join(src.splitlines()[start:end]) + "\n", node


def replace_method(text: str, cls: str, method: str, new_source: str, *, where: str, expect_args: list[str]) -> str:
    """Replace a method (decorators included) in `text`; its argument names must be `expect_args`."""
    node = _method_node(ast.parse(text), cls, method, where)
    args = [a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs]
    if args != expect_args:
        raise AnchorError(f"{where}: {cls}.{method} takes {args}, expected {expect_args}")
    lines = text.splitlines(keepends=True)
    start, end = _node_lines(node)
    return "".join(lines[:start]) + new_source + "".join(lines[end:])


def upstream_wording(text: str) -> str:
    """Package comments say "upstream" for FA4; inside FA4 that is the kernel itself."""
    text = re.sub(r"\bupstream's\b", "the kernel's", text)
    return re.sub(r"\bupstream\b", "the kernel", text)


def check_no_package_refs(text: str, where: str) -> None:
    lowered = text.lower()
    for bad in ("flash_attn_sm120", "hardware.", "emulat", "upstream", "configs/measurements"):
        if bad in lowered:
            raise AnchorError(f"{where}: package-only reference {bad!r} left in the upstream code")


# --------------------------------------------------------------------------- table and messages
@dataclass
class Context:
    """What a step sees: the temporary upstream tree and the package's data."""

    tree: Path
    table: tuple  # of flash_attn_sm120.config.TableEntry
    table_path: Path
    prune: dict  # key "bucket/mask/config-name" -> prune row
    upstream_version: str
    families: dict = field(default_factory=dict)  # family -> FamilySpec, grown by steps
    decode_table: tuple = ()  # of flash_attn_sm120.decode.DecodeEntry
    decode_bench: Optional[dict] = None  # bench_decode.py JSON quoted by the SplitKV patch

    def read(self, rel: str) -> str:
        return (self.tree / rel).read_text()

    def write(self, rel: str, text: str) -> None:
        path = self.tree / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def load_table(path: Path) -> tuple:
    with open(path, "rb") as f:
        return tuple(pkg_config.parse_fwd_table(tomllib.load(f)))


def load_prune(path) -> dict:
    """Prune rows by key from one JSONL path or several (None: none)."""
    paths = [] if path is None else [path] if isinstance(path, (str, Path)) else list(path)
    rows = {}
    for p in map(Path, paths):
        if not p.exists():
            continue
        for line in p.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by an interrupted search
            if "key" in row:
                rows[row["key"]] = row
    return rows


def _describe(cfg) -> str:
    stages = f"{cfg.num_stages} stage{'s' if cfg.num_stages > 1 else ''}"
    q = ", Q in registers" if cfg.q_in_regs else ""
    return f"{cfg.num_warps} warps, {cfg.tile_m}x{cfg.tile_n}, {stages}{q}"


def _codegen(prune: dict, bucket: int, mask: str, cfg) -> str:
    row = prune.get(f"{bucket}/{mask}/{cfg.name}")
    if row is None:
        return "-"
    return f"{row['regs']}/{row['stack_bytes']}"


def measurement_table(ctx: Context, entries) -> str:
    """The commit message's measurement table, from the config table's provenance."""
    header = ("d", "mask", "config", "TFLOPS", "before", "speedup", "regs/stack", "before", "GPU", "mode", "date")
    rows = []
    for e in entries:
        p = e.provenance
        before_cfg = pkg_config.upstream_fwd_config(e.head_dim)
        tf, up = p.get("tflops"), p.get("upstream_tflops")
        rows.append((
            str(e.head_dim), e.mask, e.config.name,
            f"{tf:.1f}" if tf is not None else "-",
            f"{up:.1f}" if up is not None else "-",
            f"{tf / up:.2f}x" if tf is not None and up else "-",
            _codegen(ctx.prune, e.head_dim, e.mask, e.config),
            _codegen(ctx.prune, e.head_dim, e.mask, before_cfg),
            str(p["gpu"]), str(p["mode"]), str(p["date"]),
        ))
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    fmt = lambda r: "  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(header)] + [fmt(r) for r in rows])


def commit_message(subject: str, *blocks, width: int = 72) -> str:
    """A commit message: a subject, then blocks separated by blank lines.

    A str block is a paragraph, wrapped to `width` unless it is verbatim (starts with two spaces:
    tables, commands); a list block is a bulleted list, each item wrapped.
    """
    out = [subject]
    for block in blocks:
        if isinstance(block, list):
            out.append("\n".join(textwrap.fill(item, width, initial_indent="- ", subsequent_indent="  ")
                                 for item in block))
        elif block.startswith("  "):
            out.append(block)
        else:
            out.append(textwrap.fill(block, width))
    return "\n\n".join(out) + "\n"



def apply_edits(text: str, edits, rel: str) -> str:
    for what, old, new in edits:
        text = substitute(text, old, new, where=f"{rel} ({what})")
    return text


def _join_defs(parts) -> str:
    """Lifted definitions joined as a module holds them: two blank lines between each."""
    return "\n\n".join(p.rstrip("\n") + "\n" for p in parts)
