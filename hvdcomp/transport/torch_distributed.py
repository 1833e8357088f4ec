"""``TorchDistributedTransport``: collectives over torch.distributed process groups (Gloo, NCCL, ...).

``WORLD`` ops run on ``process_group`` (default: the default group). Nodes are ``local_size``
consecutive ranks (default: torchrun's ``LOCAL_WORLD_SIZE``, one node when it is unset), as torchrun
places ranks. When the nodes are equal (every rank reports the same ``local_size``, it divides the
size, and torchrun's ``LOCAL_RANK``, where set, is ``rank % local_size``) and there are several of
several workers, ``NODE`` ops run on subgroups of each node's ranks (``dist.new_subgroups``) and
``CROSS`` ops on subgroups of the ranks sharing a local rank (``dist.new_subgroups_by_enumeration``).
Both are built by the constructor, so **construction is collective**: every rank builds its
transports in the same order (one small all-gather of the node sizes, then the subgroups). A scope
of one worker (one node, or one worker per node) needs no group: its result is the tensor itself.

``start`` queues an asynchronous collective (``async_op=True``) into an output kept per collective name (reused once
nothing refers to it: ``hvdcomp.codec.recycle``) and returns a handle; ``poll`` says
whether it has completed, ``wait`` returns the result, ``collective`` is both. torch.distributed pairs
collectives by call order, not by name, so ``blocking`` is True in the sense of the ``Transport``
contract: every worker must start a group's collectives in the same order. ALLTOALL sends part ``j`` of
dim 0 to member ``j`` (``all_to_all_single``; Gloo and NCCL). SUM and MAX reduce any dtype the
backend reduces (int64 lane sums, and float16 and bfloat16 at the wire's rate on Gloo and NCCL: ``sums_float16``,
``sums_bfloat16``).
ALLGATHER concatenates along dim 0 by rank; dim 0 may differ across workers: the row counts travel first (one small
blocking all-gather), then the tensors, padded to the longest. The request's tensor is never written, but
``Op.SUM_IN_PLACE``'s: summed in place (it is contiguous) and returned, as DDP's hooks sum their buffers.
Implements ``hvdcomp.exchange.protocol.Transport``.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..codec.recycle import ResultBuffers
from ..exchange.protocol import Op, Placement, Reduction, Scope, Transport

# The last few finished works, of every transport: a Gloo worker thread drops its reference to a work
# just after completing it, and when that is the last reference, freeing the work's tensors (Python-made)
# needs the GIL. A process that exits right after its last exchange then aborts at interpreter shutdown
# ("terminate called without an active exception"). Held here, works are freed on a Python thread. Few
# (each holds its result until evicted): a worker thread releases a work long before 4 later ones finish.
_FINISHED: deque[Any] = deque(maxlen=4)


def _wait_and_hold(work: Any) -> None:
    work.wait()
    _FINISHED.append(work)


@dataclass
class _Handle:
    """An all-reduce or all-gather in flight (``work`` None: done at once, for a scope of one worker)."""

    work: Any
    result: torch.Tensor | list[torch.Tensor]
    rows: list[int] | None = None  # all-gather: rows each rank sent (the buffers are padded to the longest)
    shape: tuple[int, ...] = ()  # all-gather: the trailing shape


def _local_size_from_launcher(size: int) -> int:
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value else size


class TorchDistributedTransport(Transport):
    """Collectives over torch.distributed (see the module docstring).

    Args:
        process_group: the group of the ``WORLD`` ops (default: the default group). Hierarchical
            (``NODE`` / ``CROSS``) ops need the default group.
        local_size: workers per node (default: ``LOCAL_WORLD_SIZE`` as torchrun sets it, else one node);
            pass it to emulate nodes on one machine.
    """

    blocking = True  # collectives pair by call order (start only queues them)
    sums_float16 = True  # Gloo and NCCL reduce float16 natively (DDP's fp16 hook relies on it)
    sums_bfloat16 = True  # and bfloat16 (DDP's bf16 hook relies on it)

    def __init__(self, process_group: Any = None, local_size: int | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("call torch.distributed.init_process_group(...) before building a "
                               "TorchDistributedTransport")
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        size, rank = dist.get_world_size(self.process_group), dist.get_rank(self.process_group)
        local = _local_size_from_launcher(size) if local_size is None else local_size
        if isinstance(local, bool) or not isinstance(local, int) or local < 1:
            raise ValueError(f"local_size must be an integer >= 1, got {local!r}")
        self._placement = Placement(rank, size, min(local, size))
        # torchrun's own local rank must agree with the placement (unless local_size emulates nodes)
        launcher_local_rank = int(os.environ.get("LOCAL_RANK", self._placement.local_rank)) \
            if local_size is None else self._placement.local_rank
        device = torch.device("cuda", torch.cuda.current_device()) \
            if dist.get_backend(self.process_group) == "nccl" else torch.device("cpu")
        mine = torch.tensor([local, int(launcher_local_rank == self._placement.local_rank)], device=device)
        views = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(views, mine, group=self.process_group)
        seen = torch.stack(views).cpu()
        self._equal_nodes = bool((seen[:, 0] == local).all() and seen[:, 1].all() and self.size % local == 0)
        self._node = self._cross = None
        self._results = ResultBuffers()  # per collective name, its output
        self._whole_world = self.size == dist.get_world_size()
        if self.equal_nodes and self._whole_world and 1 < self.local_size < self.size:
            self._node, _ = dist.new_subgroups(group_size=self.local_size)
            lanes = [list(range(j, self.size, self.local_size)) for j in range(self.local_size)]
            self._cross, _ = dist.new_subgroups_by_enumeration(lanes)

    size = property(lambda self: self._placement.size)
    rank = property(lambda self: self._placement.rank)
    equal_nodes = property(lambda self: self._equal_nodes)  # agreed by the constructor's all-gather
    local_size = property(lambda self: self._placement.local_size)
    local_rank = property(lambda self: self._placement.local_rank)
    cross_size = property(lambda self: self._placement.cross_size)
    cross_rank = property(lambda self: self._placement.cross_rank)

    def _group(self, scope: Scope) -> tuple[Any, int]:
        """(process group, its size) of ``scope``; the group is None for a scope of one worker."""
        if scope is Scope.WORLD:
            return self.process_group, self.size
        if not self.equal_nodes or not self._whole_world:
            raise ValueError("hierarchical exchanges over torch.distributed need the default process group and "
                             f"equal nodes of consecutive ranks (local_size {self.local_size}, size {self.size}); "
                             "launch the same --nproc-per-node on every node, or exchange over all workers")
        size = self.local_size if scope is Scope.NODE else self.cross_size
        if size == 1:
            return None, 1
        if size == self.size:
            return self.process_group, size
        return (self._node if scope is Scope.NODE else self._cross), size

    def start(self, op: Op, tensor: torch.Tensor, name: str | None = None) -> _Handle:
        """Queue ``op`` on ``tensor`` (``name`` is ignored: collectives pair by call order)."""
        group, size = self._group(op.scope)
        send = tensor.detach().contiguous()
        if op.reduction is Reduction.ALLTOALL:  # equal parts along dim 0, part j to member j
            if send.dim() == 0 or send.shape[0] % size:
                raise ValueError(f"an all-to-all over {size} workers needs a first dimension that splits into "
                                 f"equal parts, got shape {tuple(send.shape)}")
            if group is None:
                return _Handle(None, send.clone())
            result = self._output(name, send)
            return _Handle(dist.all_to_all_single(result, send, group=group, async_op=True), result)
        if op.reduction is not Reduction.ALLGATHER:
            if op.consumes_tensor:
                result = send
            elif group is None:
                return _Handle(None, send.clone())
            else:
                result = self._output(name, send).copy_(send)
            if group is None:
                return _Handle(None, result)
            reduce_op = dist.ReduceOp.MAX if op.reduction is Reduction.MAX else dist.ReduceOp.SUM
            return _Handle(dist.all_reduce(result, op=reduce_op, group=group, async_op=True), result)
        rows_here = send.shape[0] if send.dim() else 1
        send = send.reshape(rows_here, *send.shape[1:])
        if group is None:
            return _Handle(None, send.clone())
        count = torch.tensor([rows_here], dtype=torch.int64, device=send.device)
        counts = [torch.empty_like(count) for _ in range(size)]
        _wait_and_hold(dist.all_gather(counts, count, group=group, async_op=True))
        rows = [int(c) for c in torch.cat(counts).tolist()]
        longest = max(rows)
        padded = send if rows_here == longest else torch.cat([send, send.new_zeros(longest - rows_here,
                                                                                   *send.shape[1:])])
        buffers = [torch.empty_like(padded) for _ in range(size)]
        work = dist.all_gather(buffers, padded, group=group, async_op=True)
        return _Handle(work, buffers, rows, tuple(send.shape[1:]))

    def _output(self, name: str | None, send: torch.Tensor) -> torch.Tensor:
        """A result buffer shaped as ``send``: ``name``'s previous one once nothing refers to it (a fresh one is faulted
        in page by page while the backend writes it: docs/benchmarks.md#kernel-level-measurements), else a new one."""
        if name is None:
            return torch.empty_like(send)
        return self._results.take(name, send.numel(), send.dtype, send.device).view(send.shape)

    def poll(self, handle: _Handle) -> bool:
        return handle.work is None or handle.work.is_completed()

    def wait(self, handle: _Handle) -> torch.Tensor:
        if handle.work is not None:
            _wait_and_hold(handle.work)
        if handle.rows is None:
            return handle.result
        return torch.cat([buffer[:rows] for buffer, rows in zip(handle.result, handle.rows)])

    def collective(self, op: Op, tensor: torch.Tensor) -> torch.Tensor:
        return self.wait(self.start(op, tensor))
