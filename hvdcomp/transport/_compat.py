"""Horovod's private API, in one place, behind a version gate.

hvdcomp relies on parts of Horovod that Horovod does not publish, all of them here:

- ``stock_call``: which gradient Horovod's stock ``hvd.DistributedOptimizer`` is compressing, read from its
  frames (Horovod calls ``compression.compress(tensor)`` without saying whose gradient ``tensor`` is);
- ``called_by_broadcast_optimizer_state`` and ``called_by_elastic_sync``: whether Horovod's
  ``broadcast_optimizer_state`` or elastic's ``OptimizerStateHandler.sync`` is behind the current call;
- ``allreduce_async_into``: Horovod's all-reduce into a given output tensor (``mpi_ops._allreduce_async``).

Each checks once, at its first use of Horovod's private parts, that the installed Horovod is in
``SUPPORTED_HOROVOD`` (the range ``setup.py``'s ``horovod`` extra requires), and raises ``RuntimeError`` naming
the installed and the supported versions otherwise. Importing this module imports no Horovod: Horovod's
``Compression`` objects are recognised (``horovod_compressions``) only where Horovod is already loaded.

``stock_call`` reads, for the pinned Horovod, the frame that called ``compress`` when that frame runs the code
of ``horovod.torch.optimizer._DistributedOptimizer``:

- ``_allreduce_grad_async(self, p)``: its local ``name``, the name it then passes to ``allreduce_async_`` for
  the gradient (during backward, from the hooks, and in ``synchronize()`` for the parameters whose hook did
  not fire);
- ``_grouped_allreduce_grad_async(self, ps)`` (``groups=``): the comprehension's ``p``, named by
  ``self._parameter_names`` (the parameter's own name; Horovod names the grouped collective after the
  group's first).

The frame is searched for from ``compress``'s caller upward (``SEARCH_DEPTH`` frames), so a user's wrapper
around ``compress`` keeps the names rather than silently falling back to call order. A call from any other
code of Horovod's optimizer module (the Adasum optimizer), or a frame without the expected locals, raises
``RuntimeError`` (``tests/test_stock_names.py``) instead of pairing gradients by call order. A call from
anywhere else (e.g. a test calling ``compress`` directly) gives ``None``.
"""

from __future__ import annotations

import functools
import re
import sys
from types import CodeType, FrameType
from typing import Any, NamedTuple

import torch

LOWEST = (0, 28, 1)  # the oldest Horovod whose private parts are these
BELOW = (0, 29)  # the first Horovod not checked
SUPPORTED_HOROVOD = f">={'.'.join(map(str, LOWEST))},<{'.'.join(map(str, BELOW))}"
HOROVOD_OPTIMIZER_MODULE = "horovod.torch.optimizer"
SEARCH_DEPTH = 8  # frames above compress's caller searched for Horovod's optimizer


def _release(version: str) -> tuple[int, ...]:
    """The release numbers of a version string: ``"0.28.1+hvdcomp.f16c"`` -> ``(0, 28, 1)``."""
    match = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


@functools.cache
def check_horovod() -> None:
    """Raise ``RuntimeError`` unless the installed Horovod is in ``SUPPORTED_HOROVOD`` (checked once)."""
    import horovod

    version = horovod.__version__
    if not LOWEST <= _release(version) < BELOW:
        raise RuntimeError(f"hvdcomp uses private parts of Horovod {SUPPORTED_HOROVOD}, but Horovod {version} is "
                           f"installed: install 'horovod{SUPPORTED_HOROVOD}' (pip install 'hvdcomp[horovod]')")


def horovod_compressions() -> tuple[Any, Any] | None:
    """Horovod's ``(Compression.none, Compression.fp16)`` if ``horovod.torch.compression`` is loaded, else None."""
    module = sys.modules.get("horovod.torch.compression")
    return None if module is None else (module.Compression.none, module.Compression.fp16)


def allreduce_async_into(tensor: torch.Tensor, output: torch.Tensor, name: str, op: Any, process_set: Any) -> Any:
    """Horovod's asynchronous all-reduce (``op``: ``hvd.Sum`` or ``hvd.Max``) of ``tensor`` into ``output``
    over ``process_set``, named ``name``, without pre- or postscaling; returns Horovod's handle."""
    check_horovod()
    from horovod.torch import mpi_ops

    return mpi_ops._allreduce_async(tensor, output, name, op, 1.0, 1.0, process_set)


class StockCodes(NamedTuple):
    """The code objects ``hvd.DistributedOptimizer`` runs when it compresses a gradient (it copies
    ``_DistributedOptimizer``'s methods into a subclass of the user's optimizer class, so these identify
    its frames exactly); None where the installed Horovod has no such method."""

    single: CodeType | None  # _allreduce_grad_async
    grouped: CodeType | None  # _grouped_allreduce_grad_async


@functools.cache
def stock_codes() -> StockCodes:
    """The stock optimizer's code objects (imports Horovod's optimizer module, checks its version)."""
    check_horovod()
    import horovod.torch.optimizer as horovod_optimizer

    stock = getattr(horovod_optimizer, "_DistributedOptimizer", None)
    return StockCodes(*(getattr(getattr(stock, method, None), "__code__", None)
                        for method in ("_allreduce_grad_async", "_grouped_allreduce_grad_async")))


def _unsupported(what: str) -> RuntimeError:
    version = sys.modules["horovod"].__version__
    return RuntimeError(
        f"hvdcomp cannot tell which gradient Horovod's optimizer is compressing: {what} (Horovod {version}; "
        f"hvdcomp reads the frames of Horovod {SUPPORTED_HOROVOD}'s _DistributedOptimizer). Use "
        "hvdcomp.DistributedOptimizer, or a Horovod version hvdcomp supports."
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
    single, grouped = stock_codes()
    if single is not None and frame.f_code is single:
        name = _local(frame, "name")
        if not isinstance(name, str):
            raise _unsupported(f"_allreduce_grad_async's name is {name!r}")
        return name
    # the comprehension in _grouped_allreduce_grad_async: its own frame before Python 3.12, inlined since
    function = frame if frame.f_code is grouped else frame.f_back
    if grouped is not None and function is not None and function.f_code is grouped:
        return _name(_local(function, "self"), _local(frame, "p"))
    raise _unsupported(f"compress was called from {getattr(frame.f_code, 'co_qualname', frame.f_code.co_name)}")


# The methods hvd.DistributedOptimizer's class (type(name, (optimizer_class,), dict(_DistributedOptimizer.__dict__)))
# adds to the optimizer it wraps.
HOROVOD_WRAPPER_METHODS = ("_allreduce_grad_async", "synchronize")


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


def _called_from(code: CodeType, frames: int) -> bool:
    """Whether ``code`` runs in one of the ``frames`` frames above the method that asks (the caller of
    ``called_by_*``'s caller)."""
    check_horovod()
    frame = sys._getframe(3)
    for _ in range(frames):
        if frame is None:
            return False
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False
