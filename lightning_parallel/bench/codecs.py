"""``lightning-parallel codecs``: time each codec's encode and decode on one large tensor.

The training step of a compressing strategy pays, per bucket, what Hylo's exchange runs:
``encode_`` (compress, and leave the residual in the tensor: error feedback) and
``decode_add_`` (add the decoded tensor to the sum). This tool times exactly those two calls on
a float32 gradient of ``numel`` elements (10M by default), on every device asked for, and
reports the median of ``repeats`` timed calls after ``warmup`` untimed ones, scaled to
milliseconds per 10M floats:

- on CUDA, each call is bracketed by ``torch.cuda.synchronize()``, so the time is the kernels'
  and not only their launch;
- on the CPU, with the threads torch has (``torch.get_num_threads()``, reported).

The convolution codec (:class:`~lightning_parallel.compression.KernelTopK`) gets a 4-D tensor
of 3x3 kernels, the others a flat one; every input is normal noise from one seed, so the CPU and
the GPU encode the same numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_parallel.compression import (
    QSGD,
    Codec,
    KernelTopK,
    SignSGD,
    TernGrad,
    TopK,
    TwoBitQuantizer,
)

PER = 10_000_000  # times are reported per this many floats

CODECS: dict[str, Callable[[], Codec]] = {
    "two_bit": TwoBitQuantizer,  # Hylo, fully-connected layers
    "kernel_topk": KernelTopK,  # Hylo, convolutions
    "topk": lambda: TopK(0.01),
    "signsgd": SignSGD,
    "qsgd": QSGD,
    "terngrad": TernGrad,
}
HYLO = ("two_bit", "kernel_topk")


def _gradient(name: str, numel: int, device: torch.device) -> torch.Tensor:
    """Normal noise of about ``numel`` floats: 3x3 kernels for ``kernel_topk``, flat otherwise."""
    generator = torch.Generator().manual_seed(0)
    if name == "kernel_topk":
        channels = 256
        shape: tuple[int, ...] = (max(1, numel // (9 * channels)), channels, 3, 3)
    else:
        shape = (numel,)
    return torch.randn(shape, generator=generator).to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_codec(
    name: str, device: torch.device, numel: int = PER, repeats: int = 10, warmup: int = 2
) -> dict[str, Any]:
    """Median seconds of ``encode_`` and ``decode_add_`` of codec ``name`` on ``device``.

    Returns:
        ``codec``, ``device``, ``numel`` (of the tensor timed), ``encode_ms`` and ``decode_ms``
        per 10M floats, their sum ``total_ms``, the ``payload_bytes`` of one encoding and the
        ``repeats`` timed.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
    codec = CODECS[name]()
    source = _gradient(name, numel, device)
    residual = torch.empty_like(source)
    total = torch.zeros_like(source)
    workspace = torch.empty(source.numel(), device=device)
    encode_s: list[float] = []
    decode_s: list[float] = []
    payload = 0
    for index in range(warmup + repeats):
        residual.copy_(source)
        _sync(device)
        start = time.perf_counter()
        encoded = codec.encode_(residual, workspace)
        _sync(device)
        middle = time.perf_counter()
        codec.decode_add_(encoded, total, workspace)
        _sync(device)
        end = time.perf_counter()
        payload = encoded.nbytes()
        if index >= warmup:
            encode_s.append(middle - start)
            decode_s.append(end - middle)
    scale = 1000.0 * PER / source.numel()
    encode_ms = statistics.median(encode_s) * scale
    decode_ms = statistics.median(decode_s) * scale
    return {
        "codec": name,
        "device": str(device),
        "numel": source.numel(),
        "encode_ms": encode_ms,
        "decode_ms": decode_ms,
        "total_ms": encode_ms + decode_ms,
        "payload_bytes": payload,
        "repeats": repeats,
    }


def time_codecs(
    names: Sequence[str], devices: Sequence[str], numel: int = PER, repeats: int = 10
) -> dict[str, Any]:
    """Time every codec of ``names`` on every device of ``devices``; the JSON this tool writes."""
    unknown = [name for name in names if name not in CODECS]
    if unknown:
        raise ValueError(f"unknown codec {unknown[0]!r}; choose from {', '.join(CODECS)}")
    resolved = [torch.device(device) for device in devices]
    for device in resolved:
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {device}: this machine has no CUDA device; use cpu")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda[:N], got {device}")
    rows = [time_codec(name, device, numel, repeats) for device in resolved for name in names]
    described = {
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "gpus": [
            torch.cuda.get_device_name(device) for device in resolved if device.type == "cuda"
        ],
        "per_floats": PER,
    }
    return {"config": described, "rows": rows}


def render(result: dict[str, Any]) -> str:
    """A plain-text table of ``result``, with each GPU time's speed-up over the CPU's."""
    cpu = {row["codec"]: row["total_ms"] for row in result["rows"] if row["device"] == "cpu"}
    lines = [
        f"ms per {PER // 1_000_000}M floats (median of {result['rows'][0]['repeats']}); "
        f"torch {result['config']['torch']}, {result['config']['cpu_threads']} CPU threads"
        + (f", {', '.join(result['config']['gpus'])}" if result["config"]["gpus"] else ""),
        f"{'codec':<12} {'device':<8} {'encode':>9} {'decode':>9} {'total':>9} {'vs cpu':>8}",
    ]
    for row in result["rows"]:
        ratio = cpu.get(row["codec"])
        against = f"{ratio / row['total_ms']:.1f}x" if ratio and row["device"] != "cpu" else ""
        lines.append(
            f"{row['codec']:<12} {row['device']:<8} {row['encode_ms']:>9.2f} "
            f"{row['decode_ms']:>9.2f} {row['total_ms']:>9.2f} {against:>8}"
        )
    return "\n".join(lines)


def _count(text: str) -> int:
    """``10M``, ``1.5M``, ``200k`` or a plain integer."""
    scale = {"k": 1_000, "m": 1_000_000}.get(text[-1:].lower(), 1)
    number = text[:-1] if scale > 1 else text
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a count: {text!r} (e.g. 10M, 200k)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"need a positive count, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-parallel codecs",
        description="Time each codec's encode_ (with error feedback) and decode_add_ on one "
        "large float32 tensor, per 10M floats, on the CPU and on CUDA.",
    )
    parser.add_argument(
        "--device",
        action="append",
        default=None,
        help="cpu or cuda[:N] (repeat; default: cpu, and cuda when there is one)",
    )
    parser.add_argument(
        "--codec",
        action="append",
        default=None,
        choices=list(CODECS),
        help="repeat; default: Hylo's two (two_bit, kernel_topk)",
    )
    parser.add_argument("--all", action="store_true", help="every codec, the peers too")
    parser.add_argument("--numel", type=_count, default=PER, help="floats per tensor (10M)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (torch's default)")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``lightning-parallel codecs``; returns the exit code."""
    args = _parser().parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    devices = args.device or (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
    names = list(CODECS) if args.all else (args.codec or list(HYLO))
    try:
        result = time_codecs(names, devices, args.numel, args.repeats)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(render(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0
