"""Fold a kernel that the package splits across modules back into one upstream module.

The package keeps one job per module: a kernel class is composed of mixins, one per role, each in
its own file, next to modules of pure rules and helpers. Upstream keeps one module per kernel
(flash_fwd_sm90.py holds its rules, its producer, its consumer and its epilogue in one class), so
a step that lifts such a kernel folds it:

  * `split_module`: a module's source as (docstring, import statements, code after the imports);
  * `merge_imports`: the import statements of every folded module as one import block, with the
    package's own imports dropped (the folded modules) or replaced by upstream's (a mapping);
  * `mixin_methods`: a mixin module's one class, as the source of its methods, to be appended to
    the composed class's body;
  * `banner`: a section comment over each folded part, from its module docstring's summary line.

Everything raises AnchorError naming the module, so a package module that changed shape (a second
class in a mixin module, code before an import) fails the step instead of folding wrongly.
"""

from __future__ import annotations

import ast
import textwrap
from typing import Mapping

from patchgen.core import AnchorError


def split_module(text: str, where: str) -> tuple[str, list, str]:
    """(docstring, import statements, the code after the last import) of a module's source.

    The module must open with its docstring and its imports, nothing between them.
    """
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    doc = ast.get_docstring(tree, clean=False)
    if doc is None:
        raise AnchorError(f"{where}: no module docstring")
    imports, last = [], tree.body[0].end_lineno
    for node in tree.body[1:]:
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            break
        imports.append(node)
        last = node.end_lineno
    later = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)) and n.lineno > last]
    if later:
        raise AnchorError(f"{where}: an import at line {later[0].lineno} follows code; fold.split_module needs them first")
    return doc, imports, "".join(lines[last:]).strip("\n") + "\n"


def _names(node) -> list[str]:
    return [f"{a.name} as {a.asname}" if a.asname else a.name for a in node.names]


def merge_imports(
    parts: list[tuple[str, list]],
    folded: tuple[str, ...],
    replaced: Mapping[tuple[str, str], tuple[tuple[str, str], ...]],
    package: str,
) -> str:
    """One import block for the folded module: isort's order (plain imports, then `from` imports,
    each sorted by module), the names of one module merged into one statement, an aliased module
    (`from m import x as y`) on a line of its own.

    parts: (where, import statements) of each folded module. Imports from `folded` modules are
    dropped (their names are defined in the folded module); an import of `name` from `module` in
    `package` is replaced by the (module, name) imports `replaced[(module, name)]` gives (none: the
    use goes with the step's edits); any other import from `package` raises AnchorError.
    """
    plain: set[str] = set()
    merged: dict[str, set] = {}
    aliased: set[tuple[str, str]] = set()

    def add(module: str, name: str) -> None:
        if " as " in name:
            aliased.add((module, name))
        else:
            merged.setdefault(module, set()).add(name)

    for where, nodes in parts:
        for node in nodes:
            if isinstance(node, ast.Import):
                plain.update(f"import {n}" for n in _names(node))
                continue
            module = node.module
            if module in folded:
                continue
            if module.split(".")[0] != package:
                for name in _names(node):
                    add(module, name)
                continue
            for a in node.names:
                if (module, a.name) not in replaced:
                    raise AnchorError(f"{where}: `from {module} import {a.name}` has no upstream counterpart")
                for up_module, up_name in replaced[(module, a.name)]:
                    add(up_module, up_name)
    froms = [(m, ", ".join(sorted(names))) for m, names in merged.items()] + sorted(aliased)
    std = ("__future__", "dataclasses", "enum", "functools", "typing")
    head = [f"from {m} import {n}\n" for m, n in sorted(froms) if m.split(".")[0] in std]
    body = sorted(f"{p}\n" for p in plain) + [f"from {m} import {n}\n" for m, n in sorted(froms)
                                              if m.split(".")[0] not in std]
    return "".join(head) + ("\n" if head else "") + "".join(body)


def mixin_methods(text: str, where: str) -> tuple[str, str]:
    """(class name, source of its methods) of a mixin module: one class and nothing else but
    imports; the methods keep their class indentation and the comments above them."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    code = [n for n in tree.body[1:] if not isinstance(n, (ast.Import, ast.ImportFrom))]
    if len(code) != 1 or not isinstance(code[0], ast.ClassDef):
        raise AnchorError(f"{where}: a mixin module must hold exactly one class and no other code")
    cls = code[0]
    body = cls.body[1:] if ast.get_docstring(cls) is not None else cls.body
    if not body or not all(isinstance(n, ast.FunctionDef) for n in body):
        raise AnchorError(f"{where}: class {cls.name} must hold methods only")
    start = min([body[0].lineno] + [d.lineno for d in body[0].decorator_list]) - 1
    while start > 0 and lines[start - 1].lstrip().startswith("#"):
        start -= 1
    return cls.name, "".join(lines[start:cls.end_lineno]).rstrip("\n") + "\n"


def summary(doc: str) -> str:
    """A docstring's first line."""
    return doc.strip().splitlines()[0]


def banner(title: str, indent: str = "", width: int = 96) -> str:
    """A section comment, `width` wide: `title` wrapped between two rules of dashes (the class
    body's own `host side` banner has this shape)."""
    rule = f"{indent}# {'-' * (width - len(indent) - 2)}\n"
    lines = textwrap.wrap(title, width - len(indent) - 2)
    return rule + "".join(f"{indent}# {line}\n" for line in lines) + rule
