"""Checkpoints of ``Birder``: this worker's moments, active mask, step count and generator.

Each worker must save and load its own (``m`` and ``b`` follow its own gradients) for an exact resume.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch


def birder_state(optimizer: Any) -> dict[str, Any]:
    """The ``"birder"`` entry of Birder's state dict (copies)."""
    layout = optimizer._ensure_buffers()
    generator = optimizer._generator
    return {
        "numel": layout.numel,
        "step": optimizer._step,
        "m": optimizer._m.clone(),
        "b": optimizer._b.clone(),
        "active": optimizer._active.clone(),
        "rank": optimizer._generator_rank,
        "generator": None if generator is None else generator.get_state(),
    }


def load_birder_state(optimizer: Any, state_dict: dict[str, Any],
                      load_torch_state: Callable[[dict[str, Any]], None]) -> None:
    """Load a Birder state dict: torch's part with ``load_torch_state``, then the ``"birder"`` entry;
    ``ValueError`` (nothing loaded) if it is missing or holds another element count."""
    state_dict = dict(state_dict)
    birder = state_dict.pop("birder", None)
    if birder is None:
        raise ValueError("Birder.load_state_dict: no 'birder' entry (not a Birder state dict)")
    layout = optimizer._ensure_buffers()
    if birder["numel"] != layout.numel:
        raise ValueError(f"Birder.load_state_dict: {birder['numel']} elements saved, {layout.numel} here")
    load_torch_state(state_dict)
    optimizer._step = int(birder["step"])
    optimizer._m.copy_(birder["m"])
    optimizer._b.copy_(birder["b"])
    optimizer._active.copy_(birder["active"])
    optimizer._all_active = bool(optimizer._active.all())
    if birder["generator"] is None:
        optimizer._generator, optimizer._generator_rank = None, None
        return
    if optimizer._generator_rank is not None and birder["rank"] != optimizer._generator_rank:
        warnings.warn(f"Birder: loading rank {birder['rank']}'s state on rank {optimizer._generator_rank}; "
                      "each worker should load its own", RuntimeWarning, stacklevel=3)
    optimizer._generator = torch.Generator(device=layout.device)
    optimizer._generator.set_state(birder["generator"])
    optimizer._generator_rank = birder["rank"]
