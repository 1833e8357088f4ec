"""What the entry points need to behave like Horovod's own optimizers: its warning text, its
``broadcast_optimizer_state`` protocol, and gradient hooks that let go."""

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
    if functions is None:
        return False
    target = functions.broadcast_optimizer_state.__code__
    frame = sys._getframe(2)  # the caller of the step() that called this
    for _ in range(4):
        if frame is None:
            return False
        if frame.f_code is target:
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
    state, e.g. error-feedback memory keyed by bucket, would mix the two)."""
    owner = _CODEC_OWNERS.get(codec)
    live = None if owner is None else owner()
    if live is not None and live is not optimizer and live._included:
        raise ValueError("this compression object already serves another DistributedOptimizer; give each "
                         "optimizer its own (codec state such as error-feedback memory is per optimizer)")
    _CODEC_OWNERS[codec] = weakref.ref(optimizer)
    return codec
