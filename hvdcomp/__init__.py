"""hvdcomp: all-reduce-compatible gradient compression for Horovod + PyTorch."""

from .carrier import CarrierMismatchError
from .compression import (
    GlobalRandKMaxNorm,
    GlobalRandKMaxNormMultiScale,
    MaxNormCompressor,
    QSGDMaxNorm,
    QSGDMaxNormMultiScale,
)
from .packing import LaneLayout
from .quantize import MaxNormQuantizer
from .selection import RandomCoordinateSelector

__all__ = [
    "CarrierMismatchError",
    "GlobalRandKMaxNorm",
    "GlobalRandKMaxNormMultiScale",
    "LaneLayout",
    "MaxNormCompressor",
    "MaxNormQuantizer",
    "QSGDMaxNorm",
    "QSGDMaxNormMultiScale",
    "RandomCoordinateSelector",
]

__version__ = "0.1.0"
