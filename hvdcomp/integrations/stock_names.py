"""Which gradient Horovod's stock ``hvd.DistributedOptimizer`` is compressing, read from its frames.

Horovod calls ``compression.compress(tensor)`` without saying whose gradient ``tensor`` is. For the
pinned Horovod (0.28.1), ``stock_call`` reads it from the frame that called ``compress`` when that
frame runs the code of ``horovod.torch.optimizer._DistributedOptimizer``:

- ``_allreduce_grad_async(self, p)``: its local ``name``, the name it then passes to
  ``allreduce_async_`` for the gradient (during backward, from the hooks, and in ``synchronize()`` for
  the parameters whose hook did not fire);
- ``_grouped_allreduce_grad_async(self, ps)`` (``groups=``): the comprehension's ``p``, named by
  ``self._parameter_names`` (the parameter's own name; Horovod names the grouped collective after
  the group's first).

The frame is searched for from ``compress``'s caller upward (a few frames), so a user's wrapper
around ``compress`` (logging, say) keeps the names rather than silently falling back to call order.
A call from any other code in Horovod's optimizer module (another Horovod version, the Adasum
optimizer), or a frame without the expected locals, raises ``RuntimeError``, so that a Horovod that
changes these names fails loudly (``tests/test_stock_names.py``) instead of pairing gradients by call
order. A call from anywhere else (e.g. a test calling ``compress`` directly) gives ``None``.
"""

from __future__ import annotations

from types import CodeType, FrameType
from typing import Any

import horovod
import horovod.torch.optimizer as horovod_optimizer
import torch

HOROVOD_OPTIMIZER_MODULE = horovod_optimizer.__name__
_STOCK = getattr(horovod_optimizer, "_DistributedOptimizer", None)


def _code(method: str) -> CodeType | None:
    return getattr(getattr(_STOCK, method, None), "__code__", None)


# The code objects hvd.DistributedOptimizer runs: it copies _DistributedOptimizer's methods into a
# subclass of the user's optimizer class, so these identify its frames exactly.
SINGLE, GROUPED = (_code(m) for m in ("_allreduce_grad_async", "_grouped_allreduce_grad_async"))


def _unsupported(what: str) -> RuntimeError:
    return RuntimeError(
        f"hvdcomp cannot tell which gradient Horovod's optimizer is compressing: {what} (Horovod "
        f"{horovod.__version__}; hvdcomp reads the frames of Horovod 0.28.1's _DistributedOptimizer). "
        "Use hvdcomp.DistributedOptimizer, or the Horovod version hvdcomp pins."
    )


def _local(frame: FrameType, name: str) -> Any:
    values = frame.f_locals
    if name not in values:
        raise _unsupported(f"{frame.f_code.co_name} has no local {name!r}")
    return values[name]


def _name(optimizer: Any, parameter: torch.Tensor) -> str:
    name = getattr(optimizer, "_parameter_names", {}).get(parameter)
    if not isinstance(name, str):
        raise _unsupported("a parameter has no name in the optimizer's _parameter_names")
    return name


SEARCH_DEPTH = 8  # frames above compress's caller searched for Horovod's optimizer


def stock_call(frame: FrameType | None) -> str | None:
    """Horovod's name for the gradient its stock optimizer is compressing, from the first frame of its
    module at or above ``frame`` (the caller of ``compress``), or ``None`` if none is within
    ``SEARCH_DEPTH``; raises ``RuntimeError`` for code of that module it does not know."""
    for _ in range(SEARCH_DEPTH):
        if frame is None or frame.f_globals.get("__name__") == HOROVOD_OPTIMIZER_MODULE:
            break
        frame = frame.f_back
    if frame is None or frame.f_globals.get("__name__") != HOROVOD_OPTIMIZER_MODULE:
        return None
    if SINGLE is not None and frame.f_code is SINGLE:
        name = _local(frame, "name")
        if not isinstance(name, str):
            raise _unsupported(f"_allreduce_grad_async's name is {name!r}")
        return name
    # the comprehension in _grouped_allreduce_grad_async: its own frame before Python 3.12, inlined since
    function = frame if frame.f_code is GROUPED else frame.f_back
    if GROUPED is not None and function is not None and function.f_code is GROUPED:
        return _name(_local(function, "self"), _local(frame, "p"))
    raise _unsupported(f"compress was called from {getattr(frame.f_code, 'co_qualname', frame.f_code.co_name)}")
