"""scripts/install_horovod.sh installs only what it checked: the sdist against its pinned sha256, a cached wheel
against the SHA256SUMS recorded beside it in a private directory (its functions, sourced, on fake files)."""

import hashlib
import os
import re
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "install_horovod.sh"


def _call(function: str, *args: str) -> int:
    done = subprocess.run(["bash", "-c", f'source "{SCRIPT}" && {function} "$@"', "test", *args],
                          capture_output=True, text=True, timeout=60)
    return done.returncode


@pytest.fixture
def wheel_dir(tmp_path):
    """A private wheel directory with one fake wheel and its recorded sha256."""
    directory = tmp_path / "wheels" / "key"
    directory.mkdir(parents=True, mode=0o700)
    wheel = directory / "horovod-0.28.1-cp311-cp311-linux_x86_64.whl"
    wheel.write_bytes(b"not really a wheel")
    subprocess.run(f"sha256sum {wheel.name} > SHA256SUMS", shell=True, cwd=directory, check=True)
    return directory


def test_a_recorded_wheel_verifies(wheel_dir):
    assert _call("verify_wheel", str(wheel_dir)) == 0


def test_a_changed_wheel_fails(wheel_dir):
    next(wheel_dir.glob("*.whl")).write_bytes(b"planted")
    assert _call("verify_wheel", str(wheel_dir)) != 0


def test_a_wheel_without_its_sum_fails(wheel_dir):
    (wheel_dir / "SHA256SUMS").unlink()
    assert _call("verify_wheel", str(wheel_dir)) != 0


def test_a_second_wheel_fails(wheel_dir):
    (wheel_dir / "horovod-0.28.1-planted.whl").write_bytes(b"planted")
    assert _call("verify_wheel", str(wheel_dir)) != 0


def test_a_symlinked_wheel_fails(wheel_dir, tmp_path):
    wheel = next(wheel_dir.glob("*.whl"))
    (tmp_path / "real.whl").write_bytes(wheel.read_bytes())
    wheel.unlink()
    wheel.symlink_to(tmp_path / "real.whl")
    assert _call("verify_wheel", str(wheel_dir)) != 0


@pytest.mark.parametrize("mode", [0o770, 0o777])
def test_a_wheel_directory_others_can_write_fails(wheel_dir, mode):
    wheel_dir.chmod(mode)
    assert _call("verify_wheel", str(wheel_dir)) != 0


def test_a_wheel_directory_of_another_user_fails(wheel_dir):
    os.chown(wheel_dir, 65534, 65534)
    assert _call("verify_wheel", str(wheel_dir)) != 0


def test_the_sdist_is_pinned_and_checked(tmp_path):
    text = SCRIPT.read_text()
    pin = re.search(r"^HOROVOD_SDIST_SHA256=([0-9a-f]{64})\b", text, re.M)
    assert pin, "no pinned sha256 for the sdist"
    assert 'sha256_is "$work/horovod-$HOROVOD_VERSION.tar.gz" "$HOROVOD_SDIST_SHA256"' in text
    sdist = tmp_path / "horovod-0.28.1.tar.gz"
    sdist.write_bytes(b"sdist")
    assert _call("sha256_is", str(sdist), hashlib.sha256(b"sdist").hexdigest()) == 0
    assert _call("sha256_is", str(sdist), pin.group(1)) != 0
