"""What the entry points need to behave like Horovod's own optimizers: its warning text, its
``broadcast_optimizer_state`` protocol, its elastic re-synchronisation, and gradient hooks that let go."""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch

_CODEC_OWNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # codec -> weakref to its optimizer
STEP_AFTER_SYNCHRONIZE = ("optimizer.step() called without optimizer.skip_synchronize() context after "
                          "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                          "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in your "
                          "code.")  # Horovod 0.28.1's own text


def called_by_broadcast_optimizer_state() -> bool:
    """Whether Horovod's ``broadcast_optimizer_state`` called the current ``step()`` (directly or through
    torch's step wrappers) to initialise an empty optimizer state. It does that on the ranks whose state
    is empty only and skips the exchange for Horovod's own optimizers, so ours must not exchange either."""
    functions = sys.modules.get("horovod.torch.functions")
    return functions is not None and _called_from(functions.broadcast_optimizer_state.__code__, 4)


def called_by_elastic_sync() -> bool:
    """Whether Horovod elastic's ``OptimizerStateHandler.sync`` is behind the current call (through
    ``broadcast_optimizer_state``, which calls ``state_dict()`` and, on an empty state, ``step()``): every
    worker re-synchronises there after each (re)start of ``hvd.elastic.run``."""
    state = sys.modules.get("horovod.torch.elastic.state")
    return state is not None and _called_from(state.OptimizerStateHandler.sync.__code__, 8)


def _called_from(code: Any, frames: int) -> bool:
    """Whether ``code`` runs in one of the ``frames`` frames above the method that asks (the caller of
    ``called_by_*``'s caller)."""
    frame = sys._getframe(3)
    for _ in range(frames):
        if frame is None:
            return False
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def attach_weak_hooks(optimizer: Any, params: list[torch.nn.Parameter]) -> list[Any]:
    """Register ``optimizer._on_gradient`` as each parameter's post-accumulate-grad hook, without keeping
    the optimizer alive: once it is dropped the hooks do nothing and are removed. Returns the handles
    (``remove_hooks`` detaches them)."""
    ref = weakref.ref(optimizer)

    def hook(p: torch.nn.Parameter) -> None:
        live = ref()
        if live is not None:
            live._on_gradient(p)

    handles = [p.register_post_accumulate_grad_hook(hook) for p in params]
    weakref.finalize(optimizer, remove_hooks, handles)
    return handles


def remove_hooks(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


def claim_codec(codec: Any, optimizer: Any) -> Any:
    """``codec``, now serving ``optimizer``; ``ValueError`` if it already serves another live one (its
    state, e.g. error-feedback memory keyed by bucket, would mix the two). A codec around another
    (``inner``) claims that one too."""
    if codec.inner is not None:
        claim_codec(codec.inner, optimizer)
    owner = _CODEC_OWNERS.get(codec)
    live = None if owner is None else owner()
    if live is not None and live is not optimizer and live._included:
        raise ValueError("this compression object already serves another DistributedOptimizer; give each "
                         "optimizer its own (codec state such as error-feedback memory is per optimizer)")
    _CODEC_OWNERS[codec] = weakref.ref(optimizer)
    return codec
