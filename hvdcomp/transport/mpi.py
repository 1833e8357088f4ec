"""``MPITransport``: blocking collectives over mpi4py communicators.

Nodes come from ``COMM_TYPE_SHARED`` unless ``local_size`` is given (consecutive ranks form a node;
for emulating nodes on one machine). Implements ``hvdcomp.exchange.protocol.Transport``; ``start``
runs the collective at once (``poll`` is always True).
"""

from __future__ import annotations

from typing import Any

import torch

from ..exchange.protocol import Op, Reduction, Scope


class MPITransport:
    """Collectives over mpi4py (``comm``: default ``MPI.COMM_WORLD``; see the module docstring)."""

    blocking = True  # start() runs the collective: workers must start them in the same order

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
    equal_nodes = True  # the constructor refuses unequal nodes on every rank

    def _comm(self, op: Op) -> Any:
        if op.scope is Scope.NODE:
            return self.local_comm
        return self.cross_comm if op.scope is Scope.CROSS else self.comm

    def collective(self, op: Op, tensor: torch.Tensor) -> torch.Tensor:
        comm = self._comm(op)
        send = tensor.detach().cpu().contiguous()
        if op.reduction is Reduction.ALLGATHER:
            counts = comm.allgather(send.numel())
            rows = comm.allgather(send.shape[0] if send.dim() else 1)
            out = torch.empty(sum(counts), dtype=send.dtype)
            comm.Allgatherv(send.numpy(), [out.numpy(), counts])
            result = out.view(sum(rows), *send.shape[1:])
        else:
            result = torch.empty_like(send)
            mpi_op = self._mpi.MAX if op.reduction is Reduction.MAX else self._mpi.SUM
            comm.Allreduce(send.numpy(), result.numpy(), op=mpi_op)
        return result.to(tensor.device)

    def start(self, op: Op, tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
        return self.collective(op, tensor)

    def poll(self, handle: torch.Tensor) -> bool:
        return True

    def wait(self, handle: torch.Tensor) -> torch.Tensor:
        return handle
