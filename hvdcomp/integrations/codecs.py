"""The public max-norm codecs: ``QSGDMaxNorm``, ``QSGDMaxNormMultiScale``, ``GlobalRandKMaxNorm`` and
``GlobalRandKMaxNormMultiScale``. Importing this module imports no Horovod.

Each is a bucket codec (``ElementwiseCodec``) around its ``inner`` codec: an ``AheadMaxNorm`` (``QSGDMaxNorm``'s
default ``scale="ahead"``) or a ``MaxNormCodec``; ``max_norm`` is the ``MaxNormCodec`` in either case.
``hvdcomp.DistributedOptimizer`` and ``hvdcomp.ddp`` exchange buckets with ``inner``
(``hvdcomp.integrations.resolve``). Horovod's stock optimizer takes the same object,
``hvd.DistributedOptimizer(opt, named_parameters=..., compression=QSGDMaxNorm(8))``: ``compress`` and
``decompress`` go through the stock adapter (``hvdcomp.integrations.stock``, created at first use, which
loads Horovod only then). Gradients smaller than ``min_compress_numel`` (and all during the first
``warmup_steps`` steps) then travel as float32, as ``hvd.Compression.none`` sends them.

``state_dict()`` holds a ``"version"``, the codec's type and configuration, ``inner``'s state (error-feedback
memory, agreed scales and clipped excess) and the stock adapter's step counters; ``load_state_dict`` checks all
of it against this codec before it changes anything.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..codec.quantize import MaxNormQuantizer
from ..codec.selection import RandomCoordinateSelector
from ..codec.validate import check_int
from ..exchange.ahead import AheadMaxNorm
from ..exchange.bucket import ElementwiseCodec
from ..exchange.elementwise import MaxNormCodec
from ..exchange.protocol import Exchange
from ..exchange.stats import Statistics

if TYPE_CHECKING:
    from horovod.torch import ProcessSet

    from .stock import StockAdapter

MIN_COMPRESS_NUMEL = 16384  # the stock path's default: smaller gradients go uncompressed (64 KiB of float32)
SCALE_MODES = ("ahead", "exact")
STATE_VERSION = 1


class MaxNormCompressor(ElementwiseCodec):
    """A max-norm bucket codec that Horovod's stock optimizer also takes (see the module docstring).

    Args:
        max_norm: quantizer, optional shared coordinate selection, error-feedback memory, seed.
        process_set: the Horovod process set the stock optimizer reduces over (default: all workers); the stock
            path only.
        scale: ``"exact"`` (each step's shared scale agreed by a MAX before its payload) or ``"ahead"``
            (``QSGDMaxNorm``'s default: the scale agreed at the previous exchange, ``hvdcomp.exchange.ahead``).
        warmup_steps: the first ``warmup_steps`` steps send the gradients uncompressed (float32); the codec, its
            memories and step counts stay untouched.
        min_compress_numel: on the stock path, smaller gradients are always sent so (cf. BytePS's
            ``min_compress_bytes``): a compressed gradient costs a fixed ~0.7 ms of codec calls, more than a small
            one saves on the wire. ``0`` compresses all. (hvdcomp's optimizer and DDP hook use buckets.)

    ``stats`` (``hvdcomp.exchange.stats.Statistics``) counts what the stock path sent.
    """

    warmup_steps: int = 0

    def __init__(self, max_norm: MaxNormCodec, process_set: ProcessSet | None = None, scale: str = "exact",
                 warmup_steps: int = 0, min_compress_numel: int = MIN_COMPRESS_NUMEL) -> None:
        if scale not in SCALE_MODES:
            raise ValueError(f"scale must be one of {SCALE_MODES}, got {scale!r}")
        if scale == "ahead" and max_norm.selector is not None:
            raise ValueError("scale='ahead' is for QSGDMaxNorm: shared random coordinates take the exact exchange")
        self.max_norm = max_norm
        self.inner: AheadMaxNorm | MaxNormCodec = AheadMaxNorm(max_norm) if scale == "ahead" else max_norm
        self.scale = scale
        self.process_set = process_set
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)
        self.min_compress_numel = check_int("min_compress_numel", min_compress_numel, 0)
        self.stats = Statistics()
        self._stock: StockAdapter | None = None

    # -- the bucket codec: ``inner``'s ------------------------------------------------------------------
    @property
    def bucket_mb(self) -> float | None:  # type: ignore[override]
        return self.inner.bucket_mb

    @property
    def reuses_result(self) -> bool:
        return self.inner.reuses_result

    def bind_rank(self, rank: int) -> None:
        self.inner.bind_rank(rank)

    def bind_transport(self, transport: Any) -> None:
        self.inner.bind_transport(transport)

    def config(self) -> tuple:
        """What every worker must share: ``inner``'s configuration."""
        return self.inner.config()

    def exchange(self, flat: torch.Tensor, segments: Sequence[int], key: Hashable, step: int,
                 world_size: int) -> Exchange:
        """``inner``'s exchange (see ``ElementwiseCodec.exchange``)."""
        return self.inner.exchange(flat, segments, key, step, world_size)

    # -- Horovod's stock optimizer ---------------------------------------------------------------------
    def stock(self) -> StockAdapter:
        """The stock-optimizer adapter of this codec, created (loading Horovod) at the first call."""
        if self._stock is None:
            from .stock import StockAdapter

            self._stock = StockAdapter(self)
        return self._stock

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Horovod's ``Compressor.compress``: the float64 carrier (or float32 gradient) Horovod all-reduces, and the
        context for ``decompress`` (``hvdcomp.integrations.stock``)."""
        return self.stock().compress(tensor)

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Horovod's ``Compressor.decompress``: the reduced gradient, in ``tensor``'s original shape and dtype."""
        return self.stock().decompress(tensor, ctx)

    # -- checkpoints ---------------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """The configuration a state must have been saved with: type, bits, chunk size, selector, error
        feedback, scale mode, and ``rotate`` where it is on."""
        quantizer, selector = self.max_norm.quantizer, self.max_norm.selector
        described = {"type": type(self).__name__, "bits": quantizer.bits, "chunk_size": quantizer.chunk_size,
                     "selector": None if selector is None else (selector.k, selector.ratio, selector.seed),
                     "error_feedback": self.max_norm.memory is not None, "scale": self.scale}
        return described if self.max_norm.rotation is None else {**described, "rotate": True}

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue exactly, with what ``load_state_dict`` checks."""
        return {"version": STATE_VERSION, "config": self.describe(), "inner": self.inner.state_dict(),
                "stock": None if self._stock is None else self._stock.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Loads ``state_dict()``'s output; ``ValueError`` naming the saved and this compressor, before anything
        changes, if the state is of another version, type or configuration, or malformed (keys, shapes, agreed
        scales that are not finite or do not fit the gradient's scale groups)."""
        try:
            self._check_state(state)
        except ValueError as error:
            saved = state.get("config") if isinstance(state, dict) else None
            raise ValueError(f"cannot load the state of {_named(saved)} into {_named(self.describe())}: "
                             f"{error}") from None
        self.inner.load_state_dict(state["inner"])
        if state["stock"] is not None:
            self.stock().load_state_dict(state["stock"])

    def _check_state(self, state: Any) -> None:
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"not a version {STATE_VERSION} state")
        if set(state) != {"version", "config", "inner", "stock"}:
            raise ValueError(f"keys {sorted(state)}")
        if state["config"] != self.describe():
            raise ValueError("they are configured differently")
        stock = state["stock"]
        if stock is not None and (not isinstance(stock, dict) or set(stock) != STOCK_KEYS):
            raise ValueError(f"stock counters {stock!r:.200}")
        self.inner.check_state(state["inner"])
        if isinstance(self.inner, AheadMaxNorm):  # the stock path agrees one scale per group of one gradient
            for key, (numel, _, scale_stats) in state["inner"]["agreed"]["scales"].items():
                groups = self.max_norm.quantizer.scale_groups(numel).numel()
                if scale_stats.numel() != groups + 1:
                    raise ValueError(f"the agreed scales of {key!r} do not fit its {groups} scale groups")


STOCK_KEYS = {"steps", "index_in_step", "step_open", "warmup_done"}  # the stock adapter's state_dict


def _named(config: Any) -> str:
    if not isinstance(config, dict) or "type" not in config:
        return "an unknown compressor"
    return f"{config['type']}({', '.join(f'{k}={v!r}' for k, v in config.items() if k != 'type')})"


class QSGDMaxNorm(MaxNormCompressor):
    """QSGD with a shared max-norm scale: ``s = 2**bits - 1`` levels per sign, unbiased stochastic rounding.

    Scale ``M`` = max over workers of ``max|g|`` (per tensor, or per ``chunk_size`` elements). Each
    element's decoded value is unbiased with variance at most ``(M / s)**2 / 4``; the mean over ``W``
    workers has variance at most ``(M / s)**2 / (4 W)``. ``bits`` in [1, 16].

    ``scale``:

    - ``"ahead"`` (default): ``M`` is the max agreed at the gradient's (bucket's) previous exchange: no collective
      precedes the payload; the workers' maxima travel with it (in the stock optimizer, inside the float64 carrier
      Horovod all-reduces during backward) or in a small MAX after it (``hvdcomp.exchange.ahead``). An element above
      ``M`` is sent as ``sign * M``; its excess stays in a per-worker memory, sent with the next step (delayed,
      never lost; that step is biased towards zero by it). Without clipping a step is unbiased with variance at
      most ``(M / s)**2 / 4`` for the previous step's ``M``. A first exchange (and any without an agreed scale: a
      new size, the step after a NaN/Inf) is exact. Stock carrier: float64 words of ``carrier.word_bits(W)`` bits
      (8 bits per element for 4 bits at W = 2) plus ``W`` rows of one word per scale group and the NaN flag.
    - ``"exact"``: this step's ``M``, from a MAX round before the payload (in the stock optimizer, blocking,
      in ``synchronize()``, batched over every gradient); unbiased every step. ``exchange="two_stage"`` and
      ``"auto"`` take either (``"ahead"``: the statistics ride in the two-stage exchange's first stage; not with
      ``rotate=True``).

    ``warmup_steps`` and ``min_compress_numel``: see ``MaxNormCompressor``.

    ``rotate=True`` quantizes each tensor (or chunk) rotated by a randomized Hadamard transform that every worker
    shares and rotates the decoded mean back (``hvdcomp.codec.rotation``): ``M`` is then the rotated maximum, about
    ``|g| sqrt(2 ln n / n)`` for ``n`` elements whatever their outliers, and the bounds above hold with it. Off by
    default (docs/rotation.md has the measurements).
    """

    def __init__(self, bits: int = 8, chunk_size: int | None = None, seed: int = 0,
                 process_set: ProcessSet | None = None, scale: str = "ahead", warmup_steps: int = 0,
                 min_compress_numel: int = MIN_COMPRESS_NUMEL, rotate: bool = False) -> None:
        super().__init__(MaxNormCodec(MaxNormQuantizer((bits,), chunk_size), seed=seed, rotate=rotate), process_set,
                         scale, warmup_steps, min_compress_numel)


class QSGDMaxNormMultiScale(MaxNormCompressor):
    """QSGD max-norm at several resolutions ``bits=(b_1 < b_2 < ...)``, sent in ``b_1``'s range.

    Per element, the finest resolution ``s_j`` with ``|g| / M * s_j <= s_1`` on *every* worker (agreed
    through a SUM of packed 0/1 lanes, counted in ``stats``). Unbiased; variance per element at most
    ``(M / s_j)**2 / 4`` for the agreed ``j``. ``rotate``: as ``QSGDMaxNorm``'s.
    """

    def __init__(self, bits: Sequence[int] = (4, 8), chunk_size: int | None = None, seed: int = 0,
                 process_set: ProcessSet | None = None, warmup_steps: int = 0,
                 min_compress_numel: int = MIN_COMPRESS_NUMEL, rotate: bool = False) -> None:
        super().__init__(MaxNormCodec(MaxNormQuantizer(bits, chunk_size), seed=seed, rotate=rotate), process_set,
                         warmup_steps=warmup_steps, min_compress_numel=min_compress_numel)


class GlobalRandKMaxNorm(MaxNormCompressor):
    """QSGD max-norm on ``k`` (or ``ratio * numel``) coordinates of each tensor, shared by all workers each
    step (per tensor here, in ``hvdcomp.DistributedOptimizer``'s buckets and in its hierarchical shards).

    The coordinate set comes from a dedicated generator seeded by (seed, tensor, step), never the
    global RNG. Coordinates not sent stay in a per-worker error-feedback memory (default), so nothing
    is lost and every replica applies the same update; with ``error_feedback=False`` the sent mean is
    scaled by ``numel / k`` instead (unbiased). The scale ``M`` covers the sent values only.
    """

    def __init__(self, k: int | None = None, ratio: float | None = None, bits: int = 8,
                 error_feedback: bool = True, chunk_size: int | None = None, seed: int = 0,
                 process_set: ProcessSet | None = None, warmup_steps: int = 0,
                 min_compress_numel: int = MIN_COMPRESS_NUMEL) -> None:
        selector = RandomCoordinateSelector(k, ratio, seed)
        super().__init__(MaxNormCodec(MaxNormQuantizer((bits,), chunk_size), selector, error_feedback, seed),
                         process_set, warmup_steps=warmup_steps, min_compress_numel=min_compress_numel)


class GlobalRandKMaxNormMultiScale(MaxNormCompressor):
    """``GlobalRandKMaxNorm`` whose shared coordinates are quantized multi-scale (``bits=(b_1 < b_2 < ...)``)."""

    def __init__(self, k: int | None = None, ratio: float | None = None, bits: Sequence[int] = (4, 8),
                 error_feedback: bool = True, chunk_size: int | None = None, seed: int = 0,
                 process_set: ProcessSet | None = None, warmup_steps: int = 0,
                 min_compress_numel: int = MIN_COMPRESS_NUMEL) -> None:
        selector = RandomCoordinateSelector(k, ratio, seed)
        super().__init__(MaxNormCodec(MaxNormQuantizer(bits, chunk_size), selector, error_feedback, seed),
                         process_set, warmup_steps=warmup_steps, min_compress_numel=min_compress_numel)
