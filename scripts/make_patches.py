"""Generate upstream_patches/: git-format patches against pristine FA4, derived from this package.

The package is the single source of truth; the patches are build output. For each change step,
in order, this script

  1. starts from the pristine upstream source of the pinned FA4 (the `flash_attn/cute/` files of
     the installed `flash-attn-4` wheel, checked against the wheel's RECORD hashes) in a temporary
     git repository laid out as Dao-AILab/flash-attention (`flash_attn/cute/...`);
  2. runs the step, a function that edits that tree (code lifted from the package with `ast`,
     renamed into upstream's namespace; precise, verified text substitutions on upstream files)
     and returns the commit message;
  3. commits with a fixed author and date and writes `git format-patch` output to
     `upstream_patches/NNNN-short-name.patch`.

Regenerating gives byte-identical files (fixed identity and dates, no git signature, zero
commit ids in the mbox header, git run without user or system config). Measurement numbers in
the commit messages come from the config table's provenance (configs/sm120_fwd.toml) and codegen
facts from the sm_120a prune results, never from this script.

An anchor that is not found (upstream moved code after a pin bump) or a package function that
changed shape raises AnchorError naming the file and the anchor.

Usage:
  python scripts/make_patches.py              # (re)write upstream_patches/
  python scripts/make_patches.py --check      # exit 1 with a diff summary if upstream_patches/ is stale
"""

from __future__ import annotations

import argparse
import ast
import base64
import difflib
import hashlib
import importlib.metadata
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flash_attn_sm120 import config as pkg_config  # noqa: E402
from flash_attn_sm120 import decode as pkg_decode  # noqa: E402
from flash_attn_sm120 import hardware  # noqa: E402
from flash_attn_sm120 import kernels as pkg_kernels  # noqa: E402
from flash_attn_sm120 import splitkv as pkg_splitkv  # noqa: E402
from flash_attn_sm120.kernels import fwd_cpasync as pkg_fwd_cpasync  # noqa: E402
from flash_attn_sm120.kernels import fwd_splitkv as pkg_fwd_splitkv  # noqa: E402

UPSTREAM_DISTRIBUTION = "flash-attn-4"
DEFAULT_TABLE = ROOT / "configs" / "sm120_fwd.toml"
# sm_120a prune results of every search round; a later round's row of the same key wins
DEFAULT_PRUNE = tuple(ROOT / "configs" / "measurements" / d / "prune_sm120a.jsonl" for d in ("search", "search_2"))
DEFAULT_OUT = ROOT / "upstream_patches"
DEFAULT_DECODE_TABLE = ROOT / "configs" / "sm120_decode.toml"
# the decode benchmark whose rows the SplitKV patch's message quotes (bench_decode.py --out)
DEFAULT_DECODE_BENCH = ROOT / "configs" / "measurements" / "2026-11-29_decode_emulated_run3.json"

AUTHOR_NAME = "flash_attn_sm120"
AUTHOR_EMAIL = "flash-attn-sm120@users.noreply.github.com"
FIXED_DATE = "2026-01-01T00:00:00+00:00"
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


# ----------------------------------------------------------------------------- step 1: SM120 fwd
@dataclass(frozen=True)
class FamilySpec:
    """A kernel family as upstream names it: the class and its two SM120 functions."""

    module: str  # flash_attn.cute.<module>
    kernel_cls: str
    config_error: str
    smem_bytes: str


# (head dim, mask) whose table entries tests/test_patches.py compiles on the patched upstream
# for sm_120a and checks for spills; the commit message names those it covered
CODEGEN_CASES = ((128, "none"), (128, "causal"), (64, "causal"))

# renames applied to code lifted from the package into upstream's namespace
_CONFIG_RENAMES = (
    ("FwdConfig", "Sm120FwdConfig"),
    ("upstream_fwd_config", "sm120_default_fwd_config"),
)
_KERNEL_RENAMES = (("smem_bytes", "sm120_fwd_smem_bytes"),)


def _lift_sm120_rules() -> str:
    """sm120_config_error and its helpers from kernels/fwd_cpasync.py, in upstream's names."""
    where = "flash_attn_sm120/kernels/fwd_cpasync.py"
    parts = [top_level_source(pkg_fwd_cpasync, n) for n in ("_SMEM_ALIGN", "_round_up", "smem_bytes", "_smem_k_block", "sm120_config_error")]
    code = "\n\n".join(p.rstrip("\n") + "\n" for p in parts)  # two blank lines between definitions
    for old, new in _KERNEL_RENAMES:
        code = rename(code, old, new, where=where)
    code = rename(code, "hardware.DSL_STATIC_SMEM", "SM120_STATIC_SMEM", where=where)
    code = rename(code, "hardware.SMEM_PER_BLOCK_MAX", "SM120_SMEM_PER_BLOCK_MAX", where=where)
    code = upstream_wording(code)
    check_no_package_refs(code, where)
    constants = (
        f"# SM120 (compute capability 12.0): at most {hardware.SMEM_PER_BLOCK_MAX // 1024} KB of shared memory per block,\n"
        "# and the static shared memory the CuTe DSL adds to every kernel (cuobjdump SHARED on sm_120a)\n"
        f"SM120_SMEM_PER_BLOCK_MAX = {hardware.SMEM_PER_BLOCK_MAX}\n"
        f"SM120_STATIC_SMEM = {hardware.DSL_STATIC_SMEM}\n"
    )
    return constants + "\n" + code


def _lift_can_implement() -> tuple[str, list[str]]:
    src, node = method_source(pkg_fwd_cpasync, "FlashAttentionForwardSm120CpAsync", "can_implement")
    if ast.get_docstring(node) is None:
        lines = src.splitlines(keepends=True)
        first_stmt = node.body[0].lineno - _node_lines(node)[0] - 1
        indent = " " * (node.body[0].col_offset)
        doc = f'{indent}"""Whether SM120 can run this config: fp16/bf16 and no reason from sm120_config_error."""\n'
        src = "".join(lines[:first_stmt]) + doc + "".join(lines[first_stmt:])
    args = [a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs]
    return src, args


def patch_flash_fwd_sm120(ctx: Context) -> None:
    """flash_fwd_sm120.py: the SM120 rules and a can_implement that applies them."""
    rel = f"{CUTE}/flash_fwd_sm120.py"
    text = ctx.read(rel)
    text = substitute(
        text,
        "# FlashAttentionForwardSm80 and overrides the SMEM capacity check accordingly.\n",
        "# FlashAttentionForwardSm80 and overrides the SMEM capacity check accordingly.\n"
        "#\n"
        "# It runs with 4 or 8 warps stacked along M, any tile sm120_config_error accepts, and 1-3\n"
        "# cp.async stages; flash_fwd_sm120_configs.py holds the measured choice per head dim and mask.\n",
        where=rel,
    )
    text = substitute(text, "import cutlass\nimport cutlass.utils as utils_basic\n",
                      "from typing import Optional\n\nimport cutlass\n", where=rel)
    anchor = "from flash_attn.cute.flash_fwd import FlashAttentionForwardSm80\n"
    text = substitute(text, anchor, anchor + "\n\n" + _lift_sm120_rules(), where=rel)
    can_impl, args = _lift_can_implement()
    check_no_package_refs(can_impl, "flash_attn_sm120/kernels/fwd_cpasync.py (can_implement)")
    text = replace_method(text, "FlashAttentionForwardSm120", "can_implement", can_impl, where=rel, expect_args=args)
    if "utils_basic" in text:
        raise AnchorError(f"{rel}: utils_basic is still used; keep its import")
    ctx.write(rel, text)


def _table_literal(ctx: Context) -> tuple[str, list]:
    """SM120_FWD_TABLE as Python source (provenance as comments) and the entries it holds."""
    kept, skipped = [], []
    for e in ctx.table:
        (kept if e.config.family in ctx.families else skipped).append(e)
    lines = ["SM120_FWD_TABLE: tuple[TableEntry, ...] = ("]
    commands = sorted({str(e.provenance["command"]) for e in kept})
    for e in kept:
        p, c = e.provenance, e.config
        tf, up = p.get("tflops"), p.get("upstream_tflops")
        perf = f"{tf:.1f} TFLOPS" if tf is not None else "no TFLOPS recorded"
        if tf is not None and up:
            perf += f" vs {up:.1f} before ({tf / up:.2f}x)"
        lines.append(f"    # {e.head_dim}/{e.mask}: {_describe(c)}")
        lines.append(f"    #   {perf}; {p['gpu']}, {p['mode']}, {p['date']}")
        lines.append(
            f'    TableEntry({e.head_dim}, "{e.mask}", Sm120FwdConfig(num_threads={c.num_threads}, tile_m={c.tile_m}, '
            f'tile_n={c.tile_n},\n        num_stages={c.num_stages}, q_in_regs={c.q_in_regs}, family="{c.family}")),'
        )
    for e in skipped:
        lines.append(f"    # {e.head_dim}/{e.mask}: the {e.config.family!r} family is not upstream yet")
    lines.append(")")
    head = ["# The measured SM120 forward configs, one per (head-dim bucket, mask kind).", "#"]
    if kept:
        head += ["# Measured with (from the flash_attn_sm120 project):"] + [f"#   {c}" for c in commands]
        head += ["# mode sm120: a real SM120 GPU; mode emulated: SM120 kernels on a bigger GPU with each CTA's",
                 "# shared memory padded so that no more CTAs are resident per SM than on SM120."]
    else:
        head += ["# Empty: every problem gets SM120's choice before this table (sm120_default_fwd_config, or",
                 "# the first fallback that fits where that one does not)."]
    if len(lines) == 2:
        lines = [lines[0] + ")"]
    return "\n".join(head + lines) + "\n", kept


_ADAPTER = '''
def sm120_fwd_config(
    head_dim: int,
    head_dim_v: int,
    causal: bool,
    local: bool,
    tile_mn: Optional[Tuple[int, int]] = None,
) -> Sm120FwdConfig:
    """The forward config the interface runs on SM120 for these static properties.

    The table's choice (select_fwd_config). With an explicit tile_mn: the table's entry when its
    tiles are those, else those tiles with 4 warps and one stage, as before the table.
    """
    cfg = select_fwd_config(SM120_FWD_TABLE, head_dim, head_dim_v, causal, local)
    if tile_mn is None or (cfg.tile_m, cfg.tile_n) == tuple(tile_mn):
        return cfg
    return Sm120FwdConfig(num_threads=128, tile_m=tile_mn[0], tile_n=tile_mn[1], num_stages=1, q_in_regs=False)
'''


def render_configs_module(ctx: Context) -> tuple[str, list]:
    """flash_fwd_sm120_configs.py: the families, the config type, the table, the selection rule."""
    where = "flash_attn_sm120/config.py"
    cfg_parts = [top_level_source(pkg_config, n) for n in ("HEAD_DIM_BUCKETS", "MASK_KINDS")]
    family_cls = top_level_source(pkg_kernels, "KernelFamily")
    cfg_defs = [top_level_source(pkg_config, n) for n in
                ("FwdConfig", "upstream_fwd_config", "_FALLBACKS", "TableEntry", "head_dim_bucket", "mask_kind",
                 "_SELECT_MEMO", "select_fwd_config", "_select_uncached")]
    code = "".join(p + "\n" for p in cfg_parts) + "\n" + family_cls + "\n\n"
    imports = {}
    fam_lines = ["FAMILIES: dict[str, KernelFamily] = {"]
    for name, spec in ctx.families.items():
        imports.setdefault(spec.module, []).extend([spec.kernel_cls, spec.config_error, spec.smem_bytes])
        fam_lines.append(f'    "{name}": KernelFamily("{name}", {spec.kernel_cls}, {spec.config_error}, {spec.smem_bytes}),')
    fam_lines.append("}")
    code += "\n".join(fam_lines) + "\n\n\n" + "\n\n".join(d.rstrip("\n") + "\n" for d in cfg_defs).replace("\n\n\n\n", "\n\n\n")
    for old, new in _CONFIG_RENAMES:
        code = rename(code, old, new, where=where)
    code = substitute(
        code,
        "# upstream's own SM120 choice (flash_attn/cute/interface.py, _get_fwd_config): 4 warps, 1 stage\n",
        "# SM120's choice before the table (4 warps, 1 stage): used where the table has no entry\n",
        where=where,
    )
    code = upstream_wording(code)
    check_no_package_refs(code, where)
    table, kept = _table_literal(ctx)
    fam_imports = "".join(
        f"from {mod} import {', '.join(sorted(set(names)))}\n" for mod, names in sorted(imports.items())
    )
    header = (
        '"""SM120 forward configs: warps, tiles and cp.async stages per (head dim, mask), and the rule\n'
        "that picks one.\n"
        "\n"
        "SM120 (RTX PRO 6000 Blackwell, RTX 5090, DGX Spark) runs the SM80-style forward with 99 KB of\n"
        "shared memory per block. Which tiling is fastest depends on the head dim and the mask, so the\n"
        "choice is data: SM120_FWD_TABLE holds one measured entry per (head-dim bucket, mask kind).\n"
        "select_fwd_config is a pure function of the table and the problem's static properties:\n"
        "exact (bucket, mask); for local, the causal entry; then the bucket's non-causal entry; then\n"
        "SM120's earlier default and smaller fallbacks. An entry that cannot run the actual head dims\n"
        "(sm120_config_error) is skipped.\n"
        '"""\n'
        "\n"
        "from __future__ import annotations\n"
        "\n"
        "from dataclasses import asdict, dataclass, field\n"
        "from typing import Any, Callable, Iterable, Optional, Tuple\n"
        "\n"
        f"{fam_imports}"
        "\n"
    )
    return header + code + "\n\n" + table + "\n" + _ADAPTER, kept


_INTERFACE_EDITS = (
    (
        "import of the SM120 forward kernel",
        "from flash_attn.cute.flash_fwd_sm120 import FlashAttentionForwardSm120\n",
        "from flash_attn.cute.flash_fwd_sm120 import FlashAttentionForwardSm120\n"
        "from flash_attn.cute.flash_fwd_sm120_configs import sm120_fwd_config\n",
    ),
    (
        "SM120 tile choice in _get_fwd_config",
        "        if arch // 10 == 12:\n"
        "            # SM120 tile sizes tuned for 99 KB SMEM capacity:\n"
        "            # D<=64:  128x128 \u2192 48 KB (good occupancy)\n"
        "            # D>64:   128x64  \u2192 64 KB (128x128 would use 96 KB, hurting occupancy)\n"
        "            if head_dim > 64:\n"
        "                cfg = FwdConfig(128, 64, True, True)\n",
        "        if arch // 10 == 12:\n"
        "            # SM120: tiles from the measured table (flash_fwd_sm120_configs.py); warps and\n"
        "            # cp.async stages come from the same entry in _flash_attn_fwd\n"
        "            sm120_cfg = sm120_fwd_config(head_dim, head_dim_v, causal, local)\n"
        "            cfg = FwdConfig(sm120_cfg.tile_m, sm120_cfg.tile_n, True, True)\n",
    ),
    (
        "SM80/SM120 num_threads = 128 in _flash_attn_fwd",
        "    # SM80/SM120: uses SM80 MMA, 128 threads (4 warps)\n"
        "    if arch // 10 in [8, 12]:\n"
        "        num_threads = 128\n",
        "    # SM80: uses SM80 MMA, 128 threads (4 warps). SM120: the same MMA with 4 or 8 warps, set\n"
        "    # below from the config that gives its tiles\n"
        "    if arch // 10 in [8, 12]:\n"
        "        num_threads = 128\n",
    ),
    (
        "SM120 stages and Q-in-registers in the compile key",
        "        fa_logging.get_fa_log_level(),\n"
        "    )\n"
        "\n"
        "    if compile_key not in _flash_attn_fwd.compile_cache:\n",
        "        fa_logging.get_fa_log_level(),\n"
        "    )\n"
        "    if arch // 10 == 12:\n"
        "        # SM120: the table's cp.async stages and Q-in-registers change the kernel, not only its tiles\n"
        "        compile_key += (sm120_fwd_cfg.num_stages, sm120_fwd_cfg.q_in_regs)\n"
        "\n"
        "    if compile_key not in _flash_attn_fwd.compile_cache:\n",
    ),
    (
        "SM120 warps and stages after _get_fwd_config",
        "    intra_wg_overlap = fwd_cfg.intra_wg_overlap\n",
        "    intra_wg_overlap = fwd_cfg.intra_wg_overlap\n"
        "    if arch // 10 == 12:\n"
        "        # SM120: warps, cp.async stages and Q in registers from the measured table entry that\n"
        "        # gave the tiles (flash_fwd_sm120_configs.py)\n"
        "        sm120_fwd_cfg = sm120_fwd_config(head_dim, head_dim_v, causal, local, tile_mn=tile_mn)\n"
        "        num_threads = sm120_fwd_cfg.num_threads\n",
    ),
    (
        "FlashAttentionForwardSm120(...) construction",
        "            fa_fwd = FlashAttentionForwardSm120(\n"
        "                dtype,\n"
        "                head_dim,\n"
        "                head_dim_v,\n"
        "                qhead_per_kvhead,\n"
        "                is_causal=causal,\n"
        "                is_local=local,\n"
        "                pack_gqa=pack_gqa,\n"
        "                tile_m=tile_m,\n"
        "                tile_n=tile_n,\n"
        "                num_stages=1,\n"
        "                num_threads=num_threads,\n"
        "                Q_in_regs=False,\n",
        "            assert (tile_m, tile_n) == (sm120_fwd_cfg.tile_m, sm120_fwd_cfg.tile_n), (\n"
        "                \"SM120 tiles must come from the same config as its warps and stages\"\n"
        "            )\n"
        "            fa_fwd = FlashAttentionForwardSm120(\n"
        "                dtype,\n"
        "                head_dim,\n"
        "                head_dim_v,\n"
        "                qhead_per_kvhead,\n"
        "                is_causal=causal,\n"
        "                is_local=local,\n"
        "                pack_gqa=pack_gqa,\n"
        "                tile_m=tile_m,\n"
        "                tile_n=tile_n,\n"
        "                num_stages=sm120_fwd_cfg.num_stages,\n"
        "                num_threads=num_threads,\n"
        "                Q_in_regs=sm120_fwd_cfg.q_in_regs,\n",
    ),
)


def apply_edits(text: str, edits, rel: str) -> str:
    for what, old, new in edits:
        text = substitute(text, old, new, where=f"{rel} ({what})")
    return text


def step_sm120_fwd_table(ctx: Context) -> str:
    """Patch 1: SM120 forward with warps/tiles/stages from the measured table (4 or 8 warps)."""
    ctx.families["cpasync"] = FamilySpec(
        "flash_attn.cute.flash_fwd_sm120", "FlashAttentionForwardSm120", "sm120_config_error", "sm120_fwd_smem_bytes"
    )
    patch_flash_fwd_sm120(ctx)
    module, kept = render_configs_module(ctx)
    ctx.write(f"{CUTE}/flash_fwd_sm120_configs.py", module)
    rel = f"{CUTE}/interface.py"
    ctx.write(rel, apply_edits(ctx.read(rel), _INTERFACE_EDITS, rel))

    modes = sorted({str(e.provenance["mode"]) for e in kept})
    checked = [c for c in CODEGEN_CASES if c in {(e.head_dim, e.mask) for e in kept}]
    if kept:
        measured = [
            "Measured (TFLOPS: geometric mean over the bucket's problems, causal counted as half the "
            "work; before: SM120's previous 4-warp, 1-stage config on the same problems, GPU and mode; "
            "regs/stack: sm_120a registers per thread and stack bytes from cuobjdump, - where not "
            "recorded):",
            measurement_table(ctx, kept),
        ]
        if "sm120" in modes:
            measured.append("Mode sm120: measured on a real SM120 GPU.")
        if "emulated" in modes:
            measured.append(
                "Mode emulated: the SM120 kernels on a bigger GPU (the GPU column) with each CTA's shared "
                "memory padded so that no more CTAs are resident per SM than on SM120; the speedup is the "
                "evidence, the absolute numbers are not SM120 numbers."
            )
        commands = sorted({str(e.provenance["command"]) for e in kept})
        measured += ["Commands:", "\n".join(f"  {c}" for c in commands)]
    else:
        measured = [
            "Measured: no entries yet. The table is empty, so every problem gets the fallback (4 warps, "
            "64x64, one stage); this patch adds the mechanism and the SM120 rules."
        ]
    return commit_message(
        "[Cute,Sm120] Forward tiles from a measured table (warps, tiles, stages, Q in registers)",
        "SM120 (RTX PRO 6000 Blackwell, RTX 5090, DGX Spark) runs the SM80-style forward (mma.sync "
        "m16n8k16, cp.async) with 99 KB of shared memory per block. Its dispatch was fixed: 128 threads "
        "(4 warps), 128x128 tiles up to d=64 and 128x64 above, one cp.async stage, Q in shared memory.",
        "What changes:",
        [
            "flash_fwd_sm120_configs.py (new): a table of (head-dim bucket, mask) -> threads, tile_m, "
            "tile_n, cp.async stages, Q in registers, with each measurement's provenance as comments, "
            "and a pure selection rule. Problems without an entry get 4 warps, 64x64, one stage, which "
            "fits 99 KB and compiles without spills on sm_120a at every head dim up to 256 (the previous "
            "128x64 spills above d=96 and does not fit at d=256).",
            "flash_fwd_sm120.py: can_implement applies the SM120 rules of sm120_config_error, which "
            "names the reason for a refusal: 4 or 8 warps stacked along M (tile_m a multiple of 16 rows "
            "per warp), tile_n a multiple of 16, tile_m a multiple of the rows one Q/O copy covers, 1-3 "
            "stages, and the exact shared memory (sQ, sK, sV each 1 KB aligned, plus 1 KB of static "
            "shared memory) within 99 KB.",
            "interface.py: the SM120 branches take threads, tiles, stages and Q-in-registers from the "
            "table (stages and Q-in-registers join the compile key, as tiles and threads already are); "
            "an explicit tile_mn keeps 4 warps and one stage unless the table's entry has those tiles.",
        ],
        "Why: an SM120 SM has 100 KB of shared memory, so the 64 KB d=128 tile runs one CTA (4 warps) "
        "per SM, and with 4 warps each thread holds a quarter of a 128-row tile's S and O accumulators: "
        "at d=128 the 128x64 kernel runs out of registers on sm_120a and spills to local memory. Smaller "
        "tiles with Q in registers (sharing V's buffer) fit two CTAs per SM without spilling, 8 warps "
        "stacked along M halve the accumulators per thread, and a second cp.async stage keeps the next "
        "K/V tile loading during the MMAs. Which combination wins depends on the head dim and the mask, "
        "hence a measured table rather than one rule. Q in registers is refused with more than one stage: "
        "the prologue's cp.async wait count assumes Q is not in registers and Q would be read before it "
        "lands (caught as wrong results by the correctness gate).",
        *measured,
        "Tested:",
        [
            "Correctness: in the flash_attn_sm120 config search every candidate is timed only after its "
            "output matches an fp32 reference (output buffer poisoned with NaN first) on the bucket's "
            "problems, in the mode of its row above."
            if kept else
            "Correctness: no default changes and the kernel code is upstream's; the new rules and the "
            "selection are exercised on the CPU.",
            f"Codegen: this patch applied to {UPSTREAM_DISTRIBUTION} {ctx.upstream_version} and imported in "
            "place of the installed package; the SM120 forward with the table's entries for "
            + ", ".join(f"d={d} {'non-causal' if mask == 'none' else mask}" for d, mask in checked)
            + " compiled for sm_120a with fake tensors on a CPU: no local memory (cuobjdump stack 0, no "
            "LDL/STL)."
            if checked else
            f"Codegen: this patch applied to {UPSTREAM_DISTRIBUTION} {ctx.upstream_version} and imported in "
            "place of the installed package; the SM120 forward compiles for sm_120a with fake tensors on "
            "a CPU, and the selection falls back to the previous defaults where the table has no entry.",
            "The patch is generated from flash_attn_sm120 (scripts/make_patches.py) and checked to apply "
            f"to the pristine {ctx.upstream_version} source.",
        ],
    )


# ------------------------------------------------------------- step 2: SplitKV, paged KV, decode
# the package's kernel module, as upstream's flash_fwd_sm120_splitkv.py: (anchor, replacement)
_SPLITKV_MODULE_EDITS = (
    ('"""SM120 forward, splitkv family: SplitKV and paged KV on the cp.async + mma.sync kernel.\n',
     '"""SM120 forward with SplitKV and paged KV: the cp.async + mma.sync kernel of flash_fwd_sm120.py.\n'),
    ("Algorithm. The cp.async family's FlashAttention-2 mainloop",
     "Algorithm. FlashAttentionForwardSm120's FlashAttention-2 mainloop"),
    ("two generalizations that upstream FA4 refuses on SM 12.0:", "two generalizations SM 12.0 lacked:"),
    ("  Upstream's `FlashAttentionForwardCombine` then merges", "  `FlashAttentionForwardCombine` then merges"),
    ("so the MMA side is unchanged. Upstream's\n  `PagedKVManager` (flash_attn/cute/paged_kv.py)",
     "so the MMA side is unchanged.\n  `PagedKVManager` (paged_kv.py)"),
    ("written by upstream's bf16/fp16 epilogue", "written by the SM80 bf16/fp16 epilogue"),
    ("work as in\nthe cp.async family. Shared memory and its SM120-emulation padding are the cp.async family's.\n",
     "work as in\nFlashAttentionForwardSm120, with the same tiles, rules (sm120_config_error) and shared memory.\n"),
    ("from flash_attn_sm120.kernels.fwd_cpasync import FlashAttentionForwardSm120CpAsync\n",
     "from flash_attn.cute.flash_fwd_sm120 import FlashAttentionForwardSm120\n"),
    ('    family = "splitkv"\n\n', ""),
)

# the package's split rule (splitkv.py) and SM120 occupancy model (hardware.py), as upstream's
# flash_fwd_sm120_splits.py
_SPLITS_DOC_EDITS = (
    ("`num_splits` keeps upstream FA4's meaning:", "`num_splits` keeps the interface's meaning:"),
    ("(from hardware.py's SM120 occupancy model for\nthe chosen config; the SM count is the GPU's own, so in "
     "emulation it is the host's)",
     "(from the SM120 occupancy model below\nfor the chosen config; the SM count is the GPU's own)"),
)
_SPLITS_CODE_EDITS = (
    ("# Upstream's heuristic caps splits at 128; its combine kernel takes at most 256.",
     "# num_splits_heuristic caps splits at 128; the combine kernel takes at most 256."),
    ("Measured (H200, SM120 emulation, CUDA\n# graphs, configs/measurements/2026-11-29_decode_splits_emulated.md)",
     "Measured (an H200 held to SM120's\n# CTAs per SM, CUDA graphs; see the commit that added this file)"),
    ('"""Upstream\'s meaning: 1 off, n > 1 that many (clamped), <= 0 chosen."""',
     '"""The interface\'s meaning: 1 off, n > 1 that many (clamped), <= 0 chosen."""'),
)
_SPLITS_NAMES = ("MAX_SPLITS", "MIN_N_BLOCKS_TO_SPLIT", "FULL_GRID_SHARE", "EFFICIENCY_SLACK", "MIN_WAVES",
                 "MAX_BLOCKS_PER_SPLIT", "MIN_BLOCKS_PER_SPLIT")
_SPLITS_DEFS = ("useful_max_splits", "clamp_num_splits", "choose_num_splits", "resolve_num_splits")
_OCCUPANCY_NAMES = ("SMEM_PER_SM", "SMEM_PER_BLOCK_MAX", "SMEM_RESERVED_PER_CTA", "THREADS_PER_SM", "REGS_PER_SM",
                    "REG_ALLOC_UNIT_PER_WARP", "MAX_CTAS_PER_SM")
_OCCUPANCY_DEFS = ("Occupancy", "regs_per_cta", "sm120_occupancy")

_SPLITS_ADAPTER = '''

def sm120_num_splits(
    num_splits: int,
    cfg: Sm120FwdConfig,
    head_dim: int,
    head_dim_v: int,
    *,
    total_mblocks: int,
    n_blocks: int,
    num_sms: int,
) -> int:
    """The interface's num_splits resolved for an SM120 forward running `cfg` (its CTAs per SM)."""
    smem = cfg.smem_bytes(head_dim, head_dim_v) + SM120_STATIC_SMEM
    ctas_per_sm = sm120_occupancy(smem, cfg.num_threads).ctas_per_sm
    return resolve_num_splits(
        num_splits, total_mblocks=total_mblocks, n_blocks=n_blocks, num_sms=num_sms, ctas_per_sm=ctas_per_sm
    )
'''


def _join_defs(parts) -> str:
    return "\n\n".join(p.rstrip("\n") + "\n" for p in parts)


def render_splitkv_module() -> str:
    """flash_fwd_sm120_splitkv.py: the package's splitkv kernel module in upstream's names."""
    where = "flash_attn_sm120/kernels/fwd_splitkv.py"
    text = inspect.getsource(pkg_fwd_splitkv)
    for old, new in _SPLITKV_MODULE_EDITS:
        text = substitute(text, old, new, where=where)
    text = rename(text, "FlashAttentionForwardSm120CpAsync", "FlashAttentionForwardSm120", where=where)
    text = upstream_wording(text)
    check_no_package_refs(text, where)
    return text


def render_splits_module() -> str:
    """flash_fwd_sm120_splits.py: the SM120 split rule with the occupancy model it needs."""
    where = "flash_attn_sm120/splitkv.py"
    doc = ast.get_docstring(ast.parse(inspect.getsource(pkg_splitkv)), clean=False)
    for old, new in _SPLITS_DOC_EDITS:
        doc = substitute(doc, old, new, where=where)
    occupancy = "".join(top_level_source(hardware, n) for n in _OCCUPANCY_NAMES)
    occupancy_defs = _join_defs(top_level_source(hardware, n) for n in _OCCUPANCY_DEFS)
    constants = "".join(top_level_source(pkg_splitkv, n) for n in _SPLITS_NAMES)
    defs = _join_defs(top_level_source(pkg_splitkv, n) for n in _SPLITS_DEFS)
    code = (
        "# SM120 resources per SM (compute capability 12.0, as the CUDA occupancy calculator models them)\n"
        + occupancy + "\n\n" + occupancy_defs + "\n\n" + constants + "\n\n" + defs
    )
    for old, new in _SPLITS_CODE_EDITS:
        code = substitute(code, old, new, where=where)
    text = (
        f'"""{doc}"""\n\n'
        "from __future__ import annotations\n\n"
        "import math\n"
        "from dataclasses import dataclass\n"
        "from functools import lru_cache\n\n"
        "from flash_attn.cute.flash_fwd_sm120 import SM120_STATIC_SMEM\n"
        "from flash_attn.cute.flash_fwd_sm120_configs import Sm120FwdConfig\n\n\n"
        + code + "\n" + _SPLITS_ADAPTER
    )
    text = upstream_wording(text)
    check_no_package_refs(text, where)
    return text


def _decode_table_literal(ctx: Context) -> str:
    lines = [
        "# Decode-shaped problems (every sequence has at most DECODE_MAX_SEQLEN_Q query tokens) read K and V",
        "# once with the GQA group packed into one M tile: their own table, chosen before SM120_FWD_TABLE.",
        "SM120_DECODE_TABLE: tuple[DecodeEntry, ...] = (",
    ]
    for e in ctx.decode_table:
        c, p = e.config, e.provenance
        lines.append(f"    # d<={e.head_dim}: {_describe(c)}")
        if e.measured:
            lines.append(f"    #   measured: {p['gpu']}, {p['mode']}, {p['date']}")
        else:
            lines.append("    #   not measured yet (chosen by its shared memory: one CTA per SM, two K/V stages)")
        lines.append(
            f"    DecodeEntry({e.head_dim}, Sm120FwdConfig(num_threads={c.num_threads}, tile_m={c.tile_m}, "
            f"tile_n={c.tile_n}, num_stages={c.num_stages},\n        q_in_regs={c.q_in_regs})),"
        )
    lines.append(")")
    return "\n".join(lines) + "\n"


_DECODE_ADAPTER_EDITS = (
    ("    tile_mn: Optional[Tuple[int, int]] = None,\n) -> Sm120FwdConfig:\n",
     "    tile_mn: Optional[Tuple[int, int]] = None,\n    max_seqlen_q: Optional[int] = None,\n) -> Sm120FwdConfig:\n"),
    ("    The table's choice (select_fwd_config). With an explicit tile_mn:",
     "    Decode-shaped problems (an int max_seqlen_q of 1..DECODE_MAX_SEQLEN_Q) take SM120_DECODE_TABLE's\n"
     "    entry, others the table's choice (select_fwd_config). With an explicit tile_mn:"),
    ("    cfg = select_fwd_config(SM120_FWD_TABLE, head_dim, head_dim_v, causal, local)\n",
     "    cfg = None\n"
     "    if isinstance(max_seqlen_q, int) and is_decode(max_seqlen_q):\n"
     "        cfg = select_decode_config(SM120_DECODE_TABLE, head_dim, head_dim_v)\n"
     "    if cfg is None:\n"
     "        cfg = select_fwd_config(SM120_FWD_TABLE, head_dim, head_dim_v, causal, local)\n"),
)


def patch_configs_for_decode(ctx: Context) -> None:
    """flash_fwd_sm120_configs.py: the decode table and its rule, read first for decode shapes."""
    rel = f"{CUTE}/flash_fwd_sm120_configs.py"
    where = "flash_attn_sm120/decode.py"
    defs = [top_level_source(pkg_decode, n) for n in ("DECODE_MAX_SEQLEN_Q", "DecodeEntry", "is_decode",
                                                       "select_decode_config")]
    code = _join_defs(defs)
    code = rename(code, "FwdConfig", "Sm120FwdConfig", where=where)
    code = upstream_wording(code)
    check_no_package_refs(code, where)
    text = ctx.read(rel)
    anchor = "\ndef sm120_fwd_config(\n"
    text = substitute(text, anchor, "\n" + code + "\n\n" + _decode_table_literal(ctx) + "\n" + anchor, where=rel)
    for old, new in _DECODE_ADAPTER_EDITS:
        text = substitute(text, old, new, where=rel)
    ctx.write(rel, text)


_SPLITKV_INTERFACE_EDITS = (
    (
        "imports of the SM120 SplitKV kernel and split rule",
        "from flash_attn.cute.flash_fwd_sm120_configs import sm120_fwd_config\n",
        "from flash_attn.cute.flash_fwd_sm120_configs import sm120_fwd_config\n"
        "from flash_attn.cute.flash_fwd_sm120_splitkv import (\n"
        "    MAX_PAGE_SIZE as SM120_MAX_PAGE_SIZE,\n"
        "    PAGE_SIZE_MULTIPLE as SM120_PAGE_SIZE_MULTIPLE,\n"
        "    FlashAttentionForwardSm120SplitKV,\n"
        "    paged_head_dim_error,\n"
        ")\n"
        "from flash_attn.cute.flash_fwd_sm120_splits import sm120_num_splits\n",
    ),
    (
        "decode tiles in _get_fwd_config",
        "            sm120_cfg = sm120_fwd_config(head_dim, head_dim_v, causal, local)\n",
        "            sm120_cfg = sm120_fwd_config(head_dim, head_dim_v, causal, local, max_seqlen_q=max_seqlen_q)\n",
    ),
    (
        "SM120 num_splits in _get_fwd_config",
        "    if arch // 10 == 12:\n"
        "        assert num_splits <= 1, \"SM120 forward only supports num_splits=1\"\n"
        "        num_splits = 1\n"
        "    elif num_splits < 1:\n",
        "    if arch // 10 == 12:\n"
        "        # SM120 SplitKV: 1 = off, n > 1 = n (at most one split per key block), < 1 = chosen from\n"
        "        # the SM count and the CTAs per SM of the config (flash_fwd_sm120_splits.py)\n"
        "        if num_splits != 1:\n"
        "            num_splits = sm120_num_splits(\n"
        "                num_splits,\n"
        "                sm120_fwd_config(head_dim, head_dim_v, causal, local, tile_mn=tile_mn, max_seqlen_q=max_seqlen_q),\n"
        "                head_dim,\n"
        "                head_dim_v,\n"
        "                total_mblocks=total_mblocks,\n"
        "                n_blocks=num_n_blocks,\n"
        "                num_sms=get_num_sms_for_selection(device.index, arch) if num_splits < 1 else 0,\n"
        "            )\n"
        "    elif num_splits < 1:\n",
    ),
    (
        "decode warps and stages in _flash_attn_fwd",
        "        sm120_fwd_cfg = sm120_fwd_config(head_dim, head_dim_v, causal, local, tile_mn=tile_mn)\n",
        "        sm120_fwd_cfg = sm120_fwd_config(\n"
        "            head_dim, head_dim_v, causal, local, tile_mn=tile_mn, max_seqlen_q=max_seqlen_q\n"
        "        )\n",
    ),
    (
        "SM120 paged KV / SplitKV asserts",
        "            assert page_table is None, \"Paged KV not supported on SM 12.0 in this PR\"\n"
        "            assert not is_split_kv, \"SplitKV not supported on SM 12.0 in this PR\"\n",
        "            # paged KV and SplitKV: the same mainloop with page-table gathers and a split axis\n"
        "            sm120_fwd_cls, sm120_split_kwargs = FlashAttentionForwardSm120, {}\n"
        "            if page_table is not None or is_split_kv:\n"
        "                if page_table is not None:\n"
        "                    assert page_size % SM120_PAGE_SIZE_MULTIPLE == 0 and page_size <= SM120_MAX_PAGE_SIZE, (\n"
        "                        f\"SM120 paged KV needs a page size that is a multiple of {SM120_PAGE_SIZE_MULTIPLE} \"\n"
        "                        f\"up to {SM120_MAX_PAGE_SIZE}, got {page_size}\"\n"
        "                    )\n"
        "                    hdim_error = paged_head_dim_error(head_dim, head_dim_v)\n"
        "                    assert hdim_error is None, hdim_error\n"
        "                sm120_fwd_cls = FlashAttentionForwardSm120SplitKV\n"
        "                sm120_split_kwargs = dict(is_split_kv=is_split_kv)\n",
    ),
    (
        "SM120 class choice",
        "            fa_fwd = FlashAttentionForwardSm120(\n",
        "            fa_fwd = sm120_fwd_cls(\n",
    ),
    (
        "SM120 SplitKV constructor argument",
        "                has_aux_tensors=aux_tensors is not None,\n"
        "            )\n"
        "        else:\n"
        "            raise ValueError(\n",
        "                has_aux_tensors=aux_tensors is not None,\n"
        "                **sm120_split_kwargs,\n"
        "            )\n"
        "        else:\n"
        "            raise ValueError(\n",
    ),
)

# decode benchmark rows the message quotes: (batch, seqlen_k)
DECODE_ROWS = ((1, 4096), (1, 32768), (1, 131072), (8, 32768), (64, 4096))


def decode_measurement_table(bench: dict) -> tuple[str, list[str]]:
    """The message's decode table from a bench_decode.py JSON (CUDA-graph GPU times)."""
    rows = {(r["variant"], r.get("batch"), r.get("seqlen_k")): r for r in bench["rows"] if r.get("kind") == "decode"}
    header = ("b", "seqlen_k", "splits", "before ms", "split ms", "paged64 ms", "speedup", "KV GB/s", "% of copy")
    out = []
    for b, sk in DECODE_ROWS:
        up, split, paged = (rows.get((v, b, sk)) for v in ("upstream", "ours-dense", "ours-paged64"))
        if up is None or split is None:
            continue
        out.append((
            str(b), f"{sk // 1024}k", str(split["num_splits_auto"]), f"{up['graph_ms']:.3f}", f"{split['graph_ms']:.3f}",
            f"{paged['graph_ms']:.3f}" if paged else "-", f"{up['graph_ms'] / split['graph_ms']:.1f}x",
            f"{split['graph_kv_bandwidth_GBps']:.0f}", f"{100 * split['graph_frac_of_copy']:.0f}%",
        ))
    if not out:
        raise AnchorError("decode benchmark JSON has none of the rows the SplitKV patch quotes")
    widths = [max(len(r[i]) for r in out + [header]) for i in range(len(header))]
    fmt = lambda r: "  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    prefill = [r for r in bench["rows"] if r.get("kind") == "prefill" and "paged_over_dense" in r]
    notes = [f"page size {r['page_size']}: {r['paged_over_dense']:.3f}x" for r in prefill]
    return "\n".join([fmt(header)] + [fmt(r) for r in out]), notes


def step_sm120_splitkv_paged(ctx: Context) -> str:
    """Patch 2: SplitKV, paged KV and decode configs for the SM120 forward."""
    ctx.write(f"{CUTE}/flash_fwd_sm120_splitkv.py", render_splitkv_module())
    ctx.write(f"{CUTE}/flash_fwd_sm120_splits.py", render_splits_module())
    patch_configs_for_decode(ctx)
    rel = f"{CUTE}/interface.py"
    ctx.write(rel, apply_edits(ctx.read(rel), _SPLITKV_INTERFACE_EDITS, rel))

    measured = []
    if ctx.decode_bench is not None:
        table, prefill = decode_measurement_table(ctx.decode_bench)
        bench = ctx.decode_bench
        measured = [
            f"Measured ({bench['device']}, mode {bench['mode']}, {str(bench['date'])[:10]}; bf16, seqlen_q 1, "
            "32 query heads on 8 KV heads, d=128, dense KV; times are CUDA-graph replays, i.e. GPU time; "
            "before: this SM120 forward without splits (4 warps, 128x64); split: this patch's decode "
            "config and automatic split count, combine included; paged64: the same over a shuffled "
            f"page table of 64-token pages; copy: a device-to-device copy timed in the same run, "
            f"{bench['copy_bandwidth_GBps']:.0f} GB/s):",
            table,
        ]
        if prefill:
            measured.append("Paged prefill (b=4, 4096 tokens, causal) against the same problem with dense "
                            "KV: " + ", ".join(prefill) + " the dense time.")
        if bench["mode"] == "emulated":
            measured.append(
                "Mode emulated: the SM120 kernels on a bigger GPU with each CTA's shared memory padded so "
                "that no more CTAs are resident per SM than on SM120; the SM count (and so the split count) "
                f"is that GPU's ({bench['num_sms']}). Not SM120 numbers."
            )
        measured += ["Command (in flash_attn_sm120):", f"  {bench['command']}"]
    decode_lines = [
        f"d<={e.head_dim}: {_describe(e.config)} ({'measured' if e.measured else 'not measured yet'})"
        for e in ctx.decode_table
    ]
    return commit_message(
        "[Cute,Sm120] SplitKV, paged KV and decode configs for the SM120 forward",
        "The SM120 forward asserted on paged KV and on num_splits > 1 (\"not supported on SM 12.0\"), "
        "so inference engines on RTX PRO 6000 / RTX 5090 had no paged cache and no split-KV decode "
        "there. A decode step at batch 1 runs one CTA per KV head: 8 CTAs on a 188-SM GPU.",
        "What changes:",
        [
            "flash_fwd_sm120_splitkv.py (new): FlashAttentionForwardSm120SplitKV, a subclass of the SM120 "
            "forward with the same tiles and mainloop plus (a) a split axis: CTA (m_block, head, split) "
            "walks an even share of the key blocks (BlockInfo's split ranges) and writes fp32 partial "
            "O and LSE for FlashAttentionForwardCombine; an empty split writes LSE = -inf; prefetches "
            "never cross the split's first block; and (b) paged K/V: each tile is gathered row by row "
            "through the page table with PagedKVManager into the same swizzled smem tile (16-byte "
            "cp.async, rows past the sequence zero-filled), so any page size that is a multiple of 16 "
            "up to 512 works.",
            "flash_fwd_sm120_splits.py (new): the split count for num_splits < 1. It counts CTA slots "
            "as SMs x CTAs per SM (an SM120 occupancy model: 100 KB of shared memory per SM, 1 KB "
            "reserved per CTA, 1536 threads) and takes the fewest splits within 95% of the best wave "
            "efficiency; long KV starts at two waves of splits of at most 64 blocks (each keeping 16). "
            "An explicit num_splits is clamped to the number of key blocks.",
            "flash_fwd_sm120_configs.py: SM120_DECODE_TABLE, chosen for problems with at most "
            f"{pkg_decode.DECODE_MAX_SEQLEN_Q} query tokens per sequence: " + "; ".join(decode_lines) + ".",
            "interface.py: on SM120, page_table and num_splits != 1 are accepted (page size and head "
            "dims checked with a clear message) and run the new class; FlashAttentionForwardCombine "
            "merges the splits as on the other archs.",
        ],
        *measured,
        "Tested:",
        [
            "Correctness (flash_attn_sm120's hypothesis suite, deep profile, on the GPU and mode above): "
            "the split and paged paths against an fp32 reference over the gathered dense KV, with "
            "outputs poisoned with NaN first: random page sizes, shuffled page tables, seqused_k, split "
            "counts, GQA ratios, decode and prefill lengths, causal and local, varlen Q; 0 mismatches. "
            "compute-sanitizer memcheck and racecheck clean on the split and paged kernels.",
            f"This patch applied to {UPSTREAM_DISTRIBUTION} {ctx.upstream_version}: the SplitKV kernel "
            "(split and paged, GQA packed) compiles for sm_120a with fake tensors on a CPU without "
            "local memory; _get_fwd_config's split count equals the package's for decode shapes on "
            "188 SMs; and on an SM90 GPU with the SM120 dispatch forced (_arch=120) the patched "
            "flash_attn_func matches an fp32 reference for split, paged and paged-split calls.",
        ],
    )


# ----------------------------------------------------------------------------------- the steps
@dataclass(frozen=True)
class Step:
    """One upstream patch: a short file name and a function that edits the tree, returns the message."""

    name: str
    apply: Callable[[Context], str]


# Later features (TMA family, block sparsity, backward) each append a step.
STEPS: tuple[Step, ...] = (
    Step("sm120-fwd-8warp-tiles-table", step_sm120_fwd_table),
    Step("sm120-splitkv-paged-decode", step_sm120_splitkv_paged),
)


def generate(
    out_dir: Path,
    *,
    table_path: Path = DEFAULT_TABLE,
    prune_path=DEFAULT_PRUNE,
    pinned: Optional[tuple[str, str]] = None,
    steps: tuple[Step, ...] = STEPS,
    decode_table_path: Path = DEFAULT_DECODE_TABLE,
    decode_bench_path: Optional[Path] = DEFAULT_DECODE_BENCH,
) -> list[Path]:
    """Write one patch per step into out_dir (stale *.patch files there are removed)."""
    distribution, version = pinned or pinned_upstream()
    dist = check_upstream_version(version, distribution)
    files = pristine_files(dist)
    table = load_table(table_path)
    prune = load_prune(prune_path)
    decode_table = pkg_decode.load_decode_table(decode_table_path)
    decode_bench = json.loads(Path(decode_bench_path).read_text()) if decode_bench_path else None
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory(prefix="fa4-patches-") as tmp:
        repo = Path(tmp) / "flash-attention"
        make_pristine_repo(repo, files, version)
        ctx = Context(repo, table, table_path, prune, version, decode_table=decode_table, decode_bench=decode_bench)
        for i, step in enumerate(steps, 1):
            message = step.apply(ctx)
            git(repo, "add", "-A")
            git(repo, "commit", "-q", "-F", "-", input=message.encode())
            patch = git(repo, "format-patch", "-1", "HEAD", "--stdout", "--zero-commit", "--no-signature",
                        "--no-numbered", "--stat=80", "--encoding=UTF-8")
            path = out_dir / f"{i:04d}-{step.name}.patch"
            path.write_bytes(patch)
            written.append(path)
    for stale in set(out_dir.glob("*.patch")) - set(written):
        stale.unlink()
    return written


def check(out_dir: Path, **kwargs) -> list[str]:
    """Problems that make out_dir stale (empty if it is what generate() would write)."""
    with tempfile.TemporaryDirectory(prefix="fa4-patches-check-") as tmp:
        fresh = {p.name: p.read_bytes() for p in generate(Path(tmp), **kwargs)}
    have = {p.name: p.read_bytes() for p in out_dir.glob("*.patch")} if out_dir.is_dir() else {}
    problems = []
    for name in sorted(fresh.keys() - have.keys()):
        problems.append(f"missing: {name}")
    for name in sorted(have.keys() - fresh.keys()):
        problems.append(f"not generated any more: {name}")
    for name in sorted(fresh.keys() & have.keys()):
        if fresh[name] != have[name]:
            diff = list(difflib.unified_diff(
                have[name].decode(errors="replace").splitlines(), fresh[name].decode(errors="replace").splitlines(),
                f"{name} (checked in)", f"{name} (regenerated)", lineterm="", n=1,
            ))
            shown = "\n".join("    " + l for l in diff[:40])
            more = f"\n    ... {len(diff) - 40} more diff lines" if len(diff) > 40 else ""
            problems.append(f"differs: {name}\n{shown}{more}")
    return problems


def main(argv=None, *, pinned: Optional[tuple[str, str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="fail if the patches in --out are stale")
    ap.add_argument("--table", type=Path, default=DEFAULT_TABLE, help="SM120 forward config table (TOML)")
    ap.add_argument("--prune", type=Path, nargs="+", default=DEFAULT_PRUNE,
                    help="sm_120a prune results (JSONL files, later ones win) for codegen facts")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    kwargs = dict(table_path=args.table, prune_path=args.prune, pinned=pinned)
    try:
        if args.check:
            problems = check(args.out, **kwargs)
            if problems:
                print(f"{args.out} is stale; regenerate with: python scripts/make_patches.py\n", file=sys.stderr)
                print("\n".join(problems), file=sys.stderr)
                return 1
            print(f"{args.out}: up to date")
            return 0
        for path in generate(args.out, **kwargs):
            print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
        return 0
    except (UpstreamVersionError, AnchorError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
