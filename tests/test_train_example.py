"""examples/train.py under real workers: every scheme logs sane JSON, and a resumed run matches an unbroken one."""

import json
from pathlib import Path

import pytest

from tests.harness import run_script

TRAIN = Path(__file__).resolve().parent.parent / "examples" / "train.py"
QUICK = ["--epochs", "2", "--max-steps-per-epoch", "4", "--batch-size", "32", "--no-progress"]

# scheme flags -> (lowest, highest) compression ratio expected at W = 2 on the small digits model
SCHEMES = {
    "none": ([], 1.0, 1.0),
    "fp16": (["--error-feedback"], 2.0, 2.0),
    "qsgd": (["--bits", "8"], 2.5, 3.0),
    "qsgd-multiscale": (["--bits", "4", "8"], 2.5, 4.0),
    "randk": (["--ratio", "0.05", "--bits", "8"], 20.0, 80.0),
    "randk-multiscale": (["--ratio", "0.05", "--bits", "4", "8"], 20.0, 80.0),
    "powersgd": (["--rank", "1"], 4.0, 100.0),
    "birder": ([], 10.0, 16.0),
}


def _read(log: Path) -> tuple[dict, list[dict]]:
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert lines[0]["type"] == "config" and all(r["type"] == "epoch" for r in lines[1:])
    return lines[0], lines[1:]


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_every_scheme_logs_finite_metrics_and_expected_ratio(tmp_path, scheme):
    flags, low, high = SCHEMES[scheme]
    run_script(TRAIN, np=2, timeout=180, args=[*QUICK, "--scheme", scheme, *flags, "--log-dir", str(tmp_path),
                                                "--run-name", "run"])
    config, epochs = _read(tmp_path / "run.jsonl")
    assert config["scheme"] == scheme and config["world_size"] == 2 and len(epochs) == 2
    for record in epochs:
        assert 0 < record["train_loss"] < 10 and 0 < record["test_loss"] < 10
        assert 0 <= record["top1"] <= record["top5"] <= 100
        assert record["inter_node_bytes"] > 0 and record["uncompressed_bytes"] > 0
        assert low <= record["compression_ratio"] <= high, (scheme, record["compression_ratio"])
        assert record["compute_s"] > 0 and record["communicate_s"] > 0
    assert epochs[-1]["train_loss"] < epochs[0]["train_loss"] * 1.5


def test_resume_matches_unbroken_run(tmp_path):
    common = [*QUICK, "--epochs", "3", "--scheme", "randk", "--ratio", "0.1", "--log-dir", str(tmp_path)]
    run_script(TRAIN, np=2, timeout=180, args=[*common, "--run-name", "unbroken"])
    checkpoint = str(tmp_path / "ckpt")
    run_script(TRAIN, np=2, timeout=180, args=[*common, "--run-name", "broken", "--checkpoint", checkpoint,
                                                "--stop-after-epoch", "1"])
    run_script(TRAIN, np=2, timeout=180, args=[*common, "--run-name", "broken", "--resume", checkpoint])
    _, unbroken = _read(tmp_path / "unbroken.jsonl")
    _, resumed = _read(tmp_path / "broken.jsonl")
    assert [r["epoch"] for r in resumed] == [1, 2, 3]
    for a, b in zip(unbroken, resumed):
        for key in ("train_loss", "test_loss", "top1", "top5", "inter_node_bytes"):
            assert a[key] == b[key], (key, a[key], b[key])


def test_clear_errors(tmp_path):
    for args, message in [
        (["--dataset", "cifar10", "--data-dir", str(tmp_path / "nothing")], "pass --download"),
        (["--scheme", "zip"], "invalid choice"),
        (["--scheme", "qsgd", "--bits", "0"], "--bits must be between 1 and 16"),
        (["--scheme", "qsgd-multiscale", "--bits", "8", "4"], "strictly increasing"),
    ]:
        with pytest.raises(AssertionError, match=message):
            run_script(TRAIN, np=1, timeout=120, args=[*QUICK, *args, "--log-dir", str(tmp_path)])


def test_warmup_steps_then_compressed(tmp_path):
    run_script(TRAIN, np=2, timeout=180, args=[*QUICK, "--scheme", "qsgd", "--warmup-steps", "4", "--log-dir",
                                                str(tmp_path), "--run-name", "run"])
    _, (first, second) = _read(tmp_path / "run.jsonl")
    assert first["compression_ratio"] == 1.0 and 2.5 <= second["compression_ratio"] <= 3.0, (first, second)
