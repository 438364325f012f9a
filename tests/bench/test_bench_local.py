"""``bench --network local``: every host's processes on loopback, unshaped, without root."""

import json

import pytest

from lightning_parallel.bench.command import main as bench_main
from lightning_parallel.bench.runner import BenchConfig, run_spec

pytestmark = pytest.mark.slow


def test_a_loopback_bench_trains_every_rank_and_counts_no_wire_bytes(tmp_path):
    out = tmp_path / "out.json"
    code = bench_main(
        ["-s", "ddp", "--network", "local", "--hosts", "2", "--model", "convnet",
         "--max-steps", "6", "--warmup-steps", "1", "--json", str(out), "--timeout", "300",
         "--malloc", "system"]
    )  # fmt: skip
    assert code == 0
    result = json.loads(out.read_text())
    config, (run,) = result["config"], result["runs"]
    assert config["network"] == "local" and config["bandwidth"] == "unshaped"
    assert run["ok"] and run["world_size"] == 2 and run["steps"] == 6
    assert sorted(rank["rank"] for rank in run["extra"]["per_rank"]) == [0, 1]
    # --malloc system reached the ranks: glibc's own settings, nothing held
    assert config["malloc"] == "system" and run["extra"]["freed_memory_held"] is False
    # loopback carries every host's traffic: no per-host counter, the library's own count only
    assert run["wire_bytes_per_step"] is None
    assert run["reported_bytes_per_step"] == pytest.approx(
        run["extra"]["dense_allreduce_bytes_per_process"], rel=0.05
    )


def test_a_link_fault_needs_the_simulated_network():
    with pytest.raises(ValueError, match="link fault needs --network netns"):
        BenchConfig(network="local", faults=["link:1@5"]).validate()
    BenchConfig(network="local", faults=["kill:1@5"]).validate()
    with pytest.raises(ValueError, match="network must be one of netns, local"):
        BenchConfig(network="loopback").validate()


@pytest.mark.faults
def test_a_killed_loopback_rank_ends_the_survivor_with_an_error_not_a_hang(tmp_path):
    config = BenchConfig(
        network="local", model="mlp", max_steps=100_000, faults=["kill:1@step30"], timeout=240.0
    )
    run = run_spec("model_averaging:period=4,timeout=10", config, tmp_path)
    extra = run["extra"]
    assert not run["ok"] and extra["faults"][0]["applied_s"] is not None
    assert extra["hung"] == [] and extra["orphans"] == 0
    (survivor,) = [rank for rank in extra["ranks"] if not rank["faulted"]]
    assert survivor["rank"] == 0 and survivor["exit_code"] not in (0, None)
    assert 0 <= survivor["after_fault_s"] <= 10 + 30
