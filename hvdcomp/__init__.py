"""hvdcomp: all-reduce-compatible gradient compression for Horovod + PyTorch."""

from .birder import Birder
from .carrier import CarrierMismatchError
from .codecs import FP16, NoCompression
from .compression import (
    GlobalRandKMaxNorm,
    GlobalRandKMaxNormMultiScale,
    MaxNormCompressor,
    QSGDMaxNorm,
    QSGDMaxNormMultiScale,
)
from .optimizer import DistributedOptimizer
from .packing import LaneLayout
from .powersgd import PowerSGD
from .quantize import MaxNormQuantizer
from .selection import RandomCoordinateSelector
from .transport import HorovodTransport, MPITransport

__all__ = [
    "Birder",
    "CarrierMismatchError",
    "DistributedOptimizer",
    "FP16",
    "GlobalRandKMaxNorm",
    "GlobalRandKMaxNormMultiScale",
    "HorovodTransport",
    "LaneLayout",
    "MPITransport",
    "MaxNormCompressor",
    "MaxNormQuantizer",
    "NoCompression",
    "PowerSGD",
    "QSGDMaxNorm",
    "QSGDMaxNormMultiScale",
    "RandomCoordinateSelector",
]

__version__ = "0.1.0"
