"""``resolve_codec``: the bucket codec a door (``hvdcomp.DistributedOptimizer``, ``hvdcomp.ddp``) runs for its
``compression=`` argument. Importing this module imports no Horovod."""

from __future__ import annotations

from typing import Any

from ..codec.validate import check_int
from ..exchange.ahead import AheadMaxNorm
from ..exchange.bucket import BucketCodec
from ..exchange.cost import EXCHANGES
from ..exchange.elementwise import FP16, NoCompression
from ..exchange.two_stage import TwoStageMaxNorm
from ..transport._compat import horovod_compressions
from .codecs import MaxNormCompressor


def resolve_codec(compression: Any, exchange: str = "lanes", workers_per_node: int = 1) -> BucketCodec:
    """The bucket codec for ``compression``:

    - ``None`` or Horovod's ``Compression.none`` -> ``NoCompression()``; ``Compression.fp16`` -> ``FP16()``
      (recognised where Horovod is loaded; this never loads it);
    - a public max-norm codec (``hvdcomp.QSGDMaxNorm(8)``, ...) -> its ``inner`` codec (``AheadMaxNorm`` or
      ``MaxNormCodec``, whose int64 SUM of packed levels ``exchange="lanes"`` runs), or with ``exchange``
      ``"two_stage"`` / ``"auto"`` a ``TwoStageMaxNorm`` around its ``MaxNormCodec`` (``workers_per_node`` share an
      uplink in each exchange) with the compressor's ``scale`` (``"ahead"`` with rotation: ``ValueError``);
    - any other ``BucketCodec`` (``PowerSGD``, ``FP16(...)``, ``TwoStageMaxNorm(...)``, ...) as it is; with
      ``exchange="two_stage"`` only a ``TwoStageMaxNorm``.

    Anything else: ``TypeError``."""
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
    if isinstance(compression, MaxNormCompressor):
        if exchange == "lanes":
            return compression.inner
        scale = "ahead" if isinstance(compression.inner, AheadMaxNorm) else "exact"
        return TwoStageMaxNorm(compression.max_norm, exchange, workers_per_node=workers_per_node, scale=scale)
    if exchange == "two_stage" and not isinstance(compression, TwoStageMaxNorm):
        raise ValueError(f"exchange='two_stage' applies to the max-norm codecs (QSGDMaxNorm), not to "
                         f"compression={compression!r}")
    horovods = horovod_compressions()
    if compression is None or (horovods is not None and compression is horovods[0]):
        return NoCompression()
    if horovods is not None and compression is horovods[1]:
        return FP16()
    if isinstance(compression, BucketCodec):
        return compression
    raise TypeError(
        f"compression={compression!r} is not supported: use None, hvd.Compression.none, hvd.Compression.fp16, "
        "an hvdcomp max-norm codec (QSGDMaxNorm, ...), or a hvdcomp.exchange.BucketCodec (NoCompression, FP16, "
        "PowerSGD, or your own)"
    )


def resolve_warmup(compression: Any, warmup_steps: int | None) -> int:
    """A door's warm-up: ``warmup_steps`` if given, else the codec's own (``QSGDMaxNorm(..., warmup_steps=N)``;
    ``BucketCodec.warmup_steps``), else 0 (Horovod's ``Compression`` objects, ``None``)."""
    if warmup_steps is not None:
        return check_int("warmup_steps", warmup_steps, 0)
    return compression.warmup_steps if isinstance(compression, BucketCodec) else 0
