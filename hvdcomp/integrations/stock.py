"""The stock adapter: a public max-norm codec (``hvdcomp.integrations.codecs``) in Horovod's own optimizer.

``hvd.DistributedOptimizer(opt, named_parameters=..., compression=QSGDMaxNorm(8))`` calls the codec's
``compress`` and ``decompress``, which run here (this module loads Horovod). ``compress`` issues no
collective. It starts the codec's exchange (``inner.exchange``) of the flat gradient and runs it to its first
request:

- an ``Op.PAYLOAD`` (``scale="ahead"`` with a scale agreed at the gradient's previous exchange): the exchange
  quantized at once (``hvdcomp.exchange.ahead``, words of ``carrier.word_bits(W)`` bits, each worker's
  statistics row in the payload), and ``compress`` returns the payload, encoded straight into a float64 carrier
  (``hvdcomp.codec.carrier``: canary, world size, a tag of the configuration, gradient and step, then the words)
  that Horovod all-reduces during backward, with the optimizer's op (Sum or Average, predivide factor allowed).
  ``decompress`` recovers the exact word sums through the canary and sends them into the exchange, whose result
  is the mean (and whose rows' maximum is the next scale): no blocking collective;
- an ``Op.MAX`` (``scale="exact"``, the other codecs, and a gradient without an agreed scale: its first
  exchange, a new size, the step after a NaN/Inf): ``compress`` returns a small float64 *header carrier* (no
  words), which Horovod reduces with the optimizer's op. The first ``decompress`` of a step runs the exchanges
  of all the step's gradients together, in name order, with one blocking collective per round for the whole
  step (``drive_together``: a MAX of every scale, for the multi-scale variants a SUM of the agreement bits,
  then one int64 SUM of every packed level). By then every worker has compressed all its gradients of the
  step: Horovod's ``synchronize()`` compresses the parameters whose hook did not fire (zero-filled) before it
  waits for any handle, so every worker compressed the same names, whatever parameters its own loss used. The
  price: the exchange starts only in ``synchronize()``, so it does not overlap backward
  (``hvdcomp.DistributedOptimizer`` overlaps it).

Each ``decompress`` returns what the reduced header says the op made of the workers' dequantized gradients
(their mean if Horovod averaged, their sum if it summed), identical on every worker, in the gradient's shape
and dtype. Gradients smaller than ``min_compress_numel`` (and all during warm-up) are sent as float32, as
``hvd.Compression.none`` sends them.

Gradients are identified by Horovod's own name for them (``hvdcomp.transport._compat.stock_call``), which keys
their error-feedback memory, agreed scales, coordinate sets, step counts and tags. Every MAX round is stamped
with each gradient's tag (``carrier.stamp``), so workers that batch different gradients, or configure the codec
differently, all raise ``CarrierMismatchError`` rather than mix their scales; each carrier checks the same again.
Called outside Horovod's optimizer, ``compress`` identifies a gradient by its position within the step (a step
ends when decompressing starts) and the step's exchanges run in call order, so every worker must compress in the
same order. If any worker's gradient holds NaN/Inf, every worker gets an all-NaN result for that tensor (as an
uncompressed all-reduce would; ``torch.amp.GradScaler`` then skips the step) and a warning.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..codec import carrier
from ..codec.seeding import stable_seed
from ..exchange.ahead import AheadMaxNorm
from ..exchange.protocol import Exchange, Op, Request, advance, drive_together, relay
from ..exchange.stats import CountedCollectives, Traffic
from ..transport._compat import stock_call
from ..transport.horovod import HorovodTransport
from .codecs import MaxNormCompressor
from .warmup import UncompressedContext, send_uncompressed


@dataclass
class _Batch:
    """The exact exchanges of one step, run together at the step's first ``decompress``."""

    contexts: list[_Context] = field(default_factory=list)
    exchanged: bool = False
    traffic: Traffic = field(default_factory=Traffic)  # the batched collectives


@dataclass
class _Context:
    exchange: Exchange  # the codec's exchange: in a batch from its first request on, else waiting for its sums
    key: Hashable
    tag: int
    shape: torch.Size
    dtype: torch.dtype
    world_size: int
    traffic: Traffic  # the carrier, the uncompressed size, the coding time
    batch: _Batch | None  # the step's exact exchanges; None where the payload rides in the carrier
    order: tuple = ()  # sorts the batch: by name (then step), or by call order outside Horovod's optimizer
    word_sums: torch.Tensor | None = None  # this gradient's slice of the batched payload sum


def _check_gradient(tensor: torch.Tensor) -> None:
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise TypeError("hvdcomp compressors need dense gradients; sparse gradients are not supported")
    if not tensor.dtype.is_floating_point:
        raise TypeError(f"hvdcomp compressors quantize floating-point gradients, got {tensor.dtype}")


def _replayed(request: Request | StopIteration, exchange: Exchange) -> Exchange:
    """``exchange``, already advanced to ``request``, as an exchange that asks for ``request`` first."""
    while not isinstance(request, StopIteration):
        request = advance(exchange, (yield request))
    return request.value


class StockAdapter:
    """``codec``'s ``compress`` and ``decompress`` for Horovod's stock optimizer (see the module docstring), and
    its step counters. ``codec.stats`` counts what this worker sent (the batched scales, agreement bits and packed
    levels when a step's exchange runs, each gradient's carrier) and what the gradients would have taken
    uncompressed, as they are decompressed; a step begins with its first gradient's ``compress``."""

    def __init__(self, codec: MaxNormCompressor) -> None:
        self.codec = codec
        self.transport = HorovodTransport(codec.process_set)
        self._steps: dict[Hashable, int] = {}  # exchanges so far, per gradient key
        self._index_in_step = 0  # the next position, for calls from outside Horovod's optimizer
        self._step_open = False  # False until a step's first compress, and again after a decompress
        self._warmup_done, self._warming = 0, False  # warm-up steps begun; whether this step is one
        self._batch: _Batch | None = None  # the open step's exact exchanges

    def state_dict(self) -> dict[str, Any]:
        """The step counters (the codec's own state is ``codec.inner``'s)."""
        return {"steps": dict(self._steps), "index_in_step": self._index_in_step, "step_open": self._step_open,
                "warmup_done": self._warmup_done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._steps, self._index_in_step = dict(state["steps"]), state["index_in_step"]
        self._step_open, self._warmup_done = state["step_open"], state["warmup_done"]
        self._warming, self._batch = False, None

    def _open_step(self) -> None:
        self._step_open = True
        self._index_in_step = 0
        self._batch = None
        self.codec.stats.begin_step()
        self.codec.stats.steps += 1
        self._warming = self._warmup_done < self.codec.warmup_steps
        self._warmup_done += self._warming

    def _exchange_of(self, flat: torch.Tensor, key: Hashable, step: int, world_size: int,
                     tag: Callable[[], int]) -> Exchange:
        """``codec.inner``'s exchange of ``flat``, its MAX rounds stamped with ``tag()`` (computed only for them)."""
        inner = self.codec.inner
        if isinstance(inner, AheadMaxNorm):  # with an agreed scale, its payload rides in the carrier
            exchange = inner.exchange(flat, [flat.numel()], key, step, world_size,
                                      carrier_bits=carrier.word_bits(world_size))
        else:
            exchange = inner.exchange(flat, [flat.numel()], key, step, world_size)
        hint = (f" (here gradient {key!r}, exchange {step}): every worker must compress the same gradients "
                "in each step, with the same compressor settings")

        def stamp(op: Op, request: torch.Tensor) -> tuple[Op, torch.Tensor]:
            return op, carrier.stamp(request, tag()) if op is Op.MAX else request

        def unstamp(op: Op, reduced: torch.Tensor) -> torch.Tensor:
            return carrier.unstamp(reduced, tag(), hint) if op is Op.MAX else reduced

        return relay(exchange, stamp, unstamp)

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, _Context | UncompressedContext]:
        """The carrier of ``tensor`` (the whole payload with a scale agreed ahead, else a header) and the context
        for ``decompress``; no collective (see the module docstring)."""
        name = stock_call(sys._getframe(1))
        codec = self.codec
        if not self._step_open:
            self._open_step()
        _check_gradient(tensor)
        if self._warming or tensor.numel() < codec.min_compress_numel:
            return send_uncompressed(tensor, codec.stats, self.transport)
        if self._batch is None:
            self._batch = _Batch()
        key: Hashable = name
        if name is None:
            key, self._index_in_step = self._index_in_step, self._index_in_step + 1
        step = self._steps.get(key, 0)
        self._steps[key] = step + 1
        flat = tensor.detach().reshape(-1).float()
        world_size = self.transport.size
        codec.inner.bind_rank(self.transport.rank)

        def tag(ahead: bool) -> int:  # the gradient, and how every worker must have configured the codec
            return carrier.to_tag(stable_seed(type(codec).__name__, codec.inner.config(), codec.max_norm.seed,
                                              world_size, flat.numel(), step, key, ahead, codec.min_compress_numel))

        traffic = Traffic(uncompressed_bytes=tensor.numel() * tensor.element_size())
        start = time.perf_counter()
        exact_tag = functools.cache(lambda: tag(False))  # a payload agreed ahead sends no MAX: no tag to hash
        exchange = self._exchange_of(flat, key, step, world_size, exact_tag)
        request = advance(exchange, None)
        if isinstance(request, StopIteration):
            raise RuntimeError("a max-norm exchange finished without requesting a collective")
        op, message = request
        if op is Op.PAYLOAD:  # the scale agreed ahead: the payload is the carrier, but for its header
            ctx = _Context(exchange, key, tag(True), tensor.shape, tensor.dtype, world_size, traffic, None)
            sent = carrier.seal(message, world_size, ctx.tag)
        else:
            order = (0 if name is not None else 1, key, step)
            ctx = _Context(_replayed(request, exchange), key, exact_tag(), tensor.shape, tensor.dtype, world_size,
                           traffic, self._batch, order)
            self._batch.contexts.append(ctx)
            sent = carrier.wrap(torch.zeros(0, dtype=torch.int64, device=tensor.device), world_size, ctx.tag)
        traffic.compress_s += time.perf_counter() - start
        traffic.count(Op.SUM, sent, self.transport)
        return sent, ctx

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
        self.codec.stats.last_step.add(traffic)
        self.codec.stats.total.add(traffic)

    def decompress(self, tensor: torch.Tensor, ctx: _Context | UncompressedContext | None) -> torch.Tensor:
        """The mean of the workers' dequantized gradients if Horovod averaged ``ctx``'s carrier, their sum if it
        summed; a step's first call runs the step's exact exchanges. ``tensor`` (the reduced carrier) is spent: its
        words are replaced by their sums in place. With ``ctx=None`` (what Horovod passes after reducing a sparse
        gradient itself) ``tensor`` as it is."""
        if ctx is None:
            return tensor
        self._step_open = False
        if isinstance(ctx, UncompressedContext):
            return ctx.decompress(tensor)
        if ctx.batch is not None and not ctx.batch.exchanged:
            self._exchange(ctx.batch)
        start = time.perf_counter()
        if ctx.batch is None:  # the sums of the words that rode in the carrier, written over them
            word_sums, averaged = carrier.unwrap(tensor, ctx.world_size, ctx.tag)
        else:
            word_sums, ctx.word_sums = ctx.word_sums, None
            if word_sums is None:
                raise RuntimeError(f"hvdcomp: gradient {ctx.key!r} was decompressed twice, or its step's exchange "
                                   "failed")
            _, averaged = carrier.unwrap(tensor, ctx.world_size, ctx.tag)
        done = advance(ctx.exchange, word_sums)
        if not isinstance(done, StopIteration):
            raise RuntimeError("the exchange protocol did not finish after its payload")
        mean = done.value if averaged or ctx.world_size == 1 else done.value.mul_(ctx.world_size)  # the sum
        ctx.traffic.decompress_s += time.perf_counter() - start
        self.codec.stats.last_step.add(ctx.traffic)
        self.codec.stats.total.add(ctx.traffic)
        return mean.view(ctx.shape).to(ctx.dtype, copy=self.codec.inner.reuses_result)  # Horovod: p.grad.set_(it)
