"""Transports: carry out the collectives that exchanges request (see ``protocol``).

``HorovodTransport`` runs them over Horovod (a process set for the flat ops; for the node-local and
cross-node ops, process sets of each node's ranks and of the ranks sharing a local rank).
``MPITransport`` runs them over mpi4py communicators (``COMM_TYPE_SHARED`` split, or ``local_size``
for emulated nodes; blocking). Both offer ``start(op, tensor) -> handle``, ``poll(handle)``,
``wait(handle)`` and ``collective(op, tensor)``; ``drive(exchange, transport)`` runs an exchange to its end.

Ops (see ``protocol``): ``"max"``, ``"sum"``, ``"payload"`` (packed int64 words, summed), and the
node-local / cross-node ``"local_sum"``, ``"local_max"``, ``"local_allgather"``, ``"cross_sum"``,
``"cross_max"``, ``"cross_allgather"``.
"""

from __future__ import annotations

from typing import Any, Protocol

import horovod.torch as hvd
import torch

from .protocol import Exchange


class Transport(Protocol):
    size: int
    rank: int
    local_size: int
    local_rank: int
    cross_size: int
    cross_rank: int

    def start(self, op: str, tensor: torch.Tensor, name: str | None = None) -> Any: ...

    def poll(self, handle: Any) -> bool: ...

    def wait(self, handle: Any) -> torch.Tensor: ...

    def collective(self, op: str, tensor: torch.Tensor) -> torch.Tensor: ...


def drive(exchange: Exchange, transport: Transport) -> Any:
    """Run ``exchange`` to its end with blocking collectives; return its result."""
    try:
        op, tensor = next(exchange)
        while True:
            op, tensor = exchange.send(transport.collective(op, tensor))
    except StopIteration as done:
        return done.value


_HIERARCHY_SETS: dict[tuple[int, int], tuple[list[hvd.ProcessSet], list[hvd.ProcessSet]]] = {}


def _hierarchy_process_sets() -> tuple[hvd.ProcessSet, hvd.ProcessSet]:
    """This rank's (node, cross-node) Horovod process sets, registered once on every rank.

    Needs ``hvd.init(process_sets="dynamic")`` (or ``HOROVOD_DYNAMIC_PROCESS_SETS=1``) and the same
    number of workers on every node.
    """
    if not hvd.is_initialized():
        raise RuntimeError("call hvd.init(process_sets='dynamic') before using a hierarchical exchange")
    key = (hvd.size(), hvd.local_size())
    if key not in _HIERARCHY_SETS:
        topology = hvd.allgather_object((hvd.rank(), hvd.local_rank(), hvd.cross_rank(), hvd.local_size()))
        if len({t[3] for t in topology}) != 1:
            raise RuntimeError("hierarchical exchanges need the same number of workers on every node")
        nodes = sorted({t[2] for t in topology})
        local_ranks = sorted({t[1] for t in topology})
        def process_set(ranks: list[int]) -> hvd.ProcessSet:
            # Horovod refuses to add a duplicate of the global set (one node, or one worker per node)
            return hvd.global_process_set if len(ranks) == hvd.size() else hvd.add_process_set(ranks)

        try:
            node_sets = [process_set(sorted(t[0] for t in topology if t[2] == n)) for n in nodes]
            cross_sets = [process_set(sorted(t[0] for t in topology if t[1] == j)) for j in local_ranks]
        except ValueError as error:
            raise RuntimeError(
                "hierarchical exchanges over Horovod need dynamic process sets: "
                "hvd.init(process_sets='dynamic') or HOROVOD_DYNAMIC_PROCESS_SETS=1"
            ) from error
        _HIERARCHY_SETS[key] = (node_sets, cross_sets)
    node_sets, cross_sets = _HIERARCHY_SETS[key]
    return node_sets[hvd.cross_rank()], cross_sets[hvd.local_rank()]


class HorovodTransport:
    """Collectives over Horovod. Flat ops use ``process_set`` (default: all workers); node-local and
    cross-node ops use process sets built from ``local_rank`` / ``cross_rank`` (created on first use,
    global process set only)."""

    def __init__(self, process_set: hvd.ProcessSet | None = None) -> None:
        self.process_set = process_set if process_set is not None else hvd.global_process_set
        self._local: hvd.ProcessSet | None = None
        self._cross: hvd.ProcessSet | None = None

    size = property(lambda self: self.process_set.size())
    rank = property(lambda self: self.process_set.rank())
    local_size = property(lambda self: hvd.local_size())
    local_rank = property(lambda self: hvd.local_rank())
    cross_size = property(lambda self: hvd.cross_size())
    cross_rank = property(lambda self: hvd.cross_rank())

    def _group(self, op: str) -> hvd.ProcessSet:
        if not op.startswith(("local_", "cross_")):
            return self.process_set
        if self.process_set is not hvd.global_process_set and self.process_set.size() != hvd.size():
            raise ValueError("hierarchical exchanges run over all workers, not a smaller process set")
        if self._local is None:
            self._local, self._cross = _hierarchy_process_sets()
        return self._local if op.startswith("local_") else self._cross

    def start(self, op: str, tensor: torch.Tensor, name: str | None = None) -> Any:
        """Start a collective; ``name`` must be the same on every worker when several are in flight
        (Horovod matches collectives across workers by name; unnamed ones by call order)."""
        group = self._group(op)
        if op.endswith("allgather"):
            return hvd.allgather_async(tensor, name=name, process_set=group)
        reduce_op = hvd.Max if op.endswith("max") else hvd.Sum
        return hvd.allreduce_async(tensor, name=name, op=reduce_op, process_set=group)

    def poll(self, handle: Any) -> bool:
        return hvd.poll(handle)

    def wait(self, handle: Any) -> torch.Tensor:
        return hvd.synchronize(handle)

    def collective(self, op: str, tensor: torch.Tensor) -> torch.Tensor:
        return self.wait(self.start(op, tensor))


class MPITransport:
    """Blocking collectives over mpi4py. Nodes come from ``COMM_TYPE_SHARED`` unless ``local_size``
    is given (consecutive ranks form a node; for emulating nodes on one machine)."""

    def __init__(self, comm: Any = None, local_size: int | None = None) -> None:
        from mpi4py import MPI

        self._mpi = MPI
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        rank = self.comm.Get_rank()
        if local_size is None:
            self.local_comm = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        else:
            if local_size < 1 or self.comm.Get_size() % local_size:
                raise ValueError(f"local_size {local_size} must divide the {self.comm.Get_size()} ranks")
            self.local_comm = self.comm.Split(color=rank // local_size, key=rank)
        sizes = self.comm.allgather(self.local_comm.Get_size())
        if len(set(sizes)) != 1:
            raise RuntimeError(f"hierarchical exchanges need equal nodes; node sizes {sorted(set(sizes))}")
        self.cross_comm = self.comm.Split(color=self.local_comm.Get_rank(), key=rank)

    size = property(lambda self: self.comm.Get_size())
    rank = property(lambda self: self.comm.Get_rank())
    local_size = property(lambda self: self.local_comm.Get_size())
    local_rank = property(lambda self: self.local_comm.Get_rank())
    cross_size = property(lambda self: self.cross_comm.Get_size())
    cross_rank = property(lambda self: self.cross_comm.Get_rank())

    def _comm(self, op: str) -> Any:
        if op.startswith("local_"):
            return self.local_comm
        return self.cross_comm if op.startswith("cross_") else self.comm

    def collective(self, op: str, tensor: torch.Tensor) -> torch.Tensor:
        comm = self._comm(op)
        send = tensor.detach().cpu().contiguous()
        if op.endswith("allgather"):
            counts = comm.allgather(send.numel())
            rows = comm.allgather(send.shape[0] if send.dim() else 1)
            out = torch.empty(sum(counts), dtype=send.dtype)
            comm.Allgatherv(send.numpy(), [out.numpy(), counts])
            result = out.view(sum(rows), *send.shape[1:])
        else:
            result = torch.empty_like(send)
            mpi_op = self._mpi.MAX if op.endswith("max") else self._mpi.SUM
            comm.Allreduce(send.numpy(), result.numpy(), op=mpi_op)
        return result.to(tensor.device)

    def start(self, op: str, tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
        return self.collective(op, tensor)

    def poll(self, handle: torch.Tensor) -> bool:
        return True

    def wait(self, handle: torch.Tensor) -> torch.Tensor:
        return handle
