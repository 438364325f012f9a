"""The allreduce-compatible exchange on real gloo process groups, against hand computations."""

from __future__ import annotations

import pytest
import torch
from helpers.distributed import run_distributed
from helpers.spies import recording

from lightning_parallel.comm.accounting import track_collectives
from lightning_parallel.comm.ledger import CommLedger
from lightning_parallel.compression import (
    ErrorFeedback,
    HyloExchange,
    KernelTopK,
    LayerGradient,
    LayerPlan,
    TopK,
    TwoBitQuantizer,
    two_phase_chunk,
)
from lightning_parallel.compression.none import NoCompression
from lightning_parallel.compression.policy import DENSE, GATHER, KERNEL, TWO_BIT

STEPS = 3


def _gradient(shape: tuple[int, ...], rank: int, step: int, salt: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(10_000 * salt + 100 * step + rank)
    return torch.randn(shape, generator=generator)


def _run_exchange(
    rank: int,
    world: int,
    plans: list[LayerPlan],
    mode: str,
    importance_dtype: torch.dtype,
) -> list[list[torch.Tensor]]:
    """Every rank exchanges STEPS steps of its own gradients; returns the averages per step."""
    exchange = HyloExchange(ErrorFeedback(), ErrorFeedback(), mode, importance_dtype)
    return _exchange_steps(exchange, plans, rank)


def _exchange_steps(
    exchange: HyloExchange, plans: list[LayerPlan], rank: int
) -> list[list[torch.Tensor]]:
    results = []
    for step in range(STEPS):
        layers = [
            LayerGradient(plan, _gradient(plan.shape, rank, step, salt).reshape(-1))
            for salt, plan in enumerate(plans)
        ]
        exchange.average(layers)
        results.append([layer.gradient.clone() for layer in layers])
    return results


def _quantize(p: torch.Tensor, tau: torch.Tensor, reconstruction: str) -> torch.Tensor:
    """The 2-bit quantizer written out by hand: +s, -s or 0 for |p| >= tau."""
    sent = p.abs() >= tau
    if reconstruction == "threshold":
        scale = tau
    else:
        scale = p.abs()[sent].mean() if sent.any() else torch.tensor(0.0)
    return torch.where(sent, torch.sign(p) * scale, torch.zeros_like(p))


def _two_phase_by_hand(
    shape: tuple[int, ...], world: int, salt: int, factor: float, reconstruction: str
) -> list[torch.Tensor]:
    numel = int(torch.Size(shape).numel())
    chunk = two_phase_chunk(numel, world)
    worker_residuals = [torch.zeros(numel) for _ in range(world)]
    server_residuals = [torch.zeros(chunk) for _ in range(world)]
    averages = []
    for step in range(STEPS):
        decoded = torch.zeros(chunk * world)
        for rank in range(world):
            p = _gradient(shape, rank, step, salt).reshape(-1) + worker_residuals[rank]
            q = _quantize(p, factor * p.abs().mean(), reconstruction)
            worker_residuals[rank] = p - q
            decoded[:numel] += q
        mean = decoded / world
        result = torch.zeros(chunk * world)
        for owner in range(world):
            s = mean[owner * chunk : (owner + 1) * chunk] + server_residuals[owner]
            valid = max(0, min(chunk, numel - owner * chunk))
            tau = factor * s[:valid].abs().mean() if valid else torch.tensor(0.0)
            q = _quantize(s, tau, reconstruction) if valid else torch.zeros_like(s)
            server_residuals[owner] = s - q
            result[owner * chunk : (owner + 1) * chunk] = q
        averages.append(result[:numel])
    return averages


@pytest.mark.parametrize(
    ("world", "reconstruction"), [(2, "mean"), (3, "mean"), (2, "threshold"), (3, "threshold")]
)
def test_two_phase_two_bit_allreduce_equals_the_hand_computation(
    world: int, reconstruction: str
) -> None:
    codec = TwoBitQuantizer(threshold_factor=0.7, reconstruction=reconstruction)
    plan = LayerPlan("fc.weight", (7, 13), TWO_BIT, codec)  # 91 values: padded chunks
    results = run_distributed(_run_exchange, world, [plan], "two_phase", torch.float32)
    expected = _two_phase_by_hand(plan.shape, world, 0, 0.7, reconstruction)
    for step in range(STEPS):
        for rank in range(world):
            torch.testing.assert_close(results[rank][step][0], expected[step], rtol=0, atol=1e-6)
            assert torch.equal(results[rank][step][0], results[0][step][0])  # all ranks agree


def _quantize_blocks(p: torch.Tensor, block: int, factor: float) -> torch.Tensor:
    """Block-wise 2-bit by hand: every ``block`` values (the last one partial) on their own."""
    pieces = [_quantize(piece, factor * piece.abs().mean(), "mean") for piece in p.split(block)]
    return torch.cat(pieces) if pieces else torch.zeros(0)


@pytest.mark.parametrize("world", [2, 3])
def test_block_scaled_two_phase_allreduce_equals_the_hand_computation(world: int) -> None:
    """Chunks hold whole blocks; workers and owners quantize per block with its own scale."""
    block, factor = 32, 0.7
    codec = TwoBitQuantizer(threshold_factor=factor, block_size=block)
    plan = LayerPlan("fc.weight", (9, 23), TWO_BIT, codec)  # 207 values: partial last block
    results = run_distributed(_run_exchange, world, [plan], "two_phase", torch.float32)
    numel = 9 * 23
    chunk = two_phase_chunk(numel, world, block)
    assert chunk % block == 0
    workers = [torch.zeros(numel) for _ in range(world)]
    owners = [torch.zeros(chunk) for _ in range(world)]
    for step in range(STEPS):
        mean = torch.zeros(chunk * world)
        for rank in range(world):
            compensated = _gradient(plan.shape, rank, step, 0).reshape(-1) + workers[rank]
            sent = _quantize_blocks(compensated, block, factor)
            workers[rank] = compensated - sent
            mean[:numel] += sent
        mean /= world
        expected = torch.zeros(chunk * world)
        for owner in range(world):
            u = mean[owner * chunk : (owner + 1) * chunk] + owners[owner]
            valid = max(0, min(chunk, numel - owner * chunk))
            q = torch.zeros(chunk)
            q[:valid] = _quantize_blocks(u[:valid], block, factor)
            owners[owner] = u - q
            expected[owner * chunk : (owner + 1) * chunk] = q
        for rank in range(world):
            torch.testing.assert_close(
                results[rank][step][0], expected[:numel], rtol=1e-5, atol=1e-6
            )


def test_kernel_selection_is_global_and_selected_kernels_are_averaged_exactly() -> None:
    world = 2
    codec = KernelTopK(conv_rate=0.25, rate_exponent=0.0)
    plan = LayerPlan("conv.weight", (4, 3, 3, 3), KERNEL, codec)
    results = run_distributed(_run_exchange, world, [plan], "two_phase", torch.float32)
    residuals = [torch.zeros(plan.shape) for _ in range(world)]
    for step in range(STEPS):
        compensated = [
            _gradient(plan.shape, rank, step, 0) + residuals[rank] for rank in range(world)
        ]
        importance = sum(codec.importance(p) for p in compensated)
        selected = codec.select(importance, plan.shape)
        expected = torch.zeros(12, 9)
        for rank, p in enumerate(compensated):
            expected[selected] += p.reshape(12, 9)[selected] / world
            residuals[rank] = p.reshape(12, 9).index_fill(0, selected, 0.0).reshape(plan.shape)
        for rank in range(world):
            torch.testing.assert_close(
                results[rank][step][0], expected.reshape(-1), rtol=0, atol=1e-7
            )


def test_dense_and_gather_routes_average_like_the_mean_of_decoded_payloads() -> None:
    world = 2
    topk = TopK(ratio=0.1)
    plans = [
        LayerPlan("bias", (5,), DENSE, NoCompression()),
        LayerPlan("fc.weight", (6, 10), GATHER, topk),
    ]
    results = run_distributed(_run_exchange, world, plans, "two_phase", torch.float32)
    step = 0
    dense = sum(_gradient((5,), rank, step, 0) for rank in range(world)) / world
    gathered = sum(
        topk.decode(topk.encode(_gradient((6, 10), rank, step, 1))) for rank in range(world)
    )
    for rank in range(world):
        torch.testing.assert_close(results[rank][step][0], dense)
        torch.testing.assert_close(results[rank][step][1], gathered.reshape(-1) / world)


def _bytes_per_rank(rank: int, world: int, mode: str) -> float:
    plans = [
        LayerPlan("conv.weight", (64, 32, 3, 3), KERNEL, KernelTopK(conv_rate=0.05)),
        LayerPlan("fc.weight", (256, 1024), TWO_BIT, TwoBitQuantizer()),
        LayerPlan("fc.bias", (256,), DENSE, NoCompression()),
    ]
    exchange = HyloExchange(ErrorFeedback(), ErrorFeedback(), mode)
    ledger = CommLedger()
    with track_collectives(ledger):
        exchange.average([LayerGradient(p, torch.randn(p.shape).reshape(-1)) for p in plans])
    return ledger.total_bytes()


def test_bytes_per_rank_stay_flat_from_2_to_4_ranks() -> None:
    dense_bytes = 4.0 * (64 * 32 * 9 + 256 * 1024 + 256)  # float32 gradients
    two = run_distributed(_bytes_per_rank, 2, "two_phase")
    four = run_distributed(_bytes_per_rank, 4, "two_phase")
    gather_two = run_distributed(_bytes_per_rank, 2, "allgather")
    gather_four = run_distributed(_bytes_per_rank, 4, "allgather")
    # Ring-allreduce-like: 2 (W-1)/W of the payload, i.e. 1x at W=2 and 1.5x at W=4, never W-1.
    assert max(four) / max(two) < 1.6
    assert max(two) < 0.1 * dense_bytes and max(four) < 0.15 * dense_bytes
    # The allgather fallback grows with W - 1 (3x from 2 to 4 ranks).
    assert max(gather_four) / max(gather_two) > 2.5


@pytest.mark.parametrize(("world", "same_as"), [(2, "allgather"), (3, "two_phase")])
def test_auto_exchange_allgathers_at_two_ranks_and_goes_two_phase_above(
    world: int, same_as: str
) -> None:
    """At W=2 both send the same bytes; allgather quantizes once (the average is exact)."""
    codec = TwoBitQuantizer(threshold_factor=0.7)
    plan = LayerPlan("fc.weight", (7, 13), TWO_BIT, codec)
    auto = run_distributed(_run_exchange, world, [plan], "auto", torch.float32)
    reference = run_distributed(_run_exchange, world, [plan], same_as, torch.float32)
    for rank in range(world):
        for step in range(STEPS):
            assert torch.equal(auto[rank][step][0], reference[rank][step][0])


def _pipelined(rank: int, world: int, piece_numel: int | None, calibrating: bool) -> dict:
    """STEPS exchanges of a 2-bit layer (blocks of 64), a top-k layer and a bias, all gathered."""
    plans = [
        LayerPlan("fc.weight", (40, 100), GATHER, TwoBitQuantizer(block_size=64)),
        LayerPlan("fc.bias", (40,), DENSE, NoCompression()),
        LayerPlan("out.weight", (10, 40), GATHER, TopK(ratio=0.1)),
    ]
    exchange = HyloExchange(ErrorFeedback(), ErrorFeedback(), "allgather", piece_numel=piece_numel)
    exchange.calibrating = calibrating
    with recording(torch.distributed, "all_gather") as messages:
        averages = _exchange_steps(exchange, plans, rank)
    residuals = {name: exchange.memory.residual(name).clone() for name in exchange.memory}
    return {"averages": averages, "residuals": residuals, "messages": len(messages) / STEPS}


def test_pipelined_pieces_give_the_one_piece_result_bit_for_bit() -> None:
    """Pieces of whole blocks, each sent once encoded, change when bytes leave, not the values."""
    whole = run_distributed(_pipelined, 2, None, False)
    pieces = run_distributed(_pipelined, 2, 1000, False)
    for rank in range(2):
        for step in range(STEPS):
            for got, expected in zip(pieces[rank]["averages"][step], whole[rank]["averages"][step]):
                assert torch.equal(got, expected)
        assert pieces[rank]["residuals"].keys() == whole[rank]["residuals"].keys()
        for name, residual in whole[rank]["residuals"].items():
            assert torch.equal(pieces[rank]["residuals"][name], residual)
    # one message per bucket without pieces; with them the 4000-value layer is cut into pieces
    # of 960 values (15 blocks of 64, at most 1000) and a message leaves once it holds 1000
    # values or more: pieces 1-2, pieces 3-4, then piece 5 (160 values) with the top-k layer
    assert whole[0]["messages"] == 1
    assert pieces[0]["messages"] == 3


def test_calibration_steps_send_a_bucket_in_one_message() -> None:
    """The cost model reads bytes over seconds waited: on calibration steps nothing overlaps."""
    calibrating = run_distributed(_pipelined, 2, 1000, True)
    assert calibrating[0]["messages"] == 1


def _two_phase_layouts(rank: int, world: int, layouts: list[int | None]) -> dict:
    """One exchange per entry of ``layouts`` (its piece_numel) of a 2-bit layer (blocks of 64),
    two-phase; then the layer turns dense and flushes what it kept into a zero gradient."""
    plan = LayerPlan("fc.weight", (40, 100), TWO_BIT, TwoBitQuantizer(block_size=64))
    exchange = HyloExchange(ErrorFeedback(), ErrorFeedback(), "two_phase")
    averages = []
    with recording(torch.distributed, "all_to_all_single") as messages:
        for step, piece_numel in enumerate(layouts):
            exchange.piece_numel = piece_numel
            layer = LayerGradient(plan, _gradient(plan.shape, rank, step, 0).reshape(-1))
            exchange.average([layer])
            averages.append(layer.gradient.clone())
    keys = sorted(exchange.server_memory)
    kept = LayerGradient(plan, torch.zeros(plan.numel))
    exchange.flush(kept, world, rank)
    return {"averages": averages, "kept": kept.gradient, "messages": len(messages), "keys": keys}


def test_pipelined_two_phase_gives_the_one_piece_result_bit_for_bit() -> None:
    """Pieces of whole blocks: every block is quantized by the workers, averaged and
    re-quantized by its owner as in one piece; only which rank owns a block changes."""
    whole = run_distributed(_two_phase_layouts, 3, [None] * STEPS)
    pieces = run_distributed(_two_phase_layouts, 3, [1000] * STEPS)
    for rank in range(3):
        for got, expected in zip(pieces[rank]["averages"], whole[rank]["averages"]):
            assert torch.equal(got, expected)
    # what the ranks kept, averaged, is the same (held by other owners)
    kept_whole = sum(result["kept"] for result in whole) / 3
    kept_pieces = sum(result["kept"] for result in pieces) / 3
    torch.testing.assert_close(kept_pieces, kept_whole, rtol=0, atol=1e-6)
    assert whole[0]["messages"] == STEPS and pieces[0]["messages"] == 3 * STEPS


def test_changing_pieces_loses_nothing() -> None:
    """Second residuals of another layout join the gradient: every value sent or kept."""
    layouts = [None, None, 1000, 1000, 640, None]
    results = run_distributed(_two_phase_layouts, 3, layouts)
    applied = sum(results[0]["averages"])
    kept = sum(result["kept"] for result in results) / 3
    true = (
        sum(
            _gradient((40, 100), rank, step, 0).reshape(-1)
            for rank in range(3)
            for step in range(len(layouts))
        )
        / 3
    )
    torch.testing.assert_close(applied + kept, true, rtol=0, atol=1e-5)
    # the pieces' residuals were folded in when the layer went back to one piece
    for rank, result in enumerate(results):
        assert result["keys"] == [f"fc.weight@chunk{rank}of3"]
