"""Birder's flat view of its parameters: where each one lives in the flat float32 buffers (``m``, ``b``, the
gradient, the mean), which spans a step updates, the flat gradient, and the update from the mean."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..codec.onebit import MomentRuns, apply_updates, gather_checked, zero_inactive


def layout_key(param_groups: list[dict[str, Any]]) -> tuple:
    """What fixes the layout: each parameter's identity and size, in order."""
    return tuple((id(p), p.numel()) for group in param_groups for p in group["params"])


@dataclass
class FlatLayout:
    """The parameters of all groups in order; parameter ``i`` is elements ``[offsets[i], end(i))``."""

    params: list[torch.Tensor]
    offsets: list[int]
    group_indices: list[range]  # each param group's indices into params / offsets
    numel: int
    device: torch.device
    key: tuple

    @classmethod
    def of(cls, param_groups: list[dict[str, Any]]) -> FlatLayout:
        """The layout of ``param_groups`` (parameters all on one device, else ValueError)."""
        params, offsets, indices, offset = [], [], [], 0
        for group in param_groups:
            indices.append(range(len(params), len(params) + len(group["params"])))
            for p in group["params"]:
                params.append(p)
                offsets.append(offset)
                offset += p.numel()
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(f"Birder: all parameters must be on one device, got {sorted(map(str, devices))}")
        device = devices.pop() if devices else torch.device("cpu")
        return cls(params, offsets, indices, offset, device, layout_key(param_groups))

    def end(self, i: int) -> int:
        """The element after parameter ``i``."""
        return self.offsets[i] + self.params[i].numel()

    def moment_runs(self, param_groups: list[dict[str, Any]], updated: list[bool]) -> MomentRuns:
        """The spans of the ``updated`` parameters (adjacent ones merged within a group), each with its group's
        ``beta``, in order."""
        runs: list[tuple[int, int, float]] = []
        for group, indices in zip(param_groups, self.group_indices):
            start = len(runs)
            for i in (i for i in indices if updated[i]):
                if len(runs) > start and runs[-1][1] == self.offsets[i]:
                    runs[-1] = (runs[-1][0], self.end(i), group["beta"])
                else:
                    runs.append((self.offsets[i], self.end(i), group["beta"]))
        return runs

    def ending_by(self, first: int, end: int) -> int:
        """The first parameter from index ``first`` on that does not end by element ``end``."""
        while first < len(self.params) and self.end(first) <= end:
            first += 1
        return first

    def gather_grads(self, flat: torch.Tensor, active: torch.Tensor | None) -> tuple[list[float], bool, bool]:
        """``flat`` (float32 ``[numel]``) <- the gradients (zero for a parameter without one); returns per parameter
        1.0 if it has one, and ``onebit.gradient_checks(flat, active)`` (taken in the copy's pass)."""
        grads = [p.grad if p.requires_grad else None for p in self.params]
        for grad in grads:
            if grad is not None and (grad.is_sparse or grad.layout != torch.strided):
                raise TypeError("Birder does not support sparse gradients")
        finite, fresh = gather_checked([None if g is None else g.detach() for g in grads], self.offsets, flat, active)
        return [float(g is not None) for g in grads], finite, fresh

    def apply_update(self, param_groups: list[dict[str, Any]], mean: torch.Tensor, active: torch.Tensor | None,
                     updated: list[bool], first: int, end: int) -> int:
        """``x <- x - lr (u_bar + weight_decay x)`` (``u_bar``: ``mean``, zeroed here where ``active`` is False; None:
        all active) for the ``updated`` parameters from index ``first`` on that end by element ``end``; returns the
        first one left."""
        last = self.ending_by(first, end)
        if last > first and active is not None:
            lo, hi = self.offsets[first], self.end(last - 1)
            zero_inactive(mean[lo:hi], active[lo:hi])
        chosen, keeps, steps = [], [], []
        for group, indices in zip(param_groups, self.group_indices):
            lr, decay = group["lr"], group["weight_decay"]
            picked = [i for i in range(max(first, indices.start), min(last, indices.stop)) if updated[i]]
            chosen += picked
            keeps += [1 - lr * decay] * len(picked)
            steps += [-lr] * len(picked)
        apply_updates([self.params[i] for i in chosen], [self.offsets[i] for i in chosen], keeps, steps, mean)
        return last
