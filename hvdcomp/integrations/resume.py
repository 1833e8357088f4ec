"""Checkpoints of ``DistributedOptimizer``: its exchange state in the state dict, and the agreement on it.

``state_dict()`` adds ``"hvdcomp"``: the codec's state (per worker: error-feedback memories, rounding
generators, PowerSGD's Qs) and the exchange step (which coordinate sets, PowerSGD's start and shared Qs
follow). Before the first exchange after construction or ``load_state_dict``, every worker takes part
in one small agreement (``agree_on_state``), so a state loaded on some workers only is refused on all.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..exchange.protocol import Op


def exchange_state(optimizer: Any) -> dict[str, Any]:
    """The ``"hvdcomp"`` entry of the optimizer's state dict."""
    codec = None if optimizer._codec is None else optimizer._codec.state_dict()
    return {"codec": codec, "exchange_step": optimizer._exchange_step}


def load_exchange_state(optimizer: Any, state_dict: dict[str, Any],
                        load_torch_state: Callable[[dict[str, Any]], None]) -> None:
    """Load a state dict from ``state_dict()``: the wrapped optimizer's part with ``load_torch_state``,
    then the ``"hvdcomp"`` entry (absent in a plain torch state dict: the exchange state stays)."""
    state_dict = dict(state_dict)
    ours = state_dict.pop("hvdcomp", None)
    load_torch_state(state_dict)
    optimizer._synchronized = False
    optimizer._agreed = False
    if ours is not None:
        if optimizer._codec is not None and ours["codec"] is not None:
            optimizer._codec.load_state_dict(ours["codec"])
        optimizer._exchange_step = ours["exchange_step"]


def agree_on_state(optimizer: Any) -> None:
    """Before the first exchange after construction or ``load_state_dict``: every worker must hold
    the same exchange step (coordinate sets, PowerSGD's start and its shared Qs follow it). Horovod's
    ``broadcast_optimizer_state`` does not carry hvdcomp's per-worker state, so a checkpoint of it
    loaded on some workers only is refused here, on every worker, instead of diverging silently.
    (16 bytes once, not counted in ``stats``, so that a resumed run counts what an unbroken one does.)"""
    transport = optimizer._transport
    step = float(optimizer._exchange_step)
    request = torch.tensor([step, -step], dtype=torch.float64)
    seen = transport.wait(transport.start(Op.MAX, request, f"{optimizer._prefix}.agree"))
    if seen[0] != -seen[1]:
        raise RuntimeError(f"hvdcomp.DistributedOptimizer: the workers hold different hvdcomp states (exchange "
                           f"steps {int(-seen[1])} to {int(seen[0])}): every worker must load its own "
                           "optimizer.state_dict() (hvd.broadcast_optimizer_state does not carry hvdcomp's "
                           "per-worker state), or none")
    optimizer._agreed = True
