"""Checkpoints of ``Birder``: this worker's moments, active mask, step count and seed, and the verdict of
its route trial (``"route"``: True, False, or None where there was none); resuming at another world size;
Horovod elastic re-synchronisation.

Each worker must save and load its own (``m`` and ``b`` follow its own gradients) for an exact resume; the
random streams are counter-based (keyed by seed, rank and step), so they need no state. Loaded into another
number of workers (each may load any worker's checkpoint), the moments, the active mask (the same on every
worker) and the step are kept, with a warning. Under ``hvd.elastic.TorchState(model=..., optimizer=birder)``
the elastic re-synchronisation (``broadcast_optimizer_state`` calls ``step()``) agrees the active masks (a
joining worker has none) and starts the route trial again; each worker keeps its ``m`` and ``b`` (a joining
one starts from zero) and draws from its current rank's streams, with one log line when anything was changed.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable

import torch

from ..codec.packing import LaneLayout
from ..exchange.protocol import Op
from ..transport._compat import called_by_elastic_sync

LOG = logging.getLogger("hvdcomp")
BIRDER_KEYS = ("numel", "step", "seed", "m", "b", "active", "rank", "world_size")


def birder_state(optimizer: Any) -> dict[str, Any]:
    """The ``"birder"`` entry of Birder's state dict (copies)."""
    layout = optimizer._ensure_buffers()
    return {
        "numel": layout.numel,
        "step": optimizer._step,
        "seed": optimizer.seed,
        "m": optimizer._m.clone(),
        "b": optimizer._b.clone(),
        "active": optimizer._active.clone(),
        "rank": optimizer._rank,
        "world_size": None if optimizer._transport is None else optimizer._transport.size,
        "route": _route_verdict(optimizer),
    }


def _route_verdict(optimizer: Any) -> bool | None:
    """The route trial's verdict to save: the trial's since the last agreement, else the one loaded (None: none).
    A load keeps it (a checkpoint taken during the trial starts it again)."""
    if not optimizer._agreed:
        return optimizer._saved_route
    return None if optimizer.route_trial is None else optimizer.route_trial.choice


def load_birder_state(optimizer: Any, state_dict: dict[str, Any],
                      load_torch_state: Callable[[dict[str, Any]], None]) -> None:
    """Load a Birder state dict: torch's part with ``load_torch_state``, then the ``"birder"`` entry;
    ``ValueError`` (nothing loaded) if it is missing, lacks a key, or holds another element count. ``"route"``
    may be missing (a state saved before route trials): no verdict."""
    state_dict = dict(state_dict)
    birder = state_dict.pop("birder", None)
    if birder is None:
        raise ValueError("Birder.load_state_dict: no 'birder' entry (not a Birder state dict)")
    layout = optimizer._ensure_buffers()
    missing = sorted(set(BIRDER_KEYS) - set(birder))
    if missing:
        raise ValueError(f"Birder.load_state_dict: the 'birder' entry lacks {missing}")
    if birder["numel"] != layout.numel:
        raise ValueError(f"Birder.load_state_dict: {birder['numel']} elements saved, {layout.numel} here")
    load_torch_state(state_dict)
    optimizer._agreed = False
    optimizer._step = int(birder["step"])
    optimizer.seed = birder["seed"]
    optimizer._m.copy_(birder["m"])
    optimizer._b.copy_(birder["b"])
    optimizer._active.copy_(birder["active"])
    optimizer._all_active = bool(optimizer._active.all())
    optimizer._saved_route = birder.get("route")
    saved = birder["world_size"]  # None: stepped without a transport (simulate)
    size = None if saved is None else optimizer.transport.size
    if saved != size:
        optimizer._rank = None
        warnings.warn(f"Birder: this state was saved by {saved} workers and is loaded into {size}: m, b, the "
                      "active mask and the step are kept; this worker draws from its own rank's streams",
                      RuntimeWarning, stacklevel=3)
        return
    if optimizer._rank is not None and birder["rank"] != optimizer._rank:
        warnings.warn(f"Birder: loading rank {birder['rank']}'s state on rank {optimizer._rank}; "
                      "each worker should load its own", RuntimeWarning, stacklevel=3)
    optimizer._rank = birder["rank"]


def resync_birder(optimizer: Any) -> None:
    """When Horovod elastic re-synchronises (every worker, after each (re)start): agree the active masks
    (see the module docstring); a worker whose rank moved draws from its new rank's streams. Otherwise
    nothing."""
    if not called_by_elastic_sync():
        return
    transport = optimizer.transport
    transport.forget_topology()  # Horovod was initialised again
    optimizer._agreed, optimizer._resynced = False, True
    optimizer._saved_route = None  # a joining worker has no verdict: every worker tries the routes again
    layout = optimizer._ensure_buffers()
    moved = optimizer._rank is not None and optimizer._rank != transport.rank
    optimizer._rank = transport.rank
    lanes = LaneLayout(span=1, world_size=transport.size)
    counts = transport.collective(Op.SUM, lanes.pack(optimizer._active.view(torch.uint8), validate=False))
    agreed = lanes.unpack(counts, layout.numel) > 0
    changed = not torch.equal(agreed, optimizer._active)
    anyone = transport.collective(Op.MAX, torch.tensor([float(changed or moved)], dtype=torch.float64))
    optimizer._active.copy_(agreed)
    optimizer._all_active = bool(agreed.all())
    if anyone.item() > 0 and transport.rank == 0:
        LOG.warning("Birder: workers changed (elastic): active masks agreed on all %d workers; each worker keeps "
                    "its m and b (a new one starts from zero) and draws from its current rank's streams",
                    transport.size)
