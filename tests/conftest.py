"""Pytest configuration: the ``mpi``, ``slow`` and ``gpu`` markers; ``mpi`` tests skip where MPI is unavailable."""

from __future__ import annotations

import os
import shutil

import pytest

# Fused codec kernels compile once per process and lane layout (seconds each); the suite, its worker
# processes included, runs them eagerly (bit-identical results). tests/test_fused.py turns them on.
os.environ.setdefault("HVDCOMP_FUSED", "0")

MARKERS = {
    "mpi": "launches workers with mpirun (needs Open MPI and Horovod built with MPI)",
    "slow": "takes more than a few seconds; deselect with -m 'not slow'",
    "gpu": "needs a CUDA GPU (skipped without one); scripts/gpu_check.sh runs them",
}


def pytest_configure(config: pytest.Config) -> None:
    """Register the markers unless the ini file (pyproject.toml) already declares them."""
    declared = {line.split(":")[0].strip() for line in config.getini("markers")}
    for name, doc in MARKERS.items():
        if name not in declared:
            config.addinivalue_line("markers", f"{name}: {doc}")


def _mpi_unavailable() -> str | None:
    """Why ``mpi`` tests cannot run here, or None if they can."""
    if shutil.which("mpirun") is None:
        return "mpirun not found on PATH"
    import horovod.torch as hvd

    if not hvd.mpi_built():
        return "Horovod was built without MPI"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``mpi`` tests when mpirun or Horovod's MPI support is missing."""
    mpi_items = [item for item in items if item.get_closest_marker("mpi")]
    reason = _mpi_unavailable() if mpi_items else None
    if reason:
        for item in mpi_items:
            item.add_marker(pytest.mark.skip(reason=reason))
