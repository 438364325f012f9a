"""Point-to-point transport of activations and gradients between neighbouring stages.

Every message goes over ``torch.distributed`` ``isend``/``recv`` (gloo on CPU, NCCL on CUDA),
never as a pickled object, on the device the group takes
(:mod:`lightning_parallel.comm.devices`): over NCCL from device to device, over gloo through
host memory (a CUDA tensor is copied to the host to be sent and back to ``device`` once
received):

1. forward, stage ``k`` to ``k+1``: one *frame* per micro-batch, a byte tensor holding a kind
   word and every tensor of the stage output, each at a 16-byte aligned offset. The receiver
   allocates the frame from the *announced* description (tuple or single tensor, and per tensor
   its dtype, whether it requires grad, its shape: the int64 header of :func:`encode_header`).
   The description is announced only when it changes (the first micro-batch, a smaller last
   micro-batch, evaluation after training): the sender then first sends a frame of the size
   the receiver expects, of kind "header", holding the new description; the receiver reads
   it, allocates the new size and receives again. In the steady state a forward is one
   message: a receiver that must read a header before it can post the receive of the tensors
   waits for two hand-offs between the processes in a row, where the stages' compute shares
   the cores with the transport's threads (see docs/gropipe.md, "Per-micro-batch overhead");
2. backward, stage ``k+1`` to ``k``: the gradient of every input that required grad, no header
   (stage ``k`` knows the shapes of what it sent).

Both ends of a link keep the announced description, so they must be built together and carry
every forward message through :meth:`StageTransport.send_activations` and
:meth:`StageTransport.recv_activations`, in order. A frame is at least as large as a header
frame, so that a header fits in whatever size the receiver expects.

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

import math
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
FRAME_ALIGNMENT = 16  # bytes: every tensor of a frame starts at a multiple (any dtype's size)
DATA_FRAME, HEADER_FRAME = 0, 1  # the frame's kind word
HEADER_FRAME_BYTES = FRAME_ALIGNMENT + 8 * HEADER_LENGTH

TensorSpec = tuple[torch.dtype, bool, list[int]]
"""What a header says of one tensor: dtype, whether it requires grad, shape."""

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


def header_fields(tensors: Sequence[torch.Tensor], is_tuple: bool) -> list[int]:
    """The entries of a stage output's header (see :func:`encode_header`)."""
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
    return fields


def encode_header(tensors: Sequence[torch.Tensor], is_tuple: bool) -> torch.Tensor:
    """The int64 header describing a stage output (see the module docstring): is it a tuple,
    how many tensors, and per tensor its dtype code, whether it requires grad, rank, sizes."""
    return header_of(header_fields(tensors, is_tuple))


def header_of(fields: Sequence[int]) -> torch.Tensor:
    """The header tensor holding ``fields`` (:func:`header_fields`), zero-padded."""
    header = torch.zeros(HEADER_LENGTH, dtype=torch.int64)
    header[: len(fields)] = torch.tensor(fields, dtype=torch.int64)
    return header


def decode_header(header: torch.Tensor) -> tuple[bool, list[TensorSpec]]:
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


def _aligned(nbytes: int) -> int:
    return -(-nbytes // FRAME_ALIGNMENT) * FRAME_ALIGNMENT


def frame_bytes(specs: Sequence[tuple[torch.dtype, Sequence[int]]]) -> int:
    """Bytes of the data frame of tensors of these dtypes and shapes (at least a header
    frame's)."""
    payload = sum(_aligned(math.prod(shape) * dtype.itemsize) for dtype, shape in specs)
    return max(FRAME_ALIGNMENT + payload, HEADER_FRAME_BYTES)


def _slots(
    frame: torch.Tensor, specs: Sequence[tuple[torch.dtype, Sequence[int]]]
) -> list[torch.Tensor]:
    """Views of ``frame`` (a byte tensor) as the tensors of ``specs``, in order."""
    views, offset = [], FRAME_ALIGNMENT
    for dtype, shape in specs:
        size = math.prod(shape) * dtype.itemsize
        views.append(frame[offset : offset + size].view(dtype).view(tuple(shape)))
        offset += _aligned(size)
    return views


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
        # the description the receiver holds, and the frame size it expects: as sender ...
        self._announced: list[int] | None = None
        self._send_frame_bytes = HEADER_FRAME_BYTES
        # ... and as receiver
        self._expected: tuple[bool, list[TensorSpec]] | None = None
        self._recv_frame_bytes = HEADER_FRAME_BYTES

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

    def _frame(self, nbytes: int, kind: int) -> torch.Tensor:
        frame = empty_for(self.group, (nbytes,), torch.uint8)
        frame[:8].view(torch.int64).fill_(kind)
        return frame

    def send_activations(self, output: Any) -> None:
        """Send a stage output (tensor or tuple of tensors) to the next stage: one frame, after
        a header frame when its description differs from the last one announced."""
        tensors, is_tuple = stage_output_tensors(output, self.stage)
        fields = header_fields(tensors, is_tuple)
        specs = [(t.dtype, t.shape) for t in tensors]
        if fields != self._announced:
            frame = self._frame(self._send_frame_bytes, HEADER_FRAME)
            header = frame[FRAME_ALIGNMENT:HEADER_FRAME_BYTES].view(torch.int64)
            header.copy_(header_of(fields))
            self._isend(frame, self.next_rank, ACTIVATION_TAG, self.group)
            self._announced = fields
            self._send_frame_bytes = frame_bytes(specs)
        frame = self._frame(self._send_frame_bytes, DATA_FRAME)
        for slot, tensor in zip(_slots(frame, specs), tensors):
            slot.copy_(tensor.detach())
        self._isend(frame, self.next_rank, ACTIVATION_TAG, self.group)

    def recv_activations(self) -> tuple[Any, float]:
        """Receive the previous stage's output, as sent; floating tensors become leaves that
        require grad where the sender's did. Returns (value, seconds spent waiting)."""
        start = time.perf_counter()
        source, group = self.previous_rank, self.group
        while True:
            frame = self._recv(
                (self._recv_frame_bytes,), torch.uint8, source, ACTIVATION_TAG, group
            )
            if int(frame[:8].view(torch.int64)[0]) == DATA_FRAME:
                break
            self._expected = decode_header(
                frame[FRAME_ALIGNMENT:HEADER_FRAME_BYTES].view(torch.int64).cpu()
            )
            self._recv_frame_bytes = frame_bytes(
                [(dtype, shape) for dtype, _, shape in self._expected[1]]
            )
        if self._expected is None:
            raise RuntimeError(
                f"stage {self.stage} received activations before their description: both ends "
                "of a link must be built together and send every forward through this transport"
            )
        is_tuple, specs = self._expected
        views = _slots(frame, [(dtype, shape) for dtype, _, shape in specs])
        tensors = [
            view.to(self.device).detach().requires_grad_(requires_grad)
            for view, (_, requires_grad, _) in zip(views, specs)
        ]
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
