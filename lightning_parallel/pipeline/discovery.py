"""Which module of a ``LightningModule`` a pipeline splits.

A user's step calls its network in one of a few ways, and the pipeline has to split the module
that the step calls with the batch, whose ``forward`` it then stands in for:

1. ``module="net"`` (a strategy argument) names it: ``lightning_module.get_submodule("net")``;
2. a ``layers`` attribute that is an ``nn.Sequential``: the step may call ``self(x)`` (whose
   ``forward`` must be ``self.layers(x)``) or ``self.layers(x)``;
3. otherwise it is found by running the step once on a micro-batch with the ``forward`` of the
   ``LightningModule`` and of each direct child that holds trainable parameters replaced by one
   that stops the step (:func:`discover`): ``self(x)`` finds the ``LightningModule`` itself,
   ``self.net(x)`` finds ``net``.

Parameters outside the split module (a head or a loss module applied to its output in the
step) belong to the last stage, where the step's code after the call runs. Rule 3 refuses a
module that holds fewer trainable parameter elements than the rest (``self.encoder(x)`` called
first, a larger ``self.decoder`` after it): the pipeline would split the smaller part and run
the larger on one stage. Rule 1 accepts any module, but a module with parameters that the step
calls *before* the split module cannot work (its parameters live on the last stage, its output
is needed by the first). Both rules are checked before any stage is built, and the errors name
the children and the argument.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch.fx as fx
from torch import nn

from lightning_parallel.pipeline.patching import patched
from lightning_parallel.pipeline.stages import PipelineSplitError

__all__ = [
    "SplitTarget",
    "candidates",
    "discover",
    "named_target",
    "split_point_boundaries",
    "static_target",
]


@dataclass(frozen=True)
class SplitTarget:
    """The module a pipeline splits.

    Attributes:
        name: its name in the ``LightningModule`` (``""`` for the ``LightningModule`` itself).
        module: the module.
        how: ``"argument"`` (rule 1), ``"layers"`` (rule 2) or ``"step"`` (rule 3).
    """

    name: str
    module: nn.Module
    how: str


class _Called(Exception):
    def __init__(self, name: str) -> None:
        super().__init__(f"{name or 'self'} called")
        self.name = name


def candidates(module: nn.Module) -> dict[str, nn.Module]:
    """The direct children of ``module`` that hold a trainable parameter, by name."""
    return {
        name: child
        for name, child in module.named_children()
        if any(parameter.requires_grad for parameter in child.parameters())
    }


def named_target(module: nn.Module, name: str) -> SplitTarget:
    """Rule 1: the submodule ``name`` (dotted, as ``get_submodule`` takes it).

    Raises:
        PipelineSplitError: there is no such submodule (names the children that hold
            parameters).
    """
    try:
        target = module.get_submodule(name)
    except AttributeError:
        raise PipelineSplitError(
            f"module={name!r}: {type(module).__name__} has no submodule {name!r}; its "
            f"children that hold parameters: {sorted(candidates(module)) or 'none'}"
        ) from None
    return SplitTarget(name, target, "argument")


def static_target(module: nn.Module, name: str | None) -> SplitTarget | None:
    """Rules 1 and 2, which need no step run; ``None`` where rule 3 must decide."""
    if name:
        return named_target(module, name)
    layers = getattr(module, "layers", None)
    if not isinstance(module, nn.Sequential) and isinstance(layers, nn.Sequential):
        return SplitTarget("layers", layers, "layers")
    return None


def discover(
    module: nn.Module, hook: str, micro_batch: Any, hook_args: Sequence[Any]
) -> SplitTarget:
    """Rule 3: run ``module.<hook>(micro_batch, *hook_args)`` until it calls ``module`` or one
    of its :func:`candidates` (``log`` does nothing meanwhile), and check that what it called
    holds at least as many trainable parameter elements as the rest of ``module``.

    Raises:
        PipelineSplitError: the step called none of them, or called one that holds fewer
            parameter elements than the rest; the message names the candidates and the
            ``module=`` argument.
    """
    children = candidates(module)
    called: str | None = None
    with ExitStack() as stack:
        for name, child in [("", module), *children.items()]:
            stack.enter_context(patched(child, "forward", _stopper(name)))
        stack.enter_context(patched(module, "log", lambda *a, **k: None))
        try:
            getattr(module, hook)(micro_batch, *hook_args)
        except _Called as stop:
            called = stop.name
    kind = type(module).__name__
    if called is None:
        raise PipelineSplitError(
            f"{kind}.{hook} called neither self(...) nor one of the children that hold "
            f"parameters ({sorted(children) or 'none'}); a pipeline splits the module that the "
            "step calls with the batch: call it there, or name it with the strategy's "
            "module='<child name>' argument"
        )
    target = module if not called else children[called]
    inside = {id(parameter) for parameter in target.parameters()}
    trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    outside = [name for name, parameter in trainable if id(parameter) not in inside]
    held = sum(p.numel() for _, p in trainable if id(p) in inside)
    rest = sum(p.numel() for _, p in trainable if id(p) not in inside)
    if rest > held:
        more = f" and {len(outside) - 4} more" if len(outside) > 4 else ""
        raise PipelineSplitError(
            f"{kind}.{hook} calls self.{called} first, which holds {held} trainable parameter "
            f"elements against {rest} outside it ({', '.join(outside[:4])}{more}), which would "
            "all run on the last stage; call one module that holds the whole network (wrap "
            "the parts in one nn.Module), or, where the rest only runs after it, confirm it "
            f"with the strategy's module='<name>' argument (candidates: {sorted(children)})"
        )
    return SplitTarget(called, target, "step")


def _stopper(name: str) -> Any:
    def stop(*args: Any, **kwargs: Any) -> Any:
        raise _Called(name)

    return stop


def _layer_paths(layer: nn.Module, names: dict[int, str]) -> list[str]:
    """The module names (relative to the split module) whose code runs in ``layer``: a
    child's own name, or for a traced segment every entry of its nodes' module stacks."""
    if id(layer) in names:
        root = names[id(layer)]
        return [root, *(f"{root}.{sub}" for sub, _ in layer.named_modules() if sub)]
    paths: list[str] = []
    if isinstance(layer, fx.GraphModule):
        for node in layer.graph.nodes:
            for entry in (node.meta.get("nn_module_stack") or {}).values():
                paths.append(str(entry[0]))
    return paths


def split_point_boundaries(
    layers: Sequence[nn.Module], network: nn.Module, split_points: Sequence[str]
) -> list[int]:
    """The boundaries that start a stage at each split point: for a module name (relative to
    ``network``, as ``get_submodule`` takes it), the first layer that runs any of its code.
    Where no cut is allowed right before that code (a non-tensor value is live there), the
    stage starts at the nearest allowed cut before it.

    Raises:
        PipelineSplitError: a name that no layer runs, or one whose stage would start at the
            first layer; names the modules the layers do run.
    """
    names = {id(module): name for name, module in network.named_modules() if name}
    runs = [_layer_paths(layer, names) for layer in layers]
    boundaries = []
    for point in split_points:
        first = next(
            (
                index
                for index, paths in enumerate(runs)
                if any(path == point or path.startswith(point + ".") for path in paths)
            ),
            None,
        )
        if not first:
            seen = list(dict.fromkeys(path.split(".")[0] for paths in runs for path in paths))
            where = "runs in the first layer" if first == 0 else "is not run by the network"
            raise PipelineSplitError(
                f"split point {point!r} {where}; a split point names the module a stage starts "
                f"with, relative to the split network (its top-level modules, in order: {seen})"
            )
        boundaries.append(first)
    return boundaries
