"""hvdcomp's per-user cache directory and the checks that make a file in it safe to load or install.

``cache_dir()`` is ``HVDCOMP_CACHE_DIR``, else ``$XDG_CACHE_HOME/hvdcomp``, else ``~/.cache/hvdcomp`` (the same
rule as ``scripts/install_horovod.sh``). Code loaded from a cache runs as this process, so a directory or file is
trusted only if this user alone can have written it: no symlink, owned by this user, not group- or world-writable
(``check_private``). Directories hvdcomp creates there have mode 0700.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

CACHE_ENV = "HVDCOMP_CACHE_DIR"
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


class UnsafeCache(OSError):
    """A cache directory or file that another user could have written."""


def cache_dir() -> Path:
    """hvdcomp's per-user cache: ``HVDCOMP_CACHE_DIR``, else ``$XDG_CACHE_HOME/hvdcomp``, else ``~/.cache/hvdcomp``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hvdcomp"


def check_private(path: Path, st: os.stat_result | None = None) -> None:
    """Raise ``UnsafeCache`` unless ``path`` (or ``st``, the status of a descriptor open on it) is no symlink, is
    owned by this user and is not group- or world-writable."""
    st = os.lstat(path) if st is None else st
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeCache(f"{path} is a symbolic link")
    if st.st_uid != os.geteuid():
        raise UnsafeCache(f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeCache(f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o})")


def private_dir(path: Path) -> Path:
    """``path``, created with mode 0700 where missing (parents included), after ``check_private``."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_private(path)
    return path


def use_private_inductor_cache() -> None:
    """Point Inductor's on-disk cache (compiled kernels it loads) at ``inductor/`` in ``cache_dir()`` instead of its
    default ``<tmp>/torchinductor_<user>``, unless ``TORCHINDUCTOR_CACHE_DIR`` is set (then the user chose)."""
    if not os.environ.get(INDUCTOR_CACHE_ENV):
        os.environ[INDUCTOR_CACHE_ENV] = str(private_dir(cache_dir() / "inductor"))
