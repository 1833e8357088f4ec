"""Horovod ``Compressor`` objects for the max-norm quantizer family, and ``bucket_codec``.

Pass one to the stock optimizer, e.g.
``hvd.DistributedOptimizer(opt, named_parameters=..., compression=QSGDMaxNorm(8))``. For each gradient,
``compress`` runs the codec's exchange up to its payload over Horovod (one blocking MAX all-reduce of
a few floats; for the multi-scale variants also a blocking SUM of the packed agreement bits) and
returns a float64 carrier of the packed levels (``hvdcomp.codec.carrier``), which Horovod then reduces
with the optimizer's op (Sum or Average, predivide factor allowed). ``decompress`` returns what that op
makes of the workers' dequantized gradients (their mean or sum), identical on every worker, in the
gradient's shape and dtype.

Gradients are identified by Horovod's own name for them (read from the optimizer's frames, see
``stock_names``), which keys their error-feedback memory, coordinate sets, step counts and carrier
tag. The blocking rounds inside ``compress`` pair by call order: during backward the hooks call it in
backward order, the same on every worker; the parameters Horovod compresses later in
``synchronize()`` (those without a gradient this step, zero-filled, in an order that differs between
workers) are exchanged together at the first one's ``compress``, in name order, one collective per
round (``drive_together``). So every worker must compute gradients for the same parameters in a
step; a parameter used on some workers only needs ``hvdcomp.DistributedOptimizer``. Every blocking
MAX is stamped with the gradient's key and step (``carrier.stamp``), so workers that pair different
gradients all raise ``CarrierMismatchError`` rather than mix their scales (the carrier's tag then
checks the configuration too). Called outside Horovod's optimizer
(e.g. directly), ``compress`` identifies a gradient by its position within the step (a step ends when
decompressing starts), so every worker must compress its gradients in the same order.
If any worker's gradient holds NaN/Inf, every worker gets an all-NaN result for that tensor (as an
uncompressed all-reduce would; ``torch.amp.GradScaler`` then skips the step) and a warning.
"""

from __future__ import annotations

import sys
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import horovod.torch as hvd
import torch
from horovod.torch.compression import Compression, Compressor

from ..codec import carrier
from ..codec.quantize import MaxNormQuantizer
from ..codec.seeding import stable_seed
from ..codec.selection import RandomCoordinateSelector
from ..exchange.bucket import BucketCodec
from ..exchange.elementwise import FP16, MaxNormCodec, NoCompression
from ..exchange.protocol import Exchange, Op, drive, drive_together, relay
from ..exchange.stats import Statistics, Traffic, counted
from ..transport.horovod import HorovodTransport
from .stock_names import StockCall, stock_call


@dataclass
class _Context:
    exchange: Exchange
    key: Hashable
    shape: torch.Size
    dtype: torch.dtype
    world_size: int
    traffic: Traffic
    averaged: bool = False


def _flat_float(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise TypeError("hvdcomp compressors need dense gradients; sparse gradients are not supported")
    if not tensor.dtype.is_floating_point:
        raise TypeError(f"hvdcomp compressors quantize floating-point gradients, got {tensor.dtype}")
    return tensor.detach().reshape(-1).float()


class MaxNormCompressor(Compressor):
    """A ``MaxNormCodec`` as a Horovod compressor (see the module docstring).

    Args:
        codec: quantizer, optional shared coordinate selection, error-feedback memory, seed.
        process_set: the Horovod process set the optimizer reduces over (default: all workers).

    ``stats`` (``hvdcomp.exchange.stats.Statistics``) counts what this worker sent (scales, agreement
    bits, carrier) and what the gradients would have taken uncompressed, per tensor as it is
    decompressed; a step begins with its first gradient's ``compress``.
    """

    def __init__(self, codec: MaxNormCodec, process_set: hvd.ProcessSet | None = None) -> None:
        self.codec = codec
        self.transport = HorovodTransport(process_set)
        self.stats = Statistics()
        self._steps: dict[Hashable, int] = {}  # exchanges so far, per gradient key
        self._index_in_step = 0  # the next position, for calls from outside Horovod's optimizer
        self._step_open = False  # False until a step's first compress, and again after a decompress
        self._missing: tuple[object, dict[str, tuple[torch.Tensor, _Context]]] | None = None

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue exactly: the codec's state and the step counters."""
        return {"codec": self.codec.state_dict(), "steps": dict(self._steps), "index_in_step": self._index_in_step,
                "step_open": self._step_open}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.codec.load_state_dict(state["codec"])
        self._steps, self._index_in_step = dict(state["steps"]), state["index_in_step"]
        self._step_open = state["step_open"]

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, _Context]:
        """Exchange ``tensor``'s blocking rounds; return its float64 carrier and the context for
        ``decompress`` (see the module docstring for how gradients are identified and paired)."""
        call = stock_call(sys._getframe(1))
        if not self._step_open:
            self._step_open = True
            self._index_in_step = 0
            self.stats.begin_step()
            self.stats.steps += 1
        if call is not None and call.loop is not None:
            return self._compress_missing(call, tensor)
        if call is not None:
            key: Hashable = call.name
        else:
            key, self._index_in_step = self._index_in_step, self._index_in_step + 1
        ctx = self._start(tensor, key)
        return drive(ctx.exchange, self.transport, until=Op.PAYLOAD), ctx

    def _compress_missing(self, call: StockCall, tensor: torch.Tensor) -> tuple[torch.Tensor, _Context]:
        """One of ``synchronize()``'s missing gradients: the loop's first call exchanges all of them (in
        name order, one collective per round); each call returns its own carrier."""
        if self._missing is None or self._missing[0] is not call.loop:
            contexts = [self._start(grad, name) for name, grad in call.missing()]
            payloads = drive_together([ctx.exchange for ctx in contexts], self.transport, Op.PAYLOAD)
            self._missing = (call.loop, {ctx.key: (payload, ctx) for payload, ctx in zip(payloads, contexts)})
        prepared = self._missing[1].pop(call.name, None)
        if not self._missing[1]:
            self._missing = None
        if prepared is None or prepared[1].shape != tensor.shape:
            raise RuntimeError(f"hvdcomp: Horovod's synchronize() compressed {call.name!r} unexpectedly")
        return prepared

    def _start(self, tensor: torch.Tensor, key: Hashable) -> _Context:
        """The context of a new exchange of ``tensor`` as gradient ``key``, its exchange not yet started."""
        flat = _flat_float(tensor)
        step = self._steps.get(key, 0)
        self._steps[key] = step + 1
        transport = self.transport
        world_size = transport.size
        self.codec.bind_rank(transport.rank)
        tag = carrier.to_tag(stable_seed(type(self).__name__, self.codec.config(), self.codec.seed, world_size,
                                         flat.numel(), step, key))
        stamp = carrier.to_tag(stable_seed("stamp", world_size, flat.numel(), step, key))  # which gradient
        traffic = Traffic(uncompressed_bytes=tensor.numel() * tensor.element_size())
        ctx = _Context(None, key, tensor.shape, tensor.dtype, world_size, traffic)
        hint = (f" (here gradient {key!r}, exchange {step}): every worker must compress the same gradients "
                "in each step; with hvd.DistributedOptimizer, a parameter used on some workers only needs "
                "hvdcomp.DistributedOptimizer")

        def wrap(op: Op, request: torch.Tensor) -> tuple[Op, torch.Tensor]:
            if op is Op.PAYLOAD:
                return op, carrier.wrap(request, world_size, tag)
            return op, carrier.stamp(request, stamp) if op is Op.MAX else request

        def unwrap(op: Op, reduced: torch.Tensor) -> torch.Tensor:
            if op is Op.MAX:
                return carrier.unstamp(reduced, stamp, hint)
            if op is not Op.PAYLOAD:
                return reduced
            word_sums, ctx.averaged = carrier.unwrap(reduced, world_size, tag)
            return word_sums

        inner = self.codec.exchange(flat, [flat.numel()], key, step, world_size, carrier.word_bits(world_size))
        ctx.exchange = counted(relay(inner, wrap, unwrap), traffic, transport)
        return ctx

    def decompress(self, tensor: torch.Tensor, ctx: _Context | None) -> torch.Tensor:
        """The mean of the workers' dequantized gradients if Horovod averaged, their sum if it summed.
        With ``ctx=None`` (what Horovod passes after reducing a sparse gradient itself) ``tensor`` as it is."""
        if ctx is None:
            return tensor
        self._step_open = False
        try:
            ctx.exchange.send(tensor)
        except StopIteration as done:
            self.stats.last_step.add(ctx.traffic)
            self.stats.total.add(ctx.traffic)
            mean = done.value if ctx.averaged else done.value.mul_(ctx.world_size)
            return mean.view(ctx.shape).to(ctx.dtype)
        raise RuntimeError("the exchange protocol did not finish after its payload")


class QSGDMaxNorm(MaxNormCompressor):
    """QSGD with a shared max-norm scale: ``s = 2**bits - 1`` levels per sign, unbiased stochastic rounding.

    Scale ``M`` = max over workers of ``max|g|`` (per tensor, or per ``chunk_size`` elements). Each
    element's decoded value is unbiased with variance at most ``(M / s)**2 / 4``; the mean over ``W``
    workers has variance at most ``(M / s)**2 / (4 W)``. ``bits`` in [1, 16].
    """

    def __init__(self, bits: int = 8, chunk_size: int | None = None, seed: int = 0,
                 process_set: hvd.ProcessSet | None = None) -> None:
        super().__init__(MaxNormCodec(MaxNormQuantizer((bits,), chunk_size), seed=seed), process_set)


class QSGDMaxNormMultiScale(MaxNormCompressor):
    """QSGD max-norm at several resolutions ``bits=(b_1 < b_2 < ...)``, sent in ``b_1``'s range.

    Per element, the finest resolution ``s_j`` with ``|g| / M * s_j <= s_1`` on *every* worker (agreed
    through a SUM of packed 0/1 lanes, counted in ``stats``). Unbiased; variance per element at most
    ``(M / s_j)**2 / 4`` for the agreed ``j``.
    """

    def __init__(self, bits: Sequence[int] = (4, 8), chunk_size: int | None = None, seed: int = 0,
                 process_set: hvd.ProcessSet | None = None) -> None:
        super().__init__(MaxNormCodec(MaxNormQuantizer(bits, chunk_size), seed=seed), process_set)


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
                 process_set: hvd.ProcessSet | None = None) -> None:
        selector = RandomCoordinateSelector(k, ratio, seed)
        super().__init__(MaxNormCodec(MaxNormQuantizer((bits,), chunk_size), selector, error_feedback, seed),
                         process_set)


class GlobalRandKMaxNormMultiScale(MaxNormCompressor):
    """``GlobalRandKMaxNorm`` whose shared coordinates are quantized multi-scale (``bits=(b_1 < b_2 < ...)``)."""

    def __init__(self, k: int | None = None, ratio: float | None = None, bits: Sequence[int] = (4, 8),
                 error_feedback: bool = True, chunk_size: int | None = None, seed: int = 0,
                 process_set: hvd.ProcessSet | None = None) -> None:
        selector = RandomCoordinateSelector(k, ratio, seed)
        super().__init__(MaxNormCodec(MaxNormQuantizer(bits, chunk_size), selector, error_feedback, seed),
                         process_set)


def bucket_codec(compression: Any) -> BucketCodec:
    """The bucket codec for a ``compression=`` argument: ``None`` or Horovod's ``Compression.none`` ->
    ``NoCompression``; ``Compression.fp16`` -> ``FP16``; an hvdcomp compressor -> its ``MaxNormCodec``
    (packed levels moved as int64 SUM); a ``BucketCodec`` (``PowerSGD``, ``FP16(...)``, ...) as it is."""
    if compression is None or compression is Compression.none:
        return NoCompression()
    if compression is Compression.fp16:
        return FP16()
    if isinstance(compression, MaxNormCompressor):
        return compression.codec
    if isinstance(compression, BucketCodec):
        return compression
    raise TypeError(
        f"compression={compression!r} is not supported: use None, hvd.Compression.none, hvd.Compression.fp16, "
        "an hvdcomp compressor (QSGDMaxNorm, ...), or a hvdcomp.exchange.BucketCodec (NoCompression, FP16, "
        "PowerSGD, or your own)"
    )
