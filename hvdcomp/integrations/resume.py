"""Checkpoints of ``DistributedOptimizer``, resuming at another world size, and Horovod elastic training.

``state_dict()`` adds ``"hvdcomp"``: the codec's state (per worker: error-feedback memories, rounding
generators, PowerSGD's Qs), the exchange step (which coordinate sets, PowerSGD's start and shared Qs
follow) and the world size. Before the first exchange after construction, ``load_state_dict`` or an
elastic re-synchronisation, every worker takes part in one small agreement (``agree_on_state``).

What can be kept is kept: the model, the wrapped optimizer's state (momenta, moments, its step counts)
and the exchange step. What belongs to one worker of one world cannot be carried into another and is
reset on every worker alike, the codec starting again as at construction (bound to the worker's rank):

- **another world size**: a state saved by W workers, loaded into W' != W (each worker may load any
  worker's checkpoint), keeps the rest and warns that the codec state is reset;
- **Horovod elastic** (``hvd.elastic.TorchState(model=..., optimizer=...)``): when the state is
  re-synchronised after a membership change (``OptimizerStateHandler.sync``, which calls
  ``broadcast_optimizer_state``), in-flight exchanges are dropped, the topology is read again, and at the
  next exchange the workers adopt the highest exchange step and reset their codecs, with one log line.
Outside elastic re-synchronisation, workers holding different exchange steps (a checkpoint loaded on
some workers only) are refused on every worker instead of diverging silently.
"""

from __future__ import annotations

import copy
import logging
import warnings
from typing import Any, Callable

import torch

from ..exchange.protocol import Op
from .parity import called_by_elastic_sync

LOG = logging.getLogger("hvdcomp")  # without logging configured, warnings still reach stderr


def remember_fresh_codec(optimizer: Any) -> None:
    """Keep the codec's state at construction: what a reset returns it to."""
    optimizer._fresh_codec_state = copy.deepcopy(optimizer._codec.state_dict())


def reset_codec(optimizer: Any) -> None:
    """The codec as at construction, bound to this worker's current rank."""
    optimizer._codec.load_state_dict(copy.deepcopy(optimizer._fresh_codec_state))
    optimizer._codec.bind_transport(optimizer._transport)


def exchange_state(optimizer: Any) -> dict[str, Any]:
    """The ``"hvdcomp"`` entry of the optimizer's state dict; called by Horovod elastic's re-synchronisation
    (every worker, after a membership change), it first prepares the optimizer for the new world."""
    if optimizer._codec is not None and called_by_elastic_sync():
        _prepare_resync(optimizer)
    codec = None if optimizer._codec is None else optimizer._codec.state_dict()
    size = optimizer._transport.size if optimizer._codec is not None else None
    return {"codec": codec, "exchange_step": optimizer._exchange_step, "world_size": size}


def load_exchange_state(optimizer: Any, state_dict: dict[str, Any],
                        load_torch_state: Callable[[dict[str, Any]], None]) -> None:
    """Load a state dict from ``state_dict()``: the wrapped optimizer's part with ``load_torch_state``,
    then the ``"hvdcomp"`` entry (absent in a plain torch state dict: the exchange state stays). Saved by
    another number of workers: the codec is reset, with a warning."""
    state_dict = dict(state_dict)
    ours = state_dict.pop("hvdcomp", None)
    load_torch_state(state_dict)
    _drop_exchanges(optimizer)
    optimizer._agreed = False
    if ours is None:
        return
    optimizer._exchange_step = ours["exchange_step"]
    if optimizer._codec is None or ours["codec"] is None:
        return
    saved, size = ours.get("world_size"), optimizer._transport.size
    if saved is None or saved == size:
        optimizer._codec.load_state_dict(ours["codec"])
        return
    reset_codec(optimizer)
    warnings.warn(f"hvdcomp: this optimizer state was saved by {saved} workers and is loaded into {size}: the "
                  "model, the optimizer's state and the exchange step are kept; the per-worker codec state "
                  "(error-feedback memories, rounding generators, PowerSGD's Qs) starts afresh", RuntimeWarning,
                  stacklevel=3)


def agree_on_state(optimizer: Any) -> None:
    """Before the first exchange after construction, ``load_state_dict`` or an elastic re-synchronisation:
    the workers' exchange steps (coordinate sets, PowerSGD's start and its shared Qs follow them) must
    agree. After an elastic re-synchronisation every worker adopts the highest and resets its codec;
    otherwise different steps (a checkpoint loaded on some workers only: ``broadcast_optimizer_state``
    does not carry hvdcomp's per-worker state) are refused on every worker. (24 bytes, not counted in
    ``stats``, so that a resumed run counts what an unbroken one does.)"""
    transport = optimizer._transport
    step, resync = float(optimizer._exchange_step), float(optimizer._resync)
    request = torch.tensor([step, -step, resync], dtype=torch.float64)
    highest, lowest, resync = transport.wait(transport.start(Op.MAX, request, f"{optimizer._prefix}.agree")).tolist()
    lowest = -lowest
    if resync:
        optimizer._resync = False
        if highest > 0:
            reset_codec(optimizer)
            optimizer._exchange_step = int(highest)
            if transport.rank == 0:
                LOG.warning("hvdcomp: workers changed (elastic): the codec state (error-feedback memories, rounding "
                            "generators, PowerSGD's Qs) is reset on all %d workers; the model, the optimizer's "
                            "state and the exchange step (%d) are kept", transport.size, int(highest))
    elif highest != lowest:
        raise RuntimeError(f"hvdcomp.DistributedOptimizer: the workers hold different hvdcomp states (exchange "
                           f"steps {int(lowest)} to {int(highest)}): every worker must load its own "
                           "optimizer.state_dict() (or, at another world size, any worker's; "
                           "hvd.broadcast_optimizer_state does not carry hvdcomp's per-worker state), or none")
    optimizer._agreed = True


def _prepare_resync(optimizer: Any) -> None:
    """Local part of an elastic re-synchronisation: drop what a failed step left in flight, forget the
    old world's topology (process sets, node sizes) and agree again before the next exchange."""
    _drop_exchanges(optimizer)
    forget = getattr(optimizer._transport, "forget_topology", None)
    if forget is not None:
        forget()
    optimizer._agreed = False
    optimizer._resync = True


def _drop_exchanges(optimizer: Any) -> None:
    """Forget a step's exchanges (after a failure, or before loading a state): nothing in flight."""
    for bucket in getattr(optimizer, "_buckets", ()):
        bucket.ready, bucket.launched, bucket.exchange, bucket.handle = 0, False, None, None
        bucket.rounds.clear()
    for p in getattr(optimizer, "_counts", {}):
        optimizer._counts[p] = 0
    optimizer._inflight.clear()
    optimizer._sparse.clear()
    optimizer._fresh_step = True
    optimizer._synchronized = False
