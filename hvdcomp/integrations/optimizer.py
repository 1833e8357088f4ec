"""``hvdcomp.DistributedOptimizer``: bucketed, overlapped, optionally hierarchical compressed exchange.

A drop-in for ``hvd.DistributedOptimizer`` (same call shape, ``synchronize()``, ``skip_synchronize()``):
gradients are grouped into buckets (by dtype and device, about ``bucket_size_mb`` each, in reverse
parameter order, the order backward produces them). When every gradient of a bucket has been
accumulated ``backward_passes_per_step`` times, the bucket's exchange starts asynchronously; its later
rounds are started as earlier ones complete, from later gradient hooks, and ``synchronize()`` /
``step()`` wait for what is left. Max-norm compressors exchange one small MAX vector (per-tensor
scales) per bucket and move their packed levels as one int64 SUM; results are decoded to the mean
(``op=hvd.Average``) or the sum (``op=hvd.Sum``).

With ``hierarchical=True`` the bucket is summed at full precision inside each node and only the
compressed shards cross nodes (see ``hvdcomp.exchange.hierarchy``); ``transport`` may be an ``MPITransport`` (mpi4py)
instead of Horovod. Horovod's own ``HOROVOD_HIERARCHICAL_ALLREDUCE`` affects only NCCL builds; it is
passed through untouched and a warning says when it cannot take effect.

``optimizer.stats`` (``hvdcomp.exchange.stats.Statistics``) holds bytes and seconds per step and in
total. ``state_dict()`` carries the codec's state.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import horovod.torch as hvd
import torch

from ..codec.validate import check_int, check_real
from ..exchange.bucket import ElementwiseCodec
from ..exchange.hierarchy import hierarchical_elementwise, hierarchical_tensors
from ..exchange.protocol import Exchange, Op, Scope, Transport
from ..exchange.stats import Statistics
from ..transport.horovod import HorovodTransport
from .compressors import bucket_codec

DEFAULT_BUCKET_MB = 25.0


@dataclass(eq=False)
class _Bucket:
    index: int
    params: list[torch.nn.Parameter]
    dtype: torch.dtype
    buffer: torch.Tensor  # persistent float32 [numel]: the bucket's gradients, concatenated
    ready: int = 0
    exchange: Exchange | None = None
    handle: Any = None
    rounds: dict[Scope, int] = field(default_factory=dict)  # collectives started per scope this step

    @property
    def sizes(self) -> list[int]:
        return [p.numel() for p in self.params]


def _check_named_parameters(named_parameters: Any, params: list[torch.nn.Parameter]) -> dict[torch.nn.Parameter, str]:
    if named_parameters is None:
        return {p: f"allreduce.noname.{i}" for i, p in enumerate(params)}
    named = list(named_parameters)
    if any(not isinstance(item, tuple) or len(item) != 2 or not isinstance(item[0], str) for item in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), usually produced by "
                         "model.named_parameters().")
    names = [name for name, _ in named]
    if len(set(names)) != len(names):
        dups = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: {', '.join(dups)}")
    in_optimizer = {id(p) for p in params}
    strangers = [name for name, p in named if id(p) not in in_optimizer]
    if strangers:
        raise ValueError(f"named_parameters names parameters that the optimizer does not update: {strangers[:5]}")
    by_param = {p: name for name, p in named}
    unnamed = [p for p in params if p not in by_param]
    if unnamed:
        raise ValueError(f"named_parameters was specified, but {len(unnamed)} of the optimizer's parameters "
                         "were not named")
    return by_param


class _DistributedOptimizer(torch.optim.Optimizer):
    def __init__(
        self,
        params: Any,
        named_parameters: Any,
        compression: Any,
        backward_passes_per_step: int,
        op: Any,
        gradient_predivide_factor: float,
        process_set: hvd.ProcessSet,
        bucket_size_mb: float,
        hierarchical: bool,
        transport: Transport | None,
    ) -> None:
        super(self.__class__, self).__init__(params)
        all_params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        self._names = _check_named_parameters(named_parameters, all_params)
        check_int("backward_passes_per_step", backward_passes_per_step, 1)
        if op not in (hvd.Average, hvd.Sum):
            raise ValueError("hvdcomp.DistributedOptimizer supports op=hvd.Average and op=hvd.Sum")
        if gradient_predivide_factor != 1.0:
            raise ValueError("gradient_predivide_factor is not supported: hvdcomp codecs average after decoding, "
                             "so there is no low-precision sum to protect from overflow")
        check_real("bucket_size_mb", bucket_size_mb, low_open=True)
        self._transport = transport if transport is not None else HorovodTransport(process_set)
        if transport is None and not process_set.included():
            raise ValueError("this rank is not in the process set given to DistributedOptimizer")
        self._codec = bucket_codec(compression)
        self._codec.bind_rank(self._transport.rank)
        self._passes = backward_passes_per_step
        self._average = op == hvd.Average
        self._hierarchical = hierarchical
        if hierarchical and self._transport.local_size * self._transport.cross_size != self._transport.size:
            raise ValueError("hierarchical=True needs equal nodes covering all workers (local_size * cross_size "
                             "== size); use the global process set")
        _warn_about_horovod_hierarchy()
        self._buckets = self._make_buckets(all_params, bucket_size_mb)
        self._bucket_of = {p: b for b in self._buckets for p in b.params}
        self._counts = {p: 0 for p in all_params}
        self._inflight: list[_Bucket] = []
        self._exchange_step = 0
        self._synchronized = False
        self._should_synchronize = True
        self._fresh_step = True
        self.stats = Statistics()
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_gradient) for p in all_params]

    # -- construction ----------------------------------------------------------------------------
    def _make_buckets(self, params: list[torch.nn.Parameter], bucket_size_mb: float) -> list[_Bucket]:
        limit = bucket_size_mb * 2**20
        open_buckets: dict[tuple, tuple[list[torch.nn.Parameter], int]] = {}
        groups: list[list[torch.nn.Parameter]] = []
        for p in reversed(params):  # backward produces gradients roughly in reverse order
            kind = (p.dtype, p.device)
            current, nbytes = open_buckets.get(kind, ([], 0))
            size = p.numel() * p.element_size()
            if current and nbytes + size > limit:
                groups.append(current)
                current, nbytes = [], 0
            current.append(p)
            open_buckets[kind] = (current, nbytes + size)
        groups.extend(g for g, _ in open_buckets.values() if g)
        return [_Bucket(i, g, g[0].dtype, torch.zeros(sum(p.numel() for p in g), device=g[0].device))
                for i, g in enumerate(groups)]

    # -- gradient hooks and progress ---------------------------------------------------------------
    def _on_gradient(self, p: torch.nn.Parameter) -> None:
        bucket = self._bucket_of[p]
        if p.grad is not None and p.grad.is_sparse:
            raise TypeError(f"hvdcomp.DistributedOptimizer needs dense gradients; {self._names[p]} is sparse")
        if p.grad is not None and p.grad.dtype != bucket.dtype:
            raise TypeError(f"gradient of {self._names[p]} is {p.grad.dtype} but its bucket holds {bucket.dtype}; "
                            "build the DistributedOptimizer after changing the model's dtype")
        self._counts[p] += 1
        if self._counts[p] > self._passes:
            raise AssertionError("Gradients were computed more than backward_passes_per_step times before call to "
                                 "step(). Increase backward_passes_per_step to accumulate gradients locally.")
        if self._counts[p] == self._passes:
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                self._launch(bucket)
        self._progress()

    def _bucket_exchange(self, bucket: _Bucket) -> Exchange:
        t = self._transport
        key, step = f"bucket{bucket.index}", self._exchange_step
        if isinstance(self._codec, ElementwiseCodec):
            for p, piece in zip(bucket.params, bucket.buffer.split(bucket.sizes)):
                piece.copy_(p.grad.reshape(-1)) if p.grad is not None else piece.zero_()
            if self._hierarchical:
                def shard(x: torch.Tensor, segments: list[int], shard_key: object, size: int) -> Exchange:
                    return self._codec.exchange(x, segments, shard_key, step, size)

                return hierarchical_elementwise(shard, bucket.buffer, bucket.sizes, key, t.local_size, t.local_rank,
                                         t.cross_size)
            return self._codec.exchange(bucket.buffer, bucket.sizes, key, step, t.size)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
        if self._hierarchical:
            def tensors(xs: list[torch.Tensor], shard_key: object, size: int) -> Exchange:
                return self._codec.exchange(xs, shard_key, step, size)

            return hierarchical_tensors(tensors, grads, key, t.local_size, t.local_rank, t.cross_size)
        return self._codec.exchange(grads, key, step, t.size)

    def _launch(self, bucket: _Bucket) -> None:
        if self._fresh_step:
            self.stats.begin_step()
            self._fresh_step = False
        started = time.perf_counter()
        bucket.exchange = self._bucket_exchange(bucket)
        op, tensor = next(bucket.exchange)
        self.stats.last_step.compress_s += time.perf_counter() - started
        self.stats.last_step.uncompressed_bytes += sum(p.numel() * p.element_size() for p in bucket.params)
        self._start(bucket, op, tensor)
        self._inflight.append(bucket)

    def _start(self, bucket: _Bucket, op: Op, tensor: torch.Tensor) -> None:
        self.stats.last_step.count(op, tensor, self._transport)
        started = time.perf_counter()
        # Name by scope: workers of one node (or one cross-node group) run the same sequence of their
        # scope's collectives, even where a shard leaves one worker fewer rounds of another scope.
        count = bucket.rounds.get(op.scope, 0)
        bucket.rounds[op.scope] = count + 1
        name = f"hvdcomp.bucket{bucket.index}.{op.scope.value}{count}.{op.name.lower()}"
        bucket.handle = self._transport.start(op, tensor, name)
        self.stats.last_step.communicate_s += time.perf_counter() - started

    def _advance(self, bucket: _Bucket) -> bool:
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

    def _write_back(self, bucket: _Bucket, result: Any) -> None:
        means = result.split(bucket.sizes) if isinstance(result, torch.Tensor) else result
        for p, mean in zip(bucket.params, means):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.copy_(mean.view(p.shape))
            if not self._average:
                p.grad.mul_(self._transport.size)

    # -- the Horovod optimizer interface ---------------------------------------------------------
    def synchronize(self) -> None:
        """Finish every bucket's exchange; gradients then hold the mean (or sum) over the workers."""
        for bucket in self._buckets:
            if bucket.exchange is None and bucket.ready < len(bucket.params):
                self._launch(bucket)  # gradients missing on this worker (unused parameters) count as 0
        for bucket in self._inflight:
            while not self._advance(bucket):
                pass
        self._inflight.clear()
        for bucket in self._buckets:
            bucket.ready = 0
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
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called after optimizer.synchronize() without "
                              "optimizer.skip_synchronize(); the gradients are already synchronized and are not "
                              "exchanged again", stacklevel=2)
            else:
                self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._inflight:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited as it can cause "
                                 "a race condition.")
        return super(self.__class__, self).zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        state = super(self.__class__, self).state_dict()
        state["hvdcomp"] = {"codec": self._codec.state_dict(), "exchange_step": self._exchange_step}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        ours = state_dict.pop("hvdcomp", None)
        super(self.__class__, self).load_state_dict(state_dict)
        if ours is not None:
            self._codec.load_state_dict(ours["codec"])
            self._exchange_step = ours["exchange_step"]


def _warn_about_horovod_hierarchy() -> None:
    if os.environ.get("HOROVOD_HIERARCHICAL_ALLREDUCE", "0") not in ("", "0") and not hvd.nccl_built():
        warnings.warn("HOROVOD_HIERARCHICAL_ALLREDUCE takes effect only on NCCL (GPU) builds of Horovod; this "
                      "build has no NCCL, so it is ignored. Use hvdcomp's hierarchical=True instead.", stacklevel=3)


def DistributedOptimizer(  # noqa: N802 (named like Horovod's factory)
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
    compression: Any = None,
    backward_passes_per_step: int = 1,
    op: Any = hvd.Average,
    gradient_predivide_factor: float = 1.0,
    process_set: hvd.ProcessSet = hvd.global_process_set,
    bucket_size_mb: float = DEFAULT_BUCKET_MB,
    hierarchical: bool = False,
    transport: Transport | None = None,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` applies the mean (``op=hvd.Average``) or sum (``op=hvd.Sum``)
    over the workers of their compressed gradients.

    Args:
        compression: ``None`` / ``hvd.Compression.none`` (plain all-reduce), ``hvd.Compression.fp16``,
            an hvdcomp compressor (``QSGDMaxNorm(8)``, ...), ``NoCompression()``, ``FP16()`` or ``PowerSGD()``.
        bucket_size_mb: gradients per bucket; each bucket is exchanged as soon as it is complete.
        hierarchical: full precision inside nodes, the compressed payload only between nodes.
        transport: an ``MPITransport`` to run the exchange over mpi4py; default Horovod over
            ``process_set``.
    """
    # (Birder refuses to be subclassed into a wrapper like this: it exchanges its own updates.)
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, process_set, bucket_size_mb, hierarchical, transport)
