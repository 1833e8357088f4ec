"""``HorovodTransport``: collectives over Horovod.

``WORLD`` ops use a process set (default: all workers); ``NODE`` and ``CROSS`` ops use process sets
of each node's ranks and of the ranks sharing a local rank, registered once on every rank (they need
dynamic process sets, ``hvdcomp.init()`` or ``hvd.init(process_sets="dynamic")``, and equal nodes).
``equal_nodes`` costs one all-gather, at its first read. Implements ``hvdcomp.exchange.protocol.Transport``.

A large ``Op.ALLTOALL`` runs as several all-to-alls of at most ``ALLTOALL_PIECE_BYTES`` per destination
(Horovod runs them one after another; it fuses no all-to-alls), and so does a large ``*ALLGATHER_EQUAL``
(each piece sent to every worker): Horovod's Gloo sends each destination's part as one message, and a
worker reading its peer's equally large part leaves its own send waiting, so pieces keep both directions of
a slow link busy (``docs/benchmarks.md``: ``benchmarks/cluster_collectives.py``).

``sums_float16`` is True where Horovod's Gloo sums float16 with F16C/AVX (a build of
``scripts/install_horovod.sh``, whose wheels carry the local version label ``hvdcomp.f16c``). Horovod as
released converts each float16 element in software (``docs/benchmarks.md``), so there ``FP16`` takes its
reduce-scatter and all-gather route instead of asking for a float16 ``SUM``.

Horovod 0.28 has no bfloat16 tensors: an all-to-all or all-gather of bfloat16 moves its 16-bit words (viewed as
int16, and back), and a ``SUM`` or ``MAX`` of bfloat16 raises ``TypeError`` (``sums_bfloat16`` is False, so
``BF16`` takes the all-to-all and all-gather route, summing at float32 itself).
"""

from __future__ import annotations

import importlib.metadata
import os
import time
import weakref
from dataclasses import dataclass
from typing import Any

import horovod.torch as hvd
import torch
from horovod.common.exceptions import HorovodInternalError

from ..codec.recycle import ResultBuffers
from ..exchange.protocol import Op, Reduction, Scope, Transport
from ._compat import allreduce_async_into

_DYNAMIC_SETS_NEEDED = (
    "hierarchical exchanges over Horovod need dynamic process sets: start Horovod with hvdcomp.init() instead of "
    "hvd.init() (or hvd.init(process_sets='dynamic'), or export HOROVOD_DYNAMIC_PROCESS_SETS=1 before hvd.init()); "
    "or pass hierarchical=False (hierarchical=None follows HOROVOD_HIERARCHICAL_ALLREDUCE, which horovodrun "
    "--hierarchical-allreduce sets)"
)
ALLTOALL_PIECE_BYTES = 512 * 1024
WAIT_POLL_SECONDS = 1e-4
_HIERARCHY_SETS: dict[tuple[int, int], tuple[list[hvd.ProcessSet], list[hvd.ProcessSet]]] = {}
_HIERARCHY_USERS: weakref.WeakSet[HorovodTransport] = weakref.WeakSet()  # the transports bound to those sets


def _gloo_sums_float16_in_vectors() -> bool:
    """Whether the installed Horovod is a build of ``scripts/install_horovod.sh`` with Gloo's F16C/AVX float16
    sum: its version carries the local label ``hvdcomp.f16c``."""
    try:
        version = importlib.metadata.version("horovod")
    except importlib.metadata.PackageNotFoundError:
        return False
    return version.partition("+")[2] == "hvdcomp.f16c"


HOROVOD_SUMS_FLOAT16 = _gloo_sums_float16_in_vectors()


def _hierarchy_process_sets() -> tuple[hvd.ProcessSet, hvd.ProcessSet]:
    """This rank's (node, cross-node) Horovod process sets, registered once on every rank.

    Needs dynamic process sets (``hvdcomp.init()``, ``hvd.init(process_sets="dynamic")`` or
    ``HOROVOD_DYNAMIC_PROCESS_SETS=1``) and the same number of workers on every node.
    """
    if not hvd.is_initialized():
        raise RuntimeError("call hvdcomp.init() (or hvd.init(process_sets='dynamic')) before a hierarchical exchange")
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
            raise RuntimeError(_DYNAMIC_SETS_NEEDED) from error
        _HIERARCHY_SETS[key] = (node_sets, cross_sets)
    node_sets, cross_sets = _HIERARCHY_SETS[key]
    return node_sets[hvd.cross_rank()], cross_sets[hvd.local_rank()]


@dataclass
class _Pieces:
    """A collective in flight as all-to-alls of pieces: ``out`` (``[W, part]``, the result's rows by sender), its
    ``shape``, and per piece its columns ``[lo, hi)`` and Horovod handle."""

    out: torch.Tensor
    shape: tuple[int, ...]
    handles: list[tuple[int, int, Any]]


def _in_pieces(tensor: torch.Tensor, gather: bool, name: str | None, group: hvd.ProcessSet) -> _Pieces | None:
    """Start ``tensor``'s all-to-all (``gather``: its all-gather, every piece sent to every worker) as pieces of
    at most ``ALLTOALL_PIECE_BYTES`` per destination, or None where it is that small (or an all-to-all does not
    split into ``group.size()`` equal parts: Horovod's error then)."""
    workers = group.size()
    if not tensor.dim() or (not gather and tensor.shape[0] % workers):
        return None
    parts = tensor.reshape(1, -1) if gather else tensor.reshape(workers, -1)
    width = max(1, ALLTOALL_PIECE_BYTES // tensor.element_size())
    if parts.shape[1] <= width:
        return None
    shape = (workers * tensor.shape[0], *tensor.shape[1:]) if gather else tuple(tensor.shape)
    pieces = _Pieces(tensor.new_empty(workers, parts.shape[1]), shape, [])
    for index, lo in enumerate(range(0, parts.shape[1], width)):
        hi = min(lo + width, parts.shape[1])
        piece = parts[:, lo:hi].expand(workers, hi - lo).contiguous().view(-1)
        piece_name = None if name is None else f"{name}.piece{index}"
        pieces.handles.append((lo, hi, hvd.alltoall_async(piece, name=piece_name, process_set=group)))
    return pieces


@dataclass
class _Words:
    """A collective of bfloat16 in flight as int16 words: its handle, and the dtype its result is viewed back as."""

    handle: Any
    dtype: torch.dtype


def _synchronize(handle: Any) -> Any:
    """``hvd.synchronize(handle)``, sleeping ``WAIT_POLL_SECONDS`` between polls until the collective is done.
    Horovod 0.28.1's own wait spins on ``sched_yield``: for as long as a collective runs, it holds a core that
    Horovod's background thread, the kernel's network stack and the other workers on the host need."""
    while not hvd.poll(handle):
        time.sleep(WAIT_POLL_SECONDS)
    return hvd.synchronize(handle)


class HorovodTransport(Transport):
    """Collectives over Horovod. Flat ops use ``process_set`` (default: all workers); node-local and
    cross-node ops use process sets built from ``local_rank`` / ``cross_rank`` (created on first use,
    global process set only)."""

    blocking = False  # asynchronous, matched across workers by name
    sums_float16 = HOROVOD_SUMS_FLOAT16
    # From 2 MiB a sum costs more to copy into and out of Horovod's fusion buffer than to negotiate alone; smaller
    # compressed payloads gain from fusion, and all-to-alls are never fused (docs/benchmarks.md#large-sums-held-back)
    large_request_bytes = 2 * 2**20

    def __init__(self, process_set: hvd.ProcessSet | None = None) -> None:
        self.process_set = process_set if process_set is not None else hvd.global_process_set
        self._local: hvd.ProcessSet | None = None
        self._cross: hvd.ProcessSet | None = None
        self._equal_nodes: bool | None = None
        self._sums = ResultBuffers()  # per name, a reduction's output (Horovod's own allocates one per call)

    size = property(lambda self: self.process_set.size())
    rank = property(lambda self: self.process_set.rank())
    local_size = property(lambda self: hvd.local_size())
    local_rank = property(lambda self: hvd.local_rank())
    cross_size = property(lambda self: hvd.cross_size())
    cross_rank = property(lambda self: hvd.cross_rank())

    @property
    def equal_nodes(self) -> bool:
        """Whether ``local_size`` and ``cross_size`` are the same on every worker of the process set:
        agreed by an all-gather over it at the first read (every worker must read it), then cached."""
        if self._equal_nodes is None:
            sizes = hvd.allgather(torch.tensor([[hvd.local_size(), hvd.cross_size()]]), name="hvdcomp.equal_nodes",
                                  process_set=self.process_set)
            self._equal_nodes = bool((sizes == sizes[0]).all())
        return self._equal_nodes

    def _group(self, op: Op) -> hvd.ProcessSet:
        if op.scope is Scope.WORLD:
            return self.process_set
        if self.process_set is not hvd.global_process_set and self.process_set.size() != hvd.size():
            raise ValueError("hierarchical exchanges run over all workers, not a smaller process set")
        if self._local is None:
            self._local, self._cross = _hierarchy_process_sets()
            _HIERARCHY_USERS.add(self)
        return self._local if op.scope is Scope.NODE else self._cross

    def check_hierarchy(self) -> None:
        """``RuntimeError`` naming the change to make where Horovod runs without dynamic process sets
        (read from the environment that ``hvd.init`` read: the same on every worker, no collective)."""
        if os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS", "").strip() in ("", "0") and self.size > 1:
            raise RuntimeError(_DYNAMIC_SETS_NEEDED)

    def release_hierarchy(self) -> None:
        """Remove the node-local and cross-node process sets (``hvd.remove_process_set``, every worker alike) unless
        another transport still uses them: Horovod's background thread coordinates every process set at each cycle,
        so sets left unused slow every collective (docs/benchmarks.md#the-route-measured)."""
        _HIERARCHY_USERS.discard(self)
        self._local = self._cross = None
        if _HIERARCHY_USERS:
            return
        for node_sets, cross_sets in _HIERARCHY_SETS.values():
            for process_set in node_sets + cross_sets:
                if process_set is not hvd.global_process_set:
                    hvd.remove_process_set(process_set)
        _HIERARCHY_SETS.clear()

    def forget_topology(self) -> None:
        """After Horovod is initialised again (elastic training): node sizes and process sets are read
        and registered anew at their next use."""
        self._local = self._cross = self._equal_nodes = None
        _HIERARCHY_SETS.clear()
        _HIERARCHY_USERS.clear()  # the sets are gone for every transport: none holds them now

    def start(self, op: Op, tensor: torch.Tensor, name: str | None = None) -> Any:
        """Start a collective; ``name`` must be the same on every worker when several are in flight
        (Horovod matches collectives across workers by name; unnamed ones by call order). bfloat16 moves as
        int16 words; its reductions raise ``TypeError`` (the module docstring)."""
        if tensor.dtype != torch.bfloat16:
            return self._start(op, tensor, name)
        if op.reduction in (Reduction.SUM, Reduction.MAX):
            raise TypeError(f"hvdcomp: Horovod has no bfloat16 reductions ({op.name} of {name}); sum bfloat16 at "
                            "float32 (BF16 does so over Horovod)")
        return _Words(self._start(op, tensor.view(torch.int16), name), tensor.dtype)

    def _start(self, op: Op, tensor: torch.Tensor, name: str | None) -> Any:
        group = self._group(op)
        try:
            if op.reduction is Reduction.ALLGATHER:
                pieces = _in_pieces(tensor, True, name, group) if op.equal_shapes else None
                return pieces if pieces is not None else hvd.allgather_async(tensor, name=name, process_set=group)
            if op.reduction is Reduction.ALLTOALL:  # equal parts along dim 0 (Horovod 0.28.1: any dtype)
                pieces = _in_pieces(tensor, False, name, group)
                return pieces if pieces is not None else hvd.alltoall_async(tensor, name=name, process_set=group)
            reduce_op = hvd.Max if op.reduction is Reduction.MAX else hvd.Sum
            if name is None:
                return hvd.allreduce_async(tensor, op=reduce_op, process_set=group)
            # an output reused once nothing refers to it: a fresh one is faulted in page by page while Horovod
            # copies the sum into it (docs/benchmarks.md)
            output = self._sums.take(name, tensor.numel(), tensor.dtype, tensor.device).view(tensor.shape)
            return allreduce_async_into(tensor, output, name, reduce_op, group)
        except ValueError as error:  # Horovod drops its process sets when it shuts down after a rank failed
            if "process set" not in str(error).lower():
                raise
            raise HorovodInternalError(
                f"hvdcomp: Horovod has no process set of ranks {group.ranks} for this {op.name} (Horovod shut down "
                "after an error on another rank, or the set was removed)") from error

    def poll(self, handle: Any) -> bool:
        if isinstance(handle, _Words):
            return self.poll(handle.handle)
        if isinstance(handle, _Pieces):
            return all(hvd.poll(piece) for _, _, piece in handle.handles)
        return hvd.poll(handle)

    def wait(self, handle: Any) -> torch.Tensor:
        if isinstance(handle, _Words):
            return self.wait(handle.handle).view(handle.dtype)
        if isinstance(handle, _Pieces):
            for lo, hi, piece in handle.handles:  # each piece's rows, by sender, into its columns
                handle.out[:, lo:hi] = self.wait(piece).view(handle.out.shape[0], hi - lo)
            return handle.out.view(handle.shape)
        result = _synchronize(handle)
        return result[0] if isinstance(result, tuple) else result  # an all-to-all also returns its splits

    def collective(self, op: Op, tensor: torch.Tensor) -> torch.Tensor:
        return self.wait(self.start(op, tensor))

