"""One statistics type for every entry point: ``Statistics`` of ``Traffic`` per step and in total.

Byte counts mean the same everywhere:

- ``intra_node_bytes``: bytes this worker handed to node-local collectives (``Scope.NODE``);
- ``inter_node_bytes``: bytes it handed to collectives that cross nodes (``Scope.CROSS``, and
  ``Scope.WORLD``, whose groups span nodes);
- ``control_bytes``: bytes of bookkeeping collectives (Birder's flags and activity masks), kept out
  of the two above;
- ``*_wire_bytes``: what it sends on the wire for them under ring collectives (``cost``);
- ``uncompressed_bytes``: what the gradients exchanged would take uncompressed.

An all-to-all counts the chunks that leave the worker (``(G - 1) / G`` of its tensor), so a
reduce-scatter by all-to-all plus an all-gather of its ``1 / G`` counts what an all-reduce does.

Seconds: ``compress_s`` (codec work before the last request of an exchange), ``communicate_s``
(waiting for collectives), ``decompress_s`` (codec work after the last result).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, fields

import torch

from .cost import ring_wire_bytes
from .protocol import Exchange, Op, Reduction, Scope, Topology, Transport, group_size, relay


@dataclass
class Traffic:
    """Bytes and seconds of one step, or of many added up (see the module docstring)."""

    intra_node_bytes: int = 0
    inter_node_bytes: int = 0
    control_bytes: int = 0
    uncompressed_bytes: int = 0
    intra_node_wire_bytes: float = 0.0
    inter_node_wire_bytes: float = 0.0
    compress_s: float = 0.0
    communicate_s: float = 0.0
    decompress_s: float = 0.0

    @property
    def sent_bytes(self) -> int:
        return self.intra_node_bytes + self.inter_node_bytes + self.control_bytes

    @property
    def compression_ratio(self) -> float:
        """Uncompressed bytes over bytes that crossed between nodes (all bytes on a one-level exchange)."""
        return self.uncompressed_bytes / self.inter_node_bytes if self.inter_node_bytes else float("nan")

    def count(self, op: Op, tensor: torch.Tensor, topology: Topology, control: bool = False) -> None:
        """Add a request's bytes (and their ring wire estimate) to the matching counters."""
        payload = tensor.numel() * tensor.element_size()
        size = group_size(topology, op.scope)
        if op.reduction is Reduction.ALLTOALL:  # its own chunk stays with the worker
            payload = payload * (size - 1) // size
        if control:
            self.control_bytes += payload
            return
        wire = ring_wire_bytes(op.reduction, tensor.numel() * tensor.element_size(), size)
        if op.scope is Scope.NODE:
            self.intra_node_bytes += payload
            self.intra_node_wire_bytes += wire
        else:
            self.inter_node_bytes += payload
            self.inter_node_wire_bytes += wire

    def add(self, other: Traffic) -> None:
        for name in _TRAFFIC_FIELDS:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_dict(self) -> dict[str, float]:
        out = {name: getattr(self, name) for name in _TRAFFIC_FIELDS}
        out.update(sent_bytes=self.sent_bytes, compression_ratio=self.compression_ratio)
        return out


_TRAFFIC_FIELDS = tuple(f.name for f in fields(Traffic))  # read once: every gradient adds its traffic twice


@dataclass
class Statistics:
    """``last_step`` and ``total`` (since construction) ``Traffic``; ``steps`` exchanged, of which
    ``skipped_steps`` were skipped (non-finite gradients, where the entry point skips)."""

    last_step: Traffic = field(default_factory=Traffic)
    total: Traffic = field(default_factory=Traffic)
    steps: int = 0
    skipped_steps: int = 0

    def begin_step(self) -> Traffic:
        """Start a fresh ``last_step`` and return it."""
        self.last_step = Traffic()
        return self.last_step

    def end_step(self, skipped: bool = False) -> None:
        """Add ``last_step`` to ``total`` and count the step."""
        self.total.add(self.last_step)
        self.steps += 1
        self.skipped_steps += skipped


@contextlib.contextmanager
def timed(traffic: Traffic, seconds: str) -> Iterator[None]:
    """Add the block's wall time to ``traffic``'s ``seconds`` field (``"compress_s"`` or ``"decompress_s"``)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        setattr(traffic, seconds, getattr(traffic, seconds) + time.perf_counter() - start)


class CountedCollectives:
    """``transport``'s blocking ``collective`` (all that ``drive_together`` calls), with the bytes and waits
    counted in ``traffic``."""

    def __init__(self, transport: Transport, traffic: Traffic) -> None:
        self.transport, self.traffic = transport, traffic

    def collective(self, op: Op, tensor: torch.Tensor) -> torch.Tensor:
        self.traffic.count(op, tensor, self.transport)
        start = time.perf_counter()
        result = self.transport.collective(op, tensor)
        self.traffic.communicate_s += time.perf_counter() - start
        return result


def counted(exchange: Exchange, traffic: Traffic, topology: Topology, control: bool = False) -> Exchange:
    """Pass ``exchange``'s requests through, counting their bytes and timing the codec work
    (before its last request: ``compress_s``; after: ``decompress_s``) and the waits (``communicate_s``)."""
    last = [time.perf_counter()]

    def elapsed() -> float:
        now = time.perf_counter()
        seconds, last[0] = now - last[0], now
        return seconds

    def on_request(op: Op, tensor: torch.Tensor) -> tuple[Op, torch.Tensor]:
        traffic.compress_s += elapsed()
        traffic.count(op, tensor, topology, control)
        return op, tensor

    def on_result(op: Op, result: torch.Tensor) -> torch.Tensor:
        traffic.communicate_s += elapsed()
        return result

    value = yield from relay(exchange, on_request, on_result)
    traffic.decompress_s += elapsed()
    return value
