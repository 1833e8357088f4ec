"""Fused kernels: the codec's pure tensor functions compiled by ``torch.compile`` (Inductor: C++/OpenMP on
CPU, Triton on GPU), with the same functions run eagerly as the readable reference and the fallback.

A ``FusedKernel`` wraps one pure function (or, ``in_place=True``, one that writes its results into argument
tensors). Its first call compiles it with ``dynamic=True``: tensor sizes are symbolic, so buckets of any size
share one compiled graph; calls with a tensor of 0 or 1 elements (sizes torch would compile separately) run
eagerly.
Tensors passed through ``static(t)`` (e.g. the lane shifts of a word layout) keep their sizes in the
graph: one graph per lane count, which lets Inductor unroll the packing. Inductor caches compiled code
on disk, so later processes skip the C++ compile: ``TORCHINDUCTOR_CACHE_DIR``, which the first compile sets, where
unset, to ``inductor/`` in hvdcomp's private cache (``hvdcomp.codec.cache``; Inductor loads the code it finds there).
A kernel compiles for ``torch.get_num_threads()`` at its first call (Inductor's ``cpp.threads``, part of
that cache's key), so a process never reuses a kernel cached for fewer threads than it has
(docs/benchmarks.md#kernel-level-measurements).

**Fallback.** ``HVDCOMP_FUSED=0`` in the environment runs every kernel eagerly. If compiling or running a
compiled kernel raises (no C++ compiler, ``CXX`` unusable, an unsupported backend), every kernel falls back
to eager for the rest of the process after ONE ``RuntimeWarning``. Eager and compiled results are equal
bit for bit (same float operations in the same order; Inductor compiles with ``-ffp-contract=off``).
``eager()`` is a context manager that runs kernels eagerly (tests and benchmarks compare both paths).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import Any, Callable

import torch

from . import random
from .cache import use_private_inductor_cache

ENV_SWITCH = "HVDCOMP_FUSED"
_RECOMPILE_LIMIT = 64  # one graph per lane count (at most 63) and input kind


class _Mode:
    forced_eager = 0  # depth of ``eager()`` contexts
    failed: str | None = None  # why compiling failed (then everything runs eagerly)
    lanes_chosen = False  # _choose_cpu_lanes ran


def enabled() -> bool:
    """Whether kernels run compiled now: not switched off, not inside ``eager()``, no failure so far."""
    return os.environ.get(ENV_SWITCH, "1") != "0" and not _Mode.forced_eager and _Mode.failed is None


@contextlib.contextmanager
def eager() -> Iterator[None]:
    """Run every kernel eagerly inside the block."""
    _Mode.forced_eager += 1
    try:
        yield
    finally:
        _Mode.forced_eager -= 1


def fail(error: BaseException, stacklevel: int = 2) -> None:
    """After a kernel failed to compile or load: every kernel runs eagerly from now on, and ONE ``RuntimeWarning``
    says why (``stacklevel`` as ``warnings.warn``'s, counted from the caller)."""
    _Mode.failed = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}"
    warnings.warn(f"hvdcomp: fused codec kernels unavailable ({_Mode.failed}); running them eagerly "
                  f"(slower, same results). Set {ENV_SWITCH}=0 to skip compiling.", RuntimeWarning,
                  stacklevel=stacklevel + 1)


def static(tensor: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``tensor`` with its sizes (or only its size along ``dim``) marked static for ``torch.compile`` (a new
    graph per distinct size)."""
    torch._dynamo.mark_static(tensor, dim)
    return tensor


def _choose_cpu_lanes() -> None:
    """Before the first compile: Philox draws in int32 lanes unless Inductor vectorizes for AVX-512
    (``hvdcomp.codec.random``; the same bits either way)."""
    if _Mode.lanes_chosen:
        return
    _Mode.lanes_chosen = True
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    try:  # it compiles a probe: without a compiler the kernel's own compile fails next, and falls back
        random.CPU_INT32_LANES = not str(pick_vec_isa()).startswith("avx512")
    except Exception:  # noqa: BLE001
        pass


class FusedKernel:
    """``fn`` compiled at first use (see the module docstring); ``kernel.eager_fn`` is ``fn`` itself.

    ``fn`` is pure (it must not modify its inputs), or with ``in_place=True`` it writes its results into
    some of its tensor arguments (no new gradient-sized outputs to allocate and copy). Such a kernel
    compiles as one graph (``fullgraph=True``), so a failure to compile comes before anything is written
    and the eager fallback starts from the untouched inputs."""

    def __init__(self, fn: Callable[..., Any], in_place: bool = False) -> None:
        self.eager_fn = fn
        self.in_place = in_place
        self._compiled: Callable[..., Any] | None = None
        self.__doc__ = fn.__doc__

    def __call__(self, *args: Any) -> Any:
        if not enabled() or any(isinstance(a, torch.Tensor) and a.dim() and a.numel() < 2 for a in args):
            return self.eager_fn(*args)
        if self._compiled is None:
            use_private_inductor_cache()
            _choose_cpu_lanes()
            self._compiled = torch.compile(self.eager_fn, dynamic=True, fullgraph=self.in_place,
                                           options={"cpp.threads": torch.get_num_threads()})
        config = torch._dynamo.config  # set and restored around the call: cheaper than config.patch (~15 us)
        limit, config.recompile_limit = config.recompile_limit, max(config.recompile_limit, _RECOMPILE_LIMIT)
        try:
            return self._compiled(*args)
        except Exception as error:  # noqa: BLE001 (bad input raises again below; anything else: fall back)
            result = self.eager_fn(*args)  # the failed call left no trace (see the class docstring)
            fail(error)
            return result
        finally:
            config.recompile_limit = limit
