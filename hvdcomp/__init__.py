"""hvdcomp: all-reduce-compatible gradient compression for Horovod + PyTorch.

Layers, each depending only on those below it:

- ``hvdcomp.codec``: pure tensor math (packing, quantizers, coordinate selection, error feedback,
  PowerSGD's and Birder's math); importable without Horovod or mpi4py;
- ``hvdcomp.exchange``: protocols of typed collective requests, the bucket codec contract, the
  simulator, hierarchical routing, the 1-bit exchanges, the cost model and the statistics type;
- ``hvdcomp.transport``: Horovod, MPI and torch.distributed carry the requests out;
- ``hvdcomp.integrations``: the public max-norm codecs (which Horovod's stock optimizer also takes),
  ``DistributedOptimizer``, ``Birder``, the PyTorch DDP hook (public as ``hvdcomp.ddp``: ``import hvdcomp.ddp``
  needs no Horovod, nor do the codecs) and FSDP2's reduce-scatter (``hvdcomp.fsdp``); ``hvdcomp.init()`` starts
  Horovod as hierarchical exchanges need it.

The public names below load their layer on first use, so ``import hvdcomp.codec`` (or
``hvdcomp.exchange``) needs neither Horovod nor mpi4py.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "CarrierMismatchError": ".codec",
    "ConfigurationMismatchError": ".exchange",
    "LaneLayout": ".codec",
    "MaxNormQuantizer": ".codec",
    "RandomCoordinateSelector": ".codec",
    "BF16": ".exchange",
    "FP16": ".exchange",
    "NoCompression": ".exchange",
    "PowerSGD": ".exchange",
    "Statistics": ".exchange",
    "HorovodTransport": ".transport",
    "MPITransport": ".transport",
    "TorchDistributedTransport": ".transport",
    "GlobalRandKMaxNorm": ".integrations.codecs",
    "GlobalRandKMaxNormMultiScale": ".integrations.codecs",
    "MaxNormCompressor": ".integrations.codecs",
    "QSGDMaxNorm": ".integrations.codecs",
    "QSGDMaxNormMultiScale": ".integrations.codecs",
    "DistributedOptimizer": ".integrations.optimizer",
    "Birder": ".integrations.birder",
    "init": ".integrations.launch",
}

__all__ = sorted(_HOMES)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'hvdcomp' has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
