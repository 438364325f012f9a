"""Send an optimizer's per-parameter state between ranks as plain tensors (no pickling).

A checkpoint needs every shard's optimizer state on rank 0. The state is a mapping
``parameter index → {key: value}`` whose values are tensors or Python numbers; it travels as:

1. a size header ``[text bytes, entries]`` (int64);
2. the text ``"index:key\\n..."`` as UTF-8 bytes (uint8);
3. an int64 table, one row per entry: value kind (tensor, float, int, bool), dtype code,
   number of dimensions and up to :data:`MAX_DIMS` sizes;
4. each value as a tensor (numbers as 0-d float64/int64 tensors).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed import distributed_c10d as c10d

from lightning_parallel.pipeline.transport import WIRE_DTYPES

__all__: list[str] = []

MAX_DIMS = 8

_TENSOR, _FLOAT, _INT, _BOOL = 0, 1, 2, 3

State = dict[int, dict[str, Any]]


def _encode(state: State) -> tuple[Tensor, Tensor, list[Tensor]]:
    entries = [
        (index, key, value)
        for index in sorted(state)
        for key, value in sorted(state[index].items())
    ]
    text = "\n".join(f"{index}:{key}" for index, key, _ in entries).encode()
    table = torch.zeros(len(entries), 3 + MAX_DIMS, dtype=torch.int64)
    values: list[Tensor] = []
    for row, (_, key, value) in enumerate(entries):
        if isinstance(value, Tensor):
            if value.dim() > MAX_DIMS or value.dtype not in WIRE_DTYPES:
                raise ValueError(
                    f"optimizer state {key!r} ({value.dtype}, {value.dim()}-d) cannot be sent"
                )
            table[row, 0] = _TENSOR
            table[row, 1] = WIRE_DTYPES.index(value.dtype)
            table[row, 2] = value.dim()
            table[row, 3 : 3 + value.dim()] = torch.tensor(value.shape, dtype=torch.int64)
            values.append(value.detach().cpu().contiguous())
        elif isinstance(value, bool):
            table[row, 0] = _BOOL
            values.append(torch.tensor(int(value), dtype=torch.int64))
        elif isinstance(value, int):
            table[row, 0] = _INT
            values.append(torch.tensor(value, dtype=torch.int64))
        elif isinstance(value, float):
            table[row, 0] = _FLOAT
            values.append(torch.tensor(value, dtype=torch.float64))
        else:
            raise ValueError(
                f"optimizer state {key!r} of type {type(value).__name__} cannot be sent"
            )
    return torch.tensor(list(text), dtype=torch.uint8), table, values


def send_state(state: State, dst: int, group: ProcessGroup | None = None) -> None:
    """Send ``state`` to global rank ``dst`` (which calls :func:`recv_state`)."""
    text, table, values = _encode(state)
    c10d.send(torch.tensor([text.numel(), table.shape[0]], dtype=torch.int64), dst, group=group)
    if text.numel():
        c10d.send(text, dst, group=group)
    if table.numel():
        c10d.send(table, dst, group=group)
    for value in values:
        c10d.send(value.reshape(-1) if value.dim() == 0 else value, dst, group=group)


def recv_state(src: int, group: ProcessGroup | None = None) -> State:
    """Receive a state sent by :func:`send_state` from global rank ``src``."""
    sizes = torch.zeros(2, dtype=torch.int64)
    c10d.recv(sizes, src, group=group)
    length, count = sizes.tolist()
    text = torch.zeros(length, dtype=torch.uint8)
    if length:
        c10d.recv(text, src, group=group)
    table = torch.zeros(count, 3 + MAX_DIMS, dtype=torch.int64)
    if count:
        c10d.recv(table, src, group=group)
    names = bytes(text.tolist()).decode().split("\n") if length else []
    state: State = {}
    for name, row in zip(names, table.tolist()):
        index_text, key = name.split(":", 1)
        kind, dtype_code, dims = row[0], row[1], row[2]
        if kind == _TENSOR:
            shape = row[3 : 3 + dims]
            value: Any = torch.zeros(shape, dtype=WIRE_DTYPES[dtype_code])
            c10d.recv(value.reshape(-1) if dims == 0 else value, src, group=group)
        else:
            holder = torch.zeros(1, dtype=torch.float64 if kind == _FLOAT else torch.int64)
            c10d.recv(holder, src, group=group)
            number = holder.item()
            value = (
                bool(number) if kind == _BOOL else int(number) if kind == _INT else float(number)
            )
        state.setdefault(int(index_text), {})[key] = value
    return state
