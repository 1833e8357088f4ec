"""``hvdcomp.DistributedOptimizer``: bucketed, overlapped, optionally hierarchical compressed exchange.

A drop-in for ``hvd.DistributedOptimizer``: the same arguments in the same order (``groups`` and
``num_groups`` choose the buckets; ``sparse_as_dense`` as in Horovod), ``synchronize()``,
``skip_synchronize()``, ``_parameter_names``, the same warnings and errors. Gradients are grouped into
buckets (``buckets``). When every gradient of a bucket has been accumulated
``backward_passes_per_step`` times, the bucket's exchange starts asynchronously; its later rounds are
started as earlier ones complete, from later gradient hooks, and ``synchronize()`` / ``step()`` finish
the rest: a bucket whose gradients never came on this rank (a parameter unused in this step) is
exchanged with zeros, as Horovod does. Over Horovod (collectives matched by name) ``synchronize()``
advances whichever bucket's collective has completed, so bucket k+1 encodes while bucket k is on the
wire, and blocks only on the lowest bucket still in flight (which every rank reaches: no deadlock). Over
a blocking transport (``MPITransport``, torch.distributed) nothing starts in the hooks and buckets finish
one by one in bucket order, so every rank runs its collectives in that one order.
Max-norm compressors exchange one small MAX vector (per-tensor scales) per bucket and move their packed
levels as one int64 SUM; results are decoded to the mean (``op=hvd.Average``) or the sum (``op=hvd.Sum``).

With ``hierarchical=True`` the bucket is summed at full precision inside each node and only the
compressed shards cross nodes (see ``hvdcomp.exchange.hierarchy``); ``hierarchical=None`` follows
Horovod's ``HOROVOD_HIERARCHICAL_ALLREDUCE`` (``launch``). ``transport`` may be an ``MPITransport``
(mpi4py) instead of Horovod. ``warmup_steps``: the first steps exchange exact float32 means (``warmup``).

Collective names carry a prefix from the optimizer's parameter names and its ordinal among optimizers
over the same names in this process, so several optimizers (a backbone's and a head's) can exchange
in one step. ``close()`` (or leaving a ``with`` block, or dropping the optimizer) removes the gradient
hooks. On a rank outside ``process_set`` the optimizer is the wrapped one, as in Horovod.

``optimizer.stats`` (``hvdcomp.exchange.stats.Statistics``) holds bytes and seconds per step and in
total. ``state_dict()`` carries the codec's state; loading it at another world size, or Horovod elastic
re-synchronising after a membership change, resets the codec state only (``resume``).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterable
from contextlib import contextmanager
from typing import Any

import horovod.torch as hvd
import torch

from ..codec.validate import check_int, check_real
from ..exchange.bucket import ElementwiseCodec
from ..exchange.hierarchy import bucket_exchange
from ..exchange.protocol import Exchange, Op, Transport
from ..exchange.stats import Statistics
from ..transport.horovod import HorovodTransport
from .buckets import Bucket, check_groups, collective_prefix, parameter_names, plan_buckets
from .launch import check_hierarchical, resolve_hierarchical
from .parity import (
    STEP_AFTER_SYNCHRONIZE,
    attach_weak_hooks,
    called_by_broadcast_optimizer_state,
    claim_codec,
    remove_hooks,
)
from .resolve import resolve_codec
from .resume import agree_on_state, exchange_state, load_exchange_state, remember_fresh_codec
from .warmup import WARMUP_CODEC, resolve_warmup

DEFAULT_BUCKET_MB = 25.0


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
        self._parameter_names = parameter_names(named_parameters, self.param_groups)
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
        self._warmup_steps = resolve_warmup(warmup_steps, compression)
        self._synchronized = False
        self._should_synchronize = True
        self._fresh_step = True
        self._inflight: list[Bucket] = []
        self._exchange_step = 0
        self._hooks: list[Any] = []
        self._codec = None
        self.stats = Statistics()
        self._agreed = self._resync = False
        trainable = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        # On every rank, inside the process set or not, so that the names agree everywhere.
        self._prefix = collective_prefix([self._parameter_names[p] for p in trainable],
                                         "transport" if transport is not None else process_set.process_set_id)
        self._included = transport is not None or process_set.included()
        if not self._included:  # as Horovod: a rank outside the process set trains locally
            return
        self._transport = transport if transport is not None else HorovodTransport(process_set)
        per_node = 1 if self._hierarchical else self._transport.local_size  # workers sharing an uplink in an exchange
        self._codec = claim_codec(resolve_codec(compression, exchange, per_node), self)
        self._codec.bind_transport(self._transport)
        remember_fresh_codec(self)
        if self._hierarchical:
            check_hierarchical(self._transport)
        if bucket_size_mb is None:
            bucket_size_mb = self._codec.bucket_mb or DEFAULT_BUCKET_MB
        self._buckets = plan_buckets(trainable, bucket_size_mb, groups)
        self._bucket_of = {p: b for b in self._buckets for p in b.params}
        self._counts = {p: 0 for p in trainable}
        self._hooks = attach_weak_hooks(self, trainable)

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

    # -- gradient hooks and progress ---------------------------------------------------------------
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
            bucket.ready += 1
            if bucket.ready == len(bucket.params) and not self._transport.blocking:
                self._launch(bucket)
        self._progress()

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

    def _bucket_exchange(self, bucket: Bucket) -> Exchange:
        key, step = f"bucket{bucket.index}", self._exchange_step
        grads = [self._dense_grad(p) for p in bucket.params]
        codec = self._codec if step >= self._warmup_steps else WARMUP_CODEC
        bucket.result_kept = isinstance(codec, ElementwiseCodec) and not codec.reuses_result
        if isinstance(codec, ElementwiseCodec):
            pieces = bucket.buffer.split(bucket.sizes)  # the flat bucket, one view per gradient
            for grad, piece in zip(grads, pieces):
                piece.copy_(grad.reshape(-1)) if grad is not None else piece.zero_()
            grads = list(pieces)
        else:
            grads = [g if g is not None else torch.zeros_like(p) for g, p in zip(grads, bucket.params)]
        return bucket_exchange(codec, bucket.buffer, grads, key, step, self._transport, self._hierarchical)

    def _launch(self, bucket: Bucket) -> None:
        if self._fresh_step:
            self.stats.begin_step()
            self._fresh_step = False
        if not self._agreed:
            agree_on_state(self)
        started = time.perf_counter()
        bucket.launched = True
        bucket.exchange = self._bucket_exchange(bucket)
        op, tensor = next(bucket.exchange)
        self.stats.last_step.compress_s += time.perf_counter() - started
        self.stats.last_step.uncompressed_bytes += sum(p.numel() * p.element_size() for p in bucket.params)
        self._start(bucket, op, tensor)
        self._inflight.append(bucket)

    def _start(self, bucket: Bucket, op: Op, tensor: torch.Tensor) -> None:
        self.stats.last_step.count(op, tensor, self._transport)
        started = time.perf_counter()
        # Name by scope: workers of one node (or one cross-node group) run the same sequence of their
        # scope's collectives, even where a shard leaves one worker fewer rounds of another scope.
        count = bucket.rounds.get(op.scope, 0)
        bucket.rounds[op.scope] = count + 1
        name = f"{self._prefix}.bucket{bucket.index}.{op.scope.value}{count}.{op.name.lower()}"
        bucket.handle = self._transport.start(op, tensor, name)
        self.stats.last_step.communicate_s += time.perf_counter() - started

    def _advance(self, bucket: Bucket) -> bool:
        """Take the bucket's finished collective and start its next one; True when the exchange is done."""
        started = time.perf_counter()
        result = self._transport.wait(bucket.handle)
        waited = time.perf_counter()
        self.stats.last_step.communicate_s += waited - started
        try:
            op, tensor = bucket.exchange.send(result)
        except StopIteration as done:
            self._write_back(bucket, done.value)
            self.stats.last_step.decompress_s += time.perf_counter() - waited
            bucket.exchange = bucket.handle = None
            bucket.rounds.clear()
            return True
        self.stats.last_step.compress_s += time.perf_counter() - waited
        self._start(bucket, op, tensor)
        return False

    def _progress(self) -> None:
        """Advance in-flight buckets whose collective has completed, without blocking."""
        poll = getattr(self._transport, "poll", None)
        for bucket in list(self._inflight):
            while poll is not None and poll(bucket.handle):
                if self._advance(bucket):
                    self._inflight.remove(bucket)
                    break

    def _write_back(self, bucket: Bucket, result: Any) -> None:
        """Each gradient <- its mean: a view of ``result`` itself (no copy) where the codec never writes it again,
        it is not the bucket's own buffer, and the parameter is a contiguous float32 one; else a copy."""
        means = result.split(bucket.sizes) if isinstance(result, torch.Tensor) else result
        keep = bucket.result_kept and result.untyped_storage().data_ptr() != bucket.buffer.untyped_storage().data_ptr()
        for p, mean in zip(bucket.params, means):
            if p in self._sparse:
                continue
            if p.grad is not None and p.grad.is_sparse:  # back to sparse, as Horovod returns it
                p.grad = mean.view(p.shape).to(p.dtype).to_sparse()
            elif keep and p.dtype == mean.dtype and p.is_contiguous():
                p.grad = mean.view(p.shape)
            else:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.copy_(mean.view(p.shape))
            if not self._average:
                p.grad.mul_(self._transport.size)

    # -- the Horovod optimizer interface ---------------------------------------------------------
    def synchronize(self) -> None:
        """Finish every bucket's exchange; gradients then hold the mean (or sum) over the workers.

        A bucket not yet started here (gradients missing on this rank count as zeros) starts first. Over
        a transport that matches collectives by name, buckets advance as their collectives complete (the
        module docstring); otherwise each finishes in bucket order, the same on every rank."""
        if not self._included:
            self._synchronized = True
            return
        for bucket in self._buckets:
            if not bucket.launched:
                self._launch(bucket)
        pending = sorted(self._inflight, key=lambda b: b.index)
        poll = None if self._transport.blocking else self._transport.poll
        while pending:  # the first bucket whose collective completed, else (blocking on it) the lowest
            bucket = next((b for b in pending if poll(b.handle)), pending[0]) if poll else pending[0]
            if self._advance(bucket):
                pending.remove(bucket)
        self._inflight.clear()
        for p, handle in self._sparse.items():
            p.grad = handle()  # Horovod's sparse all-reduce returns the reduced sparse gradient
        self._sparse.clear()
        for bucket in self._buckets:
            bucket.ready, bucket.launched = 0, False
        for p in self._counts:
            self._counts[p] = 0
        self.stats.end_step()
        self._exchange_step += 1
        self._synchronized = True
        self._fresh_step = True

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
        return dict(super(self.__class__, self).state_dict(), hvdcomp=exchange_state(self))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        load_exchange_state(self, state_dict, super(self.__class__, self).load_state_dict)


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
            variance; ``hvdcomp.exchange.two_stage``) or ``"auto"`` (the cost model's pick per bucket).

    ``close()`` (or a ``with`` block) detaches the optimizer from the parameters' gradient hooks.
    """
    # (Birder refuses to be subclassed into a wrapper like this: it exchanges its own updates.)
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, num_groups, groups, sparse_as_dense, process_set, bucket_size_mb,
               hierarchical, transport, exchange, warmup_steps)
