"""Every strategy family, a rank killed or frozen mid-training on 2 simulated hosts: no hang.

Each run trains ``mlp`` under one SPEC with a 10 s collective timeout and injects the fault
(:func:`lightning_parallel.bench.run_spec` with ``faults``). It must show what the issue asks
of every strategy: every surviving rank ends by itself within ``timeout + 30`` s of the fault,
with an error whose diagnosis names the lost rank; no process is left behind; the record is
``ok: false`` with ``wall_s`` measured from the run's start.
"""

import pytest

from lightning_parallel.bench import BenchConfig, run_spec
from lightning_parallel.cluster import netns_unavailable_reason

REASON = netns_unavailable_reason()
pytestmark = [
    pytest.mark.faults,
    pytest.mark.netns,
    pytest.mark.slow,
    pytest.mark.skipif(REASON is not None, reason=REASON or ""),
]

TIMEOUT = 10
AT = 14.0
FAMILIES = {
    "hylo": ("hylo", 1),
    "model_averaging": ("model_averaging:period=4", 1),
    "ps_worker": ("parameter_server", 1),
    "ps_server": ("parameter_server", 0),
    "gropipe": ("gropipe:stages=2", 1),
    "spectrain": ("spectrain:stages=2", 1),
}


@pytest.mark.parametrize("kind", ["kill", "freeze"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_lost_rank_ends_every_survivor_with_an_error_naming_it(tmp_path, family, kind):
    spec, target = FAMILIES[family]
    spec += ("," if ":" in spec else ":") + f"timeout={TIMEOUT}"
    config = BenchConfig(
        hosts=2, latency="0", model="mlp", max_steps=100_000, faults=[f"{kind}:{target}@{AT:g}"]
    )
    config.timeout = 240.0
    run = run_spec(spec, config, tmp_path)
    extra = run["extra"]
    assert not run["ok"], "a run ended by a fault is not ok"
    assert extra["faults"][0]["applied_s"] == pytest.approx(AT, abs=1.0)
    assert extra["hung"] == [] and extra["orphans"] == 0
    survivors = [r for r in extra["ranks"] if not r["faulted"]]
    assert [r["rank"] for r in survivors] == [1 - target]
    for rank in survivors:
        assert rank["exit_code"] not in (0, None)
        assert 0 <= rank["after_fault_s"] <= TIMEOUT + 30, rank
        # the diagnosis names the lost rank: by its silent heartbeat, or (rank 0) the store
        # its host serves
        assert f"rank {target}" in rank["error"], rank["error"]
        assert "[lightning_parallel]" in rank["error"] or "worker rank" in rank["error"]
    assert f"rank {target}" in run["error"].splitlines()[0]
    assert run["wall_s"] == pytest.approx(max(r["end_s"] for r in survivors))
