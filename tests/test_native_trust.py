"""The native kernels load only from a cache this user alone controls (``hvdcomp.codec.cache``): a cache directory
or library that is a symlink, owned by another user or writable by others is refused, with one warning, and the
kernels are built in a fresh private directory instead; a forked child's first threaded call does not hang."""

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from hvdcomp.codec import cache, fused, native, native_build

ROOT = Path(__file__).resolve().parents[1]
NOBODY = 65534
PLANTED_SOURCE = """
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
  FILE* f = fopen(MARKER, "w");
  if (f) fclose(f);
}
"""


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """A library whose loading creates ``marker``; the cache is ``tmp_path / "cache"`` (private, not created)."""
    marker = tmp_path / "loaded"
    source = tmp_path / "planted.c"
    source.write_text(PLANTED_SOURCE)
    library = tmp_path / "planted.so"
    subprocess.run([native.compiler(), "-x", "c", "-shared", "-fPIC", f'-DMARKER="{marker}"', "-o", str(library),
                    str(source)], check=True, timeout=300)
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "cache"))
    return library, marker


def _load_refusing(reason: str) -> None:
    """``native_build.load()`` warns once with ``reason`` and returns working kernels (built elsewhere)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lib = native_build.load()
    ours = [str(w.message) for w in caught if "native kernels" in str(w.message)]
    assert len(ours) == 1 and reason in ours[0], ours
    words = torch.tensor([1, 2, 3, 4], dtype=torch.int64)
    draws = torch.empty(8, dtype=torch.float32)
    lib.hvdcomp_uniform(words.data_ptr(), 0, 8, draws.data_ptr())
    assert bool(((draws > 0) & (draws < 1)).all())


def _plant(library: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(library.read_bytes())


def test_a_cache_owned_by_another_user_is_refused(planted):
    library, marker = planted
    target = native.library_path(native.compiler())
    _plant(library, target)
    os.chown(target.parent, NOBODY, NOBODY)
    _load_refusing(f"owned by uid {NOBODY}")
    assert not marker.exists()


def test_a_library_owned_by_another_user_is_refused(planted):
    library, marker = planted
    target = native.library_path(native.compiler())
    _plant(library, target)
    target.parent.chmod(0o700)
    os.chown(target, NOBODY, NOBODY)
    _load_refusing(f"owned by uid {NOBODY}")
    assert not marker.exists()


@pytest.mark.parametrize("mode", [0o770, 0o777, 0o1777])
def test_a_cache_others_can_write_is_refused(planted, mode):
    library, marker = planted
    target = native.library_path(native.compiler())
    _plant(library, target)
    target.parent.chmod(mode)
    _load_refusing("writable by other users")
    assert not marker.exists()


def test_a_symlinked_cache_directory_is_refused(planted, tmp_path):
    library, marker = planted
    target = native.library_path(native.compiler())
    elsewhere = tmp_path / "elsewhere"
    _plant(library, elsewhere / target.name)
    target.parent.parent.mkdir(mode=0o700)
    target.parent.symlink_to(elsewhere)
    _load_refusing("symbolic link")
    assert not marker.exists()


def test_a_symlinked_library_is_refused(planted):
    library, marker = planted
    target = native.library_path(native.compiler())
    target.parent.mkdir(mode=0o700, parents=True)
    target.symlink_to(library)
    _load_refusing(str(target.parent))
    assert not marker.exists()


def test_the_private_cache_is_created_private_and_used(tmp_path, monkeypatch):
    monkeypatch.delenv(cache.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    target = native.library_path(native.compiler())
    assert target.parent.parent == tmp_path / "xdg" / "hvdcomp"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lib = native_build.load()
    assert lib is not None and target.is_file()
    for path in (target.parent.parent, target.parent, target):
        assert path.stat().st_uid == os.geteuid() and path.stat().st_mode & 0o077 == 0, oct(path.stat().st_mode)
    built = target.stat().st_mtime_ns
    native_build.load()
    assert target.stat().st_mtime_ns == built  # loaded from the cache, not rebuilt


def test_inductor_cache_is_private_unless_set(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(cache.INDUCTOR_CACHE_ENV, raising=False)
    cache.use_private_inductor_cache()
    chosen = Path(os.environ[cache.INDUCTOR_CACHE_ENV])
    assert chosen == tmp_path / "cache" / "inductor" and chosen.stat().st_mode & 0o077 == 0
    monkeypatch.setenv(cache.INDUCTOR_CACHE_ENV, str(tmp_path / "mine"))
    cache.use_private_inductor_cache()
    assert os.environ[cache.INDUCTOR_CACHE_ENV] == str(tmp_path / "mine")


FORK_SCRIPT = """
    import os
    import torch
    from hvdcomp.codec import native
    from hvdcomp.codec.random import stream_words

    torch.set_num_threads(2)
    assert native.usable(torch.zeros(1))
    x = torch.randn(1 << 20)
    groups, factors, rng = torch.tensor([x.numel()]), torch.tensor([7.0]), stream_words(1, 2, 3)
    native.encode(x, groups, factors, 7, 4, 15, rng)  # starts the pool's thread
    pid = os.fork()
    if pid == 0:
        native.encode(x, groups, factors, 7, 4, 15, rng)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    print("CHILD", os.waitstatus_to_exitcode(status))
"""


def test_a_forked_child_runs_threaded_kernels():
    env = dict(os.environ, **{fused.ENV_SWITCH: "1"})
    env.pop(native.ENV_SWITCH, None)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(FORK_SCRIPT)], env=env, capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0 and "CHILD 0" in done.stdout, done.stderr[-3000:]
