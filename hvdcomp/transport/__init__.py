"""The transport layer: ``hvdcomp.exchange.protocol.Transport`` over Horovod (``HorovodTransport``), over
mpi4py (``MPITransport``) and over torch.distributed (``TorchDistributedTransport``). Each loads its
module on first use, so the torch.distributed one needs neither Horovod nor mpi4py."""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {"HorovodTransport": ".horovod", "MPITransport": ".mpi", "TorchDistributedTransport": ".torch_distributed"}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'hvdcomp.transport' has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
