"""Turn a model into a chain of layers and group consecutive layers into pipeline stages.

A *layer sequence* is a list of modules that run as a chain: the first is called with the
model's positional arguments, each later one with the previous one's output (a tensor, or a
tuple of tensors). Where it comes from:

1. an ``nn.Sequential``: its children;
2. a module with ``layers: nn.Sequential`` whose ``forward(x)`` is ``self.layers(x)`` (the
   demo models, and the usual way to write a model for a pipeline): the children of ``layers``;
3. any other module: traced with ``torch.fx``. Each operation of the graph becomes a layer;
   between two layers the values still needed later (a residual input, the model input) travel
   as a tuple, and a cut is only offered where every such value is a tensor (never an ``int``
   from ``x.size(0)``). A module fx cannot trace raises :class:`PipelineSplitError` naming the
   fix.

Stage ``k`` of a split with boundaries ``b_1 < ... < b_{p-1}`` (``b_0 = 0``, ``b_p = n``) holds
layers ``b_k .. b_{k+1}-1``. Stages share parameters with the original model: training a
stage trains the model.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata

__all__: list[str] = []


class PipelineSplitError(ValueError):
    """The model cannot be split into pipeline stages as asked; the message names the fix."""


class StageModule(nn.Module):
    """Consecutive layers of a layer sequence, run as one pipeline stage.

    The first stage is called with the model's positional arguments, every other stage with the
    previous stage's output as one argument.
    """

    def __init__(self, layers: Sequence[nn.Module], index: int, first_layer: int) -> None:
        super().__init__()
        if not layers:
            raise PipelineSplitError(f"stage {index} would hold no layer; use fewer stages")
        self.layers = nn.ModuleList(layers)
        self.index = index
        self.first_layer = first_layer

    def forward(self, *inputs: Any) -> Any:
        layers = iter(self.layers)  # not a slice: that builds a ModuleList per call
        output = next(layers)(*inputs)
        for layer in layers:
            output = layer(output)
        return output

    def extra_repr(self) -> str:
        last = self.first_layer + len(self.layers) - 1
        return f"stage={self.index}, layers={self.first_layer}..{last}"


def pipeline_body(module: nn.Module) -> nn.Module:
    """The module the pipeline splits: ``module.layers`` if it is an ``nn.Sequential``."""
    layers = getattr(module, "layers", None)
    if not isinstance(module, nn.Sequential) and isinstance(layers, nn.Sequential):
        return layers
    return module


def layer_sequence(
    module: nn.Module, example_args: tuple[Any, ...] | None = None
) -> list[nn.Module]:
    """The layers of ``module`` as a chain (see the module docstring for the three cases).

    Args:
        module: the model (or its :func:`pipeline_body`).
        example_args: positional arguments of one forward; needed only to trace a module that
            is not a sequence (to find which cuts carry tensors only).
    """
    body = pipeline_body(module)
    if isinstance(body, nn.Sequential):
        if len(body) == 0:
            raise PipelineSplitError("the nn.Sequential to split has no layer")
        return list(body)
    if example_args is None:
        raise PipelineSplitError(
            f"{type(module).__name__} is not an nn.Sequential and has no `layers: nn.Sequential`;"
            " tracing it with torch.fx needs example inputs (pass example_args)"
        )
    return traced_layers(module, example_args)


def is_deferred(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device (deferred
    initialization: a model built under ``torch.device("meta")``)."""
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def split_stages(layers: Sequence[nn.Module], boundaries: Sequence[int]) -> list[StageModule]:
    """Group ``layers`` into ``len(boundaries) + 1`` stages cut before each boundary index.

    Raises:
        PipelineSplitError: boundaries not strictly increasing inside ``1 .. len(layers)-1``.
    """
    check_boundaries(boundaries, len(layers))
    edges = [0, *boundaries, len(layers)]
    return [
        StageModule(layers[edges[k] : edges[k + 1]], k, edges[k]) for k in range(len(edges) - 1)
    ]


def put_back(
    layers: Sequence[nn.Module], originals: Mapping[nn.Module, nn.Module]
) -> list[nn.Module]:
    """``layers`` with ``originals[m]`` wherever they are, or hold as a submodule, a replacement
    ``m`` (one walk over them; submodules are put back in place)."""
    restored = [originals.get(layer, layer) for layer in layers]
    for layer in restored:
        for parent in layer.modules():
            for name, child in parent._modules.items():
                if child is not None and child in originals:
                    parent._modules[name] = originals[child]
    return restored


def check_boundaries(boundaries: Sequence[int], layer_count: int) -> None:
    """Raise :class:`PipelineSplitError` unless ``0 < b_1 < ... < b_{p-1} < layer_count``."""
    edges = [0, *boundaries, layer_count]
    if any(not isinstance(b, int) for b in boundaries) or any(
        edges[k] >= edges[k + 1] for k in range(len(edges) - 1)
    ):
        raise PipelineSplitError(
            f"partition boundaries {list(boundaries)} must be strictly increasing integers in "
            f"1..{layer_count - 1} (the index of the first layer of stages 1, 2, ...); the model "
            f"has {layer_count} layers"
        )


def even_boundaries(layer_count: int, stages: int) -> list[int]:
    """Boundaries of an even split by layer count (``torch.distributed.pipelining``'s way)."""
    if stages > layer_count:
        raise PipelineSplitError(
            f"cannot split {layer_count} layers into {stages} stages; use at most {layer_count}"
        )
    return [round(k * layer_count / stages) for k in range(1, stages)]


class _StageTracer(fx.Tracer):
    """torch.fx's tracer, with this package's stand-in layers (deferred BatchNorm, deferred
    weight-gradient linear layers) kept whole, like the ``torch.nn`` layers they replace: their
    ``forward`` checks shapes in Python, which a symbolic trace cannot follow."""

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        from lightning_parallel.pipeline.batchnorm import DeferredBatchNorm
        from lightning_parallel.pipeline.weight_grad import DeferredGradLinear

        if isinstance(module, (DeferredBatchNorm, DeferredGradLinear)):
            return True
        return super().is_leaf_module(module, qualified_name)


def _trace(module: nn.Module) -> fx.GraphModule:
    try:
        graph = _StageTracer().trace(module)
        return fx.GraphModule(module, graph, class_name=type(module).__name__)
    except Exception as error:
        raise PipelineSplitError(
            f"torch.fx could not trace {type(module).__name__} to split it into stages ({error}). "
            "Fix: write the network as `self.layers = nn.Sequential(...)` with "
            "`forward(x) = self.layers(x)`, remove data-dependent Python control flow from "
            "`forward` (see the torch.fx limitations), or name a traceable submodule with the "
            "strategy's module='<name>' argument"
        ) from error


def _is_tensor_value(node: fx.Node) -> bool:
    # a traced graph after ShapeProp has tensor_meta, an exported one has val (a fake tensor)
    return isinstance(node.meta.get("tensor_meta"), TensorMetadata) or isinstance(
        node.meta.get("val"), torch.Tensor
    )


def _symbolic_size(node: fx.Node) -> str | None:
    """The expression of a symbolic integer value (a dynamic size), else ``None``."""
    value = node.meta.get("val")
    return str(value) if isinstance(value, torch.SymInt) else None


class _GraphCutter:
    """Live values and allowed cuts of a traced graph; builds one graph module per segment.

    Tensors cross a cut. A symbolic size (an exported graph's dynamic batch size, read once
    from the input and used by every later ``view``) does not: where a tensor crossing the
    cut has that size in one of its dimensions, the segment after the cut reads it from that
    tensor again (``aten.sym_size``); a cut where some other value would have to cross is not
    offered.
    """

    def __init__(self, graph_module: fx.GraphModule) -> None:
        self.root = graph_module
        nodes = list(graph_module.graph.nodes)
        self.placeholders = [n for n in nodes if n.op == "placeholder"]
        self.compute = [n for n in nodes if n.op in ("call_module", "call_function", "call_method")]
        self.output = next(n for n in nodes if n.op == "output")
        self.position = {node: i for i, node in enumerate(self.compute)}

    def live_at(self, cut: int) -> list[fx.Node]:
        """Values defined before compute node ``cut`` and used at or after it."""
        defined = self.placeholders + self.compute[:cut]
        live = []
        for value in defined:
            for user in value.users:
                if user is self.output or self.position.get(user, -1) >= cut:
                    live.append(value)
                    break
        return live

    def carried(self, cut: int) -> tuple[list[fx.Node], dict[fx.Node, tuple[fx.Node, int]]]:
        """The tensors that cross cut ``cut``, and for each live symbolic size the carried
        tensor and dimension it is read from again; ``([], {})`` where the cut is not allowed."""
        live = self.live_at(cut)
        tensors = [value for value in live if _is_tensor_value(value)]
        dimensions: dict[str, tuple[fx.Node, int]] = {}
        for tensor in tensors:
            for dimension, size in enumerate(getattr(tensor.meta.get("val"), "shape", ())):
                if isinstance(size, torch.SymInt):
                    dimensions.setdefault(str(size), (tensor, dimension))
        derived: dict[fx.Node, tuple[fx.Node, int]] = {}
        for value in live:
            if value in tensors:
                continue
            expression = _symbolic_size(value)
            if expression is None or expression not in dimensions:
                return [], {}
            derived[value] = dimensions[expression]
        return tensors, derived

    def allowed(self, cut: int) -> bool:
        return bool(self.carried(cut)[0])

    def segment(self, start: int, end: int) -> fx.GraphModule:
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        if start == 0:
            for placeholder in self.placeholders:
                env[placeholder] = graph.node_copy(placeholder)
        else:
            live, derived = self.carried(start)
            inputs = graph.placeholder("inputs")
            if len(live) == 1:
                env[live[0]] = inputs
            else:
                for index, value in enumerate(live):
                    env[value] = graph.call_function(operator.getitem, (inputs, index))
            for value, (tensor, dimension) in derived.items():
                size = torch.ops.aten.sym_size.int
                env[value] = graph.call_function(size, (env[tensor], dimension))
                env[value].meta = dict(value.meta)
        attributes: dict[str, fx.Node] = {}

        def lookup(node: fx.Node) -> fx.Node:
            if node.op == "get_attr":
                if node.target not in attributes:
                    attributes[str(node.target)] = graph.get_attr(str(node.target))
                return attributes[str(node.target)]
            return env[node]

        for node in self.compute[start:end]:
            env[node] = graph.node_copy(node, lookup)
        if end == len(self.compute):
            graph.output(fx.node.map_arg(self.output.args[0], lookup))
        else:
            live_out = [lookup(value) for value in self.carried(end)[0]]
            graph.output(live_out[0] if len(live_out) == 1 else tuple(live_out))
        return fx.GraphModule(self.root, graph, class_name="TracedLayer")


def _substitute(placeholder: fx.Node, value: Any) -> Any:
    def substitute(node: fx.Node) -> Any:
        return value if node is placeholder else node

    return substitute


def _bake_defaults(graph_module: fx.GraphModule, passed: int) -> None:
    """Make the parameters the call leaves at their defaults (``attn_mask=None``,
    ``is_causal=False``) constants of the graph: a placeholder would be a non-tensor value live
    across every later cut, and no cut would be offered."""
    placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
    for node in placeholders[passed:]:
        if not node.args or isinstance(node.args[0], torch.Tensor):
            continue
        for user in list(node.users):
            user.args = fx.node.map_arg(user.args, _substitute(node, node.args[0]))
            user.kwargs = fx.node.map_arg(user.kwargs, _substitute(node, node.args[0]))
        graph_module.graph.erase_node(node)
    graph_module.graph.lint()
    graph_module.recompile()


def traced_layers(module: nn.Module, example_args: tuple[Any, ...]) -> list[nn.Module]:
    """Trace ``module`` with torch.fx and cut it at every place only tensors cross.

    Returns:
        Graph modules sharing ``module``'s parameters; chained, they compute ``module``.
    """
    graph_module = _trace(module)
    _bake_defaults(graph_module, len(example_args))
    if is_deferred(module):  # weights only as shapes: propagate shapes on meta inputs
        example_args = tuple(
            torch.empty_like(a, device="meta") if isinstance(a, torch.Tensor) else a
            for a in example_args
        )
    was_training = module.training
    module.eval()  # shape propagation must not move BatchNorm running statistics
    try:
        with torch.no_grad():
            ShapeProp(graph_module).propagate(*example_args)
    except Exception as error:
        raise PipelineSplitError(
            f"running the traced {type(module).__name__} on the example inputs failed ({error});"
            " pass the model's positional forward arguments as example_args"
        ) from error
    finally:
        module.train(was_training)
    return cut_graph(graph_module, type(module).__name__)


def cut_graph(graph_module: fx.GraphModule, name: str) -> list[nn.Module]:
    """``graph_module`` (traced or exported, ``name`` in errors) cut at every place only tensors
    cross: graph modules sharing its tensors that, chained, compute it."""
    cutter = _GraphCutter(graph_module)
    if not cutter.compute:
        raise PipelineSplitError(f"{name} has no operation to split")
    cuts = [0] + [c for c in range(1, len(cutter.compute)) if cutter.allowed(c)]
    cuts.append(len(cutter.compute))
    return [cutter.segment(cuts[i], cuts[i + 1]) for i in range(len(cuts) - 1)]
