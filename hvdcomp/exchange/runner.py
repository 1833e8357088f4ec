"""``Runner``: the one scheduler of every entry point's exchanges.

An entry point (``hvdcomp.DistributedOptimizer``, the DDP hook, ``Birder``) says when a bucket's gradients are
ready (``launch``) and where its means go (``deliver``); the runner does the rest, the same way for all of them:

- **launching**: the step's codec (``NoCompression`` during warm-up, ``hvdcomp.exchange.state``) gets the
  bucket's gradients (element-wise codecs: copied into the bucket's persistent flat buffer, zeros for a missing
  gradient; to a codec that reads them in place, ``reads_pieces``, as ``Pieces`` where the native kernels take each
  of them, over all workers), its exchange (flat or hierarchical, ``hierarchy.bucket_exchange``) runs to its first
  request, and that collective starts at once;
- **advancing**: ``progress()`` (called from every event of the entry point, e.g. each gradient hook) and
  ``finish()`` advance exchanges as their collectives complete, by the transport's ordering:

  - *by name* (Horovod, ``blocking`` False): ``progress`` advances every exchange whose collective has
    completed, without blocking; ``finish`` advances whichever has completed, else blocks on the lowest bucket
    still in flight (which every worker reaches: no deadlock). Where the transport says which requests are large
    (``large_request_bytes``), an exchange whose first request is a large sum starts it only while fewer than two
    such exchanges are open, the others in launch order as those finish (every worker holds alike: the sizes are
    the same on every worker);
  - *by call order* (MPI, torch.distributed): every worker must start the same collectives in the same order,
    so ``progress`` advances each exchange launched before the previous ``progress`` by exactly one round
    (queued behind the ones just launched: the link stays busy while the next bucket encodes), and ``finish``
    runs them to their ends in launch order. An exchange waiting on its declared last request
    (``protocol.LastRequest``: nothing but computation follows) is never waited for by ``progress``, only
    finished once its collective has completed, since finishing it starts no collective: backward does not
    block on the wire (docs/benchmarks.md#the-ddp-door-without-waits-in-backward). Hierarchical exchanges,
    whose cross-node rounds may differ between local ranks, each run to their end when advanced;
- **naming**: ``f"{prefix}.{key}.{scope}{n}.{op}"``: the same on every worker, counted per scope (workers of
  one node, or one cross-node group, run the same sequence of their scope's collectives);
- **metering**: bytes per request and seconds (``compress_s`` before a request, ``communicate_s`` waiting,
  ``decompress_s`` after the last result) into ``stats.last_step``; ``finish`` ends the step;
- **agreement**: before the first exchange after construction, a load or an elastic re-synchronisation, the
  state's ``agree`` (``hvdcomp.exchange.state``): workers configured differently raise on every worker;
- **trials**: where the step's codec is trying two routes (``BucketCodec.trial``, e.g. ``exchange="auto"``'s
  lanes and two-stage exchange), ``finish`` records the step's seconds since the previous ``finish`` (the whole
  iteration the route belongs to: backward, its exchanges and the rest) in the trial, and once every trial step
  is recorded, reduces them by MAX over all workers in one blocking collective (``{prefix}.trial``), so every
  worker reaches the same verdict at the same step (``hvdcomp.exchange.route``);
- **write-back**: ``deliver(bucket, means, keep)`` gets one mean per tensor, in the gradient's shape, and
  ``keep``: whether the means may be kept as they are (they are no buffer the codec or the bucket writes
  again) instead of being copied.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..codec import native
from ..codec.pieces import Pieces
from .bucket import ElementwiseCodec
from .hierarchy import bucket_exchange
from .plan import Bucket
from .protocol import Exchange, LastRequest, Op, Reduction, Scope, Transport
from .route import RouteTrial
from .state import ExchangeState
from .stats import Statistics

Deliver = Callable[[Any], None]
# Exchanges open at once whose first request is a large sum (``Transport.large_request_bytes``): one on the wire, one
# queued behind it, so the transport never waits for the next (docs/benchmarks.md#large-sums-held-back).
_LARGE_IN_FLIGHT = 2
_FLOAT32_MAX = torch.finfo(torch.float32).max


@dataclass(eq=False)
class _Flight:
    """An exchange in flight: its name, where its result goes, its current collective's handle."""

    order: int  # the same on every worker: ``finish`` blocks on the lowest (bucket index, chunk index)
    key: str
    exchange: Exchange
    deliver: Deliver
    handle: Any = None
    rounds: dict[Scope, int] = field(default_factory=dict)
    held: tuple[Op, torch.Tensor, str] | None = None  # its first request, until the transport's window has room
    large: bool = False  # its first request counts in the transport's window (``Transport.large_request_bytes``)
    last: bool = False  # its request in flight is its last (``protocol.LastRequest``)


def consecutive_span(grads: Sequence[torch.Tensor | None], dtype: torch.dtype) -> torch.Tensor | None:
    """The ``[numel]`` view of the one buffer that holds ``grads`` one after another, contiguous and of ``dtype``
    (as DDP's bucket holds its gradients); ``None`` if they do not lie so."""
    if not grads or any(g is None for g in grads):
        return None
    first = grads[0]
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for grad in grads:
        if (grad.dtype != dtype or not grad.is_contiguous() or grad.untyped_storage().data_ptr() != storage
                or grad.storage_offset() != offset):
            return None
        offset += grad.numel()
    return first.as_strided((offset - first.storage_offset(),), (1,))


def fill_flat(flat: torch.Tensor, grads: Sequence[torch.Tensor | None], sizes: Sequence[int]) -> list[torch.Tensor]:
    """Copy ``grads`` (``None``: zeros) into ``flat``, one view per gradient, and return the views. A float64
    gradient copied into a float32 ``flat`` is clamped to float32's range first (never turned into Inf)."""
    views = list(flat.split(list(sizes)))
    for grad, view in zip(grads, views):
        if grad is None:
            view.zero_()
        else:
            view.copy_(grad.reshape(-1))
            if grad.dtype == torch.float64 and flat.dtype == torch.float32:  # finite values beyond float32's range
                overflow = view.isinf().logical_and_(grad.reshape(-1).isfinite())
                view[overflow] = view[overflow].sign() * _FLOAT32_MAX
    return views


class Runner:
    """See the module docstring.

    Args:
        transport: carries the collectives.
        stats: where the bytes and seconds go (``Statistics``).
        prefix: the collective names' prefix, the same on every worker.
        state: the entry point's ``ExchangeState`` (codec, step, plan, agreement), for ``launch``.
        hierarchical: bucket exchanges sum inside nodes first (``hierarchy``).
    """

    def __init__(self, transport: Transport, stats: Statistics, prefix: str, state: ExchangeState | None = None,
                 hierarchical: bool = False) -> None:
        self.transport, self.stats, self.prefix = transport, stats, prefix
        self.state, self.hierarchical = state, hierarchical
        self._flights: list[_Flight] = []
        self._launched_since: list[_Flight] = []  # by call order: not advanced by the next progress()
        self._large_bytes = None if transport.blocking else transport.large_request_bytes
        self._large_open = 0  # exchanges open (started, not finished) whose first request is large
        self._open = False
        self._finished_at: float | None = None  # when the previous step finished (``perf_counter``)

    @property
    def in_flight(self) -> bool:
        return bool(self._flights)

    # -- launching ---------------------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Open the step's statistics (once per step; ``launch`` calls it)."""
        if not self._open:
            self.stats.begin_step()
            self._open = True

    def launch(self, bucket: Bucket, grads: Sequence[torch.Tensor | None],
               deliver: Callable[[Bucket, list[torch.Tensor], bool], None], scratch: bool = False) -> None:
        """Start ``bucket``'s exchange of ``grads`` (one per tensor, ``None`` for zeros) with the state's codec of
        this step; ``deliver(bucket, means, keep)`` receives its result (see the module docstring). ``scratch``:
        the door's gradients are its to overwrite until the result is delivered, so where they lie one after
        another in one buffer of the codec's dtype (DDP's bucket), an element-wise codec exchanges that buffer
        itself, without the copy into the bucket's flat buffer, and a codec that declares ``takes_out`` writes the mean
        back there (``ElementwiseCodec.exchange``'s ``out``)."""
        state = self.state
        if state is None:
            raise RuntimeError("Runner.launch needs the entry point's ExchangeState")
        self.begin_step()
        if not state.agreed:
            state.agree(self.transport, f"{self.prefix}.agree")
        started = time.perf_counter()
        codec = state.step_codec()
        self.stats.last_step.uncompressed_bytes += sum(p.numel() * p.element_size() for p in bucket.params)
        flat = in_place = pieces = None
        if isinstance(codec, ElementwiseCodec):
            flat_dtype = codec.flat_dtype(bucket.dtype)
            flat = in_place = consecutive_span(grads, flat_dtype) if scratch else None
            if flat is None:
                flat = bucket.flat(flat_dtype)
                pieces = self._pieces(codec, grads)
                inputs: list[Any] = list(grads) if pieces is not None else fill_flat(flat, grads, bucket.sizes)
            else:  # the gradients are views of flat already
                inputs = list(grads)
        else:
            inputs = [g if g is not None else torch.zeros_like(p) for g, p in zip(grads, bucket.params)]
        exchange = bucket_exchange(codec, flat, inputs, bucket.key, state.step, self.transport, self.hierarchical,
                                   in_place, pieces)
        kept = flat is not None and not codec.reuses_result

        def write_back(result: Any) -> None:
            if in_place is not None and result.data_ptr() == in_place.data_ptr():  # the means are in the gradients
                deliver(bucket, inputs, False)
                return
            means = result.split(bucket.sizes) if isinstance(result, torch.Tensor) else result
            keep = kept and result.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
            deliver(bucket, [mean.view(p.shape) for mean, p in zip(means, bucket.params)], keep)

        self._launch(_Flight(bucket.index, bucket.key, exchange, write_back), started)

    def _pieces(self, codec: ElementwiseCodec, grads: Sequence[torch.Tensor | None]) -> Pieces | None:
        """``grads`` as ``Pieces`` for a codec that reads them in place (``reads_pieces``) over all workers, where the
        native kernels take each of them; else None: the bucket's flat buffer is filled
        (docs/benchmarks.md#the-gradients-read-where-they-lie)."""
        if self.hierarchical or not codec.reads_pieces or not all(native.usable_each(grads)):
            return None
        return Pieces(grads)

    def launch_exchange(self, index: int, key: str, exchange: Exchange, deliver: Deliver) -> None:
        """Start any exchange (e.g. one of Birder's chunks) under this runner; ``deliver(result)`` receives its
        result. ``index`` orders it among the step's exchanges and ``key`` names its collectives, both the same
        on every worker."""
        self.begin_step()
        self._launch(_Flight(index, key, exchange, deliver), time.perf_counter())

    def _launch(self, flight: _Flight, started: float) -> None:
        if not self._feed(flight, None, started):
            self._flights.append(flight)
            self._launched_since.append(flight)

    # -- advancing ---------------------------------------------------------------------------------------------
    def _feed(self, flight: _Flight, result: torch.Tensor | None, started: float) -> bool:
        """Send ``result`` (None: start) into the exchange and start its next collective; True once it finished
        (its result delivered)."""
        traffic = self.stats.last_step
        try:
            request = next(flight.exchange) if result is None else flight.exchange.send(result)
        except StopIteration as done:
            flight.deliver(done.value)
            traffic.decompress_s += time.perf_counter() - started
            if flight.large:
                self._large_open -= 1
                self._release()
            return True
        op, tensor = request
        if flight.last:
            raise RuntimeError(f"exchange {flight.key} asked for {op.name} after declaring its last request")
        flight.last = isinstance(request, LastRequest)
        queued = time.perf_counter()
        traffic.compress_s += queued - started
        self._start(flight, op, tensor)
        traffic.communicate_s += time.perf_counter() - queued
        return False

    def _start(self, flight: _Flight, op: Op, tensor: torch.Tensor) -> None:
        self.stats.last_step.count(op, tensor, self.transport)
        count = flight.rounds.get(op.scope, 0)
        flight.rounds[op.scope] = count + 1
        name = f"{self.prefix}.{flight.key}.{op.scope.value}{count}.{op.name.lower()}"
        if count == 0 and len(flight.rounds) == 1 and op.reduction is Reduction.SUM and self._large_bytes is not None \
                and tensor.numel() * tensor.element_size() >= self._large_bytes:
            flight.large = True
            if self._large_open >= _LARGE_IN_FLIGHT:
                flight.held = (op, tensor, name)
                return
            self._large_open += 1
        flight.handle = self.transport.start(op, tensor, name)

    def _release(self) -> None:
        """Start held first requests, in launch order, while the transport's window has room."""
        for flight in self._flights:
            if self._large_open >= _LARGE_IN_FLIGHT:
                return
            if flight.held is not None:
                op, tensor, name = flight.held
                flight.held = None
                self._large_open += 1
                flight.handle = self.transport.start(op, tensor, name)

    def _advance(self, flight: _Flight) -> bool:
        """Wait for the flight's collective and run it to its next request; True once it finished."""
        started = time.perf_counter()
        result = self.transport.wait(flight.handle)
        waited = time.perf_counter()
        self.stats.last_step.communicate_s += waited - started
        done = self._feed(flight, result, waited)
        if done:
            self._flights.remove(flight)
        return done

    def _to_end(self, flight: _Flight) -> None:
        while not self._advance(flight):
            pass

    def progress(self) -> None:
        """Advance what may advance now (the module docstring)."""
        if not self.transport.blocking:
            for flight in list(self._flights):
                while flight.held is None and self.transport.poll(flight.handle) and not self._advance(flight):
                    pass
            return
        older = [flight for flight in self._flights if flight not in self._launched_since]
        self._launched_since.clear()
        for flight in older:
            if flight.last:
                if self.transport.poll(flight.handle):
                    self._advance(flight)
            else:
                self._to_end(flight) if self.hierarchical else self._advance(flight)

    def finish(self) -> None:
        """Run every exchange in flight to its end (``complete``), close the step's statistics and count the
        state's exchange step."""
        self.complete()
        self.begin_step()  # a step without exchanges counts too
        self.stats.end_step()
        self._open = False
        if self.state is not None:
            self._time_trial(self.state.step_codec().trial)
            self.state.step += 1

    def _time_trial(self, trial: RouteTrial | None) -> None:
        """Record the step in ``trial`` and reach its verdict once it is due (the module docstring)."""
        now = time.perf_counter()
        since, self._finished_at = self._finished_at, now
        if trial is None or trial.choice is not None or self.transport.size == 1:
            return
        trial.record(now - since if since is not None else 0.0)  # a first step: untimed
        if trial.deciding:
            name = f"{self.prefix}.trial"
            trial.decide(self.transport.wait(self.transport.start(Op.MAX, trial.seconds(), name)))

    def complete(self) -> None:
        """Run every exchange in flight to its end (the module docstring); the step stays open (a door whose
        results are due before its step ends, as FSDP's reduce-scatter per module)."""
        if not self.transport.blocking:
            pending = sorted(self._flights, key=lambda f: f.order)
            while pending:  # the first whose collective completed, else (blocking on it) the oldest started
                started = [f for f in pending if f.held is None]
                flight = next((f for f in started if self.transport.poll(f.handle)), started[0])
                if self._advance(flight):
                    pending.remove(flight)
        else:
            for flight in list(self._flights):
                self._to_end(flight)
        self._launched_since.clear()

    def drop(self) -> None:
        """Forget the step's exchanges (after a failure, or before loading a state): nothing in flight."""
        for flight in self._flights:
            flight.exchange.close()
        self._flights.clear()
        self._launched_since.clear()
        self._large_open = 0
        self._open = False
