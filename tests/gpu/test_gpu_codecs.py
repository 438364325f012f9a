"""The codecs on CUDA: the CPU's result, and no host round trip (``pytest -m gpu``).

Each check runs in a spawned process, so that the pytest process never initialises CUDA (the
CPU tests launch ranks by fork, which CUDA forbids once initialised). Inputs are built so that
no value lies near a threshold or a tie (``|p|`` either far above or far below ``tau``, kernel
norms well apart): CUDA reduces in another order than the CPU, so scales agree to float32
rounding and every code, index and selection agrees exactly. Encode and decode run under
``torch.cuda.set_sync_debug_mode("error")``: a ``.item()``, ``float(tensor)`` or a blocking
copy to or from the host raises.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.codecs import make_codec
from helpers.distributed import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available"),
]

DETERMINISTIC = ["two_bit", "two_bit_threshold", "two_bit_blocks", "kernel_topk", "topk", "signsgd"]
STOCHASTIC = ["qsgd", "terngrad"]


def _gradient(name: str) -> torch.Tensor:
    """A CPU gradient with no value near a decision boundary of ``name``'s codec."""
    generator = torch.Generator().manual_seed(0)
    if name == "kernel_topk":  # 512 kernels whose norms are 1 + j/512, in a random order
        kernels = torch.randn(512, 9, generator=generator)
        norms = 1.0 + torch.randperm(512, generator=generator).float() / 512
        return (kernels / kernels.norm(dim=1, keepdim=True) * norms[:, None]).view(32, 16, 3, 3)
    if name == "topk":  # distinct magnitudes
        magnitudes = 1.0 + torch.randperm(100_000, generator=generator).float() / 1000
        return magnitudes * torch.sign(torch.randn(100_000, generator=generator))
    # magnitudes about 3 or about 0.2, either sign: tau = mean |p| is near 1.6, far from both
    big = torch.rand(100_000, generator=generator) < 0.5
    noise = 1.0 + 0.01 * torch.rand(100_000, generator=generator)
    signs = torch.sign(torch.randn(100_000, generator=generator))
    return torch.where(big, 3.0, 0.2) * noise * signs


def _on_cuda(name: str) -> dict[str, Any]:
    """Encode and decode ``name``'s gradient on the CPU and on CUDA; return both on the CPU."""
    codec = make_codec(name)
    gradient = _gradient(name)
    device = torch.device("cuda", 0)
    on_device = gradient.to(device)
    codec.decode(codec.encode(on_device))  # warm-up: kernels, generators, allocator
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        encoded = codec.encode(on_device)
        decoded = codec.decode(encoded)
        residual = on_device.clone()
        in_place = codec.encode_(residual, torch.empty(residual.numel(), device=device))
        total = torch.zeros_like(on_device)
        codec.decode_add_(in_place, total, torch.empty(total.numel(), device=device))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    reference = codec.encode(gradient)
    return {
        "devices": [part.device.type for part in [*encoded.payload, decoded, residual, total]],
        "payload": [part.cpu() for part in encoded.payload],
        "decoded": decoded.cpu(),
        "residual": residual.cpu(),
        "total": total.cpu(),
        "cpu_payload": reference.payload,
        "cpu_decoded": codec.decode(reference),
        "gradient": gradient,
    }


def _in_spawned_process(name: str) -> dict[str, Any]:
    return run_distributed(_run, 1, name, start_method="spawn", init_group=False, timeout=300.0)[0]


def _run(rank: int, world_size: int, name: str) -> dict[str, Any]:
    return _on_cuda(name)


def _by_index(payload: list[torch.Tensor]) -> list[torch.Tensor]:
    """Top-k's ``[values, indices]`` in index order (``topk(sorted=False)`` orders by device)."""
    values, indices = payload
    order = torch.argsort(indices)
    return [values[order], indices[order]]


@pytest.mark.parametrize("name", DETERMINISTIC)
def test_gpu_codec_equals_the_cpu_result_without_host_round_trips(name: str) -> None:
    result = _in_spawned_process(name)
    assert set(result["devices"]) == {"cuda"}
    payload, cpu_payload = result["payload"], result["cpu_payload"]
    if name == "topk":
        payload, cpu_payload = _by_index(payload), _by_index(cpu_payload)
    for on_cuda, on_cpu in zip(payload, cpu_payload, strict=True):
        assert on_cuda.dtype == on_cpu.dtype and on_cuda.shape == on_cpu.shape
        if on_cpu.is_floating_point():
            torch.testing.assert_close(on_cuda, on_cpu, rtol=1e-5, atol=1e-6)
        else:  # codes, packed words, indices: exactly the CPU's
            assert torch.equal(on_cuda, on_cpu)
    torch.testing.assert_close(result["decoded"], result["cpu_decoded"], rtol=1e-5, atol=1e-6)
    # error feedback: what was sent plus what is kept is the gradient
    torch.testing.assert_close(
        result["total"] + result["residual"], result["gradient"], rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("name", STOCHASTIC)
def test_gpu_stochastic_codec_runs_on_cuda_without_host_round_trips(name: str) -> None:
    result = _in_spawned_process(name)
    assert set(result["devices"]) == {"cuda"}
    decoded, gradient = result["decoded"], result["gradient"]
    _words, scale = result["payload"]
    assert decoded.shape == gradient.shape and torch.isfinite(decoded).all()
    # every decoded value is on the codec's grid: a whole number of steps of the scale
    levels = make_codec(name).levels if name == "qsgd" else 1
    steps = decoded / (scale / levels)
    torch.testing.assert_close(steps, steps.round(), rtol=0, atol=1e-3)
    assert steps.abs().max() <= levels
    torch.testing.assert_close(result["total"] + result["residual"], gradient, rtol=1e-5, atol=1e-5)
