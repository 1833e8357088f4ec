"""The bucket codec contract: what an entry point needs of a codec to exchange one bucket of gradients.

A codec turns one bucket of this worker's gradients into an exchange (``protocol``) whose result is
the mean over the workers, identical on every worker, and keeps whatever state it needs between
steps (error-feedback memories, random generators, warm-start factors) in ``state_dict``. There are
two kinds:

- ``ElementwiseCodec``: works on the bucket's gradients concatenated into one float32 vector,
  element by element (per-tensor scales come from ``segments``), so it can run on any slice of the
  vector: hierarchical exchanges give each local rank a shard, and pass a ``Segments`` that says
  where it lies in the bucket (for per-tensor choices that must not depend on the sharding).
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
from dataclasses import dataclass, field
from typing import Any

import torch

from .protocol import Exchange
from .route import RouteTrial


@dataclass(frozen=True)
class Segments(Sequence[int]):
    """Where an ``ElementwiseCodec``'s ``flat`` lies: elements ``[lo, hi)`` (default: all) of a bucket of
    tensors of ``sizes`` elements, concatenated; tensor ``i`` is ``(key, i)`` on every worker (``key``
    is the whole bucket's, the same in every shard).

    As a sequence of ints: the sizes of the pieces of tensors in ``flat`` (tensors cut at ``lo`` and
    ``hi``; empty pieces left out), which is what ``segments`` means to codecs that need no more.
    """

    sizes: tuple[int, ...]
    key: Hashable
    lo: int = 0
    hi: int | None = None
    _pieces: tuple[tuple[int, int, int], ...] = field(init=False, repr=False, compare=False)
    _lengths: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        total = sum(self.sizes)
        hi = total if self.hi is None else self.hi
        if min(self.sizes, default=0) < 0 or not 0 <= self.lo <= hi <= total:
            raise ValueError(f"[{self.lo}, {self.hi}) is not a slice of a bucket of sizes {self.sizes[:8]}")
        pieces, start = [], 0
        for index, size in enumerate(self.sizes):
            first, last = max(self.lo, start), min(hi, start + size)
            if last > first:
                pieces.append((index, first - start, last - first))
            start += size
        object.__setattr__(self, "hi", hi)
        object.__setattr__(self, "_pieces", tuple(pieces))
        object.__setattr__(self, "_lengths", tuple(length for _, _, length in pieces))

    @classmethod
    def of(cls, segments: Sequence[int], key: Hashable) -> Segments:
        """``segments`` as a ``Segments``: plain sizes mean whole tensors of a bucket keyed ``key``."""
        return segments if isinstance(segments, Segments) else cls(tuple(segments), key)

    def pieces(self) -> tuple[tuple[int, int, int], ...]:
        """``(tensor index, first element within the tensor, length)`` of each piece in ``flat``, in order."""
        return self._pieces

    def __getitem__(self, index: Any) -> Any:  # int -> int, slice -> tuple[int, ...]
        return self._lengths[index]

    def __len__(self) -> int:
        return len(self._pieces)


class BucketCodec(ABC):
    """The parts every codec has: rank binding, checkpointable state, its configuration, and the settings entry
    points read from it: ``bucket_mb``, the bucket size (MiB of float32 gradients) the codec runs best with where
    the caller gives none (None: the caller's own); ``splits_deliveries``, whether that size should also split
    what arrives at once (one of DDP's buckets: it pays where a bucket's encode overlaps the previous bucket's
    wire; where not, the DDP door exchanges DDP's own buckets); and ``warmup_steps``, the exchanges an entry point
    sends uncompressed first (``hvdcomp.exchange.state``). ``trial``: the two routes the codec is trying (its
    ``RouteTrial``, e.g. ``TwoStageMaxNorm``'s ``exchange="auto"``), whose steps the runner times and whose verdict
    it reaches (``hvdcomp.exchange.runner``); None: the codec's route is fixed."""

    bucket_mb: float | None = None
    splits_deliveries: bool = True
    warmup_steps: int = 0
    inner: BucketCodec | None = None  # the codec a wrapping codec runs (state of its own that one door may own)
    trial: RouteTrial | None = None

    def config(self) -> tuple:
        """What every worker must configure alike (compared between workers before the first exchange, and
        recorded in checkpoints): a tuple whose ``repr`` is the same in every process. Default: nothing."""
        return ()

    def bind_rank(self, rank: int) -> None:  # noqa: B027 (most codecs draw no per-worker randomness)
        """Called by the entry point with this worker's rank before its first exchange; codecs with
        per-worker randomness seed it from the rank. The default does nothing."""

    def bind_transport(self, transport: Any) -> None:
        """Called by the entry points before the first exchange with the transport that carries it (a
        ``protocol.Transport``): binds ``transport.rank`` (``bind_rank``). Codecs that choose their requests
        by what the transport does well (``FP16``) also read it here."""
        self.bind_rank(transport.rank)

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue exactly (each worker saves its own)."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""


class ElementwiseCodec(BucketCodec):
    """A codec over the bucket's flat float32 vector (see the module docstring)."""

    takes_out: bool = False  # whether ``exchange`` takes ``out=`` (see ``exchange``)
    reads_pieces: bool = False  # whether ``exchange`` takes ``pieces=`` (see ``exchange``)

    def flat_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of the flat vector this codec exchanges for gradients of ``dtype``. Default float32: codecs
        compute in float32, and entry points clamp float64 gradients to float32's range (never to Inf)."""
        return torch.float32

    @abstractmethod
    def exchange(self, flat: torch.Tensor, segments: Sequence[int], key: Hashable, step: int,
                 world_size: int) -> Exchange:
        """Exchange this worker's ``flat`` (float32 ``[n]``, the bucket's tensors concatenated;
        ``segments`` their sizes, summing to ``n``: a list of whole tensors, or a ``Segments`` when
        ``flat`` is a shard). Returns float32 ``[n]``: the mean over the workers, valid until this codec's
        next exchange of ``key`` (a codec may reuse its buffer: ``MaxNormCodec`` with a selector; copy what you
        keep longer). A codec that declares ``takes_out`` also takes ``out=``: where the caller wants the mean
        (``[n]`` of ``flat``'s dtype, the caller's, e.g. ``flat`` itself once it is read), and writes it there in its
        last pass, saving the caller a copy (``NoCompression``, ``FP16``, ``BF16``). A codec that declares
        ``reads_pieces`` also takes ``pieces=``: the values as ``hvdcomp.codec.pieces.Pieces`` (the caller's gradients,
        read in place, never written; ``flat`` is then not filled, but the codec's to write, e.g. to fill it from them
        where it needs the vector itself), saving the caller the copy into ``flat`` (``AheadMaxNorm``; ``FP16`` and
        ``BF16`` without error feedback).

        The call may check the configuration against ``segments`` (every worker alike, before any
        collective); ``flat``'s values are read only once the exchange runs (a hierarchical exchange
        fills its shard after the node-local sum)."""

    @property
    def reuses_result(self) -> bool:
        """Whether a result of ``exchange`` may be a buffer this codec writes again at its next exchange of the
        same key (callers then copy it). False: never this codec's buffer, but a new tensor (a decode's output,
        a collective's) or the caller's ``flat`` (which some transports sum in place). Codecs that know say
        False."""
        return True


class TensorCodec(BucketCodec):
    """A codec over the bucket's gradients as tensors (see the module docstring)."""

    @abstractmethod
    def exchange(self, grads: Sequence[torch.Tensor], key: Hashable, step: int, world_size: int) -> Exchange:
        """Exchange this worker's ``grads`` (floating point, any shapes, one device; every worker passes
        the same shapes in the same order). Returns the list of means, in the same shapes and dtypes."""
