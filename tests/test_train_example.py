"""examples/train.py under real workers: every scheme logs sane JSON, and a resumed run matches an unbroken one;
Horovod's own optimizer (``--wrapper horovod``) with an hvdcomp compressor learns, keeps replicas identical and
resumes exactly."""

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.harness import run_script

TRAIN = Path(__file__).resolve().parent.parent / "examples" / "train.py"
sys.path.insert(0, str(TRAIN.parent))
import train  # noqa: E402

QUICK = ["--epochs", "2", "--max-steps-per-epoch", "4", "--batch-size", "32", "--no-progress"]

# scheme flags -> (lowest, highest) compression ratio expected at W = 2 on the small digits model
SCHEMES = {
    "none": ([], 1.0, 1.0),
    "fp16": (["--error-feedback"], 2.0, 2.0),
    "bf16": (["--error-feedback"], 1.99, 2.0),  # over Horovod: an all-to-all, odd buckets padded to W elements
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


@pytest.mark.parametrize("door, low, high", [([], 2.5, 3.0),  # the stock door's float64 carrier costs more
                                             (["--wrapper", "horovod", "--min-compress-numel", "0"], 2.0, 2.5)])
def test_warmup_steps_then_compressed(tmp_path, door, low, high):
    run_script(TRAIN, np=2, timeout=180, args=[*QUICK, *door, "--scheme", "qsgd", "--warmup-steps", "4", "--log-dir",
                                                str(tmp_path), "--run-name", "run"])
    _, (first, second) = _read(tmp_path / "run.jsonl")
    assert first["compression_ratio"] == 1.0 and low <= second["compression_ratio"] <= high, (first, second)


def _model(checkpoint: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint, weights_only=True)["model"]


@pytest.mark.slow
def test_stock_door_learns_keeps_replicas_identical_and_resumes(tmp_path):
    """hvd.DistributedOptimizer(compression=QSGDMaxNorm(4)) on 2 workers: loss falls, both workers end with the
    same model, the compressor's statistics show compression, and a run resumed from its checkpoint (the
    compressor's state included) matches an unbroken one exactly."""
    common = [*QUICK, "--epochs", "3", "--wrapper", "horovod", "--scheme", "qsgd", "--bits", "4",
              "--min-compress-numel", "0", "--log-dir", str(tmp_path)]
    run_script(TRAIN, np=2, timeout=180, args=[*common, "--run-name", "unbroken", "--checkpoint",
                                                str(tmp_path / "unbroken")])
    broken = str(tmp_path / "broken")
    run_script(TRAIN, np=2, timeout=180, args=[*common, "--run-name", "broken", "--checkpoint", broken,
                                                "--stop-after-epoch", "1"])
    run_script(TRAIN, np=2, timeout=180, args=[*common, "--run-name", "broken", "--resume", broken,
                                                "--checkpoint", broken])
    config, unbroken = _read(tmp_path / "unbroken.jsonl")
    assert config["door"] == "hvd.DistributedOptimizer" and config["wrapper"] == "horovod"
    assert config["bytes_source"] == "statistics" and config["machine"]["hvdcomp"] and config["machine"]["cpu"]
    assert unbroken[-1]["train_loss"] < unbroken[0]["train_loss"] and unbroken[-1]["test_loss"] < 2.2
    for record in unbroken:
        assert 3.5 <= record["compression_ratio"] <= 4.5, record["compression_ratio"]
        assert record["communicate_s"] > 0 and record["compress_s"] is None
    models = [_model(tmp_path / f"unbroken.rank{rank}") for rank in (0, 1)]
    assert all(torch.equal(models[0][k], models[1][k]) for k in models[0])
    _, resumed = _read(tmp_path / "broken.jsonl")
    assert [r["epoch"] for r in resumed] == [1, 2, 3]
    for a, b in zip(unbroken, resumed):
        for key in ("train_loss", "test_loss", "top1", "top5", "inter_node_bytes"):
            assert a[key] == b[key], (key, a[key], b[key])
    resumed_model = _model(tmp_path / "broken.rank1")
    assert all(torch.equal(models[0][k], resumed_model[k]) for k in models[0])


# the stock door's other schemes (qsgd: above) -> (flags, lowest, highest ratio at W = 2, all gradients compressed)
STOCK_SCHEMES = {
    "none": ([], 1.0, 1.0),
    "fp16": ([], 2.0, 2.0),
    "qsgd-multiscale": (["--bits", "4", "8", "--min-compress-numel", "0"], 3.0, 4.5),
    "randk": (["--ratio", "0.05", "--bits", "8", "--min-compress-numel", "0"], 20.0, 80.0),
    "randk-multiscale": (["--ratio", "0.05", "--bits", "4", "8", "--min-compress-numel", "0"], 20.0, 80.0),
}


@pytest.mark.slow
@pytest.mark.parametrize("scheme", sorted(STOCK_SCHEMES))
def test_stock_door_every_scheme_learns_and_counts_bytes(tmp_path, scheme):
    """Every other scheme the stock door takes trains and logs its compression. hvd.Compression.none/fp16 keep
    no statistics: the log counts one sum of every gradient a step, at 4 or 2 bytes an element, as hvdcomp's
    NoCompression/FP16 count it, and says so."""
    flags, low, high = STOCK_SCHEMES[scheme]
    run_script(TRAIN, np=2, timeout=180, args=[*QUICK, "--wrapper", "horovod", "--scheme", scheme, *flags,
                                                "--log-dir", str(tmp_path), "--run-name", "run"])
    config, epochs = _read(tmp_path / "run.jsonl")
    computed = scheme in ("none", "fp16")
    assert config["bytes_source"].startswith("computed") == computed
    for record in epochs:
        assert low <= record["compression_ratio"] <= high, (scheme, record["compression_ratio"])
        if computed:
            assert record["uncompressed_bytes"] == config["parameters"] * 4 * config["steps_per_epoch"]
    assert epochs[-1]["train_loss"] < epochs[0]["train_loss"]


@pytest.mark.parametrize("argv, message", [
    (["--scheme", "powersgd"], "--scheme powersgd needs --wrapper hvdcomp"),
    (["--scheme", "birder"], "--scheme birder needs --wrapper hvdcomp"),
    (["--scheme", "bf16"], "Horovod has no bfloat16"),
    (["--engine", "ddp"], "--wrapper horovod is for --engine horovod"),
    (["--scheme", "qsgd", "--bucket-mb", "8"], "does not take --bucket-mb"),
    (["--scheme", "qsgd", "--hierarchical"], "does not take --hierarchical"),
    (["--scheme", "fp16", "--error-feedback"], "does not take --error-feedback"),
    (["--scheme", "qsgd", "--elastic"], "does not take --elastic with a max-norm scheme"),
])
def test_stock_door_refuses_what_it_cannot_do_when_parsing(capsys, argv, message):
    with pytest.raises(SystemExit):
        train.parse_args(["--wrapper", "horovod", *argv])
    assert message in capsys.readouterr().err


def test_min_compress_numel_is_for_the_stock_door(capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--scheme", "qsgd", "--min-compress-numel", "0"])
    assert "--min-compress-numel is for --wrapper horovod" in capsys.readouterr().err
    assert train.parse_args(["--wrapper", "horovod", "--scheme", "qsgd", "--min-compress-numel", "0"]).bucket_mb is None


@pytest.mark.parametrize("workers, preset, expected", [("5", None, "90"), ("2", None, None), ("5", "7", "7")])
def test_gloo_timeout_raised_for_more_workers_than_cores(monkeypatch, capsys, workers, preset, expected):
    """On 2 cores, 5 workers get 30 s per worker per core (3 x 30 s), set before hvd.init(); 2 workers keep
    Gloo's default; a value the user set stays."""
    monkeypatch.setattr(train, "usable_cpus", lambda: 2)
    monkeypatch.setenv("HOROVOD_LOCAL_SIZE", workers)
    monkeypatch.setenv("HOROVOD_LOCAL_RANK", "0")
    monkeypatch.setenv(train.GLOO_TIMEOUT, preset or "")  # undone after the test, whatever train.py sets
    if preset is None:
        monkeypatch.delenv(train.GLOO_TIMEOUT)
    train.raise_gloo_timeout()
    assert train.os.environ.get(train.GLOO_TIMEOUT) == expected
    told = f"{train.GLOO_TIMEOUT}=90" in capsys.readouterr().err
    assert told == (expected == "90")


def test_rotate_is_for_the_qsgd_schemes(capsys):
    assert train.parse_args(["--scheme", "qsgd", "--bits", "2", "--rotate"]).rotate
    with pytest.raises(SystemExit):
        train.parse_args(["--scheme", "randk", "--rotate"])
    assert "--rotate is for --scheme qsgd and qsgd-multiscale" in capsys.readouterr().err
