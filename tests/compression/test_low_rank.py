"""The low-rank codec (PowerSGD-style) and its route in Hylo's exchange."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from helpers.distributed import run_distributed

from lightning_parallel.comm.accounting import ring_allreduce_bytes
from lightning_parallel.compression import (
    ErrorFeedback,
    HyloExchange,
    LayerGradient,
    LayerPlan,
    low_rank,
)
from lightning_parallel.compression.low_rank import LowRank, orthonormalize
from lightning_parallel.compression.policy import LOW_RANK, ROUTES

STEPS = 3
SHAPE = (24, 40)


def _gradient(shape: tuple[int, ...], rank: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(shape, generator=generator)


def test_error_feedback_keeps_what_the_factors_miss() -> None:
    codec = LowRank(rank=2)
    p = torch.randn(SHAPE)
    residual = p.clone()
    encoded = codec.encode_(residual)
    decoded = codec.decode(encoded)
    torch.testing.assert_close(decoded + residual, p, rtol=0, atol=1e-6)
    assert float(residual.norm()) < float(p.norm())  # the projection removed something
    assert encoded.nbytes() == codec.payload_nbytes(SHAPE) == 4 * (24 + 40) * 2


def test_a_matrix_of_the_codec_rank_is_sent_exactly() -> None:
    codec = LowRank(rank=3)
    left, right = torch.randn(30, 3), torch.randn(3, 50)
    matrix = left @ right
    torch.testing.assert_close(codec.decode(codec.encode(matrix)), matrix, rtol=1e-4, atol=1e-4)


def test_rank_is_capped_by_the_matrix_and_convolutions_are_flattened() -> None:
    codec = LowRank(rank=8)
    assert codec.rank_for((4, 100)) == 4
    assert codec.factor_numel((16, 3, 3, 3)) == (16 + 27) * 8
    encoded = codec.encode(torch.randn(16, 3, 3, 3))
    assert codec.decode(encoded).shape == (16, 3, 3, 3)
    with pytest.raises(ValueError, match="rank must be a positive int"):
        LowRank(rank=0)


def test_warm_start_factors_are_checkpointed() -> None:
    codec = LowRank(rank=2)
    factor = codec.warm_start("fc.weight", SHAPE, torch.zeros(1))
    codec.keep("fc.weight", factor * 2)
    restored = LowRank(rank=2)
    restored.load_state_dict(codec.state_dict())
    torch.testing.assert_close(restored.warm_start("fc.weight", SHAPE, torch.zeros(1)), factor * 2)
    # the first step's factor depends on the name and the seed only (the same on every rank)
    torch.testing.assert_close(
        LowRank(rank=2).warm_start("fc.weight", SHAPE, torch.zeros(1)), factor
    )


def _exchange(rank: int, world: int, block_bytes: int | None = None) -> dict:
    if block_bytes is not None:  # rows of 160 bytes: blocks of block_bytes // 160 rows
        low_rank.ROW_BLOCK_BYTES = block_bytes
    codec = LowRank(rank=2)
    exchange = HyloExchange(ErrorFeedback(), ErrorFeedback())
    plan = LayerPlan("fc.weight", SHAPE, LOW_RANK, codec)
    averages, sent = [], []
    for step in range(STEPS):
        layer = LayerGradient(plan, _gradient(SHAPE, rank, step).reshape(-1))
        reports = exchange.average([layer])
        averages.append(layer.gradient.clone())
        sent.append(reports["fc.weight"].bytes_sent)
    return {
        "averages": averages,
        "sent": sent,
        "residual": exchange.memory.pop("fc.weight"),
        "blocks": len(low_rank.row_blocks(*SHAPE, 4, torch.device("cpu"))),
    }


@pytest.mark.parametrize(("world", "block_bytes"), [(2, None), (3, None), (2, 640), (3, 960)])
def test_low_rank_route_equals_the_hand_computation(world: int, block_bytes: int | None) -> None:
    results = run_distributed(_exchange, world, block_bytes)
    # the whole matrix at once by default; blocks of 4 and 6 rows when asked
    assert results[0]["blocks"] == {None: 1, 640: 6, 960: 4}[block_bytes]
    codec = LowRank(rank=2)
    q = codec.warm_start("fc.weight", SHAPE, torch.zeros(1))
    residuals = [torch.zeros(SHAPE) for _ in range(world)]
    for step in range(STEPS):
        matrices = [_gradient(SHAPE, rank, step) + residuals[rank] for rank in range(world)]
        p = orthonormalize(sum(matrix @ q for matrix in matrices))
        q = sum(matrix.t() @ p / world for matrix in matrices)
        estimate = p @ q.t()
        residuals = [matrix - estimate for matrix in matrices]
        for rank in range(world):
            average = results[rank]["averages"][step].view(SHAPE)
            torch.testing.assert_close(average, estimate, rtol=0, atol=1e-5)
    for rank in range(world):
        # every rank decodes the same average, bit for bit
        for step in range(STEPS):
            assert torch.equal(results[rank]["averages"][step], results[0]["averages"][step])
        torch.testing.assert_close(
            results[rank]["residual"].view(SHAPE), residuals[rank], atol=1e-5, rtol=0
        )
        expected = ring_allreduce_bytes(24 * 2 * 4, world) + ring_allreduce_bytes(40 * 2 * 4, world)
        assert results[rank]["sent"] == [pytest.approx(expected)] * STEPS


def test_the_route_plot_reads_the_route_gauges(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = Path(__file__).resolve().parents[2] / "scripts" / "plot_hylo_routes.py"
    spec = importlib.util.spec_from_file_location("plot_hylo_routes", path)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    gauges = {
        "hylo/fc.weight/route": float(ROUTES.index("low_rank")),
        "hylo/fc.weight/bytes": 4096.0,
        "hylo/conv.weight/route": float(ROUTES.index("kernel")),
        "hylo/conv.weight/bytes": 2048.0,
        "hylo/bytes": 4608.0,
    }
    result = {
        "config": {"model": "m", "bandwidth": "100mbit"},
        "runs": [{"spec": "hylo", "extra": {"gauges": gauges}}],
    }
    assert script.layer_routes(result["runs"][0]) == [
        ("fc.weight", "low_rank", 4096.0),
        ("conv.weight", "kernel", 2048.0),
    ]
    (tmp_path / "out.json").write_text(json.dumps(result))
    script.main([str(tmp_path / "out.json"), str(tmp_path / "routes.png")])
    assert (tmp_path / "routes.png").stat().st_size > 0


def test_the_first_trial_s_errors_are_what_each_candidate_misses_of_the_gradient() -> None:
    """What the cost model compares with its error budget, as the plan takes it from the
    profile: a rank-1 gradient loses nothing to rank-8 factors, a random 256 x 256 one most of
    itself; 2-bit codes lose about half of either; a layer with one candidate is not tried."""
    from lightning_parallel.compression.policy import HyloPolicy
    from lightning_parallel.compression.trials import first_trial_errors

    generator = torch.Generator().manual_seed(0)
    column, row = torch.randn(256, 1, generator=generator), torch.randn(1, 256, generator=generator)
    gradients = {
        "flat": column @ row,
        "noise": torch.randn(256, 256, generator=generator),
        "bias": torch.randn(256, generator=generator),
    }
    kept = {name: gradient.clone() for name, gradient in gradients.items()}
    policy = HyloPolicy(rank=8)
    errors = first_trial_errors(gradients, policy)
    assert set(errors) == {"flat", "noise"}
    assert errors["flat"]["low_rank@8"] < 1e-4
    assert errors["noise"]["low_rank@8"] > 0.85
    assert 0.3 < errors["flat"]["two_bit"] < 0.7 and 0.3 < errors["noise"]["two_bit"] < 0.7
    # the gradients and the policy's own codecs are left as they were (no warm start kept)
    assert all(torch.equal(gradients[name], kept[name]) for name in gradients)
    assert policy.low_rank_codec is not None
    assert not policy.low_rank_codec.state_dict()["factors"]
