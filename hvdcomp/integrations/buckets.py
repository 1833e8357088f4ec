"""How ``DistributedOptimizer`` names its parameters, orders them and names its collectives, as Horovod does.

Names follow ``hvd.DistributedOptimizer``: ``named_parameters`` must be ``(name, parameter)`` tuples
with unique names that cover every parameter the optimizer holds (names of other parameters, e.g. a
frozen layer left out of a fine-tuning optimizer, are accepted); without it, parameter ``j`` of
group ``i`` is ``allreduce.noname.{i}.{j}``. Buckets (``hvdcomp.exchange.plan``) follow the order of
``named_parameters`` (the model's, the same on every worker whatever order the optimizer lists them in).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..codec.seeding import stable_seed

Parameter = torch.nn.Parameter
_ORDINALS: dict[tuple, int] = {}  # optimizers created in this process per (parameter names, process set)


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


def model_order(params: Sequence[Parameter], named: Sequence[tuple[str, Parameter]] | None) -> list[Parameter]:
    """``params`` in the order of ``named`` (``named_parameters``: the model's order), or as given without it."""
    if named is None:
        return list(params)
    position: dict[Parameter, int] = {}
    for _, p in named:
        position.setdefault(p, len(position))
    return sorted(params, key=position.__getitem__)


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
