"""``lightning-parallel codecs``: each codec's encode_ and decode_add_, timed per 10M floats."""

import json

import pytest
import torch

from lightning_parallel.bench import codecs
from lightning_parallel.cli import main as cli_main


def test_every_codec_is_timed_with_its_payload(tmp_path, capsys):
    out = tmp_path / "codecs.json"
    assert cli_main(["codecs", "--all", "--device", "cpu", "--numel", "20k", "--repeats", "2",
                     "--json", str(out)]) == 0  # fmt: skip
    result = json.loads(out.read_text())
    assert [row["codec"] for row in result["rows"]] == list(codecs.CODECS)
    for row in result["rows"]:
        assert row["device"] == "cpu" and row["repeats"] == 2
        assert row["encode_ms"] > 0 and row["decode_ms"] > 0
        assert row["total_ms"] == pytest.approx(row["encode_ms"] + row["decode_ms"])
        # every codec compresses: its payload is below the float32 tensor's 4 bytes a value
        assert 0 < row["payload_bytes"] < 4 * row["numel"]
    assert abs(result["rows"][0]["numel"] - 20_000) < 2_500  # kernels round the size down
    assert "two_bit" in capsys.readouterr().out


def test_the_timed_calls_encode_with_error_feedback_and_sum_the_decoded(monkeypatch):
    calls = {"encode_": 0, "decode_add_": 0}
    codec_class = codecs.CODECS["two_bit"]

    class Counted(codec_class):  # type: ignore[misc,valid-type]
        def encode_(self, tensor, workspace=None):
            calls["encode_"] += 1
            return super().encode_(tensor, workspace)

        def decode_add_(self, encoded, out, workspace=None):
            calls["decode_add_"] += 1
            return super().decode_add_(encoded, out, workspace)

    monkeypatch.setitem(codecs.CODECS, "two_bit", Counted)
    row = codecs.time_codec("two_bit", torch.device("cpu"), numel=1000, repeats=3, warmup=1)
    assert calls == {"encode_": 4, "decode_add_": 4} and row["repeats"] == 3


def test_bad_arguments_name_the_fix(capsys):
    with pytest.raises(ValueError, match="unknown codec 'zip'"):
        codecs.time_codecs(["zip"], ["cpu"], numel=100)
    with pytest.raises(SystemExit):
        cli_main(["codecs", "--numel", "lots"])
    assert "not a count: 'lots'" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert cli_main(["codecs", "--device", "cuda", "--numel", "1k"]) == 2
        assert "no CUDA device; use cpu" in capsys.readouterr().err
