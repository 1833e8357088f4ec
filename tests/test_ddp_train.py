"""examples/train.py --engine ddp under torchrun: every scheme logs sane JSON, and a resumed run matches an
unbroken one. One torchrun launch runs them all (a driver calls train.main per run), to keep start-up costs low."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_train_example import QUICK, SCHEMES

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
DRIVER = """
import sys
sys.path.insert(0, {examples!r})
import train

for argv in {runs!r}:
    train.main(argv)
"""


def train_under_torchrun(tmp_path: Path, runs: list[list[str]]) -> None:
    """``train.main(run)`` for each of ``runs`` (argument lists) in one torchrun launch of 2 workers; fails with the
    workers' output unless it exits 0."""
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.format(examples=str(EXAMPLES), runs=runs))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(EXAMPLES.parent), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(driver)], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-5000:])


def _read(log: Path) -> tuple[dict, list[dict]]:
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert lines[0]["type"] == "config" and all(r["type"] == "epoch" for r in lines[1:])
    return lines[0], lines[1:]


@pytest.mark.slow
def test_every_scheme_and_resume_under_torchrun(tmp_path):
    logs = ["--log-dir", str(tmp_path), "--engine", "ddp"]
    runs = [[*QUICK, *logs, "--scheme", scheme, *flags, "--run-name", scheme]
            for scheme, (flags, _, _) in SCHEMES.items()]
    resume = [*QUICK, *logs, "--epochs", "3", "--scheme", "powersgd"]
    checkpoint = str(tmp_path / "ckpt")
    runs += [[*resume, "--run-name", "unbroken"],
             [*resume, "--run-name", "broken", "--checkpoint", checkpoint, "--stop-after-epoch", "1"],
             [*resume, "--run-name", "broken", "--resume", checkpoint]]
    train_under_torchrun(tmp_path, runs)

    for scheme, (_, low, high) in SCHEMES.items():
        config, epochs = _read(tmp_path / f"{scheme}.jsonl")
        assert config["engine"] == "ddp" and config["world_size"] == 2 and len(epochs) == 2
        for record in epochs:
            assert 0 < record["train_loss"] < 10 and 0 <= record["top1"] <= record["top5"] <= 100
            assert record["inter_node_bytes"] > 0 and record["uncompressed_bytes"] > 0
            assert low <= record["compression_ratio"] <= high, (scheme, record["compression_ratio"])
        assert epochs[-1]["train_loss"] < epochs[0]["train_loss"] * 1.5
    _, unbroken = _read(tmp_path / "unbroken.jsonl")
    _, resumed = _read(tmp_path / "broken.jsonl")
    assert [r["epoch"] for r in resumed] == [1, 2, 3]
    for a, b in zip(unbroken, resumed):
        for key in ("train_loss", "test_loss", "top1", "top5", "inter_node_bytes"):
            assert a[key] == b[key], (key, a[key], b[key])
