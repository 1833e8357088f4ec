"""Bucket codecs for ``hvdcomp.DistributedOptimizer``: one bucket's gradients in, their mean out.

A *flat* codec (``flat = True``) works on the bucket's gradients concatenated into one float32 vector:
``exchange(flat, segments, key, step, world_size)`` is an exchange (see ``protocol``) returning the
float32 mean over the workers of that vector; ``segments`` are the sizes of the tensors in it. Being
element-wise, a flat codec can be run on any slice of the vector (hierarchical shards). A *tensor*
codec (``flat = False``, e.g. ``PowerSGD``) takes the list of gradients and returns the list of means.

``bucket_codec(compression)`` turns what a user passes as ``compression=`` into a codec: ``None`` or
Horovod's ``Compression.none`` -> ``NoCompression``; ``Compression.fp16`` -> ``FP16``; an hvdcomp
max-norm compressor -> its scheme, with packed levels moved as int64 Sum.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from horovod.torch.compression import Compression

from .compression import MaxNormCompressor
from .memory import ErrorFeedback
from .protocol import Exchange


class NoCompression:
    """Plain all-reduce of the float32 bucket (AllReduce-SGD): one ``"sum"`` of 32 bits per element."""

    flat = True

    def exchange(self, flat: torch.Tensor, segments: Sequence[int], key: object, step: int,
                 world_size: int) -> Exchange:
        total = yield "sum", flat
        return total.div_(world_size)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class FP16:
    """All-reduce in float16 (Horovod's fp16 compression): one ``"sum"`` of 16 bits per element.

    With ``error_feedback`` each worker keeps what rounding to float16 lost and adds it next step.
    Values beyond float16's range become Inf, as with Horovod's own fp16 compression.
    """

    flat = True

    def __init__(self, error_feedback: bool = False) -> None:
        self.memory = ErrorFeedback() if error_feedback else None

    def exchange(self, flat: torch.Tensor, segments: Sequence[int], key: object, step: int,
                 world_size: int) -> Exchange:
        if self.memory is None:
            half = flat.half()
        else:  # the residual buffer holds gradient + residual, then what rounding to float16 lost
            residual = self.memory.residual(key, flat)
            half = residual.add_(flat).half()
            residual.sub_(half)
        total = yield "sum", half
        return total.float().div_(world_size)

    def state_dict(self) -> dict[str, Any]:
        return {} if self.memory is None else self.memory.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.memory is not None:
            self.memory.load_state_dict(state)


class MaxNormCodec:
    """An hvdcomp max-norm compressor's scheme in our optimizer: per-tensor scales for the whole bucket
    in one MAX all-reduce, the packed levels in one int64 ``"payload"`` SUM (63 usable bits a word)."""

    flat = True

    def __init__(self, compressor: MaxNormCompressor) -> None:
        self.compressor = compressor

    def exchange(self, flat: torch.Tensor, segments: Sequence[int], key: object, step: int,
                 world_size: int) -> Exchange:
        generator = self.compressor.rounding_generator(flat.device)
        return self.compressor.scheme.exchange(flat, key, step, world_size, generator=generator, segments=segments)

    def state_dict(self) -> dict[str, Any]:
        return self.compressor.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.compressor.load_state_dict(state)


def bucket_codec(compression: Any) -> Any:
    """The bucket codec for a ``compression=`` argument (see the module docstring)."""
    if compression is None or compression is Compression.none:
        return NoCompression()
    if compression is Compression.fp16:
        return FP16()
    if isinstance(compression, MaxNormCompressor):
        return MaxNormCodec(compression)
    if hasattr(compression, "exchange") and hasattr(compression, "flat"):
        return compression
    raise TypeError(
        f"compression={compression!r} is not supported: use None, hvd.Compression.none, hvd.Compression.fp16, "
        "an hvdcomp compressor (QSGDMaxNorm, ...), NoCompression, FP16 or PowerSGD"
    )
