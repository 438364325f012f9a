"""Rules on the package's source that the CI's Python cannot check by running it."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

from helpers.sources import PACKAGE, source_files


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
    for path in source_files():
        tree = ast.parse(path.read_text(), filename=str(path))
        module_names = _module_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                for name in sorted(_comprehension_targets(node) & module_names):
                    found.append(
                        f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}: {name}"
                    )
    assert not found, "comprehension variables named like a module-level name:\n" + "\n".join(found)


def _private_names(folder: Path) -> set[str]:
    """Private names a package's source defines: ``self._x = ...``, ``def _x``, class ``_x = ...``."""
    names: set[str] = set()
    for path in source_files(folder):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id == "self":
                    names.add(node.attr)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return {name for name in names if name.startswith("_") and not name.startswith("__")}


def _lightning_private_names() -> set[str]:
    """The private names of the installed Lightning (trainer and fabric), less torch's own
    ``nn.Module`` internals (``_modules``, ``_parameters``: torch's, used by plain-torch code)."""
    import lightning_fabric
    import pytorch_lightning
    import torch

    names: set[str] = set()
    for package in (pytorch_lightning, lightning_fabric):
        names |= _private_names(Path(package.__file__).parent)
    return names - set(vars(torch.nn.Module())) - set(dir(torch.nn.Module))


_STRING_ACCESS = {"getattr", "setattr", "hasattr", "delattr"}
#: private names Lightning's source mentions that belong to other libraries
_NOT_LIGHTNINGS = {
    "_forward_cache": "torchmetrics' Metric: the value of the last batch",
    "_ddp_params_and_buffers_to_ignore": "torch's DistributedDataParallel: tensors it skips",
}


def test_private_lightning_names_are_reached_only_through_compat() -> None:
    """Outside ``compat/``, no code reads a private Lightning name off another object
    (``trainer._x``, ``getattr(module, "_x")``), and a Lightning subclass's own ``self._x`` or
    ``def _x`` that is Lightning's is one :data:`compat.private.PRIVATE_USES` lists (checked at
    construction on the installed Lightning). Names this package defines itself are its own."""
    from lightning_parallel.compat.private import PRIVATE_USES

    lightning = _lightning_private_names() - set(_NOT_LIGHTNINGS)
    ours = _private_names(PACKAGE) - _private_names(PACKAGE / "compat")
    listed = {use.name for use in PRIVATE_USES}
    found = []
    for path in source_files():
        relative = path.relative_to(PACKAGE.parent)
        if "compat" in relative.parts:
            continue
        layer = relative.parts[1] in ("strategies", "callbacks")
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            name, on_self = None, False
            if isinstance(node, ast.Attribute):
                name = node.attr
                on_self = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in _STRING_ACCESS:
                if len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
                    name = str(node.args[1].value)
            elif layer and isinstance(node, ast.FunctionDef):
                name, on_self = node.name, True
            if name is None or name not in lightning:
                continue
            if on_self and (name in listed or (name in ours and not layer)):
                continue
            if not on_self and name in ours:
                continue
            if on_self and name in ours and _defined_here(path, name):
                continue
            found.append(f"{relative}:{node.lineno}: {name}")
    assert not found, "private Lightning names outside compat/:\n" + "\n".join(found)


def _defined_here(path: Path, name: str) -> bool:
    """Whether ``path`` itself assigns ``self.<name>`` or defines ``<name>`` (its own)."""
    return name in _private_names_of_file(path)


def _private_names_of_file(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
    return names
