"""The bucket codec contract: what an entry point needs of a codec to exchange one bucket of gradients.

A codec turns one bucket of this worker's gradients into an exchange (``protocol``) whose result is
the mean over the workers, identical on every worker, and keeps whatever state it needs between
steps (error-feedback memories, random generators, warm-start factors) in ``state_dict``. There are
two kinds:

- ``ElementwiseCodec``: works on the bucket's gradients concatenated into one float32 vector,
  element by element (per-tensor scales come from ``segments``), so it can run on any slice of the
  vector: hierarchical exchanges give each local rank a shard.
- ``TensorCodec``: works on the list of gradients as tensors (e.g. PowerSGD's matrices);
  hierarchical exchanges give each local rank whole tensors.

Every worker runs its own instance, configured alike. ``key`` identifies the bucket (or shard)
across steps and needs a ``repr`` that is the same in every process (int, str, tuples of them);
``step`` counts exchanges from 0; ``world_size`` is the number of workers the exchange's ``WORLD``
collectives span.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from .protocol import Exchange


class BucketCodec(ABC):
    """The parts every codec has: rank binding and checkpointable state."""

    def bind_rank(self, rank: int) -> None:  # noqa: B027 (most codecs draw no per-worker randomness)
        """Called by the entry point with this worker's rank before its first exchange; codecs with
        per-worker randomness seed it from the rank. The default does nothing."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue exactly (each worker saves its own)."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""


class ElementwiseCodec(BucketCodec):
    """A codec over the bucket's flat float32 vector (see the module docstring)."""

    @abstractmethod
    def exchange(self, flat: torch.Tensor, segments: Sequence[int], key: Hashable, step: int,
                 world_size: int) -> Exchange:
        """Exchange this worker's ``flat`` (float32 ``[n]``, the bucket's tensors concatenated;
        ``segments`` their sizes, summing to ``n``). Returns float32 ``[n]``: the mean over the workers."""


class TensorCodec(BucketCodec):
    """A codec over the bucket's gradients as tensors (see the module docstring)."""

    @abstractmethod
    def exchange(self, grads: Sequence[torch.Tensor], key: Hashable, step: int, world_size: int) -> Exchange:
        """Exchange this worker's ``grads`` (floating point, any shapes, one device; every worker passes
        the same shapes in the same order). Returns the list of means, in the same shapes and dtypes."""
