"""The exchange protocol: typed collective requests, the transport contract, and ``drive``.

An *exchange* is a generator run identically on every worker: it yields ``(op, tensor)`` requests,
receives each collective's result through ``send``, and returns its result (e.g. the averaged
gradient). Any transport can carry it out: ``drive`` runs one to its end with blocking collectives,
``drive_together`` runs several of one worker up to an op with one collective per round,
``hvdcomp.exchange.simulator.simulate`` runs W workers in lockstep in one process, and
``hvdcomp.exchange.runner.Runner`` has every entry point's exchanges in flight together, overlapped with
backward, through ``Transport.start`` / ``poll`` / ``wait``.

An ``Op`` is a reduction (``SUM``, ``MAX``, ``ALLGATHER``: concatenation along dim 0, by rank;
``ALLTOALL``: each worker's tensor split into as many equal parts along dim 0 as the group has
workers, part ``j`` going to the group's ``j``-th worker, which receives the parts addressed to it
concatenated by sender rank, in the shape it sent) over a scope of workers:

- ``Scope.WORLD``: every worker of the exchange (``Op.SUM``, ``Op.MAX``, ``Op.ALLGATHER``,
  ``Op.ALLGATHER_EQUAL``: one shape on every worker, ``Op.ALLTOALL``, ``Op.PAYLOAD``: the ``SUM`` of the
  packed words that carry the result, which a transport may move differently, and ``Op.SUM_IN_PLACE``: the ``SUM``
  of a tensor the exchange gives up, into which the transport may write the sum);
- ``Scope.NODE``: the workers of this node (``Op.LOCAL_SUM``, ``Op.LOCAL_MAX``, ``Op.LOCAL_ALLGATHER``);
- ``Scope.CROSS``: the workers with this worker's local rank, one per node (``Op.CROSS_*``).

All-gathers and all-to-alls move any dtype; every worker's tensor of an all-to-all has the same shape.

Workers are laid out node by node: rank ``r`` is local rank ``r % local_size`` of node
``r // local_size`` (as horovodrun places them; see ``Topology``).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol, runtime_checkable

import torch


class Scope(Enum):
    """Which workers a collective spans."""

    WORLD = "world"
    NODE = "node"
    CROSS = "cross"


class Reduction(Enum):
    """What a collective computes over its workers' tensors."""

    SUM = "sum"
    MAX = "max"
    ALLGATHER = "allgather"
    ALLTOALL = "alltoall"


class Op(Enum):
    """A collective request: a reduction over a scope (see the module docstring), and what else the transport
    may rely on: ``PAYLOAD`` carries the result, ``*ALLGATHER_EQUAL`` gathers tensors of one shape on every
    worker (so a transport may cut it into pieces without first learning the other workers' sizes),
    ``SUM_IN_PLACE``'s tensor is the exchange's scratch until the result arrives (a transport may sum in it and
    return it, saving a copy of the tensor: docs/benchmarks.md#the-ddp-door-at-parity)."""

    SUM = (Scope.WORLD, Reduction.SUM, "")
    MAX = (Scope.WORLD, Reduction.MAX, "")
    PAYLOAD = (Scope.WORLD, Reduction.SUM, "payload")
    SUM_IN_PLACE = (Scope.WORLD, Reduction.SUM, "in_place")
    ALLGATHER = (Scope.WORLD, Reduction.ALLGATHER, "")
    ALLGATHER_EQUAL = (Scope.WORLD, Reduction.ALLGATHER, "equal")
    ALLTOALL = (Scope.WORLD, Reduction.ALLTOALL, "")
    LOCAL_SUM = (Scope.NODE, Reduction.SUM, "")
    LOCAL_MAX = (Scope.NODE, Reduction.MAX, "")
    LOCAL_ALLGATHER = (Scope.NODE, Reduction.ALLGATHER, "")
    CROSS_SUM = (Scope.CROSS, Reduction.SUM, "")
    CROSS_MAX = (Scope.CROSS, Reduction.MAX, "")
    CROSS_ALLGATHER = (Scope.CROSS, Reduction.ALLGATHER, "")
    CROSS_ALLGATHER_EQUAL = (Scope.CROSS, Reduction.ALLGATHER, "equal")
    CROSS_ALLTOALL = (Scope.CROSS, Reduction.ALLTOALL, "")

    @property
    def scope(self) -> Scope:
        return self.value[0]

    @property
    def reduction(self) -> Reduction:
        return self.value[1]

    @property
    def carries_payload(self) -> bool:
        """True for ``PAYLOAD``: the words that carry the exchange's result."""
        return self.value[2] == "payload"

    @property
    def consumes_tensor(self) -> bool:
        """True for ``SUM_IN_PLACE``: the transport may write the result into the request's tensor."""
        return self.value[2] == "in_place"

    @property
    def equal_shapes(self) -> bool:
        """True for ``ALLGATHER_EQUAL`` and ``CROSS_ALLGATHER_EQUAL``: every worker's tensor has one shape."""
        return self.value[2] == "equal"

    def across_nodes(self) -> Op:
        """The same request among the workers sharing this local rank (``WORLD`` ops only)."""
        if self.scope is not Scope.WORLD:
            raise ValueError(f"a codec inside a hierarchical exchange may not ask for {self}")
        return _CROSS[self.reduction, self.equal_shapes]


_CROSS = {(Reduction.SUM, False): Op.CROSS_SUM, (Reduction.MAX, False): Op.CROSS_MAX,
          (Reduction.ALLGATHER, False): Op.CROSS_ALLGATHER, (Reduction.ALLGATHER, True): Op.CROSS_ALLGATHER_EQUAL,
          (Reduction.ALLTOALL, False): Op.CROSS_ALLTOALL}

Request = tuple[Op, torch.Tensor]
Exchange = Generator[Request, torch.Tensor, Any]


class LastRequest(tuple):
    """A request (``(op, tensor)``, a ``Request``) that its exchange declares to be its last: once its result is
    sent in, the exchange only computes and returns. A runner that pairs collectives by call order may then take
    that result whenever it is ready without changing the order of any worker's collectives (``last``)."""

    __slots__ = ()


def last(op: Op, tensor: torch.Tensor) -> Request:
    """``(op, tensor)`` declared the exchange's last request (``LastRequest``); yielding another after it is an
    error."""
    return LastRequest((op, tensor))


@runtime_checkable
class Topology(Protocol):
    """Where a worker sits among ``size`` workers in ``cross_size`` nodes of ``local_size`` each.

    ``equal_nodes``: whether ``local_size`` and ``cross_size`` are the same on every worker (every node
    holds as many workers). It is the same on every worker, so a decision made from it and those two
    sizes is too; a transport that agrees it through a collective does so when first read, so every
    worker must read it at the same point.
    """

    size: int
    rank: int
    local_size: int
    local_rank: int
    cross_size: int
    cross_rank: int
    equal_nodes: bool


@dataclass(frozen=True)
class Placement:
    """A ``Topology`` from a rank: rank ``r`` is local rank ``r % local_size`` of node ``r // local_size``."""

    rank: int
    size: int
    local_size: int

    @property
    def local_rank(self) -> int:
        return self.rank % self.local_size

    @property
    def cross_size(self) -> int:
        return self.size // self.local_size

    @property
    def cross_rank(self) -> int:
        return self.rank // self.local_size

    @property
    def equal_nodes(self) -> bool:
        return self.size % self.local_size == 0


def group_size(topology: Topology, scope: Scope) -> int:
    """Number of workers that a collective of ``scope`` spans for this worker."""
    if scope is Scope.NODE:
        return topology.local_size
    return topology.cross_size if scope is Scope.CROSS else topology.size


@runtime_checkable
class Transport(Topology, Protocol):
    """Carries out the collectives that exchanges request (``hvdcomp.transport`` implements it).

    ``start`` begins a collective and returns a handle; ``name`` must be the same on every worker
    when several are in flight. ``poll`` says whether it has completed, ``wait`` returns its result
    (the reduced tensor, on the input's device), and ``collective`` is ``wait(start(...))``. A transport
    reads the request's tensor and never writes it (exchanges may use it again after the result), but for an op
    that ``consumes_tensor``, whose tensor it may reduce in place and return as the result.
    ``blocking`` is True when collectives pair by call order, not by name: ``start`` completes the
    collective before returning (MPI) or queues it (torch.distributed); every worker must then start
    them in the same order. ``sums_float16`` (default False): its ``SUM`` of a float16 tensor runs natively at
    the wire's rate (Gloo and NCCL through torch.distributed; Horovod where its Gloo has the F16C/AVX sum), so
    codecs may ask for it (``FP16``); ``sums_bfloat16`` (default False) likewise for bfloat16 (torch.distributed;
    ``BF16``). ``large_request_bytes`` (default None): for a transport that pairs by name, the size from which a
    sum is large: the runner keeps at most two exchanges whose first request is a large sum open at once
    (``HorovodTransport``: its background thread would fuse them, copying each into and out of its fusion buffer).
    A transport never does arithmetic of its own. Every transport moves float16 and bfloat16 tensors
    (all-to-all, all-gather). Transports subclass this class, so the defaults below are theirs unless they say
    otherwise.
    """

    blocking: bool
    sums_float16: bool = False
    sums_bfloat16: bool = False
    large_request_bytes: int | None = None

    def forget_topology(self) -> None:
        """Read the topology anew at its next use (after the launcher re-initialised the workers: elastic
        training). Default: nothing to forget."""

    def check_hierarchy(self) -> None:
        """Raise, on every worker alike and without a collective, where node-local and cross-node collectives
        cannot run. Default: they can."""

    def release_hierarchy(self) -> None:
        """Free, on every worker alike, what node-local and cross-node collectives hold once a door no longer needs
        them (``HorovodTransport``: its process sets, which cost every collective). Default: nothing held."""

    def start(self, op: Op, tensor: torch.Tensor, name: str | None = None) -> Any: ...

    def poll(self, handle: Any) -> bool: ...

    def wait(self, handle: Any) -> torch.Tensor: ...

    def collective(self, op: Op, tensor: torch.Tensor) -> torch.Tensor: ...


def drive(exchange: Exchange, transport: Transport, until: Op | None = None) -> Any:
    """Run ``exchange`` with ``transport``'s blocking collectives; return its result.

    With ``until``, stop at the first request for that op and return its tensor instead: the exchange
    then waits for that collective's result (``exchange.send(result)`` finishes it).
    """
    try:
        op, tensor = next(exchange)
        while op is not until:
            op, tensor = exchange.send(transport.collective(op, tensor))
    except StopIteration as done:
        if until is not None:
            raise RuntimeError(f"the exchange finished without requesting {until}") from None
        return done.value
    return tensor


def advance(exchange: Exchange, result: torch.Tensor | None) -> Request | StopIteration:
    """``exchange``'s next request after ``result`` (``None``: its first request), or the
    ``StopIteration`` that carries its return value once it has finished."""
    try:
        return next(exchange) if result is None else exchange.send(result)
    except StopIteration as done:
        # without its traceback: that would tie the caller's frame, and so the result, into a reference cycle
        return done.with_traceback(None)


def drive_together(exchanges: Sequence[Exchange], transport: Transport, until: Op) -> list[torch.Tensor]:
    """Run ``exchanges`` in lockstep with one blocking collective per round, up to their ``until``
    request; return the tensor of each one's ``until`` request (as ``drive(exchange, transport, until)``
    would, each exchange then waits for that collective's result).

    In each round every exchange must ask for the same op, with tensors of one dtype and device (the
    exchanges of one codec do): they are flattened, concatenated in the order of ``exchanges`` into
    one collective, and each exchange receives its own slice, in its request's shape. Every worker
    must pass its exchanges in the same order. ``ALLGATHER`` and ``ALLTOALL`` ops are refused (their
    results interleave the workers); so is an exchange that finishes or asks for a different op than the others.
    """
    requests = [advance(exchange, None) for exchange in exchanges]
    while True:
        if any(isinstance(request, StopIteration) for request in requests):
            raise RuntimeError(f"an exchange finished without requesting {until}")
        ops = {op for op, _ in requests}
        if ops <= {until}:
            return [tensor for _, tensor in requests]
        if len(ops) != 1:
            raise RuntimeError(f"exchanges driven together asked for different ops: {sorted(op.name for op in ops)}")
        op = ops.pop()
        if op.reduction in (Reduction.ALLGATHER, Reduction.ALLTOALL):
            raise ValueError(f"drive_together cannot batch {op}: its result interleaves the workers' tensors")
        tensors = [tensor for _, tensor in requests]
        if len({(tensor.dtype, tensor.device) for tensor in tensors}) != 1:
            raise ValueError(f"exchanges driven together asked for {op} of different dtypes or devices")
        reduced = transport.collective(op, torch.cat([tensor.reshape(-1) for tensor in tensors]))
        parts = reduced.split([tensor.numel() for tensor in tensors])
        requests = [advance(exchange, part.view(tensor.shape))
                    for exchange, part, tensor in zip(exchanges, parts, tensors)]


def single(op: Op, tensor: torch.Tensor) -> Exchange:
    """An exchange of one request, returning its result."""
    return (yield op, tensor)


def relay(
    exchange: Exchange,
    on_request: Callable[[Op, torch.Tensor], Request],
    on_result: Callable[[Op, torch.Tensor], torch.Tensor] | None = None,
) -> Exchange:
    """``exchange`` with each request passed through ``on_request(op, tensor) -> (op, tensor)`` and each
    result through ``on_result(op, result) -> result`` (``op`` as the inner exchange asked); same result."""
    try:
        op, tensor = next(exchange)
        while True:
            result = yield on_request(op, tensor)
            op, tensor = exchange.send(result if on_result is None else on_result(op, result))
    except StopIteration as done:
        return done.value
