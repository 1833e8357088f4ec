"""The Docker image's pins and the GPU flavour's preconditions (the image itself: `make image-test`)."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def test_dockerfile_pins_the_constrained_torch():
    pins = dict(re.findall(r"^(torch|torchvision)==(\S+)$", (ROOT / "requirements/constraints.txt").read_text(), re.M))
    args = dict(re.findall(r"^ARG (TORCH_VERSION|TORCHVISION_VERSION)=(\S+)$", (ROOT / "docker/Dockerfile").read_text(),
                           re.M))
    assert pins == {"torch": args["TORCH_VERSION"], "torchvision": args["TORCHVISION_VERSION"]}


def _gpu_build_missing() -> list[str]:
    nccl = "HOROVOD_NCCL_HOME" in os.environ or "libnccl" in subprocess.run(
        ["ldconfig", "-p"], capture_output=True, text=True).stdout
    found = {"nvcc": shutil.which("nvcc") is not None, "NCCL": nccl, "a CUDA build of torch": bool(torch.version.cuda)}
    return [name for name, ok in found.items() if not ok]


@pytest.mark.slow
def test_gpu_flavour_names_what_is_missing_and_needs_no_gpu():
    missing = _gpu_build_missing()
    if not missing:
        pytest.skip("everything the gpu build needs is here: the script would build Horovod")
    env = {**os.environ, "HVDCOMP_HOROVOD_FLAVOUR": "gpu", "PYTHON": str(ROOT / ".venv/bin/python")}
    done = subprocess.run([str(ROOT / "scripts/install_horovod.sh")], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith("install_horovod: error: GPU build asked for but missing: "), done.stderr
    listed = [item.split(" (")[0] for item in error.split("missing: ", 1)[1].split(";")]
    assert listed == missing, (listed, missing)  # a GPU or nvidia-smi is not among the requirements
