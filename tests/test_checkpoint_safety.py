"""Checkpoints load with ``torch.load(weights_only=True)``: what examples/train.py writes loads that way, and resuming
from a planted pickle whose ``__reduce__`` runs code is refused before the code runs."""

import pickle
from pathlib import Path

import pytest
import torch

from tests.harness import run_script
from tests.test_train_example import QUICK, TRAIN


class _Payload:
    """Unpickles as a call to ``Path.touch(marker)``: stands for arbitrary code in a checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def test_train_checkpoints_load_with_weights_only(tmp_path):
    for scheme in ("randk", "birder"):
        checkpoint = tmp_path / scheme
        run_script(TRAIN, np=1, timeout=300, args=[*QUICK, "--scheme", scheme, "--log-dir", str(tmp_path),
                                                    "--run-name", scheme, "--checkpoint", str(checkpoint),
                                                    "--stop-after-epoch", "1"])
        state = torch.load(f"{checkpoint}.rank0", weights_only=True)
        assert {"model", "optimizer", "epoch", "world_size"} <= set(state), scheme


def test_a_planted_pickle_is_refused(tmp_path):
    marker = tmp_path / "ran"
    checkpoint = tmp_path / "planted"
    with open(f"{checkpoint}.rank0", "wb") as f:
        pickle.dump({"world_size": 1, "payload": _Payload(marker)}, f)
    with pytest.raises(AssertionError) as failed:  # run_script's report of a failed worker
        run_script(TRAIN, np=1, timeout=300, args=[*QUICK, "--scheme", "none", "--log-dir", str(tmp_path),
                                                    "--resume", str(checkpoint)])
    assert "weights_only" in str(failed.value), str(failed.value)[-2000:]
    assert not marker.exists()
