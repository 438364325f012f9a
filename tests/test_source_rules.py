"""Rules on the package's source that the CI's Python cannot check by running it."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_parallel"


def _module_names(tree: ast.Module) -> set[str]:
    """Names bound at module level (also inside module-level ``if`` and ``try`` blocks), and
    the builtins: a comprehension variable named like either shadows it under PEP 709."""
    names = set(dir(builtins))
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.If | ast.Try | ast.With):
            for field in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, field, []):
                    pending.extend(child.body if isinstance(child, ast.ExceptHandler) else [child])
    return names


def _comprehension_targets(function: ast.AST) -> set[str]:
    targets: set[str] = set()
    for node in ast.walk(function):
        if isinstance(node, ast.ListComp | ast.SetComp | ast.DictComp | ast.GeneratorExp):
            for generator in node.generators:
                targets.update(n.id for n in ast.walk(generator.target) if isinstance(n, ast.Name))
    return targets


def test_no_comprehension_variable_shadows_a_module_name() -> None:
    """Python 3.12 inlines comprehensions (PEP 709): ``{k: copy for k, copy in pairs}`` made
    ``copy.deepcopy`` in another comprehension of the same function raise ``UnboundLocalError``
    on a GPU machine's Python 3.12 (the model-averaging checkpoint), while CI's 3.11 passed."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        module_names = _module_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                for name in sorted(_comprehension_targets(node) & module_names):
                    found.append(
                        f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}: {name}"
                    )
    assert not found, "comprehension variables named like a module-level name:\n" + "\n".join(found)
