"""Result buffers handed out again once nothing refers to them: no gradient-sized allocation per step.

A decode into a fresh tensor every step faults in new pages for every result (glibc returns large freed blocks to
the system), which costs about as much as the decode itself (docs/benchmarks.md#kernel-level-measurements).
``ResultBuffers`` keeps, per key, the buffer it handed out last, and hands it out again only when no other tensor (a
view such as ``p.grad``, a NumPy array) shares its storage any more; otherwise it allocates a new one. So a result
is still never rewritten while its caller can see it: to the caller each result is a new tensor (``reuses_result``
stays False), and the usual loop (``zero_grad`` drops the gradients, the next exchange decodes) reuses the same
memory every step. The buffer stays allocated between steps (one result's size per key). A Python handle on the raw
storage (``tensor.untyped_storage()``) is not counted. The count is torch's (``torch._C._storage_Use_Count``); a
torch without it gets a new buffer every time.
"""

from __future__ import annotations

import sys
from collections.abc import Hashable

import torch

_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)  # torch's own count; without it, nothing is reused


def _references(tensor: torch.Tensor) -> int:
    """How many tensors (and array exports) share ``tensor``'s storage, plus one for the storage object asked
    (without torch's count: more than any buffer alone has)."""
    return _USE_COUNT(tensor.untyped_storage()._cdata) if _USE_COUNT is not None else sys.maxsize


_ALONE = _references(torch.empty(1)) if _USE_COUNT is not None else 0  # a buffer nothing else refers to


class ResultBuffers:
    """Per key, a 1-D buffer for a result, reused once nothing else refers to it (see the module docstring)."""

    def __init__(self) -> None:
        self._buffers: dict[Hashable, torch.Tensor] = {}

    def take(self, key: Hashable, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A ``[numel]`` tensor of ``dtype`` on ``device`` (uninitialized): ``key``'s previous one if it matches and
        nothing else refers to it, else a new one (kept for the next call). Always a view: a caller holding it
        holds a reference that ``take`` counts (the kept tensor object itself would not count)."""
        buffer = self._buffers.get(key)
        if (buffer is None or buffer.numel() != numel or buffer.dtype != dtype or buffer.device != device
                or _references(buffer) > _ALONE):
            buffer = self._buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return buffer.view(numel)

    def __getstate__(self) -> dict:
        return {}  # buffers are scratch: a copied codec allocates its own

    def __setstate__(self, state: dict) -> None:
        self.__init__()
