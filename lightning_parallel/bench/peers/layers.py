"""The layer list a pipeline peer is given, as its users would write it.

DeepSpeed's ``PipelineModule`` and torchgpipe's ``GPipe`` take a model as a sequence of layers
and cut it between layers. A model that is an ``nn.Sequential`` is that sequence; a network
with skip connections inside blocks (a ResNet) is written by their users as stem, blocks,
pooling and classifier in a row, which the bundled ResNets give with ``as_sequential()``. Any
other model is refused with the reason and the way around it.
"""

from __future__ import annotations

from torch import nn

__all__: list[str] = []


def peer_layers(body: nn.Module, peer: str) -> nn.Sequential:
    """``body`` as the ``nn.Sequential`` of layers ``peer`` pipelines (the same modules).

    Raises:
        ValueError: ``body`` is not an ``nn.Sequential`` and has no ``as_sequential()``.
    """
    if isinstance(body, nn.Sequential):
        return body
    as_sequential = getattr(body, "as_sequential", None)
    if callable(as_sequential):
        layers = as_sequential()
        if isinstance(layers, nn.Sequential):
            return layers
    raise ValueError(
        f"{peer} pipelines a sequence of layers (an nn.Sequential in the model's `self.layers`, "
        f"or a network with an `as_sequential()` method); {type(body).__name__} is neither: "
        "give it one, or compare with gropipe, spectrain, torch_gpipe or torch_1f1b, which "
        "trace the model's forward"
    )
