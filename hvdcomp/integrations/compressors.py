"""Horovod ``Compressor`` objects for the max-norm quantizer family, and ``bucket_codec``.

Pass one to the stock optimizer, e.g.
``hvd.DistributedOptimizer(opt, named_parameters=..., compression=QSGDMaxNorm(8))``. ``compress``
issues no collective. Gradients smaller than ``min_compress_numel`` (and all during warm-up) are sent as
float32, as ``hvd.Compression.none`` sends them. With ``scale="ahead"`` (``QSGDMaxNorm``'s default) and a
scale agreed at the gradient's previous exchange, ``compress`` quantizes at once and returns the whole
payload in a float64 carrier that Horovod all-reduces during backward, with each worker's local maximum
for the next step's scale (``scale_ahead``: clipping, error feedback, bias and variance). Otherwise
(``scale="exact"``, the other compressors, and a gradient's first exchange) it records the gradient and
returns a small float64 *header carrier* (``hvdcomp.codec.carrier``: canary, world size and a tag of the
compressor's configuration, the gradient's name, its step and size, and no words), which Horovod reduces
with the optimizer's op (Sum or Average, predivide factor allowed). The first ``decompress`` of a step
runs the codec's exchanges of all the step's gradients together, in name order, with one blocking
collective per round for the whole step (``drive_together``: a MAX of every scale, for the multi-scale
variants a SUM of the agreement bits, then one int64 SUM of every packed level). By then every worker
has compressed all its gradients of the step: Horovod's ``synchronize()`` compresses the parameters
whose hook did not fire (zero-filled) before it waits for any handle, so every worker compressed the
same names, whatever parameters its own loss used (so a head used on some workers only works as in stock
Horovod). Each ``decompress`` returns what the reduced header says the op made of the workers' dequantized
gradients (their mean if Horovod averaged, their sum if it summed), identical on every worker, in the
gradient's shape and dtype. The price: the exchange starts only in ``synchronize()``, so it does not
overlap backward (``hvdcomp.DistributedOptimizer`` overlaps it).

Gradients are identified by Horovod's own name for them (read from the optimizer's frames by
``hvdcomp.transport._compat.stock_call``), which keys their error-feedback memory, coordinate sets, step
counts and tags.
Every MAX round is stamped with each gradient's tag (``carrier.stamp``), so workers that batch
different gradients, or configure the compressor differently, all raise ``CarrierMismatchError``
rather than mix their scales; each header checks the same again. Called outside Horovod's optimizer,
``compress`` identifies a gradient by its position within the step (a step ends when decompressing
starts) and the step's exchanges run in call order, so every worker must compress in the same order.
If any worker's compressed gradient holds NaN/Inf, every worker gets an all-NaN result for that tensor
(as an uncompressed all-reduce would; ``torch.amp.GradScaler`` then skips the step) and a warning.
"""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import horovod.torch as hvd
import torch
from horovod.torch.compression import Compression, Compressor

from ..codec import carrier
from ..codec.quantize import MaxNormQuantizer
from ..codec.seeding import stable_seed
from ..codec.selection import RandomCoordinateSelector
from ..codec.validate import check_int
from ..exchange.ahead import AheadMaxNorm
from ..exchange.bucket import BucketCodec
from ..exchange.cost import EXCHANGES
from ..exchange.elementwise import FP16, MaxNormCodec, NoCompression
from ..exchange.protocol import Exchange, Op, drive_together, relay
from ..exchange.stats import CountedCollectives, Statistics, Traffic
from ..exchange.two_stage import TwoStageMaxNorm
from ..transport._compat import stock_call
from ..transport.horovod import HorovodTransport
from .scale_ahead import SCALE_MODES, AheadExchange, ScaleAhead
from .warmup import UncompressedContext, send_uncompressed

MIN_COMPRESS_NUMEL = 16384  # the stock path's default: smaller gradients go uncompressed (64 KiB of float32)


@dataclass
class _Batch:
    """The gradients compressed in one step, exchanged together at the step's first ``decompress``."""

    contexts: list[_Context] = field(default_factory=list)
    exchanged: bool = False
    traffic: Traffic = field(default_factory=Traffic)  # the batched collectives


@dataclass
class _Context:
    exchange: Exchange  # the codec's exchange, its MAX rounds stamped with ``tag``
    key: Hashable
    order: tuple  # sorts the batch: by name (then step), or by call order outside Horovod's optimizer
    tag: int
    shape: torch.Size
    dtype: torch.dtype
    world_size: int
    traffic: Traffic  # the header carrier, the uncompressed size, the decoding time
    batch: _Batch
    word_sums: torch.Tensor | None = None  # this gradient's slice of the batched payload sum


@dataclass
class _AheadContext:
    exchange: AheadExchange  # the payload travels in the carrier Horovod reduces
    shape: torch.Size
    dtype: torch.dtype
    traffic: Traffic  # the carrier, the uncompressed size, the coding time


def _check_gradient(tensor: torch.Tensor) -> None:
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise TypeError("hvdcomp compressors need dense gradients; sparse gradients are not supported")
    if not tensor.dtype.is_floating_point:
        raise TypeError(f"hvdcomp compressors quantize floating-point gradients, got {tensor.dtype}")


class MaxNormCompressor(Compressor):
    """A ``MaxNormCodec`` as a Horovod compressor (see the module docstring).

    Args:
        codec: quantizer, optional shared coordinate selection, error-feedback memory, seed.
        process_set: the Horovod process set the optimizer reduces over (default: all workers).
        scale: ``"exact"`` (each step's shared scale agreed by a MAX before its payload) or ``"ahead"``
            (``QSGDMaxNorm``'s default: the scale agreed at the previous step, see ``scale_ahead``).
        warmup_steps: the first ``warmup_steps`` steps send the gradient uncompressed (float32, reduced by
            Horovod as with ``hvd.Compression.none``); the codec, its memories and step counts stay untouched.
        min_compress_numel: smaller gradients are always sent so (cf. BytePS's ``min_compress_bytes``): a
            compressed gradient costs a fixed ~0.7 ms of codec calls, more than a small one saves on the
            wire. ``0`` compresses all. Stock optimizer only (hvdcomp's optimizer and DDP hook use buckets).

    ``stats`` (``hvdcomp.exchange.stats.Statistics``) counts what this worker sent (the batched scales,
    agreement bits and packed levels when a step's exchange runs, each gradient's header carrier) and
    what the gradients would have taken uncompressed, as they are decompressed; a step begins with its
    first gradient's ``compress``.
    """

    def __init__(self, codec: MaxNormCodec, process_set: hvd.ProcessSet | None = None, scale: str = "exact",
                 warmup_steps: int = 0, min_compress_numel: int = MIN_COMPRESS_NUMEL) -> None:
        if scale not in SCALE_MODES:
            raise ValueError(f"scale must be one of {SCALE_MODES}, got {scale!r}")
        if scale == "ahead" and codec.selector is not None:
            raise ValueError("scale='ahead' is for QSGDMaxNorm: shared random coordinates take the exact exchange")
        self.codec = codec
        self.scale = scale
        self.ahead = ScaleAhead(codec.quantizer) if scale == "ahead" else None
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)
        self.min_compress_numel = check_int("min_compress_numel", min_compress_numel, 0)
        self._warmup_done, self._warming = 0, False  # warm-up steps begun; whether this step is one
        self.transport = HorovodTransport(process_set)
        self.stats = Statistics()
        self._steps: dict[Hashable, int] = {}  # exchanges so far, per gradient key
        self._index_in_step = 0  # the next position, for calls from outside Horovod's optimizer
        self._step_open = False  # False until a step's first compress, and again after a decompress
        self._batch: _Batch | None = None  # the open step's gradients

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue exactly: the codec's state and the step counters."""
        return {"codec": self.codec.state_dict(), "steps": dict(self._steps), "index_in_step": self._index_in_step,
                "step_open": self._step_open, "ahead": None if self.ahead is None else self.ahead.state_dict(),
                "warmup_done": self._warmup_done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.codec.load_state_dict(state["codec"])
        if self.ahead is not None and state.get("ahead") is not None:
            self.ahead.load_state_dict(state["ahead"])
        self._steps, self._index_in_step = dict(state["steps"]), state["index_in_step"]
        self._step_open = state["step_open"]
        self._warmup_done, self._warming = state.get("warmup_done", self.warmup_steps), False
        self._batch = None

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, _Context | _AheadContext]:
        """Record ``tensor`` for its step's exchange (no collective); return its carrier (the whole payload
        with an agreed scale ahead, else a header) and the context for ``decompress`` (see the module
        docstring)."""
        name = stock_call(sys._getframe(1))
        if not self._step_open:
            self._step_open = True
            self._index_in_step = 0
            self._batch = None
            self.stats.begin_step()
            self.stats.steps += 1
            self._warming = self._warmup_done < self.warmup_steps
            self._warmup_done += self._warming
        _check_gradient(tensor)
        if self._warming or tensor.numel() < self.min_compress_numel:
            return send_uncompressed(tensor, self.stats, self.transport)
        if self._batch is None:
            self._batch = _Batch()
        step_of = self._steps.get
        if name is not None:
            key: Hashable = name
            order: tuple = (0, name, step_of(name, 0))
        else:
            key, self._index_in_step = self._index_in_step, self._index_in_step + 1
            order = (1, key, step_of(key, 0))
        flat = tensor.detach().reshape(-1).float()
        step = self._steps.get(key, 0)
        self._steps[key] = step + 1
        world_size = self.transport.size
        self.codec.bind_rank(self.transport.rank)
        ahead = self.ahead is not None and self.ahead.ready(key, flat.numel(), world_size)
        # which gradient, and how every worker must have configured the compressor: in each MAX round's
        # stamp and in the carrier's header
        tag = carrier.to_tag(stable_seed(type(self).__name__, self.codec.config(), self.codec.seed, world_size,
                                         flat.numel(), step, key, self.scale, ahead,
                                         self.min_compress_numel))
        traffic = Traffic(uncompressed_bytes=tensor.numel() * tensor.element_size())
        values = flat if self.ahead is None else self.ahead.with_excess(key, flat)
        if ahead:
            start = time.perf_counter()
            payload, exchange = self.ahead.start(key, values, world_size, self.transport.rank, tag,
                                                 self.codec.rounding_stream(key, step, flat.device))
            traffic.compress_s += time.perf_counter() - start
            traffic.count(Op.SUM, payload, self.transport)
            return payload, _AheadContext(exchange, tensor.shape, tensor.dtype, traffic)
        ctx = self._start(values, key, step, order, tag, tensor, traffic)
        self._batch.contexts.append(ctx)
        header = carrier.wrap(torch.zeros(0, dtype=torch.int64, device=tensor.device), ctx.world_size, ctx.tag)
        ctx.traffic.count(Op.SUM, header, self.transport)
        return header, ctx

    def _start(self, values: torch.Tensor, key: Hashable, step: int, order: tuple, tag: int, tensor: torch.Tensor,
               traffic: Traffic) -> _Context:
        """The context of a new exact exchange of flat ``values`` (``tensor``'s, plus any clipped excess) as
        gradient ``key``, its exchange not yet started."""
        world_size = self.transport.size
        hint = (f" (here gradient {key!r}, exchange {step}): every worker must compress the same gradients "
                "in each step, with the same compressor settings")
        ahead = self.ahead

        def stamp(op: Op, request: torch.Tensor) -> tuple[Op, torch.Tensor]:
            return op, carrier.stamp(request, tag) if op is Op.MAX else request

        def unstamp(op: Op, reduced: torch.Tensor) -> torch.Tensor:
            if op is not Op.MAX:
                return reduced
            stats = carrier.unstamp(reduced, tag, hint)
            if ahead is not None:  # the shared scale of this exchange seeds the next one's
                ahead.agree(key, values.numel(), world_size, stats)
            return stats

        inner = self.codec.exchange(values, [values.numel()], key, step, world_size)  # int64 payload words
        return _Context(relay(inner, stamp, unstamp), key, order, tag, tensor.shape, tensor.dtype, world_size,
                        traffic, self._batch)

    def _exchange(self, batch: _Batch) -> None:
        """Run the exchanges of ``batch`` together up to their payload, one collective per round, then one
        int64 SUM of every payload; leave each context its slice of the sums."""
        batch.exchanged = True
        contexts = sorted(batch.contexts, key=lambda ctx: ctx.order)
        transport = CountedCollectives(self.transport, batch.traffic)
        start = time.perf_counter()
        payloads = drive_together([ctx.exchange for ctx in contexts], transport, Op.PAYLOAD)
        sums = transport.collective(Op.PAYLOAD, torch.cat([payload.reshape(-1) for payload in payloads]))
        for ctx, part in zip(contexts, sums.split([payload.numel() for payload in payloads])):
            ctx.word_sums = part
        traffic = batch.traffic
        traffic.compress_s += time.perf_counter() - start - traffic.communicate_s
        self.stats.last_step.add(traffic)
        self.stats.total.add(traffic)

    def decompress(self, tensor: torch.Tensor, ctx: _Context | None) -> torch.Tensor:
        """The mean of the workers' dequantized gradients if Horovod averaged ``ctx``'s header, their sum if
        it summed; the step's first call runs the step's exchange. With ``ctx=None`` (what Horovod passes
        after reducing a sparse gradient itself) ``tensor`` as it is."""
        if ctx is None:
            return tensor
        self._step_open = False
        if isinstance(ctx, UncompressedContext):
            return ctx.decompress(tensor)
        if isinstance(ctx, _AheadContext):
            return self._finish_ahead(tensor, ctx)
        if not ctx.batch.exchanged:
            self._exchange(ctx.batch)
        word_sums, ctx.word_sums = ctx.word_sums, None
        if word_sums is None:
            raise RuntimeError(f"hvdcomp: gradient {ctx.key!r} was decompressed twice, or its step's exchange failed")
        _, averaged = carrier.unwrap(tensor, ctx.world_size, ctx.tag)
        start = time.perf_counter()
        try:
            ctx.exchange.send(word_sums)
        except StopIteration as done:
            mean = done.value if averaged else done.value.mul_(ctx.world_size)
            ctx.traffic.decompress_s += time.perf_counter() - start
            self.stats.last_step.add(ctx.traffic)
            self.stats.total.add(ctx.traffic)
            return mean.view(ctx.shape).to(ctx.dtype, copy=self.codec.reuses_result)  # Horovod: p.grad.set_(it)
        raise RuntimeError("the exchange protocol did not finish after its payload")

    def _finish_ahead(self, reduced: torch.Tensor, ctx: _AheadContext) -> torch.Tensor:
        start = time.perf_counter()
        exchange = ctx.exchange
        mean, averaged, finite = self.ahead.finish(exchange, reduced)
        if not finite:
            warnings.warn(f"hvdcomp: a worker's gradient {exchange.key!r} holds NaN/Inf; every worker gets NaN for it",
                          RuntimeWarning, stacklevel=3)
        elif not averaged:
            mean.mul_(exchange.world_size)
        ctx.traffic.decompress_s += time.perf_counter() - start
        self.stats.last_step.add(ctx.traffic)
        self.stats.total.add(ctx.traffic)
        return mean.view(ctx.shape).to(ctx.dtype)


class QSGDMaxNorm(MaxNormCompressor):
    """QSGD with a shared max-norm scale: ``s = 2**bits - 1`` levels per sign, unbiased stochastic rounding.

    Scale ``M`` = max over workers of ``max|g|`` (per tensor, or per ``chunk_size`` elements). Each
    element's decoded value is unbiased with variance at most ``(M / s)**2 / 4``; the mean over ``W``
    workers has variance at most ``(M / s)**2 / (4 W)``. ``bits`` in [1, 16].

    ``scale``:

    - ``"ahead"`` (default): ``M`` is the max agreed at the gradient's previous exchange: no collective
      precedes the payload. The stock optimizer carries the max with the payload Horovod all-reduces during
      backward; ``hvdcomp.DistributedOptimizer`` and the DDP hook (``exchange="lanes"``) send a small MAX
      after each bucket's payload (``hvdcomp.exchange.ahead``). An element above ``M`` is sent as
      ``sign * M``; its excess stays in a per-worker memory, sent with the next step (delayed, never lost;
      that step is biased towards zero by it). Without clipping a step is unbiased with variance at most
      ``(M / s)**2 / 4`` for the previous step's ``M``. A gradient's first exchange (and any without an agreed
      scale: a new size, the step after a NaN/Inf) is exact. Stock carrier: float64 words of
      ``carrier.word_bits(W)`` bits (8 bits per element for 4 bits at W = 2) plus ``W`` slots per scale group.
    - ``"exact"``: this step's ``M``, from a MAX round before the payload (in the stock optimizer, blocking,
      in ``synchronize()``, batched over every gradient); unbiased every step.

    ``warmup_steps`` and ``min_compress_numel`` (gradients sent uncompressed): see ``MaxNormCompressor``.
    """

    def __init__(self, bits: int = 8, chunk_size: int | None = None, seed: int = 0,
                 process_set: hvd.ProcessSet | None = None, scale: str = "ahead", warmup_steps: int = 0,
                 min_compress_numel: int = MIN_COMPRESS_NUMEL) -> None:
        super().__init__(MaxNormCodec(MaxNormQuantizer((bits,), chunk_size), seed=seed), process_set, scale,
                         warmup_steps, min_compress_numel)


class QSGDMaxNormMultiScale(MaxNormCompressor):
    """QSGD max-norm at several resolutions ``bits=(b_1 < b_2 < ...)``, sent in ``b_1``'s range.

    Per element, the finest resolution ``s_j`` with ``|g| / M * s_j <= s_1`` on *every* worker (agreed
    through a SUM of packed 0/1 lanes, counted in ``stats``). Unbiased; variance per element at most
    ``(M / s_j)**2 / 4`` for the agreed ``j``.
    """

    def __init__(self, bits: Sequence[int] = (4, 8), chunk_size: int | None = None, seed: int = 0,
                 process_set: hvd.ProcessSet | None = None, warmup_steps: int = 0,
                 min_compress_numel: int = MIN_COMPRESS_NUMEL) -> None:
        super().__init__(MaxNormCodec(MaxNormQuantizer(bits, chunk_size), seed=seed), process_set,
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
                 process_set: hvd.ProcessSet | None = None, warmup_steps: int = 0,
                 min_compress_numel: int = MIN_COMPRESS_NUMEL) -> None:
        selector = RandomCoordinateSelector(k, ratio, seed)
        super().__init__(MaxNormCodec(MaxNormQuantizer((bits,), chunk_size), selector, error_feedback, seed),
                         process_set, warmup_steps=warmup_steps, min_compress_numel=min_compress_numel)


class GlobalRandKMaxNormMultiScale(MaxNormCompressor):
    """``GlobalRandKMaxNorm`` whose shared coordinates are quantized multi-scale (``bits=(b_1 < b_2 < ...)``)."""

    def __init__(self, k: int | None = None, ratio: float | None = None, bits: Sequence[int] = (4, 8),
                 error_feedback: bool = True, chunk_size: int | None = None, seed: int = 0,
                 process_set: hvd.ProcessSet | None = None, warmup_steps: int = 0,
                 min_compress_numel: int = MIN_COMPRESS_NUMEL) -> None:
        selector = RandomCoordinateSelector(k, ratio, seed)
        super().__init__(MaxNormCodec(MaxNormQuantizer(bits, chunk_size), selector, error_feedback, seed),
                         process_set, warmup_steps=warmup_steps, min_compress_numel=min_compress_numel)


def bucket_codec(compression: Any, exchange: str = "lanes", workers_per_node: int = 1) -> BucketCodec:
    """The bucket codec for a ``compression=`` argument: ``None`` or Horovod's ``Compression.none`` ->
    ``NoCompression``; ``Compression.fp16`` -> ``FP16``; an hvdcomp compressor -> its ``MaxNormCodec`` (int64
    SUM of packed levels; in an ``AheadMaxNorm`` with ``scale="ahead"``), or with ``exchange`` ``"auto"`` /
    ``"two_stage"`` (exact scale) a ``TwoStageMaxNorm`` around it (``workers_per_node`` share an uplink in each
    exchange); a ``BucketCodec`` (``PowerSGD``, ``FP16(...)``, ``TwoStageMaxNorm(...)``, ...) as it is."""
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
    if isinstance(compression, MaxNormCompressor) and exchange != "lanes":
        return TwoStageMaxNorm(compression.codec, exchange, workers_per_node=workers_per_node)
    if exchange == "two_stage" and not isinstance(compression, TwoStageMaxNorm):
        raise ValueError(f"exchange='two_stage' applies to the max-norm compressors (QSGDMaxNorm), not to "
                         f"compression={compression!r}")
    if compression is None or compression is Compression.none:
        return NoCompression()
    if compression is Compression.fp16:
        return FP16()
    if isinstance(compression, MaxNormCompressor):
        return AheadMaxNorm(compression.codec) if compression.scale == "ahead" else compression.codec
    if isinstance(compression, BucketCodec):
        return compression
    raise TypeError(
        f"compression={compression!r} is not supported: use None, hvd.Compression.none, hvd.Compression.fp16, "
        "an hvdcomp compressor (QSGDMaxNorm, ...), or a hvdcomp.exchange.BucketCodec (NoCompression, FP16, "
        "PowerSGD, or your own)"
    )
