"""Bucket plans: which gradients every entry point exchanges together, identified by name.

A plan lists buckets of tensors of one dtype and device, in the order backward produces their gradients
(reverse parameter order): about ``bucket_size_mb`` MiB each by default; Horovod's ``groups`` maps onto
them: an integer splits the tensors into that many buckets as Horovod splits its groups, a list of tensor
lists makes each list a bucket (split by dtype and device where they differ) and the rest are bucketed by
size. The caller orders the tensors by a rule that is the same on every worker (a model's parameter order).

A caller that receives gradients in buckets of its own (DDP's: ``Delivery``) passes their sizes, and no
planned bucket spans two of them, so each starts its exchange as soon as the delivery that completes it
arrives (docs/benchmarks.md#the-ddp-door-without-waits-in-backward).

``signature`` describes a plan by (name, numel, dtype) per bucket, so the workers' agreement
(``hvdcomp.exchange.state``) compares names, not positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class Bucket:
    """One bucket of a plan: its tensors, their names, and the flat buffers its exchanges use."""

    index: int
    params: list[torch.Tensor]
    names: list[str]
    dtype: torch.dtype  # the tensors' dtype when planned
    _flat: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)  # per dtype, reused every step

    @property
    def sizes(self) -> list[int]:
        return [p.numel() for p in self.params]

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    @property
    def key(self) -> str:
        """The bucket's key for codec state and collective names: the same on every worker."""
        return f"bucket{self.index}"

    def flat(self, dtype: torch.dtype) -> torch.Tensor:
        """This bucket's persistent ``[numel]`` buffer of ``dtype`` (the concatenated gradients an element-wise
        codec exchanges)."""
        buffer = self._flat.get(dtype)
        if buffer is None:
            buffer = self._flat[dtype] = torch.zeros(sum(self.sizes), dtype=dtype, device=self.device)
        return buffer

    def signature(self) -> tuple:
        return tuple((name, p.numel(), str(self.dtype)) for name, p in zip(self.names, self.params))


@dataclass(frozen=True)
class Delivery:
    """How a caller receives gradients, by DDP's rule: per dtype and device, in reverse parameter order, a
    delivery bucket closes as soon as it holds at least ``first_mb`` MiB (the first) or ``rest_mb`` MiB (each
    later one)."""

    first_mb: float
    rest_mb: float


def _by_size(params: Sequence[torch.Tensor], bucket_size_mb: float,
             delivery: Delivery | None = None) -> list[list[torch.Tensor]]:
    limit = bucket_size_mb * 2**20
    open_buckets: dict[tuple, tuple[list[torch.Tensor], int]] = {}
    delivered: dict[tuple, tuple[int, int]] = {}  # per kind: bytes in the open delivery bucket, deliveries closed
    buckets: list[list[torch.Tensor]] = []
    for p in reversed(params):  # backward produces gradients roughly in reverse order
        kind = (p.dtype, p.device)
        current, nbytes = open_buckets.get(kind, ([], 0))
        size = p.numel() * p.element_size()
        if current and nbytes + size > limit:
            buckets.append(current)
            current, nbytes = [], 0
        current.append(p)
        open_buckets[kind] = (current, nbytes + size)
        if delivery is not None:
            filled, closed = delivered.get(kind, (0, 0))
            filled += size
            if filled >= (delivery.rest_mb if closed else delivery.first_mb) * 2**20:  # the delivery closes here
                buckets.append(current)
                open_buckets[kind] = ([], 0)
                filled, closed = 0, closed + 1
            delivered[kind] = (filled, closed)
    return buckets + [b for b, _ in open_buckets.values() if b]


def _by_kind(params: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    kinds: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        kinds.setdefault((p.dtype, p.device), []).append(p)
    return list(kinds.values())


def plan_buckets(params: Sequence[torch.Tensor], names: dict[torch.Tensor, str], bucket_size_mb: float,
                 groups: int | list | None = None, delivery: Delivery | None = None) -> list[Bucket]:
    """The buckets of ``params`` (see the module docstring); ``names[p]`` names each tensor alike on every worker.
    ``delivery``: the buckets the caller receives gradients in (without ``groups``), which no planned bucket spans."""
    if groups is None or groups == 0:
        lists = _by_size(params, bucket_size_mb, delivery)
    elif isinstance(groups, int):
        count = min(groups, len(params))  # Horovod's split_list: near-equal counts, in order
        base, extra = divmod(len(params), count) if count else (0, 0)
        bounds = [i * base + min(i, extra) for i in range(count + 1)]
        lists = [b for lo, hi in zip(bounds, bounds[1:]) for b in _by_kind(params[lo:hi])]
    else:
        planned = {id(p) for p in params}
        listed = [[p for p in group if id(p) in planned] for group in groups]
        seen = {id(p) for group in listed for p in group}
        rest = [p for p in params if id(p) not in seen]
        lists = [b for group in listed if group for b in _by_kind(group)] + _by_size(rest, bucket_size_mb)
    return [Bucket(i, b, [names[p] for p in b], b[0].dtype) for i, b in enumerate(lists)]


def signature(plan: Sequence[Bucket]) -> tuple:
    """The plan as (name, numel, dtype) per tensor, bucket by bucket: equal on workers that exchange alike."""
    return tuple(bucket.signature() for bucket in plan)
