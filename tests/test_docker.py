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


def test_the_image_bakes_no_ssh_host_keys_and_clients_check_them():
    dockerfile = (ROOT / "docker/Dockerfile").read_text()
    assert "rm -f /etc/ssh/ssh_host_*" in dockerfile  # the keys openssh-server's install generated
    after_removal = dockerfile.split("rm -f /etc/ssh/ssh_host_*")[1]
    assert "ssh-keygen -A" not in dockerfile and "/etc/ssh/ssh_host_" not in after_removal
    assert "StrictHostKeyChecking no" not in dockerfile and "UserKnownHostsFile /dev/null" not in dockerfile
    assert "StrictHostKeyChecking accept-new" in dockerfile
    key = "/etc/ssh/host_keys/ssh_host_ed25519_key"  # sshd's HostKey, which the entrypoint generates
    assert "HostKey %s" in dockerfile and f"{key} > /etc/ssh/sshd_config.d/hvdcomp.conf" in dockerfile
    assert f"HVDCOMP_SSH_HOST_KEY:-{key}" in (ROOT / "docker/entrypoint.sh").read_text()
    assert 'ENTRYPOINT ["/usr/local/bin/hvdcomp-entrypoint"]' in dockerfile
    assert "COPY docker/entrypoint.sh /usr/local/bin/hvdcomp-entrypoint" in dockerfile


def _entrypoint(key: Path) -> str:
    done = subprocess.run([str(ROOT / "docker/entrypoint.sh"), "cat", f"{key}.pub"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "HVDCOMP_SSH_HOST_KEY": str(key)})
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_each_container_generates_its_own_host_key_at_start(tmp_path):
    first, second = tmp_path / "a" / "key", tmp_path / "b" / "key"
    key = _entrypoint(first)
    assert key.startswith("ssh-ed25519 ") and key != _entrypoint(second)
    assert _entrypoint(first) == key  # kept across restarts where its directory is a volume
    assert (first.parent.stat().st_mode & 0o777) == 0o700 and (first.stat().st_mode & 0o077) == 0
