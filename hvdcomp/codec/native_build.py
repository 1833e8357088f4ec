"""Building and loading ``native_kernels.cpp`` (``hvdcomp.codec.native``'s kernels) for this CPU, from a private cache.

**Build.** At first use, the C++ compiler Inductor would use (``CXX``, else ``g++``, else ``c++``) builds the
file with ``-O3 -march=native -ffp-contract=off`` (no fused multiply-add: the same float32 roundings as
eager) into ``native/`` under ``cache_dir()`` (``HVDCOMP_CACHE_DIR``, else ``$XDG_CACHE_HOME/hvdcomp``, else
``~/.cache/hvdcomp``: the cache ``scripts/install_horovod.sh`` keeps its Horovod wheels in), under a name keyed
by the source, the compiler, the flags and this CPU's features, so a cache shared by several machines never hands
one a library built for another's instructions. The build runs at first use, not at install time, because the
key includes the CPU that runs it (an image or a shared venv is built on another machine). Concurrent workers each
build to a temporary name and rename, so none loads a half-written file. A compile or load failure falls back like
any fused kernel (``hvdcomp.codec.fused.fail``: one warning, eager from then on).

**Trust.** A loaded library runs as this process, so only files this user alone controls are loaded: the cache
directory and its ``native/`` are created with mode 0700, and each of them and the library file must be no symlink,
owned by this user and not group- or world-writable. The file is opened without following links, checked through
that descriptor and loaded through ``/proc/self/fd`` (what was checked is what is loaded). If the cache fails a
check, one ``RuntimeWarning`` says why and the kernels are built into a fresh private temporary directory instead
(removed once loaded).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Any

from .cache import UnsafeCache, cache_dir, check_private, private_dir

SOURCE = Path(__file__).with_name("native_kernels.cpp")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-trapping-math", "-std=c++17", "-shared", "-fPIC")
SANITIZE_ENV = "HVDCOMP_NATIVE_SANITIZE"
SANITIZE_FLAGS = ("-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=undefined")
_POINTER, _INT, _FLOAT, _DOUBLE = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_double
# a flat vector in pieces (codec.pieces): pointers, ends, count, numel; its sparse addend's places, values and count
_PIECES = (_POINTER, _POINTER, _INT, _INT, _POINTER, _POINTER, _INT)


def compiler() -> str:
    """The C++ compiler: ``CXX``, else ``g++`` or ``c++`` on ``PATH`` (as Inductor picks one)."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or "c++"


def _cpu_features() -> str:
    """This CPU's architecture and feature flags (Linux ``/proc/cpuinfo``; else the platform's description)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        flags = next((line for line in lines if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = platform.processor()
    return f"{platform.machine()} {flags}"


def flags() -> tuple[str, ...]:
    """``FLAGS``, plus the sanitizers' when ``HVDCOMP_NATIVE_SANITIZE=1`` (``make sanitize``)."""
    return FLAGS + (SANITIZE_FLAGS if os.environ.get(SANITIZE_ENV) == "1" else ())


def library_path(cxx: str) -> Path:
    """Where the library built by ``cxx`` for this CPU lives in ``cache_dir()`` (built or not)."""
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), cxx.encode(), " ".join(flags()).encode(),
                                     _cpu_features().encode()])).hexdigest()[:24]
    return cache_dir() / "native" / f"native_kernels_{key}.so"


def build(cxx: str, target: Path, flags: tuple[str, ...] = FLAGS) -> None:
    """Compile ``SOURCE`` into ``target`` atomically (a temporary name, then a rename)."""
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(handle)
    try:
        done = subprocess.run([cxx, *flags, "-o", temporary, str(SOURCE)], capture_output=True, text=True,
                              timeout=300)
        if done.returncode:
            raise RuntimeError(f"{cxx} failed to build {SOURCE.name}: {done.stderr.strip()[-500:]}")
        os.chmod(temporary, 0o700)
        os.replace(temporary, target)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def open_checked(path: Path) -> ctypes.CDLL:
    """The library at ``path`` (``declare``d), opened without following a link, checked (``check_private``) through
    its descriptor and loaded through that descriptor, so the file checked is the file loaded."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeCache(f"{path} is not a regular file")
        check_private(path, st)
        return declare(ctypes.CDLL(f"/proc/self/fd/{fd}"))
    finally:
        os.close(fd)


def load() -> ctypes.CDLL:
    """The kernels (``declare``d), built into the cache if missing; from a fresh private directory if the cache
    fails a check (one warning)."""
    cxx, options = compiler(), flags()
    path = library_path(cxx)
    try:
        private_dir(path.parent.parent)
        private_dir(path.parent)
        if not os.path.lexists(path):
            build(cxx, path, options)
        return open_checked(path)
    except OSError as refusal:  # UnsafeCache, or a symlink that O_NOFOLLOW refused (ELOOP)
        warnings.warn(f"hvdcomp: not loading the native kernels from {path.parent} ({refusal}); building them in a "
                      f"fresh private directory", RuntimeWarning, stacklevel=4)
    with tempfile.TemporaryDirectory(prefix="hvdcomp-native-") as fresh:  # mkdtemp: mode 0700, this user's
        path = Path(fresh) / path.name
        build(cxx, path, options)
        return open_checked(path)


def _check_status(status: int, function: Any, args: tuple) -> int:
    """A kernel's status: 0, else ``ValueError`` (the kernel refused its sizes and touched nothing)."""
    if status:
        raise ValueError(f"{function.__name__} refused its arguments {args}")
    return status


_SIGNATURES = {  # each kernel's argument types (each returns 0, or -1 for arguments that cannot be right)
    "hvdcomp_encode": [*_PIECES, _POINTER, _POINTER, _INT, _INT, _INT, _INT, _POINTER, _INT, _INT, _POINTER,
                       _POINTER, _INT],
    "hvdcomp_decode": [_POINTER, _POINTER, _POINTER, _INT, _INT, _INT, _INT, _INT, _INT, _INT, _POINTER],
    "hvdcomp_uniform": [_POINTER, _INT, _INT, _POINTER],
    "hvdcomp_draw_bits": [_POINTER, _POINTER, _POINTER, _INT, _POINTER, _POINTER, _INT, _INT, _INT, _POINTER, _INT,
                          _INT, _INT, _POINTER],
    "hvdcomp_draw_bools": [_POINTER, _POINTER, _POINTER, _INT, _POINTER, _POINTER, _INT, _POINTER, _INT, _INT, _INT,
                           _POINTER],
    "hvdcomp_binarize_counts": [_POINTER, _INT, _INT, _POINTER, _INT, _INT, _INT, _POINTER],
    "hvdcomp_pack_bits": [_POINTER, _INT, _INT, _POINTER],
    "hvdcomp_unpack_bits": [_POINTER, _INT, _INT, _INT, _POINTER],
    "hvdcomp_count_bits": [_POINTER, _INT, _INT, _INT, _POINTER],
    "hvdcomp_pack_lanes": [_POINTER, _INT, _INT, _INT, _POINTER],
    "hvdcomp_unpack_lanes": [_POINTER, _INT, _INT, _INT, _POINTER],
    "hvdcomp_lane_counts_mean": [_POINTER, _INT, _INT, _INT, _INT, _POINTER],
    "hvdcomp_counts_mean": [_POINTER, _INT, _INT, _INT, _INT, _INT, _POINTER],
    "hvdcomp_encode_planes": [*_PIECES, _POINTER, _POINTER, _INT, _INT, _INT, _POINTER, _INT, _INT, _INT, _INT,
                              _POINTER, _POINTER],
    "hvdcomp_sum_planes": [_POINTER, _INT, _INT, _INT, _INT, _INT, _INT, _POINTER],
    "hvdcomp_requantize_planes": [_POINTER, _INT, _INT, _INT, _INT, _FLOAT, _POINTER, _INT, _INT, _POINTER],
    "hvdcomp_decode_planes": [_POINTER, _INT, _INT, _INT, _INT, _POINTER, _POINTER, _POINTER, _INT, _INT, _INT, _INT,
                              _POINTER],
    "hvdcomp_rotate": [_POINTER, _INT, _POINTER, _INT, _INT, _POINTER, _INT, _INT, _INT],
    "hvdcomp_gather_checked": [_POINTER, _POINTER, _POINTER, _INT, _POINTER, _INT, _POINTER, _POINTER, _INT, _INT],
    "hvdcomp_birder_update": [_POINTER, _POINTER, _POINTER, _POINTER, _POINTER, _INT, _POINTER, _INT, _INT, _INT],
    "hvdcomp_half_mean": [_POINTER, _INT, _INT, _FLOAT, _INT, _INT, _POINTER, _POINTER],
    "hvdcomp_carrier_sums": [_POINTER, _INT, _DOUBLE, _INT, _INT, _POINTER],
    "hvdcomp_clip_excess": [*_PIECES, _POINTER, _POINTER, _POINTER, _INT, _INT, _POINTER, _POINTER, _POINTER],
    "hvdcomp_local_stats": [_POINTER, _INT, _POINTER, _INT, _INT, _INT, _POINTER],
}


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """``lib`` (a build of ``SOURCE``) with its functions' argument types declared."""
    for name, argtypes in _SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype, function.errcheck = argtypes, ctypes.c_int64, _check_status
    return lib
