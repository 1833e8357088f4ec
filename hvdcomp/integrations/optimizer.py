"""``hvdcomp.DistributedOptimizer``: bucketed, overlapped, optionally hierarchical compressed exchange.

A drop-in for ``hvd.DistributedOptimizer``: the same arguments in the same order (``groups`` and
``num_groups`` choose the buckets; ``sparse_as_dense`` as in Horovod), ``synchronize()``,
``skip_synchronize()``, ``_parameter_names``, the same warnings and errors. This module is the door: it says
when a bucket is ready (every gradient of it accumulated ``backward_passes_per_step`` times) and where its
means go (``p.grad``); ``hvdcomp.exchange.runner.Runner`` schedules, names, meters and agrees, and
``hvdcomp.exchange.state.ExchangeState`` holds the codec, the exchange step and the checkpoints.

Buckets (``hvdcomp.exchange.plan``) follow the model's parameter order (``named_parameters``). Over Horovod
(collectives matched by name) a bucket's exchange starts from the gradient hook that completes it, and later
rounds advance from later hooks as collectives complete; ``synchronize()`` / ``step()`` finish the rest (a
bucket whose gradients never came on this rank, a parameter unused in this step, is exchanged with zeros, as
Horovod does). Over a transport that pairs collectives by call order (``MPITransport``, torch.distributed)
every bucket starts in ``synchronize()``, in bucket order, the same on every rank whatever its backward did.
Results are decoded to the mean (``op=hvd.Average``) or the sum (``op=hvd.Sum``); float64 gradients stay
float64 with ``NoCompression``.

With ``hierarchical=True`` the bucket is summed at full precision inside each node and only the
compressed shards cross nodes (see ``hvdcomp.exchange.hierarchy``); ``hierarchical=None`` follows
Horovod's ``HOROVOD_HIERARCHICAL_ALLREDUCE`` (``launch``). ``transport`` may be an ``MPITransport``
(mpi4py) instead of Horovod. ``warmup_steps``: the first steps exchange exact means.

Collective names carry a prefix from the optimizer's parameter names and its ordinal among optimizers
over the same names in this process, so several optimizers (a backbone's and a head's) can exchange
in one step. ``close()`` (or leaving a ``with`` block, or dropping the optimizer) removes the gradient
hooks. On a rank outside ``process_set`` the optimizer is the wrapped one, as in Horovod.

``optimizer.stats`` (``hvdcomp.exchange.stats.Statistics``) holds bytes and seconds per step and in
total. ``state_dict()`` carries the exchange state; loading it at another world size, or Horovod elastic
re-synchronising after a membership change, resets the codec state only.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from contextlib import contextmanager
from typing import Any

import horovod.torch as hvd
import torch

from ..codec.validate import check_int, check_real
from ..exchange.plan import Bucket, plan_buckets
from ..exchange.protocol import Transport
from ..exchange.runner import Runner
from ..exchange.state import ExchangeState
from ..transport._compat import called_by_broadcast_optimizer_state, called_by_elastic_sync
from ..transport.horovod import HorovodTransport
from .buckets import check_groups, collective_prefix, model_order, parameter_names
from .launch import check_hierarchical, resolve_hierarchical
from .parity import (
    STEP_AFTER_SYNCHRONIZE,
    attach_weak_hooks,
    claim_codec,
    remove_hooks,
)
from .resolve import resolve_codec, resolve_warmup

DEFAULT_BUCKET_MB = 25.0
DOOR = "hvdcomp.DistributedOptimizer"


class _DistributedOptimizer(torch.optim.Optimizer):
    def __init__(
        self,
        params: Any,
        named_parameters: Any,
        compression: Any,
        backward_passes_per_step: int,
        op: Any,
        gradient_predivide_factor: float,
        num_groups: int,
        groups: Any,
        sparse_as_dense: bool,
        process_set: hvd.ProcessSet,
        bucket_size_mb: float | None,
        hierarchical: bool | None,
        transport: Transport | None,
        exchange: str,
        warmup_steps: int | None,
    ) -> None:
        super(self.__class__, self).__init__(params)
        named = None if named_parameters is None else list(named_parameters)
        self._parameter_names = parameter_names(named, self.param_groups)
        check_int("backward_passes_per_step", backward_passes_per_step, 1)
        if op not in (hvd.Average, hvd.Sum):
            raise ValueError("hvdcomp.DistributedOptimizer supports op=hvd.Average and op=hvd.Sum")
        if gradient_predivide_factor != 1.0:
            raise ValueError("gradient_predivide_factor is not supported: hvdcomp codecs average after decoding, "
                             "so there is no low-precision sum to protect from overflow")
        if bucket_size_mb is not None:
            check_real("bucket_size_mb", bucket_size_mb, low_open=True)
        if num_groups:
            warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                          DeprecationWarning, stacklevel=3)
            groups = groups if groups is not None else check_int("num_groups", num_groups, 0)
        check_groups(groups)
        self._passes = backward_passes_per_step
        self._average = op == hvd.Average
        self._sparse_as_dense = bool(sparse_as_dense)
        self._warned_sparse = False
        self._sparse: dict[torch.nn.Parameter, Any] = {}  # Horovod's sparse all-reduces in flight
        self._hierarchical = resolve_hierarchical(hierarchical, default=False)
        self._synchronized = False
        self._should_synchronize = True
        self._hooks: list[Any] = []
        self._state: ExchangeState | None = None
        # the model's order (named_parameters), not the optimizer's: the same on every worker
        trainable = model_order([p for group in self.param_groups for p in group["params"] if p.requires_grad], named)
        # On every rank, inside the process set or not, so that the names agree everywhere.
        self._prefix = collective_prefix([self._parameter_names[p] for p in trainable],
                                         "transport" if transport is not None else process_set.process_set_id)
        self._included = transport is not None or process_set.included()
        if not self._included:  # as Horovod: a rank outside the process set trains locally
            return
        self._transport = transport if transport is not None else HorovodTransport(process_set)
        per_node = 1 if self._hierarchical else self._transport.local_size  # workers sharing an uplink in an exchange
        codec = claim_codec(resolve_codec(compression, exchange, per_node), self)
        codec.bind_transport(self._transport)
        settings = {"op": "average" if self._average else "sum", "backward_passes_per_step": self._passes,
                    "hierarchical": self._hierarchical, "exchange": exchange}
        self._state = ExchangeState(codec, DOOR, settings, resolve_warmup(compression, warmup_steps))
        if self._hierarchical:
            check_hierarchical(self._transport)
        if bucket_size_mb is None:
            bucket_size_mb = codec.bucket_mb or DEFAULT_BUCKET_MB
        self._state.plan = plan_buckets(trainable, self._parameter_names, bucket_size_mb, groups)
        self._runner = Runner(self._transport, self._state.stats, self._prefix, self._state, self._hierarchical)
        self._bucket_of = {p: b for b in self._state.plan for p in b.params}
        self._counts = {p: 0 for p in trainable}
        self._ready = {b: 0 for b in self._state.plan}  # gradients complete this step, per bucket
        self._launched: set[Bucket] = set()
        self._hooks = attach_weak_hooks(self, trainable)

    @property
    def stats(self) -> Any:
        """``hvdcomp.exchange.Statistics``: bytes and seconds of the last step and in total (``None`` on a rank
        outside the process set)."""
        return None if self._state is None else self._state.stats

    @property
    def exchange_trial(self) -> Any:
        """``exchange="auto"``'s timing of both exchanges (``hvdcomp.exchange.route.RouteTrial``: ``choice`` None
        while trying, then True where the two-stage exchange was kept; ``medians``: seconds per step of the lanes
        and of the two-stage exchange); None where the exchange is fixed or on a rank outside the process set."""
        return None if self._state is None else self._state.codec.trial

    def _accumulating(self) -> bool:
        """Whether gradients arrived since the last ``synchronize()`` (Horovod's ``_handles``)."""
        return self._included and any(self._counts.values())

    def close(self) -> None:
        """Remove the gradient hooks: this optimizer exchanges nothing more (``step()`` is then local)."""
        if self._accumulating():
            raise AssertionError("optimizer.close() was called with exchanges in flight; call optimizer.step() or "
                                 "optimizer.synchronize() first, on every rank")
        self.__exit__()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        remove_hooks(self._hooks)
        self._included = False

    # -- gradient hooks ------------------------------------------------------------------------------------------
    def _on_gradient(self, p: torch.nn.Parameter) -> None:
        bucket = self._bucket_of[p]
        if p.grad is not None and p.grad.dtype != bucket.dtype:
            raise TypeError(f"gradient of {self._parameter_names[p]} is {p.grad.dtype} but its bucket holds "
                            f"{bucket.dtype}; build the DistributedOptimizer after changing the model's dtype")
        self._counts[p] += 1
        if self._counts[p] > self._passes:
            raise AssertionError("Gradients were computed more than backward_passes_per_step times before call to "
                                 "step(). Increase backward_passes_per_step to accumulate gradients locally.")
        if self._counts[p] == self._passes:
            if p.grad is not None and p.grad.is_sparse and not self._sparse_as_dense:
                self._reduce_sparse(p)
            self._ready[bucket] += 1
            # collectives matched by name may start as soon as a bucket is complete; by call order only in
            # synchronize(), where every worker starts them in bucket order whatever its backward did
            if self._ready[bucket] == len(bucket.params) and not self._transport.blocking:
                self._launch(bucket)
        if not self._transport.blocking:
            self._runner.progress()

    def _reduce_sparse(self, p: torch.nn.Parameter) -> None:
        """``sparse_as_dense=False``: reduce a sparse gradient as Horovod does (its sparse all-reduce,
        uncompressed; every rank must produce it), or, over a transport other than Horovod, exchange it dense."""
        name = self._parameter_names[p]
        if isinstance(self._transport, HorovodTransport):
            self._sparse[p] = hvd.sparse_allreduce_async(p.grad, name=f"{self._prefix}.sparse.{name}",
                                                         op=hvd.Average if self._average else hvd.Sum,
                                                         process_set=self._transport.process_set)
        elif not self._warned_sparse:
            self._warned_sparse = True
            warnings.warn(f"hvdcomp: the sparse gradient of {name} is exchanged dense (this transport has no sparse "
                          "all-reduce); pass sparse_as_dense=True to say so", stacklevel=3)

    def _dense_grad(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        """The gradient a bucket exchanges: dense; None (zeros) where Horovod reduces it sparse."""
        if p in self._sparse:
            return None
        return p.grad.to_dense() if p.grad is not None and p.grad.is_sparse else p.grad

    def _launch(self, bucket: Bucket) -> None:
        self._launched.add(bucket)
        self._runner.launch(bucket, [self._dense_grad(p) for p in bucket.params], self._write_back)

    def _write_back(self, bucket: Bucket, means: list[torch.Tensor], keep: bool) -> None:
        """Each gradient <- its mean: the mean itself (no copy) where ``keep`` allows and the parameter is a
        contiguous one of the mean's dtype; else a copy."""
        for p, mean in zip(bucket.params, means):
            if p in self._sparse:
                continue
            if p.grad is not None and p.grad.is_sparse:  # back to sparse, as Horovod returns it
                p.grad = mean.to(p.dtype).to_sparse()
            elif keep and p.dtype == mean.dtype and p.is_contiguous():
                p.grad = mean
            else:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.copy_(mean)
            if not self._average:
                p.grad.mul_(self._transport.size)

    # -- the Horovod optimizer interface ---------------------------------------------------------
    def synchronize(self) -> None:
        """Finish every bucket's exchange; gradients then hold the mean (or sum) over the workers.

        A bucket not yet started here (gradients missing on this rank count as zeros) starts first, in bucket
        order; then the runner finishes every exchange (``hvdcomp.exchange.runner``)."""
        if not self._included:
            self._synchronized = True
            return
        for bucket in self._state.plan:
            if bucket not in self._launched:
                self._launch(bucket)
                self._runner.progress()
        self._runner.finish()
        for p, handle in self._sparse.items():
            p.grad = handle()  # Horovod's sparse all-reduce returns the reduced sparse gradient
        self._end_step()
        self._synchronized = True

    def _end_step(self) -> None:
        """Forget this step's progress (after its exchanges finished, or to drop them)."""
        self._sparse.clear()
        self._launched.clear()
        for bucket in self._ready:
            self._ready[bucket] = 0
        for p in self._counts:
            self._counts[p] = 0

    @contextmanager
    def skip_synchronize(self):
        """Call ``step()`` inside after calling ``synchronize()`` yourself (e.g. to clip gradients)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        if self._should_synchronize and not called_by_broadcast_optimizer_state():
            if self._synchronized:
                warnings.warn(STEP_AFTER_SYNCHRONIZE, stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._accumulating():
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited as it can cause "
                                 "a race condition.")
        return super(self.__class__, self).zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """Torch's state dict plus ``"hvdcomp"``: this worker's exchange state (``ExchangeState.state_dict``).
        Called by Horovod elastic's re-synchronisation (every worker, after a membership change), it first drops
        what a failed step left in flight, forgets the old world's topology and agrees again at the next step,
        adopting the highest exchange step and resetting the codec state."""
        if self._state is not None and called_by_elastic_sync():
            self._drop()
            self._transport.forget_topology()
            self._state.resync = True
        ours = None if self._state is None else self._state.state_dict(self._transport.size)
        return dict(super(self.__class__, self).state_dict(), hvdcomp=ours)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ``state_dict()``'s output (or a plain torch state dict: the exchange state stays). The hvdcomp
        part is checked first (``ExchangeState.check_state``): a state of another compressor raises
        ``ValueError`` before anything changes. Saved by another number of workers, the codec state starts
        afresh, with a warning."""
        state_dict = dict(state_dict)
        ours = state_dict.pop("hvdcomp", None)
        if ours is not None and self._state is not None:
            self._state.check_state(ours, self._transport.size)
        super(self.__class__, self).load_state_dict(state_dict)
        if self._state is None:
            return
        self._drop()
        self._state.agreed = False
        if ours is not None:
            self._state.load_state_dict(ours, self._transport)

    def _drop(self) -> None:
        """Forget a step's exchanges (after a failure, or before loading a state): nothing in flight."""
        self._runner.drop()
        self._end_step()
        self._synchronized = False


def DistributedOptimizer(  # noqa: N802 (named like Horovod's factory)
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
    compression: Any = None,
    backward_passes_per_step: int = 1,
    op: Any = hvd.Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: int | list[list[torch.Tensor]] | None = None,
    sparse_as_dense: bool = False,
    process_set: hvd.ProcessSet = hvd.global_process_set,
    bucket_size_mb: float | None = None,
    hierarchical: bool | None = None,
    transport: Transport | None = None,
    exchange: str = "lanes",
    warmup_steps: int | None = None,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` applies the mean (``op=hvd.Average``) or sum (``op=hvd.Sum``)
    over the workers of their compressed gradients. The arguments up to ``process_set`` are Horovod's,
    in Horovod's order.

    Args:
        compression: ``None`` / ``hvd.Compression.none`` (plain all-reduce), ``hvd.Compression.fp16``,
            an hvdcomp compressor (``QSGDMaxNorm(8)``, ...), or a bucket codec (``NoCompression()``,
            ``FP16()``, ``PowerSGD()``, your own ``hvdcomp.exchange.BucketCodec``).
        num_groups, groups: Horovod's grouping, applied to the buckets (see ``buckets``);
            ``num_groups`` is Horovod's deprecated spelling of an integer ``groups``.
        sparse_as_dense: ``True``: sparse gradients are densified and compressed like any gradient (they
            come back sparse); ``False``: they are reduced as Horovod reduces them (its sparse
            all-reduce, uncompressed; over ``MPITransport``, dense with a warning).
        bucket_size_mb: MiB of float32 gradients per bucket; each bucket is exchanged as soon as it is complete.
            Default: the codec's ``bucket_mb`` (8 for ``QSGDMaxNorm``'s scale agreed ahead and ``FP16``), else 25.
        hierarchical: full precision inside nodes, the compressed payload only between nodes; ``None``:
            as ``HOROVOD_HIERARCHICAL_ALLREDUCE`` says (``horovodrun --hierarchical-allreduce``), else off.
        transport: an ``MPITransport`` to run the exchange over mpi4py; default Horovod over
            ``process_set``.
        warmup_steps: the first ``warmup_steps`` steps exchange exact float32 means, the codec untouched;
            ``None``: the compressor's own ``warmup_steps`` if it has one, else 0.
        exchange: how max-norm levels travel: ``"lanes"`` (summed), ``"two_stage"`` (constant bits at any W, more
            variance; ``hvdcomp.exchange.two_stage``) or ``"auto"``: the first ``2 (EXCHANGE_TRIAL_ROUNDS + 1)`` steps
            (12) run the lanes, then the two-stage exchange, and the one whose median step was shorter on the slowest
            worker is kept (``exchange_trial``; ``hvdcomp.exchange.route``). With error feedback, the cost
            model's pick per bucket.

    ``close()`` (or a ``with`` block) detaches the optimizer from the parameters' gradient hooks.
    """
    # (Birder refuses to be subclassed into a wrapper like this: it exchanges its own updates.)
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, num_groups, groups, sparse_as_dense, process_set, bucket_size_mb,
               hierarchical, transport, exchange, warmup_steps)
