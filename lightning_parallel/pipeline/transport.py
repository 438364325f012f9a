"""Point-to-point transport of activations and gradients between neighbouring stages.

Every message goes over ``torch.distributed`` ``isend``/``recv`` (gloo on CPU, NCCL on CUDA),
never as a pickled object, on the device the group takes
(:mod:`lightning_parallel.comm.devices`): over NCCL from device to device, over gloo through
host memory (a CUDA tensor is copied to the host to be sent and back to ``device`` once
received):

1. forward, stage ``k`` to ``k+1``: a fixed-size int64 *header* tensor describing the payload
   (tuple or single tensor, count, and per tensor its dtype code, whether it requires grad, its
   rank and sizes), then each tensor; the receiver allocates from the header, so shapes may
   change from one micro-batch to the next (a smaller last micro-batch);
2. backward, stage ``k+1`` to ``k``: the gradient of every input that required grad, no header
   (stage ``k`` knows the shapes of what it sent).

Gradients travel on a group of their own when one is given (``backward_group``): on NCCL each
direction between two stages then has its own communicator and stream, and a send never waits
behind a receive of the other direction queued before it. Host values that travel between
neighbours (the no-flush runtime's gradient norms) use :attr:`StageTransport.bookkeeping`, a
gloo group whose tags are honoured.

Sends are asynchronous: :meth:`StageTransport.wait_sends` completes them (call it before the
step ends, the buffers must stay alive until then). Receives block; their waiting time is
returned for the timeline.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_parallel.comm.devices import empty_for, to_group

__all__: list[str] = []

HEADER_LENGTH = 128
ACTIVATION_TAG = 11
GRADIENT_TAG = 12

WIRE_DTYPES: tuple[torch.dtype, ...] = (  # dtype codes on the wire (index = code)
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)


def encode_header(tensors: Sequence[torch.Tensor], is_tuple: bool) -> torch.Tensor:
    """The int64 header of a forward message (see the module docstring)."""
    fields = [1 if is_tuple else 0, len(tensors)]
    for tensor in tensors:
        if tensor.dtype not in WIRE_DTYPES:
            raise TypeError(f"cannot send a {tensor.dtype} tensor between stages")
        fields += [
            WIRE_DTYPES.index(tensor.dtype),
            int(tensor.requires_grad),
            tensor.dim(),
            *tensor.shape,
        ]
    if len(fields) > HEADER_LENGTH:
        raise ValueError(
            f"a stage output of {len(tensors)} tensors needs a {len(fields)}-entry header, more "
            f"than {HEADER_LENGTH}; return fewer tensors across a stage boundary (choose other "
            "partition boundaries)"
        )
    header = torch.zeros(HEADER_LENGTH, dtype=torch.int64)
    header[: len(fields)] = torch.tensor(fields, dtype=torch.int64)
    return header


def decode_header(header: torch.Tensor) -> tuple[bool, list[tuple[torch.dtype, bool, list[int]]]]:
    """Inverse of :func:`encode_header`: (is_tuple, [(dtype, requires_grad, shape)])."""
    values = header.tolist()
    is_tuple, count = bool(values[0]), int(values[1])
    specs, position = [], 2
    for _ in range(count):
        dtype, requires_grad, rank = values[position : position + 3]
        shape = values[position + 3 : position + 3 + rank]
        specs.append((WIRE_DTYPES[dtype], bool(requires_grad), shape))
        position += 3 + rank
    return is_tuple, specs


def stage_output_tensors(output: Any, stage: int) -> tuple[list[torch.Tensor], bool]:
    """The tensors of a stage output that is not the last stage's, and whether it was a tuple."""
    if isinstance(output, torch.Tensor):
        return [output], False
    if (
        isinstance(output, (tuple, list))
        and output
        and all(isinstance(t, torch.Tensor) for t in output)
    ):
        return list(output), True
    raise TypeError(
        f"stage {stage} returned {type(output).__name__}; a stage that feeds another must return "
        "a tensor or a tuple of tensors (move the cut, or return tensors from that layer)"
    )


class StageTransport:
    """Send and receive a stage's activations and gradients over ``torch.distributed``.

    Args:
        stage: this stage's index ``k``.
        stage_ranks: global rank of every stage of this pipeline, by stage index.
        group: process group that contains ``stage_ranks`` (``None``: the default group);
            activations travel on it.
        device: device to receive tensors on (the stage's device).
        backward_group: a group over the same ranks for the gradients (``None``: ``group``).
        bookkeeping_group: a gloo group over the same ranks for host values (``None``:
            ``group``).
    """

    def __init__(
        self,
        stage: int,
        stage_ranks: Sequence[int],
        group: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
        backward_group: dist.ProcessGroup | None = None,
        bookkeeping_group: dist.ProcessGroup | None = None,
    ) -> None:
        if not 0 <= stage < len(stage_ranks):
            raise ValueError(f"stage {stage} is outside 0..{len(stage_ranks) - 1}")
        self.stage = stage
        self.stage_ranks = list(stage_ranks)
        self.group = group
        self.device = device or torch.device("cpu")
        self.backward_group = backward_group if backward_group is not None else group
        self._bookkeeping = bookkeeping_group
        self.pending: list[tuple[Any, torch.Tensor]] = []
        self.bytes_sent = 0

    @property
    def bookkeeping(self) -> dist.ProcessGroup | None:
        """The group for host values between neighbours (gloo where one was given)."""
        return self._bookkeeping if self._bookkeeping is not None else self.group

    @property
    def previous_rank(self) -> int:
        return self.stage_ranks[self.stage - 1]

    @property
    def next_rank(self) -> int:
        return self.stage_ranks[self.stage + 1]

    def _isend(
        self, tensor: torch.Tensor, destination: int, tag: int, group: Any, counted: bool = True
    ) -> None:
        payload = to_group(tensor.detach().contiguous(), group, point_to_point=True)
        work = dist.isend(payload, dst=destination, group=group, tag=tag)
        self.pending.append((work, payload))  # alive until the send completes
        if counted:
            self.bytes_sent += payload.numel() * payload.element_size()

    def _recv(
        self, shape: Sequence[int], dtype: torch.dtype, source: int, tag: int, group: Any
    ) -> torch.Tensor:
        buffer = empty_for(group, shape, dtype)
        dist.recv(buffer, src=source, group=group, tag=tag)
        return buffer

    def send_activations(self, output: Any) -> None:
        """Send a stage output (tensor or tuple of tensors) to the next stage."""
        tensors, is_tuple = stage_output_tensors(output, self.stage)
        header = encode_header(tensors, is_tuple)
        self._isend(header, self.next_rank, ACTIVATION_TAG, self.group)
        for tensor in tensors:
            self._isend(tensor, self.next_rank, ACTIVATION_TAG, self.group)

    def recv_activations(self) -> tuple[Any, float]:
        """Receive the previous stage's output, as sent; floating tensors become leaves that
        require grad where the sender's did. Returns (value, seconds spent waiting)."""
        start = time.perf_counter()
        source, group = self.previous_rank, self.group
        header = self._recv((HEADER_LENGTH,), torch.int64, source, ACTIVATION_TAG, group)
        is_tuple, specs = decode_header(header.cpu())
        tensors = []
        for dtype, requires_grad, shape in specs:
            received = self._recv(shape, dtype, source, ACTIVATION_TAG, group)
            tensors.append(received.to(self.device).requires_grad_(requires_grad))
        waited = time.perf_counter() - start
        return (tuple(tensors) if is_tuple else tensors[0]), waited

    def send_gradients(self, gradients: Sequence[torch.Tensor]) -> None:
        """Send the gradients of this stage's inputs that required grad to the previous stage."""
        for gradient in gradients:
            self._isend(gradient, self.previous_rank, GRADIENT_TAG, self.backward_group)

    def recv_gradients(self, outputs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], float]:
        """Receive the gradients of ``outputs`` (those that require grad) from the next stage."""
        start = time.perf_counter()
        gradients = []
        for output in outputs:
            # contiguous whatever the output's layout (a slice or a transposed view): what
            # arrives is packed, and receives need contiguous memory
            gradient = self._recv(
                output.shape, output.dtype, self.next_rank, GRADIENT_TAG, self.backward_group
            )
            gradients.append(gradient.to(output.device))
        return gradients, time.perf_counter() - start

    def send_values(self, values: Sequence[float], destination: int, tag: int) -> None:
        """Send host values (float64) to a neighbour on :attr:`bookkeeping`, asynchronously
        (completed by :meth:`wait_sends`); not counted in :attr:`bytes_sent`, which counts
        activations and gradients."""
        payload = torch.tensor(list(values), dtype=torch.float64)
        self._isend(payload, destination, tag, self.bookkeeping, counted=False)

    def recv_values(self, count: int, source: int, tag: int) -> list[float]:
        """Receive ``count`` host values sent by :meth:`send_values`."""
        return self._recv((count,), torch.float64, source, tag, self.bookkeeping).tolist()

    def wait_sends(self) -> float:
        """Complete every pending send; returns the seconds spent waiting."""
        start = time.perf_counter()
        for work, _payload in self.pending:
            if work is not None:
                work.wait()
        self.pending.clear()
        return time.perf_counter() - start
