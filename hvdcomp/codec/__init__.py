"""The codec layer: pure tensor math, no collectives, importable without Horovod or mpi4py.

- ``packing``: summable lanes (``LaneLayout``) and plain bit planes (``bits_to_bytes``);
- ``carrier``: float64 carriers that survive Horovod's float reductions exactly;
- ``quantize``: the max-norm quantizer family (``MaxNormQuantizer``);
- ``selection``: shared random coordinate sets (``RandomCoordinateSelector``); ``sparse``: gathering the chosen
  coordinates (with the bucket's NaN/Inf check, fused), the error-feedback update and the scatter of the mean;
- ``memory``: error-feedback residuals (``ErrorFeedback``); ``agreed``: scales agreed a step ahead, clipped excess;
- ``lowrank``: PowerSGD's orthonormalization and flat packing;
- ``onebit``: Birder's direction, binarization and count decoding;
- ``half``: float16 rounding, chunk sums and means (``FP16``'s math, fused);
- ``random``: counter-based random numbers (Philox4x32-7), keyed by seed, rank, tensor and step;
- ``fused``: the pure kernels compiled by ``torch.compile``, with their eager fallback;
- ``seeding`` and ``validate``: shared seeds and argument checks for every layer.

Layers above: ``hvdcomp.exchange`` (protocols of collective requests built on this math),
``hvdcomp.transport`` (Horovod, MPI) and ``hvdcomp.integrations`` (optimizers, the public codecs).
"""

from .carrier import CarrierMismatchError
from .memory import ErrorFeedback
from .packing import INT64_WORD_BITS, LaneLayout, bits_to_bytes, bytes_to_bits
from .quantize import MaxNormQuantizer
from .seeding import stable_seed
from .selection import RandomCoordinateSelector

__all__ = [
    "INT64_WORD_BITS",
    "CarrierMismatchError",
    "ErrorFeedback",
    "LaneLayout",
    "MaxNormQuantizer",
    "RandomCoordinateSelector",
    "bits_to_bytes",
    "bytes_to_bits",
    "stable_seed",
]
