"""The exchange layer: protocols of collective requests, built on ``hvdcomp.codec``'s math.

- ``protocol``: typed ops (``Op``, ``Scope``, ``Reduction``), the ``Transport`` and ``Topology``
  contracts, ``drive`` and ``drive_together``;
- ``runner``: ``Runner``, the one scheduler of every entry point's exchanges (launch, advance, name, meter,
  agree, write back); ``state``: ``ExchangeState`` (codec, exchange step, agreement, checkpoints);
  ``plan``: bucket plans by name;
- ``simulator``: W workers in one process (``simulate``);
- ``bucket``: the bucket codec contract (``BucketCodec``, ``ElementwiseCodec``, ``TensorCodec``,
  ``Segments``);
- ``elementwise``: ``NoCompression``, ``FP16``, ``BF16``, ``MaxNormCodec``; ``powersgd``: ``PowerSGD``;
- ``two_stage``: ``TwoStageMaxNorm``, max-norm levels at constant bits per element for any world size;
- ``ahead``: ``AheadMaxNorm``, QSGD with the scale agreed one exchange ahead (no round before the payload);
- ``hierarchy``: node-local full precision, compressed shards across nodes;
- ``onebit``: Birder's 1-bit exchanges; ``cost``: the cost model (Birder's variants, lanes or two-stage);
- ``stats``: the statistics type every entry point reports.

Importable without Horovod or mpi4py; ``hvdcomp.transport`` carries the requests out.
"""

from .ahead import AheadMaxNorm
from .bucket import BucketCodec, ElementwiseCodec, Segments, TensorCodec
from .elementwise import BF16, FP16, MaxNormCodec, NoCompression
from .powersgd import PowerSGD
from .protocol import Exchange, Op, Placement, Reduction, Scope, Topology, Transport, drive, drive_together
from .simulator import simulate
from .state import ConfigurationMismatchError, ExchangeState
from .stats import Statistics, Traffic
from .two_stage import TwoStageMaxNorm

__all__ = [
    "BF16",
    "FP16",
    "AheadMaxNorm",
    "BucketCodec",
    "ConfigurationMismatchError",
    "ElementwiseCodec",
    "Exchange",
    "ExchangeState",
    "MaxNormCodec",
    "NoCompression",
    "Op",
    "Placement",
    "PowerSGD",
    "Reduction",
    "Scope",
    "Segments",
    "Statistics",
    "TensorCodec",
    "Topology",
    "Traffic",
    "Transport",
    "TwoStageMaxNorm",
    "drive",
    "drive_together",
    "simulate",
]
