"""The one resolver of ``compression=`` arguments (temporary shape until the public codecs land)."""

from __future__ import annotations

import sys
from typing import Any

from ..codec.validate import check_int
from ..exchange.bucket import BucketCodec
from ..exchange.elementwise import NoCompression


def resolve_codec(compression: Any, exchange: str = "lanes", workers_per_node: int = 1) -> BucketCodec:
    """The bucket codec for a ``compression=`` argument."""
    if compression is None:
        return NoCompression()
    if isinstance(compression, BucketCodec) and exchange == "lanes":
        return compression
    if "horovod.torch" in sys.modules:
        from .compressors import bucket_codec

        return bucket_codec(compression, exchange, workers_per_node)
    raise TypeError(f"compression={compression!r} is not supported")


def resolve_warmup(compression: Any, warmup_steps: int | None) -> int:
    """``warmup_steps`` if given, else the compression's own (``QSGDMaxNorm(..., warmup_steps=N)``), else 0."""
    if warmup_steps is not None:
        return check_int("warmup_steps", warmup_steps, 0)
    return int(getattr(compression, "warmup_steps", 0))
