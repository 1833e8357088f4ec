"""``AheadMaxNorm``: QSGD's bucket exchange with the scale agreed one exchange ahead (no round before the payload).

With the scale every worker agreed at the bucket's previous exchange, a worker quantizes its values at
once and sends the payload; the MAX of this step's local statistics follows the payload and becomes the
next exchange's scale. So a bucket's payload can start as soon as its gradients are complete, queued
right behind the previous bucket's, and the wire does not wait for a MAX round and an encode between
buckets. Requests:

- with an agreed scale: ``Op.PAYLOAD`` of the packed levels, then ``Op.MAX`` of this worker's
  ``local_stats`` (float32 ``[G + 1]``: max ``|x|`` per scale group, NaN/Inf flag). Over all the workers of
  the transport bound (``bind_transport``; not a hierarchical shard, whose position among its peers the codec
  does not know), the statistics ride in the payload instead: ``W`` rows of ``G + 1`` int64 words after the
  levels, each worker writing the float32 bits of its statistics into its own row (zeros elsewhere), so the
  SUM gathers every worker's row exactly and the maximum over the rows is the MAX, bit for bit. One collective
  per bucket instead of two, whose small MAX waited its turn behind the payloads in Horovod's queue and took 2
  to 10 ms each on the emulated cluster. The rows are used while they are at most 1/64 of the payload's words
  (``scale_share``; many small scale groups and many workers take the MAX). In a float carrier
  (``carrier_bits``: Horovod's stock optimizer reduces nothing else) the rows always ride in the payload, and
  the payload is the carrier itself: words and rows written as float64 after room for its header
  (``hvdcomp.codec.carrier``);
- without one (a bucket's first exchange, a new size or world size, a resumed state without one, the
  step after a NaN/Inf): the exact exchange of ``MaxNormCodec`` (``Op.MAX`` then ``Op.PAYLOAD``), whose
  MAX seeds the agreed scale.

An element above the agreed scale ``M`` is sent as ``sign(x) * M`` and its excess stays in this worker's
memory, added to the bucket's next values (``hvdcomp.codec.agreed``): delayed, never lost. With ``inner``'s
rotation (``hvdcomp.codec.rotation``) the values are rotated before the statistics, so ``M`` is the rotated
maximum; the excess of the rotated elements is rotated back into the memory (the unrotated values: dense, on the
steps that clip), since the next step's rotation differs. Bias and
variance are those of ``hvdcomp.QSGDMaxNorm``'s ``scale="ahead"`` (``hvdcomp.integrations.codecs``). If any
worker's values hold NaN/Inf, every worker learns it from the MAX after the payload and returns all-NaN,
with a warning; the excess memory is left as it was and the next exchange is exact.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch

from ..codec import carrier, native
from ..codec.agreed import AgreedScales
from ..codec.packing import INT64_WORD_BITS, lane_block_words
from ..codec.pieces import Pieces, as_vector, checked_pieces
from .bucket import ElementwiseCodec, Segments
from .elementwise import MaxNormCodec, warn_nonfinite
from .protocol import Exchange, Op, last, relay


class AheadMaxNorm(ElementwiseCodec):
    """``inner`` (one resolution, every coordinate) with the scale agreed one exchange ahead (see the module
    docstring). Its rounding streams, rank and configuration are ``inner``'s.

    Buckets of 8 MiB (``bucket_mb``) keep encode and decode in step with the wire: less of both runs before the
    first payload leaves and after the last one arrives (2 nodes at 1 Gbit/s, ResNet-50: QSGD 8 0.309 to 0.318 s
    against 0.332 to 0.338 s with 25 MiB and 0.322 to 0.348 s with 4 MiB)."""

    bucket_mb = 8.0
    takes_out = True  # the decode writes the mean there (docs/benchmarks.md#the-codec-in-situ)
    reads_pieces = True  # the encode reads gradients in place (docs/benchmarks.md#the-gradients-read-where-they-lie)
    scale_share = 64  # statistics rows ride in the payload while at most 1/scale_share of its words

    def __init__(self, inner: MaxNormCodec) -> None:
        if inner.quantizer.multiscale or inner.selector is not None:
            raise ValueError("a scale agreed ahead needs a single resolution and every coordinate (QSGDMaxNorm): "
                             "the multi-scale agreement and shared coordinates take the exact exchange")
        self.inner = inner
        self.memory = AgreedScales()
        self.workers: int | None = None  # the bound transport's worker count

    def bind_rank(self, rank: int) -> None:
        self.inner.bind_rank(rank)

    def bind_transport(self, transport: Any) -> None:
        """Binds the rank, and the transport's worker count: exchanges over all of them carry their statistics
        in the payload (the module docstring)."""
        super().bind_transport(transport)
        self.workers = transport.size

    def scale_rows(self, world_size: int, count: int, words: int, carried: bool = False) -> int:
        """int64 words of statistics rows in the payload of an exchange over ``world_size`` workers with ``count``
        statistics and ``words`` words of levels: ``world_size * count`` (always in a float carrier: ``carried``),
        or 0 (a separate ``Op.MAX``)."""
        rows = world_size * count
        return rows if carried or (world_size == self.workers and rows * self.scale_share <= words) else 0

    @property
    def reuses_result(self) -> bool:
        """False: every result is a decode's new tensor (``inner`` has no selector)."""
        return False

    def config(self) -> tuple:
        """What every worker must share: ``inner``'s configuration, and that the scale is agreed ahead."""
        return (*self.inner.config(), "ahead")

    def exchange(self, flat: torch.Tensor, segments: Sequence[int], key: Hashable, step: int, world_size: int,
                 word_bits: int = INT64_WORD_BITS, carrier_bits: int | None = None,
                 out: torch.Tensor | None = None, pieces: Pieces | None = None) -> Exchange:
        """See ``ElementwiseCodec.exchange`` (``out``: where the mean goes, ``takes_out``; ``pieces``: the values, read
        in place by the encode of an agreed scale, ``reads_pieces``); ``key`` keys the agreed scale and the excess
        memory. ``word_bits``: the usable bits of the exact exchange's payload words.
        ``carrier_bits``: with an agreed scale, the payload request is a float carrier without its header
        (``hvdcomp.codec.carrier``): float64 ``[carrier.HEADER + words + rows]``, words of that many bits and the
        statistics rows as float64 integers after ``carrier.HEADER`` elements left to ``carrier.seal``; the reply is
        their exact int64 sums (``carrier.unwrap``: ``[words + rows]``), and no request follows it. Default: int64
        words, the rows as ``scale_rows`` says, the reply the same shape."""
        layout = Segments.of(segments, key)
        checked_pieces(pieces, flat, self.reads_pieces)
        if sum(layout) != flat.numel() or (out is not None and out.shape != flat.shape):
            raise ValueError(f"segments {list(layout)[:8]}... do not split the {flat.numel()} elements of flat (and "
                             f"out, if given: {None if out is None else tuple(out.shape)})")
        return self._exchange(flat, layout, key, step, world_size, word_bits, carrier_bits, out, pieces)

    def _exchange(self, flat: torch.Tensor, layout: Segments, key: Hashable, step: int, world_size: int,
                  word_bits: int, carrier_bits: int | None, out: torch.Tensor | None,
                  pieces: Pieces | None) -> Exchange:
        memory, quantizer = self.memory, self.inner.quantizer
        numel = flat.numel()
        values = memory.with_excess(key, flat, pieces)  # pieces: the excess rides along as their addend
        groups = quantizer.scale_groups(numel, layout)
        scale_stats = memory.scales(key, numel, world_size, groups.numel())
        if scale_stats is None or self.inner.rotation is not None or not native.usable(flat):  # the vector itself
            values = as_vector(values, flat)
        if scale_stats is None:
            def seed(op: Op, reduced: torch.Tensor) -> torch.Tensor:
                if op is Op.MAX and memory.agree(key, numel, world_size, reduced):
                    memory.keep_excess(key, None)  # this exchange sends it
                return reduced

            exact = self.inner.exchange(values, layout, key, step, world_size, word_bits)
            mean = yield from relay(exact, lambda op, tensor: (op, tensor), seed)
            return mean if out is None else out.copy_(mean)

        rotation = self.inner.rotation
        if rotation is not None:  # the agreed scale is the rotated maximum
            values = rotation.forward(values, groups, key, step)
        rounding = self.inner.rounding_stream(key, step, flat.device)
        carried = carrier_bits is not None
        word_bits = carrier_bits if carried else word_bits
        words = lane_block_words(numel, quantizer.payload_layout(world_size, word_bits).lanes_per_word)
        local = torch.empty(groups.numel() + 1, dtype=torch.float32, device=flat.device)
        rows = self.scale_rows(world_size, local.numel(), words, carried)
        room = carrier.HEADER if carried else 0  # the carrier's header goes first (carrier.seal)
        message = self.inner.buffers.take((key, "payload"), room + words + rows,
                                          torch.float64 if carried else torch.int64, flat.device)
        payload = message[room:]
        # the statistics in the encode's pass (docs/benchmarks.md#the-codec-in-situ)
        quantizer.encode(values, scale_stats, groups, None, world_size, word_bits, rounding, payload[:words], local)
        finite = not quantizer.saw_nonfinite(local)
        if not finite:  # encoded again without them: what every worker sends is of no use then, but well defined
            values = torch.nan_to_num(as_vector(values, flat), nan=0.0, posinf=0.0, neginf=0.0)
            quantizer.encode(values, scale_stats, groups, None, world_size, word_bits, rounding, payload[:words])
        excess = memory.clipped(values, local, scale_stats, groups) if finite else None
        if excess is not None and rotation is not None and excess[0].numel():  # the memory is of unrotated values
            unrotated = values.new_zeros(numel).index_put_((excess[0],), excess[1])
            excess = torch.arange(numel, device=flat.device), rotation.inverse_(unrotated, groups, key, step)
        if rows:  # this worker's row: the bits of its float32 statistics (non-negative, below 2**31)
            payload[words:].zero_().view(world_size, -1)[self.inner.rank] = local.view(torch.int32)
        sums = yield last(Op.PAYLOAD, message) if rows else (Op.PAYLOAD, message)
        mean = quantizer.decode(sums[:words], scale_stats, groups, None, numel, world_size, word_bits,
                                self.inner.buffers, key, out)
        if rotation is not None:
            mean = rotation.inverse_(mean, groups, key, step)
        if rows:  # each column summed one worker's bits and zeros: every row exactly, and their maximum
            reduced = sums[words:].to(torch.int32).view(torch.float32).view(world_size, -1).amax(dim=0)
        else:
            reduced = yield Op.MAX, local  # the next exchange's scale
        if not memory.agree(key, numel, world_size, reduced):
            warn_nonfinite(key, step)
            return mean.fill_(float("nan"))
        memory.keep_excess(key, excess)
        return mean

    def state_dict(self) -> dict[str, Any]:
        """``inner``'s state, the agreed scales and the excess memory."""
        return {"inner": self.inner.state_dict(), "agreed": self.memory.state_dict()}

    def check_state(self, state: Any) -> None:
        """``ValueError`` unless ``state`` is a ``state_dict()`` of a codec configured as this one (a
        ``MaxNormCodec``'s, saved with ``scale="exact"``, is not)."""
        if not isinstance(state, dict) or set(state) != {"inner", "agreed"}:
            raise ValueError(f"not an AheadMaxNorm state: {state!r:.200} (a state saved with scale='exact' loads "
                             "with scale='exact')")
        self.inner.check_state(state["inner"])
        AgreedScales.check_state(state["agreed"])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        self.inner.load_state_dict(state["inner"])
        self.memory.load_state_dict(state["agreed"])
