"""The example models have the seed paper's sizes and run on CIFAR-shaped and digits-shaped inputs."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from models import MODELS  # noqa: E402


@pytest.mark.parametrize("name,millions", [("resnet50", 23.52), ("vgg16", 14.73), ("small", 0.03)])
def test_parameter_counts_and_output_shape(name, millions):
    model = MODELS[name](num_classes=10, in_channels=3)
    assert round(sum(p.numel() for p in model.parameters()) / 1e6, 2) == millions
    model.eval()
    with torch.no_grad():
        assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_small_model_takes_digits():
    with torch.no_grad():
        assert MODELS["small"](num_classes=10, in_channels=1)(torch.randn(4, 1, 8, 8)).shape == (4, 10)
