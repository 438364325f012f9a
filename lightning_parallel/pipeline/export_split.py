"""Split what torch.fx cannot trace: the module's call captured with ``torch.export``.

torch.fx's symbolic trace (:func:`~lightning_parallel.pipeline.stages.traced_layers`) follows
``forward`` with proxies: it refuses keyword arguments through a pipeline, structured outputs
are opaque to it, and Python control flow on a traced value stops it (Hugging Face models do
all three). ``torch.export`` (non-strict, the route of ``torch.distributed.pipelining``) runs
``forward`` on fake tensors instead and records the ATen operations that ran, so it captures
such models whole. The pipeline then works on *flat* calls:

1. **inputs**: the step's call ``module(*args, **kwargs)`` is flattened into its pytree leaves
   (:class:`FlatCall`): stage 0 is called with them positionally, in the order of the exported
   program's input spec (``None`` is no leaf; a ``bool`` such as ``use_cache=False`` is, and
   export fixes it as a constant);
2. **batch size**: dimension 0 of every tensor input is exported as dynamic
   (``Dim.AUTO``), so a smaller last batch runs the same graph; where the model pins it,
   export specializes it, and a micro-batch of another size is refused before it runs;
3. **outputs**: the last stage returns the flat output leaves; :meth:`FlatCall.output` puts
   them back into the module's structure (a ``ModelOutput`` with ``loss`` and ``logits``) for
   the user's step;
4. **training and evaluation**: the program is exported in training mode and its mode-dependent
   operations (dropout, the dropout of ``scaled_dot_product_attention``, batch norm and its
   ``num_batches_tracked`` count) are rewritten to follow the split module's ``training`` flag
   at run time (:class:`ModeFollowing`), as the module's own code would;
5. **cuts**: the exported graph goes to the same
   :class:`~lightning_parallel.pipeline.stages._GraphCutter` as a traced one: a cut is offered
   where only tensors are live, and each segment shares the model's parameters (the exported
   module's ``get_attr`` nodes refer to the same ``nn.Parameter`` objects).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch.export import Dim

from lightning_parallel.pipeline.microbatch import merge_microbatches
from lightning_parallel.pipeline.stages import (
    PipelineSplitError,
    cut_graph,
    layer_sequence,
    pipeline_body,
)

__all__: list[str] = []

aten = torch.ops.aten


@dataclass
class FlatCall:
    """How the step calls the split module, as the flat inputs and outputs of its graph.

    Attributes:
        in_spec: the structure of ``(args, kwargs)``; the exported program's once it is known.
        out_spec: the structure of the module's output (set by :func:`exported_layers`).
        output_type: the class of a mapping output (a ``ModelOutput``), rebuilt from its
            fields.
        fixed_shapes: input index -> the shape the program fixed for that tensor input
            (``None`` for a dynamic size; the sequence length of a language model, a batch
            size export could not leave dynamic).
    """

    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec | None = None
    output_type: type | None = None
    fixed_shapes: dict[int, tuple[int | None, ...]] = field(default_factory=dict)

    @staticmethod
    def needed(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether a call takes the export path: keyword arguments, or a nested argument."""
        return bool(kwargs) or any(isinstance(a, (tuple, list, dict)) for a in args)

    @classmethod
    def of(cls, args: tuple[Any, ...], kwargs: dict[str, Any]) -> FlatCall:
        return cls(pytree.tree_flatten((args, kwargs))[1])

    def inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """Stage 0's positional inputs for the call ``module(*args, **kwargs)``.

        Raises:
            PipelineSplitError: a call whose structure differs from the exported one.
        """
        leaves, spec = pytree.tree_flatten((args, _ordered(kwargs, self.in_spec)))
        if spec != self.in_spec:
            raise PipelineSplitError(
                "the step called the split module with other arguments than on the first "
                f"micro-batch ({spec} against {self.in_spec}); a pipeline captures one call "
                "structure: pass the same keyword arguments every step"
            )
        for index, shape in self.fixed_shapes.items():
            leaf = leaves[index]
            if isinstance(leaf, Tensor) and not _fits(tuple(leaf.shape), shape):
                raise PipelineSplitError(
                    f"the pipeline's graph was captured for inputs of shape {shape} (None: any "
                    f"size; torch.export fixed the others), this micro-batch has "
                    f"{tuple(leaf.shape)}: use inputs of that shape (for a fixed batch size, a "
                    "batch divisible by micro_batches and drop_last=True on the data loader)"
                )
        return tuple(leaves)

    def call(self, inputs: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The ``(args, kwargs)`` that :meth:`inputs` flattened."""
        args, kwargs = pytree.tree_unflatten(list(inputs), self.in_spec)
        return tuple(args), dict(kwargs)

    def output(self, value: Any) -> Any:
        """The last stage's flat output in the module's output structure."""
        if self.out_spec is None:
            return value
        leaves = list(value) if isinstance(value, (tuple, list)) else [value]
        output = pytree.tree_unflatten(leaves, self.out_spec)
        return self.output_type(**output) if self.output_type is not None else output


def _fits(shape: tuple[int, ...], fixed: tuple[int | None, ...]) -> bool:
    return len(shape) == len(fixed) and all(f is None or f == n for n, f in zip(shape, fixed))


def _ordered(kwargs: dict[str, Any], spec: pytree.TreeSpec) -> dict[str, Any]:
    """``kwargs`` in the key order of ``spec``'s keyword-argument dict (where it has one)."""
    try:  # torch >= 2.10 has child(i); children_specs before
        child = spec.child(1) if hasattr(spec, "child") else spec.children_specs[1]
        keys = child.context
    except (AttributeError, IndexError):
        return kwargs
    if not isinstance(keys, list) or set(keys) != set(kwargs):
        return kwargs
    return {key: kwargs[key] for key in keys}


class ModeFollowing(nn.Module):
    """An ATen operation whose mode argument follows ``source.training`` at run time.

    Args:
        source: the split module (held without registering it: no parameters here).
        operation: the ATen overload.
        adapt: ``(args, kwargs, training) -> (args, kwargs)`` for the call.
    """

    def __init__(self, source: nn.Module, operation: Any, adapt: Callable[..., Any]) -> None:
        super().__init__()
        self._source = [source]
        self.operation = operation
        self.adapt = adapt

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = self.adapt(list(args), dict(kwargs), self._source[0].training)
        return self.operation(*args, **kwargs)

    def extra_repr(self) -> str:
        return str(self.operation)


def _set_argument(index: int, name: str, value: Callable[[Any, bool], Any]) -> Callable[..., Any]:
    def adapt(args: list[Any], kwargs: dict[str, Any], training: bool) -> Any:
        if len(args) > index:
            args[index] = value(args[index], training)
        else:
            kwargs[name] = value(kwargs.get(name), training)
        return args, kwargs

    return adapt


def _counting(args: list[Any], kwargs: dict[str, Any], training: bool) -> Any:
    return (args if training else [args[0], 0]), kwargs


_TRAIN_FLAG = _set_argument(2, "train", lambda _, training: training)  # the dropouts'

#: ATen operations whose behaviour depends on the mode, and how to set it
_MODE_DEPENDENT: dict[Any, Callable[..., Any]] = {
    aten.dropout.default: _TRAIN_FLAG,
    aten.feature_dropout.default: _TRAIN_FLAG,
    aten.alpha_dropout.default: _TRAIN_FLAG,
    aten.batch_norm.default: _set_argument(5, "training", lambda _, training: training),
    aten.scaled_dot_product_attention.default: _set_argument(
        4, "dropout_p", lambda p, training: (p or 0.0) if training else 0.0
    ),
}


def follow_mode(graph_module: fx.GraphModule, source: nn.Module) -> int:
    """Rewrite ``graph_module``'s mode-dependent operations into :class:`ModeFollowing` calls;
    returns how many were rewritten. (Export's shape guards stay: stage 0 checks its inputs.)"""
    rewritten = 0
    for node in list(graph_module.graph.nodes):
        if node.op != "call_function":
            continue
        adapt = _MODE_DEPENDENT.get(node.target)
        counting = (
            node.target is aten.add_.Tensor
            and isinstance(node.args[0], fx.Node)
            and str(node.args[0].target).endswith("num_batches_tracked")
        )
        if adapt is None and not counting:
            continue
        name = f"_lp_mode_{rewritten}"
        graph_module.add_submodule(
            name, ModeFollowing(source, node.target, adapt if adapt is not None else _counting)
        )
        node.op, node.target = "call_module", name
        rewritten += 1
    graph_module.graph.lint()
    graph_module.recompile()
    return rewritten


def unregister_constants(graph_module: nn.Module, module: nn.Module) -> None:
    """Turn the buffers export registered for tensors created inside ``forward`` (its lifted
    constants) into plain attributes: they are no tensors of the model, which the pipeline's
    ownership names and places, but constants of the graph."""
    known = {id(t) for t in [*module.parameters(), *module.buffers()]}
    for child in graph_module.modules():
        for name, buffer in list(child._buffers.items()):
            if buffer is not None and id(buffer) not in known:
                del child._buffers[name]
                setattr(child, name, buffer)


def _dynamic_batch(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``dynamic_shapes`` for export: dimension 0 of every tensor input ``Dim.AUTO``, by the
    names of ``module.forward``'s parameters."""

    auto = Dim.AUTO  # type: ignore[attr-defined]

    def spec(value: Any) -> Any:
        return {0: auto} if isinstance(value, Tensor) and value.dim() > 0 else None

    bound = inspect.signature(module.forward).bind(*args, **kwargs)
    return {name: pytree.tree_map(spec, value) for name, value in bound.arguments.items()}


def _flattenable(value: Any) -> bool:
    leaves = pytree.tree_leaves(value)
    return all(isinstance(leaf, (Tensor, int, float, bool, str)) for leaf in leaves)


_OUTPUT_TYPES: dict[int, type] = {}


class _Outputs(nn.Module):
    """``inner`` with a mapping output (a ``ModelOutput``) cut to the fields export can
    flatten, as a dict: a language model's ``past_key_values`` cache object is dropped (the
    pipeline trains; nothing reuses it). The output's class is kept for
    :meth:`FlatCall.output`."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        output = self.inner(*args, **kwargs)
        if not isinstance(output, Mapping):
            return output
        _OUTPUT_TYPES[id(self)] = type(output)  # not an attribute: export puts those back
        return {key: value for key, value in output.items() if _flattenable(value)}


def outputs_wrapper(inner: nn.Module) -> _Outputs:
    """An :class:`_Outputs` whose ``forward`` has ``inner.forward``'s signature (export binds
    the call, and its dynamic shapes, by those names)."""
    signature = inspect.signature(inner.forward)

    def forward(self: _Outputs, *args: Any, **kwargs: Any) -> Any:
        return _Outputs.forward(self, *args, **kwargs)

    this = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    forward.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[this, *signature.parameters.values()]
    )
    kind = type(_Outputs.__name__, (_Outputs,), {"forward": forward})
    return kind(inner)


def export_module(
    wrapper: _Outputs, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> torch.export.ExportedProgram:
    """``torch.export`` of ``wrapper(*args, **kwargs)`` in training mode (modes restored),
    batch dimension dynamic where export allows it, else static.

    Where export meets a data-dependent branch (``if mask.all():``, which it cannot decide on
    fake tensors), ``torch.export.draft_export`` captures the branch the example took, with a
    check in the graph that raises if another input would take the other.

    Raises:
        PipelineSplitError: every attempt fails; names the construct and the ways out.
    """
    module = wrapper.inner
    modes = {m: m.training for m in module.modules()}
    module.train()
    # Dim.AUTO: torch >= 2.6; before it, the batch size is static
    dynamic = _dynamic_batch(module, args, kwargs) if hasattr(Dim, "AUTO") else None
    export = torch.export.export
    draft = getattr(torch.export, "draft_export", None)  # torch >= 2.7
    attempts: list[Callable[[], torch.export.ExportedProgram]] = [
        lambda: export(wrapper, args, kwargs, dynamic_shapes=dynamic, strict=False),
        lambda: export(wrapper, args, kwargs, strict=False),  # the model fixes its batch size
    ]
    if draft is not None:  # data-dependent branches fixed to those taken, checked at run time
        attempts += [
            lambda: draft(wrapper, args, kwargs, dynamic_shapes=dynamic, strict=False),
            lambda: draft(wrapper, args, kwargs, strict=False),
        ]
    errors: list[Exception] = []
    try:
        for attempt in attempts:
            try:
                return attempt()
            except Exception as failure:  # the next attempt; the first error tells most
                errors.append(failure)
    finally:
        for child, training in modes.items():
            child.training = training
    error: Exception = errors[0]
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    raise PipelineSplitError(
        f"torch.export could not capture {type(module).__name__} to split it into stages "
        f"({type(error).__name__}: {first}). Fix: name a submodule that export or torch.fx "
        "can capture with the strategy's module='<name>' argument (and split_points=[...] "
        "inside it), or write the network as `self.layers = nn.Sequential(...)`"
    ) from error


def exported_layers(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[list[nn.Module], FlatCall]:
    """Export ``module(*args, **kwargs)`` and cut the graph wherever only tensors are live.

    Returns:
        The segments (chained, the first called with :meth:`FlatCall.inputs`, the last
        returning the flat output leaves) and the call's :class:`FlatCall`, with the exported
        program's input and output specs.
    """
    wrapper = outputs_wrapper(module)
    try:
        program = export_module(wrapper, args, kwargs)
    finally:  # also after a failed export, whose forward may have run
        output_type = _OUTPUT_TYPES.pop(id(wrapper), None)
    graph_module = program.module()
    follow_mode(graph_module, module)
    spec = program.call_spec
    call = FlatCall(spec.in_spec, spec.out_spec, output_type)
    inputs = [n.meta.get("val") for n in graph_module.graph.nodes if n.op == "placeholder"]
    call.fixed_shapes = {
        index: tuple(size if isinstance(size, int) else None for size in value.shape)
        for index, value in enumerate(inputs)
        if isinstance(value, Tensor)
    }
    layers = cut_graph(graph_module, type(module).__name__)
    for layer in layers:
        unregister_constants(layer, module)
    return layers, call


def split_layers(
    body: nn.Module, example: tuple[Any, ...], call: FlatCall | None
) -> tuple[list[nn.Module], FlatCall | None, tuple[Any, ...]]:
    """The layer sequence of ``body`` for stage 0's ``example`` inputs, by the first way that
    captures it: a sequence or torch.fx for a positional call (``call`` is ``None``),
    torch.export for a flat call or where fx fails.

    Returns:
        The layers, the call (``None`` on the fx path) and ``example`` in its input order.

    Raises:
        PipelineSplitError: neither captures ``body``; gives both reasons and the ways out.
    """
    if call is None:
        try:
            return layer_sequence(body, example), None, example
        except PipelineSplitError as traced:
            if isinstance(pipeline_body(body), nn.Sequential):
                raise
            try:
                layers, flat = exported_layers(body, example, {})
            except PipelineSplitError as exported:
                raise PipelineSplitError(
                    f"{type(body).__name__} cannot be split: {traced}; and then {exported}"
                ) from exported
            return layers, flat, flat.inputs(example, {})
    args, kwargs = call.call(example)
    layers, flat = exported_layers(body, args, kwargs)
    return layers, flat, flat.inputs(args, kwargs)


def stage_zero_inputs(
    call: FlatCall | None, built: bool, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[FlatCall | None, tuple[Any, ...]]:
    """Stage 0's inputs for the captured call ``(args, kwargs)``: the positional arguments on
    the fx path (``call`` is ``None``), the flat leaves on the export path, which the first
    call with keyword or nested arguments chooses. Returns the call and the inputs.

    Raises:
        PipelineSplitError: such a call after the pipeline was ``built`` from a positional one.
    """
    if call is None and FlatCall.needed(args, kwargs):
        if built:
            raise PipelineSplitError(
                "a step called the split module with keyword or nested arguments, but the "
                "pipeline was built from a call with positional tensors only; call it the "
                "same way in every step method"
            )
        call = FlatCall.of(args, kwargs)
    return call, (args if call is None else call.inputs(args, kwargs))


def merge_outputs(parts: Sequence[Any], sizes: Sequence[int], flat: bool) -> Any:
    """The micro-batches' outputs (of ``sizes`` samples each) as one batch's: concatenated
    (:func:`~lightning_parallel.pipeline.microbatch.merge_microbatches`), except that on the
    export path (``flat``) a 0-dimensional tensor (a loss computed inside the model) is the
    micro-batches' size-weighted mean."""
    if not flat:
        return merge_microbatches(parts)
    return _merge_flat(parts, [n / sum(sizes) for n in sizes])


def _merge_flat(parts: Sequence[Any], weights: Sequence[float]) -> Any:
    first = parts[0]
    if not isinstance(first, (tuple, list)):
        return _merge_flat([(p,) for p in parts], weights)[0]
    merged: list[Any] = []
    for index, value in enumerate(first):
        column = [part[index] for part in parts]
        if isinstance(value, Tensor) and value.dim() == 0:
            merged.append(sum(w * t for w, t in zip(weights, column, strict=True)))
        elif isinstance(value, Tensor):
            merged.append(torch.cat(column, dim=0))
        else:
            merged.append(value)
    return type(first)(merged)
