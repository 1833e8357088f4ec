"""The one-process simulator: W workers' exchanges driven in lockstep, bit-exactly like real collectives, and
writing the result of an op that consumes its tensor (``Op.SUM_IN_PLACE``) into that tensor.

Used by tests and benchmarks. Workers are laid out node by node (see ``protocol.Placement``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .protocol import Exchange, Op, Reduction, Scope, advance


def _group_of(op: Op, rank: int, local_size: int) -> int:
    if op.scope is Scope.WORLD:
        return 0
    return rank // local_size if op.scope is Scope.NODE else rank % local_size


def _all_to_all(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each member's result: part ``j`` (of ``len(tensors)`` along dim 0) of every member's tensor, by sender."""
    if len({tuple(t.shape) for t in tensors}) != 1 or tensors[0].dim() == 0 or tensors[0].shape[0] % len(tensors):
        raise ValueError(f"an all-to-all needs tensors of one shape whose first dimension splits into "
                         f"{len(tensors)} parts, got {sorted({tuple(t.shape) for t in tensors})}")
    parts = [t.chunk(len(tensors)) for t in tensors]
    return [torch.cat([sent[j] for sent in parts]) for j in range(len(tensors))]


def _reduce(op: Op, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each member's result of ``op`` over the members' ``tensors`` (in rank order)."""
    if op.reduction is Reduction.ALLTOALL:
        return _all_to_all(tensors)
    if op.reduction is Reduction.MAX:
        result = torch.stack(tensors).amax(dim=0)
    elif op.reduction is Reduction.ALLGATHER:
        if op.equal_shapes and len({tuple(t.shape) for t in tensors}) != 1:
            raise ValueError(f"{op.name} needs tensors of one shape, got {sorted({tuple(t.shape) for t in tensors})}")
        result = torch.cat(tensors)
    else:
        result = torch.stack(tensors).sum(dim=0)
    return [result] * len(tensors)


def simulate(exchanges: Sequence[Exchange], local_size: int | None = None) -> list[object]:
    """Drive one exchange per worker in lockstep; return each worker's result.

    ``local_size`` workers per node (default: all on one node); it must divide the worker count.
    Raises ``RuntimeError`` if the workers ask for different collectives or finish at different times.
    """
    world_size = len(exchanges)
    local_size = local_size or world_size
    if world_size % local_size:
        raise ValueError(f"{world_size} workers do not fill nodes of {local_size}")
    requests = [advance(exchange, None) for exchange in exchanges]
    while True:
        if all(isinstance(r, StopIteration) for r in requests):
            return [r.value for r in requests]
        if any(isinstance(r, StopIteration) for r in requests):
            raise RuntimeError("some workers finished their exchange while others still communicate")
        ops = {op for op, _ in requests}
        if len(ops) != 1:
            raise RuntimeError(f"workers asked for different collectives: {sorted(op.name for op in ops)}")
        op = ops.pop()
        if not isinstance(op, Op):
            raise TypeError(f"an exchange must request an Op, got {op!r}")
        groups: dict[int, list[int]] = {}
        for rank in range(world_size):
            groups.setdefault(_group_of(op, rank, local_size), []).append(rank)
        reduced = {}
        for members in groups.values():
            results = _reduce(op, [requests[rank][1] for rank in members])
            reduced.update(zip(members, results))
        # an op that consumes its tensor gets the result there, as TorchDistributedTransport sums in place
        requests = [advance(exchange, requests[rank][1].copy_(reduced[rank]) if op.consumes_tensor
                            else reduced[rank].clone()) for rank, exchange in enumerate(exchanges)]
