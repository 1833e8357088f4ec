"""Scale agreed one step ahead: the stock-optimizer path of ``QSGDMaxNorm`` without a blocking collective.

With ``scale="ahead"``, ``compress`` quantizes a gradient at once with the scale every worker agreed
for it at its previous exchange, and returns the whole payload as one float64 carrier that Horovod
all-reduces during backward, overlapped with it:

    [canary, W, tag, tag**2 | packed level words | W x (G + 1) per-rank slots]

(``hvdcomp.codec.carrier``: words of ``carrier.word_bits(W)`` bits, exact under Sum, Average and a
predivide factor). ``G`` is the number of scale groups of the tensor (one, or one per ``chunk_size``
elements); worker ``r`` writes its local ``max|g|`` per group and its NaN/Inf flag into row ``r`` and
zeros elsewhere, so the reduced rows hold every worker's local statistics and the next exchange's
shared scale (their maximum) is known on every worker without another collective.

An element above the agreed scale ``M`` is *clipped*: it is sent as ``sign(x) * M`` (the top level,
no rounding) and its excess ``x - sign(x) * M`` stays in a per-worker error-feedback memory that is
added to the tensor's next gradient, so nothing is lost; the next scale is the max of ``|g + excess|``,
so the excess fits then. The memory holds only the clipped elements (indices and excess values).

Bias and variance, against ``scale="exact"`` (this step's max, one blocking MAX round per step):

- a step without clipping is unbiased, with per-element variance at most ``(M / s)**2 / 4`` for the
  agreed ``M``: larger than the exact mode's when the gradient's max shrank since the last step,
  smaller when it grew;
- a clipped element is biased towards zero by its excess in that step; the excess is sent the next
  step (delayed, not lost): over steps, the sum of what a worker sent equals the sum of its
  gradients minus its current excess.

A gradient without an agreed scale (its first exchange, a new size or world size, a state that did
not hold one, or the step after a non-finite one) takes the exact exchange instead; its MAX round
then seeds the agreed scale. If any worker's gradient holds NaN/Inf, every worker gets an all-NaN
result (the caller warns), the excess memory is left as it was, and the tensor's next exchange is exact.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from ..codec import carrier
from ..codec.agreed import AgreedScales
from ..codec.quantize import MaxNormQuantizer
from ..codec.recycle import ResultBuffers

SCALE_MODES = ("ahead", "exact")


@dataclass
class AheadExchange:
    """One gradient's exchange in flight: what ``finish`` needs after Horovod reduced its carrier."""

    key: Hashable
    numel: int
    world_size: int
    tag: int
    groups: torch.Tensor  # int64 lengths of the scale groups
    stats: torch.Tensor  # float32 [G + 1]: the agreed scales used, then 0
    words: int  # number of payload words in the carrier
    excess: tuple[torch.Tensor, torch.Tensor] | None  # clipped (indices, excess), kept if the step is finite


class ScaleAhead:
    """Agreed scales and clipping memory of one compressor's gradients (see the module docstring).

    Args:
        quantizer: a single-resolution ``MaxNormQuantizer`` (the multi-scale agreement needs its own round).
    """

    def __init__(self, quantizer: MaxNormQuantizer) -> None:
        if quantizer.multiscale:
            raise ValueError("scale='ahead' needs a single resolution: the multi-scale agreement is a round of its own")
        self.quantizer = quantizer
        self.memory = AgreedScales()
        self._carriers: dict[Hashable, torch.Tensor] = {}  # the carrier buffer, reused every step
        self._decoded = ResultBuffers()  # the decode's, reused once nothing refers to it (Horovod's p.grad.set_)

    def ready(self, key: Hashable, numel: int, world_size: int) -> bool:
        """Whether ``key`` has a scale agreed for an exchange of ``numel`` elements over ``world_size`` workers."""
        return self.memory.scales(key, numel, world_size, self.quantizer.scale_groups(numel).numel()) is not None

    def with_excess(self, key: Hashable, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` plus the excess clipped from ``key``'s earlier steps (``AgreedScales.with_excess``)."""
        return self.memory.with_excess(key, flat)

    def agree(self, key: Hashable, numel: int, world_size: int, stats: torch.Tensor) -> None:
        """Record the MAX-reduced ``local_stats`` of an exact exchange of ``key`` as its next agreed scale
        (or forget it after a non-finite step), and drop the excess that exchange sent."""
        if self.memory.agree(key, numel, world_size, stats):
            self.memory.keep_excess(key, None)

    def start(self, key: Hashable, values: torch.Tensor, world_size: int, rank: int, tag: int,
              rounding: torch.Tensor) -> tuple[torch.Tensor, AheadExchange]:
        """The float64 carrier of flat float32 ``values`` (gradient + excess) quantized with ``key``'s agreed
        scale, and the exchange's context. The carrier is a buffer of ``key`` reused every step."""
        quantizer = self.quantizer
        numel = values.numel()
        groups = quantizer.scale_groups(numel)
        stats = self.memory.scales(key, numel, world_size, groups.numel())
        local = quantizer.local_stats(values, groups)
        finite = not quantizer.saw_nonfinite(local)
        if not finite:
            values = torch.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0)
        word_bits = carrier.word_bits(world_size)
        words = quantizer.encode(values, stats, groups, None, world_size, word_bits, rounding)
        slots = world_size * local.numel()
        size = carrier.HEADER + words.numel() + slots
        buffer = self._carriers.get(key)
        if buffer is None or buffer.numel() != size or buffer.device != values.device:
            buffer = self._carriers[key] = torch.empty(size, dtype=torch.float64, device=values.device)
        buffer[:carrier.HEADER] = carrier.wrap(words.new_empty(0), world_size, tag)
        buffer[carrier.HEADER:carrier.HEADER + words.numel()].copy_(words)
        rows = buffer[carrier.HEADER + words.numel():].view(world_size, local.numel())
        rows.zero_()
        rows[rank] = local
        excess = self.memory.clipped(values, local, stats, groups) if finite else None
        return buffer, AheadExchange(key, numel, world_size, tag, groups, stats, words.numel(), excess)

    def finish(self, exchange: AheadExchange, reduced: torch.Tensor) -> tuple[torch.Tensor, bool, bool]:
        """From the reduced carrier: float32 ``[numel]`` mean over the workers of their decoded values (all
        NaN if any worker's values were non-finite), whether Horovod averaged, and whether all were finite.
        Updates the agreed scale and, on a finite step, the excess memory."""
        quantizer, world_size = self.quantizer, exchange.world_size
        end = carrier.HEADER + exchange.words
        word_sums, averaged = carrier.unwrap(reduced[:end], world_size, exchange.tag)
        # every element of the carrier was scaled alike: the canary (reduced to c * W) recovers the sums
        rows = (reduced[end:] * (world_size / reduced[0])).view(world_size, -1)
        if not self.memory.agree(exchange.key, exchange.numel, world_size, rows.amax(dim=0)):
            mean = torch.full((exchange.numel,), float("nan"), device=reduced.device)
            return mean, averaged, False
        mean = quantizer.decode(word_sums, exchange.stats, exchange.groups, None, exchange.numel, world_size,
                                carrier.word_bits(world_size), self._decoded, exchange.key)
        self.memory.keep_excess(exchange.key, exchange.excess)
        return mean, averaged, True

    def state_dict(self) -> dict[str, Any]:
        """The agreed scales and the excess memory (what a resumed run needs to continue exactly)."""
        return self.memory.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.memory.load_state_dict(state)
