"""hvdcomp's bucket codecs on PyTorch DDP: ``register`` a communication hook, keep its ``CompressionState``.

DDP owns bucketing, overlap with backward and ``no_sync``; a hook (``hook(state, bucket) -> Future``,
torch's ``ddp_comm_hooks`` contract) owns the codec and its collectives, which run over a
``TorchDistributedTransport`` (int64 lane sums, float16, MAX and all-gathers over Gloo or NCCL).

**Codec buckets, planned once.** DDP's buckets change: its first iteration puts every gradient in one
bucket (without ``find_unused_parameters``), it then rebuilds them in the order gradients became ready,
and a resumed process starts from one bucket again. Codec state keyed by DDP's buckets (error-feedback
memories, PowerSGD's ``Q``s, the order in which rounding draws are taken) would neither survive the
rebuild nor resume exactly. So the state plans its own *codec buckets* from the parameters alone
(reverse model order, split by dtype and device, DDP's ``bucket_cap_mb`` each unless ``bucket_size_mb``
says otherwise: ``hvdcomp.DistributedOptimizer``'s rule), and DDP's buckets only deliver gradients to them:

1. each DDP bucket's hook copies its gradients into the codec buckets (``bucket.parameters()`` /
   ``bucket.gradients()``) and remembers where the means must go;
2. codec buckets start their exchange in plan order once all their gradients are in (never before a
   bucket planned earlier), so codec state and random draws follow the plan, not DDP's layout;
3. each hook then advances the exchanges that earlier hooks started by one round (hierarchical ones to their
   end), so that its own buckets' collectives are queued behind theirs while it waits: the link stays busy
   while it copies, encodes and decodes;
4. the last bucket's hook (``bucket.is_last()``: DDP runs hooks in bucket order) finishes every
   exchange, writes the means into DDP's bucket buffers and completes the step's futures.

The first synchronizing step of a process learns the parameters from DDP's buckets (every parameter
DDP reduces is in one of them each step), so its exchanges all start in its last hook; DDP sends that
step as one bucket anyway. Results therefore do not depend on DDP's bucketing: the first step, the
rebuilt steps and a resumed run exchange exactly alike (hvdcomp's codecs take each exchange's random
draws at one point, which rounds keep in launch order).

**Order.** torch.distributed pairs collectives by call order. Every worker sees the same hooks (DDP's
buckets are the same on every worker) and the schedule above depends on nothing else, so every worker
starts the same collectives in the same order; hierarchical exchanges, whose number of cross-node rounds
may differ between local ranks, each run to their end before the next one advances.

**no_sync.** DDP calls no hook inside ``no_sync()``; the gradients it accumulated go through the hook
at the next synchronizing backward. ``stats.steps`` counts synchronizing steps.

**Hierarchical** (``hierarchical=True``): full precision inside nodes, the compressed shards between
them (``hvdcomp.exchange.hierarchy``), over subgroups of torchrun's nodes (``LOCAL_WORLD_SIZE``
consecutive ranks, equal on every node). ``None`` (the default) and ``False`` exchange over all workers:
DDP has no launcher setting to follow (as ``HOROVOD_HIERARCHICAL_ALLREDUCE`` is for Horovod), NCCL already
routes its own rings by topology, and a hierarchical exchange changes the numerics (node means first), so
it is an explicit choice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..codec import carrier
from ..codec.seeding import stable_seed
from ..codec.validate import check_bool, check_real
from ..exchange.bucket import BucketCodec, ElementwiseCodec
from ..exchange.hierarchy import bucket_exchange
from ..exchange.protocol import Exchange, Op
from ..exchange.stats import Statistics
from ..transport.torch_distributed import TorchDistributedTransport
from .buckets import Bucket, plan_buckets
from .resolve import resolve_codec

Parameter = torch.nn.Parameter


@dataclass(eq=False)
class _Running:
    """A codec bucket's exchange in flight: its current collective's handle."""

    bucket: Bucket
    exchange: Exchange
    handle: Any = None


class CompressionState:
    """What the hook keeps between steps (see the module docstring); built by ``register``.

    ``stats``: ``hvdcomp.exchange.Statistics`` (bytes intra-/inter-node, uncompressed, seconds) per
    synchronizing step and in total. ``state_dict()`` / ``load_state_dict()``: the codec's state and the
    exchange step; each worker saves and loads its own (memories differ per worker), and every worker
    must load one or none (checked, on every worker, at the next exchange).
    """

    __slots__ = ("codec", "transport", "hierarchical", "stats", "step", "_bucket_size_mb", "_order", "_plan",
                 "_home", "_arrivals", "_destinations", "_futures", "_running", "_next_launch", "_agreed")

    def __init__(self, codec: BucketCodec, transport: TorchDistributedTransport, hierarchical: bool,
                 bucket_size_mb: float, parameters: list[Parameter]) -> None:
        self.codec, self.transport, self.hierarchical = codec, transport, hierarchical
        self.stats = Statistics()
        self.step = 0  # synchronizing steps exchanged
        self._bucket_size_mb = bucket_size_mb
        self._order = {p: i for i, p in enumerate(parameters)}  # the model's order, the same in every process
        self._plan: list[Bucket] | None = None
        self._home: dict[Parameter, tuple[Bucket, int]] = {}  # parameter -> (codec bucket, offset in its buffer)
        self._arrivals: list[tuple[Parameter, torch.Tensor]] = []  # this step's gradients not yet delivered
        self._destinations: dict[Parameter, torch.Tensor] = {}  # this step's DDP gradient views
        self._futures: list[tuple[torch.Tensor, torch.futures.Future]] = []
        self._running: list[_Running] = []
        self._next_launch = 0
        self._agreed = False

    # -- checkpoints ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue exactly: the codec's state and the exchange step."""
        return {"codec": self.codec.state_dict(), "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._futures:
            raise RuntimeError("load_state_dict() was called in the middle of a backward pass")
        self.codec.load_state_dict(state["codec"])
        self.step = state["step"]
        self._agreed = False

    # -- the hook ------------------------------------------------------------------------------------------
    def on_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """Take DDP's bucket (see the module docstring); return the future of its mean."""
        buffer = bucket.buffer()
        if buffer.is_sparse:
            raise TypeError("hvdcomp's DDP hook needs dense gradients; sparse gradients are not supported")
        future: torch.futures.Future = torch.futures.Future()
        if not self._futures:
            self.stats.begin_step()
        self._futures.append((buffer, future))
        self._arrivals.extend(zip(bucket.parameters(), bucket.gradients()))
        try:
            in_flight = list(self._running)  # started by earlier hooks: advanced once this bucket's are on their way
            if self._plan is None and bucket.is_last():
                self._make_plan()
            if self._plan is not None:
                self._deliver()
                self._launch_ready()
            self._advance_running(in_flight, finish=False)
            if bucket.is_last():
                self._finish_step()
        except BaseException as error:
            self._abandon_step(error)
            raise
        return future

    def _make_plan(self) -> None:
        """Plan the codec buckets from the parameters DDP reduces (this first step's buckets)."""
        unknown = [p for p, _ in self._arrivals if p not in self._order]
        if unknown:
            raise RuntimeError(f"DDP reduces {len(unknown)} parameters that ddp_model.parameters() does not list")
        params = sorted({p for p, _ in self._arrivals}, key=self._order.__getitem__)
        self._plan = plan_buckets(params, self._bucket_size_mb, None)
        for codec_bucket in self._plan:
            offsets = [0, *torch.tensor(codec_bucket.sizes).cumsum(0).tolist()]
            self._home.update((p, (codec_bucket, lo)) for p, lo in zip(codec_bucket.params, offsets))

    def _deliver(self) -> None:
        copy = isinstance(self.codec, ElementwiseCodec)
        for p, grad in self._arrivals:
            home = self._home.get(p)
            if home is None:
                raise RuntimeError("DDP reduced a parameter that its first step did not; hvdcomp's codec buckets "
                                   "are planned at the first step: register the hook on the final model")
            codec_bucket, lo = home
            self._destinations[p] = grad
            if copy:
                codec_bucket.buffer[lo:lo + grad.numel()].copy_(grad.reshape(-1))
            codec_bucket.ready += 1
        self._arrivals.clear()

    def _launch_ready(self) -> None:
        """Start the complete codec buckets, in plan order."""
        plan = self._plan
        while self._next_launch < len(plan) and plan[self._next_launch].ready == len(plan[self._next_launch].params):
            codec_bucket = plan[self._next_launch]
            self._next_launch += 1
            if not self._agreed:
                self._agree_on_state()
            last = self.stats.last_step
            last.uncompressed_bytes += sum(self._destinations[p].numel() * self._destinations[p].element_size()
                                           for p in codec_bucket.params)
            started = time.perf_counter()
            grads = [self._destinations[p] for p in codec_bucket.params]
            exchange = bucket_exchange(self.codec, codec_bucket.buffer, grads, f"bucket{codec_bucket.index}",
                                       self.step, self.transport, self.hierarchical)
            running = _Running(codec_bucket, exchange)
            last.compress_s += time.perf_counter() - started
            if not self._feed(running, None):
                self._running.append(running)

    def _feed(self, running: _Running, result: torch.Tensor | None) -> bool:
        """Send ``result`` (None: start) to the exchange and start its next collective; True when it finished
        (its means are then written back)."""
        last = self.stats.last_step
        started = time.perf_counter()
        try:
            op, tensor = next(running.exchange) if result is None else running.exchange.send(result)
        except StopIteration as done:
            self._write_back(running.bucket, done.value)
            last.decompress_s += time.perf_counter() - started
            return True
        queued = time.perf_counter()
        last.compress_s += queued - started
        last.count(op, tensor, self.transport)
        running.handle = self.transport.start(op, tensor)
        last.communicate_s += time.perf_counter() - queued
        return False

    def _advance_running(self, in_flight: list[_Running], finish: bool) -> None:
        """Advance each exchange of ``in_flight``, in launch order: by one round, or to its end when ``finish`` or
        hierarchical (see the module docstring)."""
        for running in in_flight:
            done = False
            while not done:
                waited = time.perf_counter()
                result = self.transport.wait(running.handle)
                self.stats.last_step.communicate_s += time.perf_counter() - waited
                done = self._feed(running, result)
                if not (finish or self.hierarchical):
                    break
            if done:
                self._running.remove(running)

    def _write_back(self, codec_bucket: Bucket, result: Any) -> None:
        means = result.split(codec_bucket.sizes) if isinstance(result, torch.Tensor) else result
        for p, mean in zip(codec_bucket.params, means):
            destination = self._destinations[p]
            destination.copy_(mean.view(destination.shape))

    def _finish_step(self) -> None:
        while self._running:
            self._advance_running(list(self._running), finish=True)
        if self._next_launch != len(self._plan):
            raise RuntimeError("DDP reduced fewer parameters than at its first step; hvdcomp's codec buckets are "
                               "planned at the first step: register the hook on the final model")
        futures = self._futures
        self._reset_step()
        self.stats.end_step()
        self.step += 1
        for buffer, future in futures:
            future.set_result(buffer)

    def _abandon_step(self, error: BaseException) -> None:
        futures = self._futures
        self._reset_step()
        self._agreed = False
        for _, future in futures:
            if not future.done():
                future.set_exception(error)

    def _reset_step(self) -> None:
        self._futures, self._running, self._next_launch = [], [], 0
        self._arrivals.clear()
        self._destinations.clear()
        for codec_bucket in self._plan or ():
            codec_bucket.ready = 0

    def _agree_on_state(self) -> None:
        """Before the first exchange after construction or ``load_state_dict``: every worker must hold the
        same exchange step and configure the codec alike (a tag of its type, configuration, route, world
        size and codec buckets); one float64 MAX of 4 values, not counted in ``stats``."""
        codec = self.codec
        config = getattr(codec, "config", tuple)()
        tag = carrier.to_tag(stable_seed(type(codec).__name__, config, self.hierarchical, self.transport.size,
                                         [tuple(b.sizes) for b in self._plan]))
        step = float(self.step)
        request = torch.tensor([step, -step, tag, -tag], dtype=torch.float64, device=self._plan[0].buffer.device)
        seen = self.transport.collective(Op.MAX, request).tolist()
        if seen[0] != -seen[1]:
            raise RuntimeError(f"hvdcomp.ddp: the workers hold different hook states (exchange steps {int(-seen[1])} "
                               f"to {int(seen[0])}): every worker must load its own state.state_dict(), or none")
        if seen[2] != -seen[3]:
            raise RuntimeError("hvdcomp.ddp: the workers configured the hook differently (compression, its "
                               "settings, hierarchical, or the model's parameters): register it alike on every worker")
        self._agreed = True


def compression_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future:
    """The DDP communication hook: ``state``'s codec on ``bucket`` (see the module docstring)."""
    return state.on_bucket(bucket)


# DDP checks the hook's annotations as objects; this module's are strings (``from __future__ import annotations``)
compression_hook.__annotations__.update(bucket=dist.GradBucket, state=CompressionState)
compression_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]

def register(ddp_model: DistributedDataParallel, compression: Any, process_group: Any = None,
             hierarchical: bool | None = None, bucket_size_mb: float | None = None) -> CompressionState:
    """Register ``compression_hook`` on ``ddp_model`` (``ddp_model.register_comm_hook``) and return its state.

    Call it on every worker, in the same order as the other collective set-up (it builds a
    ``TorchDistributedTransport``), before the first backward.

    Args:
        ddp_model: a ``torch.nn.parallel.DistributedDataParallel`` model.
        compression: ``None`` (fp32 mean), a bucket codec (``hvdcomp.NoCompression()``, ``hvdcomp.FP16()``,
            ``hvdcomp.PowerSGD(rank=1)``, a ``MaxNormCodec``), or an hvdcomp compressor
            (``hvdcomp.QSGDMaxNorm(8)``, ``QSGDMaxNormMultiScale``, ``GlobalRandKMaxNorm``,
            ``GlobalRandKMaxNormMultiScale``: their codec is used). One compression object per model.
        process_group: the workers to average over (default: the DDP model's process group).
        hierarchical: ``True``: full precision inside nodes, compressed between them (needs the default
            process group and equal nodes of consecutive ranks, as torchrun places them). ``None`` or
            ``False``: over all workers (see the module docstring for why that is the default).
        bucket_size_mb: size of the codec buckets (default: the DDP model's ``bucket_cap_mb``); the codec's
            state and results depend on it, not on DDP's buckets.

    Returns:
        the ``CompressionState``: ``stats``, ``state_dict()``, ``load_state_dict()``.
    """
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(f"hvdcomp.ddp.register needs a torch.nn.parallel.DistributedDataParallel model, got "
                        f"{type(ddp_model).__name__}")
    codec = resolve_codec(compression)
    hierarchical = False if hierarchical is None else check_bool("hierarchical", hierarchical)
    if bucket_size_mb is None:
        bucket_size_mb = ddp_model.bucket_bytes_cap / 2**20
    check_real("bucket_size_mb", bucket_size_mb, low_open=True)
    group = process_group if process_group is not None else ddp_model.process_group
    transport = TorchDistributedTransport(group)
    if hierarchical and not (transport.equal_nodes and transport.size == dist.get_world_size()):
        raise ValueError(f"hierarchical=True needs the default process group and equal nodes of consecutive ranks "
                         f"(LOCAL_WORLD_SIZE {transport.local_size} of {transport.size} workers, not the same on "
                         "every node, or a smaller group); pass hierarchical=False")
    codec.bind_transport(transport)
    state = CompressionState(codec, transport, hierarchical, bucket_size_mb, list(ddp_model.parameters()))
    ddp_model.register_comm_hook(state, compression_hook)
    return state
