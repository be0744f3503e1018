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
the commit messages come from the config table's provenance (flash_attn_sm120/configs/sm120_fwd.toml), a committed
benchmark JSON (0002) and codegen facts from the sm_120a prune results, never from this script.
The steps live in scripts/patchgen/ (one module per patch; the shared machinery in core.py, and
fold.py for a kernel the package splits across modules that upstream gets as one).

An anchor that is not found (upstream moved code after a pin bump) or a package function that
changed shape raises AnchorError naming the file and the anchor.

Usage:
  python scripts/make_patches.py              # (re)write upstream_patches/
  python scripts/make_patches.py --check      # exit 1 with a diff summary if upstream_patches/ is stale
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from flash_attn_sm120 import decode as pkg_decode  # noqa: E402
from patchgen.core import (  # noqa: E402,F401 (re-exported: tests and CONTRIBUTING use make_patches.<name>)
    AUTHOR_EMAIL,
    AUTHOR_NAME,
    DEFAULT_DECODE_BENCH,
    DEFAULT_DECODE_TABLE,
    DEFAULT_OUT,
    DEFAULT_PRUNE,
    DEFAULT_TABLE,
    AnchorError,
    Context,
    UpstreamVersionError,
    apply_edits,
    check_no_package_refs,
    check_upstream_version,
    git,
    load_prune,
    load_table,
    make_pristine_repo,
    pinned_upstream,
    pristine_files,
)
from patchgen.step_fwd_table import _INTERFACE_EDITS, CODEGEN_CASES, step_sm120_fwd_table  # noqa: E402,F401
from patchgen.step_tma import _TMA_INTERFACE_EDITS, render_tma_module, step_sm120_tma  # noqa: E402,F401
from patchgen.step_bwd import (  # noqa: E402,F401
    _BWD_INTERFACE_EDITS,
    render_bwd_configs_module,
    render_tuned_module,
    step_sm120_bwd,
)
from patchgen.step_mods import _MODS_INTERFACE_EDITS, render_mods_module, step_sm120_mods  # noqa: E402,F401
from patchgen.step_block_sparse import (  # noqa: E402,F401
    _BS_INTERFACE_EDITS,
    render_bwd_block_sparse_module,
    step_sm120_block_sparse,
)
from patchgen.step_splitkv import (  # noqa: E402,F401
    _SPLITKV_INTERFACE_EDITS,
    render_splits_module,
    render_splitkv_module,
    step_sm120_splitkv_paged,
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
    Step("sm120-tma-forward", step_sm120_tma),
    Step("sm120-bwd-table-deterministic", step_sm120_bwd),
    Step("sm120-bwd-score-mod-mask-mod", step_sm120_mods),
    Step("sm120-block-sparse", step_sm120_block_sparse),
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
