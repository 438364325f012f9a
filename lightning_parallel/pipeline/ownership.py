"""Each rank keeps only its own stage: other stages' tensors go to the meta device.

A pipeline rank runs one stage, so it needs that stage's parameters, their gradients and their
optimizer state, and nothing else of the model. Once the split is known:

1. :func:`release_unowned` replaces every parameter and buffer that the rank does not own by a
   tensor of the same shape and dtype on the ``meta`` device (no memory), everywhere the model
   (or a stage built from it) refers to it, so the real tensor is freed;
2. :func:`materialize` gives the owned tensors that were created on ``meta`` (deferred
   initialization: a model built under ``torch.device("meta")``) real storage on the rank's
   device and initializes them with each module's own ``reset_parameters()``;
3. :func:`restrict_optimizer` rebuilds the user's optimizer (its class, defaults and every
   parameter group's hyperparameters, group by group, so that learning-rate schedulers keep
   their group indices) over the owned parameters only, carrying their state over
   (:func:`restrict_optimizers`: every optimizer, over the tensors that replaced them).

Each owned tensor is known by its name in the model (``model.named_parameters()``), which stays
the same on every rank and in checkpoints; :class:`TensorNames` keeps the map.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_parallel.optimizers import rebuild_optimizer

__all__: list[str] = []


@dataclass
class TensorNames:
    """Names of a model's parameters and buffers, each tensor once (its first name)."""

    parameters: dict[str, nn.Parameter] = field(default_factory=dict)
    buffers: dict[str, Tensor] = field(default_factory=dict)

    @classmethod
    def of(cls, model: nn.Module) -> TensorNames:
        names = cls()
        seen: set[int] = set()
        for name, parameter in model.named_parameters(remove_duplicate=False):
            if id(parameter) not in seen:
                seen.add(id(parameter))
                names.parameters[name] = parameter
        for name, buffer in model.named_buffers(remove_duplicate=False):
            if id(buffer) not in seen:
                seen.add(id(buffer))
                names.buffers[name] = buffer
        return names

    def name_of(self) -> dict[int, str]:
        """``id(tensor) -> name`` for every tensor."""
        return {id(t): n for n, t in [*self.parameters.items(), *self.buffers.items()]}


def _meta_like(tensor: Tensor) -> Tensor:
    meta = torch.empty_like(tensor, device="meta")
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(meta, requires_grad=tensor.requires_grad)
    return meta


def _replace(
    modules: Iterable[nn.Module], decide: Callable[[Tensor], Tensor | None]
) -> dict[int, Tensor]:
    """Swap tensors in every module's parameter and buffer slots; ``decide`` returns the new
    tensor for one (or ``None``: keep it). The same tensor gets the same replacement wherever
    it appears (tied weights stay tied). Returns ``id(old) -> new``."""
    replaced: dict[int, Tensor] = {}
    done: set[int] = set()
    for module in modules:
        if id(module) in done:
            continue
        done.add(id(module))
        for slots in (module._parameters, module._buffers):
            for name, tensor in list(slots.items()):
                if tensor is None:
                    continue
                if id(tensor) not in replaced:
                    new = decide(tensor)
                    if new is None:
                        continue
                    replaced[id(tensor)] = new
                slots[name] = replaced[id(tensor)]  # type: ignore[assignment]
    return replaced


def _all_modules(roots: Iterable[nn.Module]) -> list[nn.Module]:
    return [module for root in roots for module in root.modules()]


def release_unowned(roots: Sequence[nn.Module], keep: Iterable[Tensor]) -> int:
    """Move every parameter and buffer of ``roots`` (and their submodules) that is not in
    ``keep`` to the meta device. Returns the bytes released."""
    kept = {id(t) for t in keep}
    released = 0

    def decide(tensor: Tensor) -> Tensor | None:
        nonlocal released
        if id(tensor) in kept or tensor.is_meta:
            return None
        released += tensor.numel() * tensor.element_size()
        return _meta_like(tensor)

    _replace(_all_modules(roots), decide)
    return released


@torch.no_grad()
def materialize(
    roots: Sequence[nn.Module], wanted: Iterable[Tensor], device: torch.device
) -> list[str]:
    """Give the meta tensors among ``wanted`` real storage on ``device`` and initialize them.

    Every submodule of ``roots`` that holds one of them and defines ``reset_parameters()``
    (every ``torch.nn`` layer does) is reset; a module holding one without such a method would
    keep uninitialized values, so its class name is returned (the caller refuses it).
    """
    targets = {id(t) for t in wanted if t.is_meta}
    if not targets:
        return []
    modules = _all_modules(roots)
    touched = [
        module
        for module in modules
        if any(
            t is not None and id(t) in targets
            for t in [*module._parameters.values(), *module._buffers.values()]
        )
    ]

    def decide(tensor: Tensor) -> Tensor | None:
        if id(tensor) not in targets:
            return None
        real = torch.empty_like(tensor, device=device)
        if isinstance(tensor, nn.Parameter):
            return nn.Parameter(real, requires_grad=tensor.requires_grad)
        return real

    _replace(modules, decide)
    uninitialized = []
    for module in {id(m): m for m in touched}.values():
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
        else:
            uninitialized.append(type(module).__name__)
    return uninitialized


def restrict_optimizer(
    optimizer: torch.optim.Optimizer, keep: Mapping[int, nn.Parameter]
) -> torch.optim.Optimizer:
    """``optimizer``'s class, defaults and parameter groups over the parameters in ``keep``.

    Args:
        optimizer: the user's optimizer over the whole model.
        keep: ``id(parameter in optimizer) -> parameter to train``: the owned ones (the same
            object, or its materialized replacement). Groups left without a parameter stay, so
            that learning-rate schedulers keep their group indices.

    Raises:
        TypeError: the optimizer class cannot be rebuilt
            (:func:`~lightning_parallel.optimizers.rebuild_optimizer`).
    """
    groups: list[dict[str, Any]] = []
    for group in optimizer.param_groups:
        settings = {key: value for key, value in group.items() if key != "params"}
        kept = [keep[id(p)] for p in group["params"] if id(p) in keep]
        groups.append({**settings, "params": kept})
    restricted = rebuild_optimizer(optimizer, groups)
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            state = optimizer.state.get(parameter)
            if id(parameter) in keep and state:
                restricted.state[keep[id(parameter)]] = state
    return restricted


def restrict_optimizers(
    optimizers: Iterable[Any],
    owned: Iterable[Tensor],
    replaced: Mapping[int, Tensor],
    names: Mapping[int, str],
    schedulers: Sequence[Any] = (),
) -> list[torch.optim.Optimizer]:
    """Every optimizer rebuilt by :func:`restrict_optimizer` over its ``owned`` parameters,
    each the tensor that replaced it (``replaced``: ``id(before) -> now``) if materializing
    did; the ``schedulers`` of an optimizer are pointed at its replacement.

    Args:
        optimizers: the user's optimizers (not Lightning's wrappers).
        owned: this rank's tensors.
        replaced: ``id(tensor before) -> tensor now`` (:attr:`Ownership.replaced`).
        names: ``id(tensor) -> name`` for every tensor of the model, taken before any was
            replaced: each result's ``_lp_parameter_names`` lists its optimizer's parameters by
            name, group by group (the layout of its state in checkpoints:
            :mod:`~lightning_parallel.pipeline.checkpoint_layout`).
        schedulers: learning-rate schedulers (anything with an ``optimizer`` attribute).

    Each user's optimizer lets go of every tensor (its groups and state are cleared): whoever
    still holds it must not keep the released stages alive.
    """
    owned_ids = {id(t) for t in owned}
    rebuilt = []
    for optimizer in optimizers:
        keep: dict[int, nn.Parameter] = {}
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                current = replaced.get(id(parameter), parameter)
                if id(current) in owned_ids:
                    keep[id(parameter)] = current  # type: ignore[assignment]
        restricted = restrict_optimizer(optimizer, keep)
        restricted._lp_parameter_names = [  # type: ignore[attr-defined]
            [names[id(p)] for p in group["params"]] for group in optimizer.param_groups
        ]
        for scheduler in schedulers:
            if scheduler.optimizer is optimizer:
                scheduler.optimizer = restricted
        optimizer.param_groups.clear()
        optimizer.state.clear()
        rebuilt.append(restricted)
    return rebuilt


def adopt_tensors(original: nn.Module, current: nn.Module) -> None:
    """Point ``original``'s parameter and buffer slots at ``current``'s tensors of the same
    names (a layer that stood in for ``original`` goes; its tensors, maybe moved to ``meta`` or
    materialized meanwhile, stay)."""
    for slots, now in (
        (original._parameters, current._parameters),
        (original._buffers, current._buffers),
    ):
        for key in slots:
            if key in now:
                slots[key] = now[key]  # type: ignore[assignment]


@dataclass(frozen=True)
class TensorSlot:
    """A parameter or buffer slot of a module that holds one of the model's tensors.

    Attributes:
        module: the module holding the slot (a split layer, or a module inside one).
        kind: ``"_parameters"`` or ``"_buffers"``.
        key: the slot's key in that dictionary.
        name: the model's name of the tensor it held when recorded.
    """

    module: nn.Module
    kind: str
    key: str
    name: str


def tensor_slots(modules: Iterable[nn.Module], model: nn.Module) -> list[TensorSlot]:
    """Every parameter and buffer slot of ``modules`` and their submodules that holds one of
    ``model``'s tensors, with that tensor's name in ``model``.

    A split layer may hold the model's tensors in slots of its own: a graph segment's
    ``get_attr`` of a parameter that sits on the split module itself (a vision transformer's
    position embedding) is an attribute of the segment. Anything that gives the model new
    tensors (a device move, loading a state dict with ``assign=True``) leaves those slots on
    the old ones: :func:`repoint` puts them back on the model's."""
    name_of = TensorNames.of(model).name_of()
    slots: list[TensorSlot] = []
    for module in _all_modules(modules):
        for kind in ("_parameters", "_buffers"):
            for key, tensor in getattr(module, kind).items():
                if tensor is not None and id(tensor) in name_of:
                    slots.append(TensorSlot(module, kind, key, name_of[id(tensor)]))
    return slots


def repoint(slots: Iterable[TensorSlot], model: nn.Module) -> int:
    """Point each slot at ``model``'s tensor of the slot's name now (a name the model no longer
    has leaves its slot as it is). Returns how many slots changed."""
    names = TensorNames.of(model)
    now: dict[str, Tensor] = {**names.parameters, **names.buffers}
    changed = 0
    for slot in slots:
        tensor = now.get(slot.name)
        held = getattr(slot.module, slot.kind)
        if tensor is not None and held.get(slot.key) is not tensor:
            held[slot.key] = tensor
            changed += 1
    return changed


class TiedAcrossStagesError(ValueError):
    """A tensor is used by two stages; the message names the fix."""


def stage_tensors_owned(
    model: nn.Module, stages: Sequence[nn.Module], stage: int, tie: bool = False
) -> list[Tensor]:
    """The tensors stage ``stage`` owns: its own; the last stage also every tensor of ``model``
    outside the stages (those used after the split body, in the loss, run there).

    Args:
        tie: a tensor used by several stages is owned by each of them
            (:mod:`~lightning_parallel.pipeline.tied` keeps the copies equal); else refused.

    Raises:
        TiedAcrossStagesError: a tensor used by two stages, without ``tie``.
    """
    where: dict[int, int] = {}
    per_stage = [stage_tensors(stage_module) for stage_module in stages]
    for index, tensors in enumerate(per_stage):
        for tensor in tensors:
            if where.setdefault(id(tensor), index) != index and not tie:
                raise TiedAcrossStagesError(
                    f"a tensor of shape {tuple(tensor.shape)} is used by stages "
                    f"{where[id(tensor)]} and {index} (tied weights); pass tie=True to give "
                    "each stage a copy (lightning_parallel.pipeline.tied keeps them equal), "
                    "untie it, or choose boundaries that keep its uses in one stage"
                )
    owned = list(per_stage[stage])
    if stage == len(stages) - 1:
        owned += [t for t in stage_tensors(model) if id(t) not in where]
    return owned


def stage_tensors(module: nn.Module) -> list[Tensor]:
    """Parameters then buffers of ``module``, each tensor once."""
    seen: set[int] = set()
    tensors = []
    for tensor in [*module.parameters(), *module.buffers()]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            tensors.append(tensor)
    return tensors


@dataclass
class Ownership:
    """What :func:`take_ownership` did on this rank.

    Attributes:
        owned: the stage's tensors (materialized where they were on ``meta``).
        names: the model's name of each tensor of ``owned``.
        replaced: ``id(tensor before) -> tensor now`` for the owned tensors that materializing
            replaced (an optimizer built before refers to the old ones).
        released_bytes: bytes of the other stages' tensors let go.
        materialized: whether the stage was created from ``meta``.
    """

    owned: list[Tensor]
    names: list[str]
    replaced: dict[int, Tensor]
    released_bytes: int
    materialized: bool


def take_ownership(
    model: nn.Module,
    stages: Sequence[nn.Module],
    stage: int,
    device: torch.device,
    also: Sequence[nn.Module] = (),
    tie: bool = False,
) -> Ownership:
    """Keep stage ``stage`` of ``model`` on this rank: release every other tensor to ``meta``
    and materialize the stage's own meta tensors on ``device`` (steps 1 and 2 of the module
    docstring).

    Args:
        model: the whole model.
        stages: its stages (modules that share its tensors).
        stage: this rank's stage.
        device: where a meta stage is materialized.
        also: modules outside ``model`` that refer to its tensors (layers an engine replaced
            and will put back).
        tie: own the tensors this stage shares with others (see :func:`stage_tensors_owned`).

    Raises:
        TiedAcrossStagesError: a tensor used by two stages, without ``tie``.
        ValueError: a meta tensor in a module without ``reset_parameters()`` (named).
    """
    owned = stage_tensors_owned(model, stages, stage, tie)
    name_of = TensorNames.of(model).name_of()
    names = [name_of[id(t)] for t in owned]
    deferred = any(t.is_meta for t in owned)
    roots = [model, *stages, *also]
    released = release_unowned(roots, owned)
    uninitialized = materialize(roots, owned, device)
    if uninitialized:
        raise ValueError(
            f"stage {stage} holds tensors created on the meta device in modules without "
            f"reset_parameters(): {sorted(set(uninitialized))}; give them a reset_parameters() "
            "that initializes every parameter and buffer"
        )
    now = stage_tensors_owned(model, stages, stage, tie)  # the same order, materialized
    replaced = {id(old): new for old, new in zip(owned, now) if old is not new}
    return Ownership(now, names, replaced, released, deferred)
