"""What the entry points need to behave like Horovod's own optimizers: its warning text, its
``broadcast_optimizer_state`` protocol, its elastic re-synchronisation, and gradient hooks that let go."""

from __future__ import annotations

import weakref
from typing import Any

import torch

_CODEC_OWNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # codec -> weakref to its optimizer
STEP_AFTER_SYNCHRONIZE = ("optimizer.step() called without optimizer.skip_synchronize() context after "
                          "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                          "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in your "
                          "code.")  # Horovod 0.28.1's own text


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
