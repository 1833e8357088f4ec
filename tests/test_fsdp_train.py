"""examples/train.py --engine fsdp under torchrun: the element-wise schemes log sane JSON with the compression
ratios of the DDP engine, in one torchrun launch (``tests/test_ddp_train.py``'s driver); what it refuses."""


import pytest

from tests.test_ddp_train import _read, train_under_torchrun
from tests.test_train_example import QUICK, SCHEMES, train

FSDP_SCHEMES = ("none", "fp16", "qsgd", "qsgd-multiscale", "randk")


@pytest.mark.slow
def test_element_wise_schemes_under_torchrun(tmp_path):
    logs = ["--log-dir", str(tmp_path), "--engine", "fsdp"]
    runs = [[*QUICK, *logs, "--scheme", scheme, *SCHEMES[scheme][0], "--run-name", scheme] for scheme in FSDP_SCHEMES]
    train_under_torchrun(tmp_path, runs)

    for scheme in FSDP_SCHEMES:
        _, low, high = SCHEMES[scheme]
        config, epochs = _read(tmp_path / f"{scheme}.jsonl")
        assert config["engine"] == "fsdp" and config["door"].startswith("torch FSDP2") and len(epochs) == 2
        for record in epochs:
            assert 0 < record["train_loss"] < 10 and 0 <= record["top1"] <= record["top5"] <= 100
            assert low <= record["compression_ratio"] <= high, (scheme, record["compression_ratio"])
        assert epochs[-1]["train_loss"] < epochs[0]["train_loss"] * 1.5


@pytest.mark.parametrize("argv", [["--scheme", "powersgd"], ["--scheme", "birder"], ["--checkpoint", "ckpt"]])
def test_fsdp_engine_refuses_what_it_cannot_do_when_parsing(capsys, argv):
    with pytest.raises(SystemExit):
        train.parse_args(["--engine", "fsdp", *argv])
    assert "--engine fsdp runs the element-wise schemes" in capsys.readouterr().err
