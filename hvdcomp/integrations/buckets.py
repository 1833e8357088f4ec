"""How ``DistributedOptimizer`` names parameters and groups them into buckets.

Names follow ``hvd.DistributedOptimizer``: ``named_parameters`` must be ``(name, parameter)`` tuples
with unique names that cover every parameter the optimizer holds (names of other parameters, e.g. a
frozen layer left out of a fine-tuning optimizer, are accepted); without it, parameter ``j`` of
group ``i`` is ``allreduce.noname.{i}.{j}``.

Buckets hold trainable parameters of one dtype and device, in reverse order (the order backward
produces gradients): about ``bucket_size_mb`` each by default; Horovod's ``groups`` maps onto them:
an integer splits the trainable parameters into that many buckets as Horovod splits its groups, a
list of parameter lists makes each list a bucket (split by dtype and device where they differ) and
the rest are bucketed by size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..codec.seeding import stable_seed
from ..exchange.protocol import Exchange, Scope

Parameter = torch.nn.Parameter
_ORDINALS: dict[tuple, int] = {}  # optimizers created in this process per (parameter names, process set)


@dataclass(eq=False)
class Bucket:
    """One bucket: its parameters, a persistent float32 buffer of their gradients, and its exchange."""

    index: int
    params: list[Parameter]
    dtype: torch.dtype
    buffer: torch.Tensor  # float32 [numel]: the bucket's gradients, concatenated
    ready: int = 0  # gradients complete this step
    launched: bool = False  # exchange started this step (it may have finished already)
    result_kept: bool = False  # this step's codec returns a result it never writes again (reuses_result False)
    exchange: Exchange | None = None
    handle: Any = None
    rounds: dict[Scope, int] = field(default_factory=dict)  # collectives started per scope this step

    @property
    def sizes(self) -> list[int]:
        return [p.numel() for p in self.params]


def parameter_names(named_parameters: Any, param_groups: Sequence[dict[str, Any]]) -> dict[Parameter, str]:
    """Horovod's ``_parameter_names``: each parameter's name (see the module docstring)."""
    if named_parameters is None:
        return {p: f"allreduce.noname.{i}.{j}" for i, group in enumerate(param_groups)
                for j, p in enumerate(group["params"])}
    named = list(named_parameters)
    if any(not isinstance(item, tuple) or len(item) != 2 or not isinstance(item[0], str) for item in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), usually produced by "
                         "model.named_parameters().")
    names = [name for name, _ in named]
    if len(set(names)) != len(names):
        dups = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: {', '.join(dups)}")
    by_param = {p: name for name, p in sorted(named, key=lambda item: item[0])}
    unnamed = [p for group in param_groups for p in group["params"] if p not in by_param]
    if unnamed:
        raise ValueError(f"named_parameters was specified, but {len(unnamed)} of the optimizer's parameters "
                         "were not named")
    return by_param


def collective_prefix(names: Sequence[str], group: object) -> str:
    """The prefix of an optimizer's collective names: from its parameter names, its process ``group`` and
    its ordinal among optimizers over the same in this process. Every rank must build its optimizers in
    the same order (and count them whether it belongs to the group or not), so the names agree."""
    identity = (tuple(sorted(names)), group)
    ordinal = _ORDINALS.get(identity, 0)
    _ORDINALS[identity] = ordinal + 1
    return f"hvdcomp.{stable_seed(identity) % 16**8:08x}.{ordinal}"


def _by_size(params: Sequence[Parameter], bucket_size_mb: float) -> list[list[Parameter]]:
    limit = bucket_size_mb * 2**20
    open_buckets: dict[tuple, tuple[list[Parameter], int]] = {}
    buckets: list[list[Parameter]] = []
    for p in reversed(params):  # backward produces gradients roughly in reverse order
        kind = (p.dtype, p.device)
        current, nbytes = open_buckets.get(kind, ([], 0))
        size = p.numel() * p.element_size()
        if current and nbytes + size > limit:
            buckets.append(current)
            current, nbytes = [], 0
        current.append(p)
        open_buckets[kind] = (current, nbytes + size)
    return buckets + [b for b, _ in open_buckets.values() if b]


def _by_kind(params: Sequence[Parameter]) -> list[list[Parameter]]:
    kinds: dict[tuple, list[Parameter]] = {}
    for p in params:
        kinds.setdefault((p.dtype, p.device), []).append(p)
    return list(kinds.values())


def plan_buckets(params: Sequence[Parameter], bucket_size_mb: float, groups: int | list | None) -> list[Bucket]:
    """The buckets of the trainable ``params`` (see the module docstring)."""
    if groups is None or groups == 0:
        lists = _by_size(params, bucket_size_mb)
    elif isinstance(groups, int):
        count = min(groups, len(params))  # Horovod's split_list: near-equal counts, in order
        base, extra = divmod(len(params), count) if count else (0, 0)
        bounds = [i * base + min(i, extra) for i in range(count + 1)]
        lists = [b for lo, hi in zip(bounds, bounds[1:]) for b in _by_kind(params[lo:hi])]
    else:
        trainable = {id(p) for p in params}
        listed = [[p for p in group if id(p) in trainable] for group in groups]
        seen = {id(p) for group in listed for p in group}
        rest = [p for p in params if id(p) not in seen]
        lists = [b for group in listed if group for b in _by_kind(group)] + _by_size(rest, bucket_size_mb)
    return [Bucket(i, b, b[0].dtype, torch.zeros(sum(p.numel() for p in b), device=b[0].device))
            for i, b in enumerate(lists)]


def check_groups(groups: Any) -> None:
    """Horovod's checks of ``groups``: a non-negative integer, or lists of tensors, each tensor once."""
    if groups is None:
        return
    if isinstance(groups, bool) or not (isinstance(groups, list) or (isinstance(groups, int) and groups >= 0)):
        raise ValueError("groups should be a non-negative integer or a list of list of torch.Tensor.")
    if isinstance(groups, list):
        seen: set[int] = set()
        for group in groups:
            for p in group:
                if not isinstance(p, torch.Tensor):
                    raise ValueError("groups must consist of torch.Tensor.")
                if id(p) in seen:
                    raise ValueError("A parameter can only appear once in groups.")
                seen.add(id(p))
