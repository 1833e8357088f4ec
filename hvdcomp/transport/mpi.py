"""``MPITransport``: blocking collectives over mpi4py communicators.

Nodes come from ``COMM_TYPE_SHARED`` unless ``local_size`` is given (consecutive ranks form a node;
for emulating nodes on one machine). Implements ``hvdcomp.exchange.protocol.Transport``; ``start``
runs the collective at once (``poll`` is always True). MPI has no 16-bit float datatypes: float16 and
bfloat16 travel as 16-bit words and are reduced in their own dtype by a user-defined MPI op (as
Horovod reduces them), so they cost 16 bits an element on the wire.
"""

from __future__ import annotations

from typing import Any

import torch

from ..exchange.protocol import Op, Reduction, Scope, Transport

_HALF_FLOATS = (torch.float16, torch.bfloat16)
_HALF_OPS: dict[tuple[torch.dtype, Reduction], Any] = {}


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as MPI can move it: 16-bit floats viewed as int16 words, others as they are."""
    return tensor.view(torch.int16) if tensor.dtype in _HALF_FLOATS else tensor


def _half_op(mpi: Any, dtype: torch.dtype, reduction: Reduction) -> Any:
    """A commutative MPI op that reduces ``dtype`` elements sent as 16-bit words (created once)."""
    op = _HALF_OPS.get((dtype, reduction))
    if op is None:
        combine = torch.maximum if reduction is Reduction.MAX else torch.add

        def reduce(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
            if len(memoryview(inoutbuf)):  # torch.frombuffer refuses empty buffers
                into = torch.frombuffer(inoutbuf, dtype=dtype)
                combine(torch.frombuffer(inbuf, dtype=dtype), into, out=into)

        op = _HALF_OPS[(dtype, reduction)] = mpi.Op.Create(reduce, commute=True)
    return op


class MPITransport(Transport):
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
            comm.Allgatherv(_words(send).numpy(), [_words(out).numpy(), counts])
            result = out.view(sum(rows), *send.shape[1:])
        elif op.reduction is Reduction.ALLTOALL:
            if send.dim() == 0 or send.shape[0] % comm.Get_size():
                raise ValueError(f"an all-to-all over {comm.Get_size()} ranks needs a first dimension that splits "
                                 f"into equal parts, got shape {tuple(send.shape)}")
            result = torch.empty_like(send)
            comm.Alltoall(_words(send).numpy(), _words(result).numpy())
        else:
            result = torch.empty_like(send)
            if send.dtype in _HALF_FLOATS:
                mpi_op = _half_op(self._mpi, send.dtype, op.reduction)
            else:
                mpi_op = self._mpi.MAX if op.reduction is Reduction.MAX else self._mpi.SUM
            comm.Allreduce(_words(send).numpy(), _words(result).numpy(), op=mpi_op)
        return result.to(tensor.device)

    def start(self, op: Op, tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
        return self.collective(op, tensor)

    def poll(self, handle: torch.Tensor) -> bool:
        return True

    def wait(self, handle: torch.Tensor) -> torch.Tensor:
        return handle
