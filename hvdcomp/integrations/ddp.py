"""hvdcomp's bucket codecs on PyTorch DDP: ``register`` a communication hook, keep its ``CompressionState``; or
take ``hook()``'s ``(state, hook)`` for ``ddp_model.register_comm_hook(state, hook)`` (torch's convention, which
trainers such as Lightning's ``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)`` follow).

DDP owns bucketing, overlap with backward and ``no_sync``; a hook (``hook(state, bucket) -> Future``,
torch's ``ddp_comm_hooks`` contract) owns the codec and its collectives, which run over a
``TorchDistributedTransport`` (int64 lane sums, float16, MAX and all-gathers over Gloo or NCCL).

**Codec buckets, planned once.** DDP's buckets change: its first iteration puts every gradient in one
bucket (without ``find_unused_parameters``), it then rebuilds them in the order gradients became ready,
and a resumed process starts from one bucket again. Codec state keyed by DDP's buckets (error-feedback
memories, PowerSGD's ``Q``s, the order in which rounding draws are taken) would neither survive the
rebuild nor resume exactly. So the state plans its own *codec buckets* from the parameters alone
(reverse model order, split by dtype and device, ``bucket_size_mb`` each, by default the codec's ``bucket_mb``
where it has one and splits deliveries (``BucketCodec.splits_deliveries``: not ``FP16`` and ``BF16``, whose codec
buckets are DDP's own), else DDP's ``bucket_cap_mb``, and cut where DDP's rebuilt buckets will be cut, by DDP's size
rule and caps, so that none waits for two of them), and DDP's buckets only deliver gradients to them:

1. each DDP bucket's hook records its gradients (``bucket.parameters()`` / ``bucket.gradients()``), which
   are also where the means must go: DDP's bucket is the hook's until its future completes, so a codec bucket
   whose gradients lie one after another in it is exchanged there, with no copy (``Runner.launch``'s
   ``scratch``), and ``NoCompression``, ``FP16`` and ``BF16`` write the mean back into it in their last pass;
2. codec buckets start their exchange in plan order once all their gradients are in (never before a
   bucket planned earlier), so codec state and random draws follow the plan, not DDP's layout;
3. the one runner (``hvdcomp.exchange.runner``, ordering by call order) then advances the exchanges that
   earlier hooks started by one round, queued behind the new ones: the link stays busy while the hook
   copies, encodes and decodes;
4. the last bucket's hook (``bucket.is_last()``: DDP runs hooks in bucket order) finishes every
   exchange, writes the means into DDP's bucket buffers and completes the step's futures.

The first synchronizing step of a process learns the parameters from DDP's buckets (every parameter
DDP reduces is in one of them each step), so its exchanges all start in its last hook; DDP sends that
step as one bucket anyway. Results therefore do not depend on the buckets DDP happens to use (only on
its caps, which cut the plan): the first step, the rebuilt steps and a resumed run exchange exactly alike.
Every worker sees the same hooks (DDP's buckets are the same on every worker), so every worker starts the
same collectives in the same order. Before the first exchange the workers agree on the codec, its settings
and the plan (``hvdcomp.exchange.state``).

**Binding.** ``register`` binds the state to its DDP model at once: the transport over the model's process group,
DDP's ``bucket_cap_mb`` and the model's parameter names. ``hook()``'s state binds when DDP first calls the hook
(every worker calls it at the same point): the transport over ``process_group`` (default: the default group), and
the parameters named by their position in that first step's buckets, alike on every worker. DDP's first step
reduces the gradients of each dtype and device in one bucket, in the model's order, so for a model of one dtype
and device the plan, and so the results, are ``register``'s (with several, its buckets may be numbered otherwise);
checkpoints load into either.

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

from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..codec.validate import check_bool, check_real
from ..exchange.plan import Bucket, Delivery, plan_buckets
from ..exchange.runner import Runner
from ..exchange.state import ExchangeState, ExchangeStateView
from ..transport.torch_distributed import TorchDistributedTransport
from .resolve import resolve_codec, resolve_warmup

Parameter = torch.nn.Parameter
DOOR = "hvdcomp.ddp"
DDP_BUCKET_CAP_MB = 25.0  # DistributedDataParallel's default bucket_cap_mb
DDP_FIRST_BUCKET_MB = 1.0  # and the cap of its first bucket with the default bucket_cap_mb


class CompressionState(ExchangeStateView):
    """What the hook keeps between steps (see the module docstring); built by ``register`` or ``hook``.

    ``stats``: ``hvdcomp.exchange.Statistics`` (bytes intra-/inter-node, uncompressed, seconds) per
    synchronizing step and in total. ``state_dict()`` / ``load_state_dict()``: the exchange state
    (``hvdcomp.exchange.state.ExchangeState``); each worker saves and loads its own (memories differ per
    worker), and every worker must load one or none (checked, on every worker, at the next exchange).
    """

    __slots__ = ("transport", "_state", "_runner", "_hierarchical", "_group", "_bucket_size_mb", "_names", "_home",
                 "_arrivals", "_destinations", "_futures", "_ready", "_next_launch", "_pending_load", "_delivery")

    def __init__(self, state: ExchangeState, hierarchical: bool, process_group: Any, bucket_size_mb: float,
                 delivery: Delivery, names: dict[Parameter, str] | None) -> None:
        self.transport: TorchDistributedTransport | None = None  # bind()
        self._state = state
        self._runner: Runner | None = None
        self._hierarchical = hierarchical
        self._group = process_group  # None: the default group
        self._bucket_size_mb = bucket_size_mb
        self._delivery = delivery  # DDP's bucket caps, which no codec bucket spans
        self._names = names  # the model's parameters in its order, named alike on every worker; None: by position
        self._home: dict[Parameter, Bucket] = {}
        self._arrivals: list[tuple[Parameter, torch.Tensor]] = []  # this step's gradients not yet delivered
        self._destinations: dict[Parameter, torch.Tensor] = {}  # this step's DDP gradient views
        self._futures: list[tuple[torch.Tensor, torch.futures.Future]] = []
        self._ready: dict[Bucket, int] = {}
        self._next_launch = 0
        self._pending_load: dict[str, Any] | None = None  # loaded before bind(): applied there

    def bind(self) -> None:
        """Build the transport over the process group (collective: every worker binds at the same point), bind the
        codec to it and apply a state loaded before. ``register`` calls it; ``hook``'s state at its first call."""
        transport = TorchDistributedTransport(self._group)
        if self._hierarchical and not (transport.equal_nodes and transport.size == dist.get_world_size()):
            raise ValueError(f"hierarchical=True needs the default process group and equal nodes of consecutive "
                             f"ranks (LOCAL_WORLD_SIZE {transport.local_size} of {transport.size} workers, not the "
                             "same on every node, or a smaller group); pass hierarchical=False")
        self._state.codec.bind_transport(transport)
        self.transport = transport
        self._runner = Runner(transport, self._state.stats, "hvdcomp.ddp", self._state, self._hierarchical)
        if self._pending_load is not None:
            self._state.load_state_dict(self._pending_load, transport)
            self._pending_load = None

    def _world_size(self) -> int:
        return self.transport.size if self.transport is not None else dist.get_world_size(self._group)

    # -- checkpoints ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue exactly (``ExchangeState.state_dict``)."""
        if self._pending_load is not None:
            return self._pending_load
        return self._state.state_dict(self._world_size())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load ``state_dict()``'s output; ``ValueError`` before anything changes if it does not fit. Before the
        state is bound (``hook()``'s, before its first call), it is applied when it binds."""
        if self._futures:
            raise RuntimeError("load_state_dict() was called in the middle of a backward pass")
        self._state.check_state(state, self._world_size())
        if self.transport is None:
            self._pending_load = state
        else:
            self._state.load_state_dict(state, self.transport)

    # -- the hook ------------------------------------------------------------------------------------------
    def on_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """Take DDP's bucket (see the module docstring); return the future of its mean."""
        buffer = bucket.buffer()
        if buffer.is_sparse:
            raise TypeError("hvdcomp's DDP hook needs dense gradients; sparse gradients are not supported")
        if self.transport is None:
            self.bind()
        future: torch.futures.Future = torch.futures.Future()
        self._futures.append((buffer, future))
        self._arrivals.extend(zip(bucket.parameters(), bucket.gradients()))
        try:
            if not self._state.plan and bucket.is_last():
                self._make_plan()
            if self._state.plan:
                self._deliver()
                self._launch_ready()
            self._runner.progress()
            if bucket.is_last():
                self._finish_step()
        except BaseException as error:
            self._abandon_step(error)
            raise
        return future

    def _make_plan(self) -> None:
        """Plan the codec buckets from the parameters DDP reduces (this first step's buckets)."""
        if self._names is None:  # by position in the first step's buckets, the same on every worker
            params = list(dict.fromkeys(p for p, _ in self._arrivals))
            names = {p: f"parameter{i}" for i, p in enumerate(params)}
        else:
            unknown = [p for p, _ in self._arrivals if p not in self._names]
            if unknown:
                raise RuntimeError(f"DDP reduces {len(unknown)} parameters that ddp_model.parameters() does not list")
            order = {p: i for i, p in enumerate(self._names)}
            params, names = sorted({p for p, _ in self._arrivals}, key=order.__getitem__), self._names
        self._state.plan = plan_buckets(params, names, self._bucket_size_mb, delivery=self._delivery)
        self._home = {p: b for b in self._state.plan for p in b.params}
        self._ready = {b: 0 for b in self._state.plan}

    def _deliver(self) -> None:
        for p, grad in self._arrivals:
            home = self._home.get(p)
            if home is None:
                raise RuntimeError("DDP reduced a parameter that its first step did not; hvdcomp's codec buckets "
                                   "are planned at the first step: register the hook on the final model")
            self._destinations[p] = grad
            self._ready[home] += 1
        self._arrivals.clear()

    def _launch_ready(self) -> None:
        """Start the complete codec buckets, in plan order."""
        plan = self._state.plan
        while self._next_launch < len(plan):
            codec_bucket = plan[self._next_launch]
            if self._ready[codec_bucket] < len(codec_bucket.params):
                return
            self._next_launch += 1
            self._runner.launch(codec_bucket, [self._destinations[p] for p in codec_bucket.params], self._write_back,
                                scratch=True)

    def _write_back(self, codec_bucket: Bucket, means: list[torch.Tensor], keep: bool) -> None:
        for p, mean in zip(codec_bucket.params, means):
            destination = self._destinations[p]
            if mean.data_ptr() != destination.data_ptr():  # else the mean is already there (summed in place)
                destination.copy_(mean)

    def _finish_step(self) -> None:
        self._runner.finish()
        if self._next_launch != len(self._state.plan):
            raise RuntimeError("DDP reduced fewer parameters than at its first step; hvdcomp's codec buckets are "
                               "planned at the first step: register the hook on the final model")
        futures = self._futures
        self._reset_step()
        for buffer, future in futures:
            future.set_result(buffer)

    def _abandon_step(self, error: BaseException) -> None:
        futures = self._futures
        self._runner.drop()
        self._reset_step()
        self._state.agreed = False
        for _, future in futures:
            if not future.done():
                future.set_exception(error)

    def _reset_step(self) -> None:
        self._futures, self._next_launch = [], 0
        self._arrivals.clear()
        self._destinations.clear()
        for codec_bucket in self._ready:
            self._ready[codec_bucket] = 0


def compression_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future:
    """The DDP communication hook: ``state``'s codec on ``bucket`` (see the module docstring)."""
    return state.on_bucket(bucket)


# DDP checks the hook's annotations as objects; this module's are strings (``from __future__ import annotations``)
compression_hook.__annotations__.update(bucket=dist.GradBucket, state=CompressionState)
compression_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]


def _ddp_delivery(cap_mb: float) -> Delivery:
    """DDP's buckets for ``bucket_cap_mb`` = ``cap_mb``: its first is 1 MiB under the default cap, else ``cap_mb``. A
    25 MiB cap given explicitly makes DDP's first bucket 25 MiB; planning it as 1 MiB only adds one cut inside it."""
    return Delivery(DDP_FIRST_BUCKET_MB if cap_mb == DDP_BUCKET_CAP_MB else cap_mb, cap_mb)


def _state(compression: Any, process_group: Any, hierarchical: bool | None, bucket_size_mb: float | None,
           delivery: Delivery, names: dict[Parameter, str] | None) -> CompressionState:
    """An unbound ``CompressionState`` for ``compression``; every argument checked, on every worker alike."""
    codec = resolve_codec(compression)
    if bucket_size_mb is None:
        bucket_size_mb = codec.bucket_mb if codec.bucket_mb and codec.splits_deliveries else delivery.rest_mb
    hierarchical = False if hierarchical is None else check_bool("hierarchical", hierarchical)
    check_real("bucket_size_mb", bucket_size_mb, low_open=True)
    exchange_state = ExchangeState(codec, DOOR, {"hierarchical": hierarchical}, resolve_warmup(compression, None))
    return CompressionState(exchange_state, hierarchical, process_group, bucket_size_mb, delivery, names)


def register(ddp_model: DistributedDataParallel, compression: Any, process_group: Any = None,
             hierarchical: bool | None = None, bucket_size_mb: float | None = None) -> CompressionState:
    """Register ``compression_hook`` on ``ddp_model`` (``ddp_model.register_comm_hook``) and return its state.

    Call it on every worker, in the same order as the other collective set-up (it builds a
    ``TorchDistributedTransport``), before the first backward.

    Args:
        ddp_model: a ``torch.nn.parallel.DistributedDataParallel`` model.
        compression: ``None`` (fp32 mean), a bucket codec (``hvdcomp.NoCompression()``, ``hvdcomp.FP16()``,
            ``hvdcomp.BF16()``, ``hvdcomp.PowerSGD(rank=1)``, a ``MaxNormCodec``), or an hvdcomp compressor
            (``hvdcomp.QSGDMaxNorm(8)``, ``QSGDMaxNormMultiScale``, ``GlobalRandKMaxNorm``,
            ``GlobalRandKMaxNormMultiScale``: their codec is used). One compression object per model. Gradients
            may be float32, float16 or bfloat16 (codecs compute in float32); each mean is written back in its
            gradient's dtype.
        process_group: the workers to average over (default: the DDP model's process group).
        hierarchical: ``True``: full precision inside nodes, compressed between them (needs the default
            process group and equal nodes of consecutive ranks, as torchrun places them). ``None`` or
            ``False``: over all workers (see the module docstring for why that is the default).
        bucket_size_mb: size of the codec buckets (default: the codec's ``bucket_mb`` where it splits deliveries,
            8 for ``QSGDMaxNorm``'s scale agreed ahead, else the DDP model's ``bucket_cap_mb``: ``FP16`` and
            ``BF16`` exchange DDP's own buckets), cut where the DDP model's caps will cut its buckets; the codec's
            state and results depend on these, not on the buckets DDP uses in a step.

    Returns:
        the ``CompressionState``: ``stats``, ``state_dict()``, ``load_state_dict()``.
    """
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(f"hvdcomp.ddp.register needs a torch.nn.parallel.DistributedDataParallel model, got "
                        f"{type(ddp_model).__name__}")
    group = process_group if process_group is not None else ddp_model.process_group
    names = {p: name for name, p in ddp_model.named_parameters()}  # the model's order
    state = _state(compression, group, hierarchical, bucket_size_mb, _ddp_delivery(ddp_model.bucket_bytes_cap / 2**20),
                   names)
    state.bind()
    ddp_model.register_comm_hook(state, compression_hook)
    return state


def hook(compression: Any, process_group: Any = None, hierarchical: bool | None = None,
         bucket_size_mb: float | None = None, bucket_cap_mb: float | None = None) -> tuple[CompressionState, Any]:
    """``(state, compression_hook)`` for ``ddp_model.register_comm_hook(state, hook)``, torch's convention, e.g.
    ``lightning.pytorch.strategies.DDPStrategy(ddp_comm_state=state, ddp_comm_hook=hook)``.

    The state binds when DDP first calls the hook (see the module docstring); from then on it is ``register``'s.
    Arguments are checked here, on every worker alike.

    Args:
        compression: as for ``register``.
        process_group: the workers to average over: the DDP model's (default: the default process group).
        hierarchical: as for ``register``.
        bucket_size_mb: size of the codec buckets (default: as for ``register``, with ``bucket_cap_mb`` for the
            DDP model's).
        bucket_cap_mb: the ``bucket_cap_mb`` the DDP model was built with, where it was given one (default: DDP's
            default caps, 1 MiB for its first bucket, then 25 MiB). The codec buckets are cut where these caps cut
            DDP's buckets, as ``register`` cuts them from the model's caps; with other caps than the model's the
            results are still the same on every worker, but a codec bucket may wait for two of DDP's buckets.

    Returns:
        the ``CompressionState`` (``stats``, ``state_dict()``, ``load_state_dict()``) and ``compression_hook``.
    """
    if bucket_cap_mb is not None:
        check_real("bucket_cap_mb", bucket_cap_mb, low_open=True)
    delivery = _ddp_delivery(DDP_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb)
    return _state(compression, process_group, hierarchical, bucket_size_mb, delivery, None), compression_hook
