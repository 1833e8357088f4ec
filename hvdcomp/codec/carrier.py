"""Float64 carriers: packed words that survive Horovod's float reductions exactly.

Horovod's stock optimizer all-reduces whatever ``compress`` returns with the user's op: Sum, or
Average (Sum then ``postscale = 1/size``), possibly with ``gradient_predivide_factor`` pre/postscales.
Each reduces every element to ``c * (sum over workers)`` for one unknown factor ``c``. A carrier holds

    [canary = 1, world_size, tag, tag**2, word_0, word_1, ...]

as float64, with words below ``2**word_bits(W)`` so the sums can be recovered exactly: plain sums of
such integers are exact in float64, and with a (non power of two) predivide factor each of the
``W - 1`` additions of scaled values rounds by at most 2**-53 relative, so
``word_bits(W) = 51 - bit_length(W + 3)`` keeps the total error below 1/4 (48 bits for W <= 4,
38 bits for W = 4096). After the reduction the canary reads ``c * W``, which recovers the exact
integer word sums (only a Sum, leaving ``W``, or an Average, leaving 1, is accepted), and the header
checks that every worker agreed: same world size, and the same ``tag`` (a hash of the compressor's
configuration, tensor and step) — equal means of ``tag`` and ``tag**2`` imply all tags are equal.
Any mismatch raises ``CarrierMismatchError``. The words are written where they are sent: an encode writes
them as float64 into a message whose first ``HEADER`` elements ``seal`` fills, and ``unwrap`` turns the reduced
words into their int64 sums in the same memory (docs/benchmarks.md#the-float-carrier-in-place).

On the stock optimizer's path (``hvdcomp.integrations.stock``), exact exchanges send carriers without
words, as headers only (their payload travels as int64 in a batched exchange); the words carry the packed
values of an exchange with its scale agreed ahead through Horovod's float reduction. The blocking MAX rounds
before the payload get the same check through a *stamp*: ``stamp`` appends ``[tag, -tag]`` to the request,
and after the MAX ``unstamp`` reads back ``max(tag)`` and ``-min(tag)``, equal to this worker's tag on every
worker only if all tags are equal.
"""

from __future__ import annotations

import torch

from . import native, native_carrier

HEADER = 4
TAG_BITS = 16
_TWO_52, _TWO_52_BITS = 2.0**52, 0x4330000000000000  # 2**52 and its float64 bits
_SUM_LIMIT = 2**51  # every sum of carrier words lies below it (word_bits)


class CarrierMismatchError(RuntimeError):
    """Workers disagreed on what they reduced (world size, configuration, tensor or step)."""


def word_bits(world_size: int) -> int:
    """Usable bits per float64 word for W workers (see the module docstring)."""
    return 51 - (world_size + 3).bit_length()


def to_tag(seed: int) -> int:
    """A tag in [1, 2**16) from any integer (tags must be small enough that sums of squares stay exact)."""
    return 1 + seed % (2**TAG_BITS - 1)


def stamp(values: torch.Tensor, tag: int) -> torch.Tensor:
    """1-D ``values`` followed by ``[tag, -tag]``, for a MAX all-reduce (float32, float64 or integer:
    dtypes that hold the tag exactly)."""
    if values.dtype not in (torch.float32, torch.float64) and values.dtype.is_floating_point:
        raise TypeError(f"a stamp needs float32, float64 or integer values, got {values.dtype}")
    return torch.cat([values.reshape(-1), torch.tensor([tag, -tag], dtype=values.dtype, device=values.device)])


def unstamp(reduced: torch.Tensor, tag: int, hint: str = "") -> torch.Tensor:
    """The MAX-reduced values of a ``stamp``; raises ``CarrierMismatchError`` (ending with ``hint``)
    unless every worker stamped ``tag``, so every worker of a mismatched all-reduce raises."""
    highest, negated_lowest = reduced[-2:].tolist()
    if highest != tag or -negated_lowest != tag:
        raise CarrierMismatchError(
            f"workers reduced different tensors in one MAX all-reduce: tag {tag} here, tags from "
            f"{-negated_lowest:g} to {highest:g} over the workers{hint}"
        )
    return reduced[:-2]


def seal(message: torch.Tensor, world_size: int, tag: int) -> torch.Tensor:
    """``message`` (float64 ``[HEADER + n]``, its ``n`` words already in place as float64 integers below
    ``2**word_bits(W)``) with the header written into its first ``HEADER`` elements: the carrier, returned."""
    if message.dtype != torch.float64 or message.dim() != 1 or message.numel() < HEADER:
        raise ValueError(f"a carrier is a float64 [{HEADER} + words] tensor, got {message.dtype} "
                         f"{tuple(message.shape)}")
    message[:HEADER] = torch.tensor([1.0, float(world_size), float(tag), float(tag) ** 2], dtype=torch.float64)
    return message


def wrap(words: torch.Tensor, world_size: int, tag: int) -> torch.Tensor:
    """A new float64 ``[HEADER + len(words)]`` carrier for integer ``words`` (each below ``2**word_bits(W)``)."""
    message = torch.empty(HEADER + words.numel(), dtype=torch.float64, device=words.device)
    message[HEADER:].copy_(words.reshape(-1))
    return seal(message, world_size, tag)


def unwrap(reduced: torch.Tensor, world_size: int, tag: int) -> tuple[torch.Tensor, bool]:
    """Exact int64 sums of the workers' words from a reduced carrier, and whether the reduction averaged (True) or
    summed (False). The sums are written over the words of ``reduced``, in place (a one-pass kernel where
    ``native.usable`` says): the result is an int64 view of ``reduced[HEADER:]``, no allocation
    (docs/benchmarks.md#the-float-carrier-in-place). Raises ``CarrierMismatchError`` on any disagreement in the
    header, before anything is written, or when a word's sum is none that carriers make."""
    if reduced.dtype != torch.float64 or reduced.dim() != 1 or reduced.numel() < HEADER or not reduced.is_contiguous():
        raise CarrierMismatchError(
            f"expected a contiguous float64 carrier of at least {HEADER} elements, got {reduced.dtype} "
            f"{tuple(reduced.shape)}"
        )
    canary, sizes, tags, tags_sq = reduced[:HEADER].tolist()
    # Sum leaves the canary at W; Average (with or without predivide) scales every element by 1/W.
    if abs(canary - world_size) <= 1e-9 * world_size:
        multiplier = 1  # with W = 1 a Sum and an Average are the same
    elif abs(canary - 1.0) <= 1e-9:
        multiplier = world_size
    else:
        raise CarrierMismatchError(
            f"the reduction turned the canary 1 into {canary!r}: expected {world_size} (Sum over {world_size} "
            "workers) or 1 (Average); the compressor and the all-reduce disagree on the workers or the op"
        )
    mean_size, mean_tag, mean_tag_sq = sizes / canary, tags / canary, tags_sq / canary
    if abs(mean_size - world_size) > 1e-6 * world_size:
        raise CarrierMismatchError(
            f"this worker reduces over {world_size} workers, but the others' world sizes average {mean_size:.6g}"
        )
    if abs(mean_tag - tag) > 1e-6 * tag or abs(mean_tag_sq - tag * tag) > 1e-6 * tag * tag:
        raise CarrierMismatchError(
            "workers reduced different things (compressor settings, tensor order, shapes or step "
            f"counts differ): tag {tag} here, mean tag {mean_tag:.6g} over the workers"
        )
    words = reduced[HEADER:]
    if native.usable(words, torch.float64):
        in_range = native_carrier.carrier_sums(words, multiplier)
        sums = words.view(torch.int64)
    else:  # the kernel's arithmetic in torch: adding 2**52 rounds to an integer, whose bits less those of 2**52 it is
        sums = (words.mul_(multiplier) if multiplier != 1 else words).add_(_TWO_52).view(torch.int64).sub_(_TWO_52_BITS)
        in_range = bool(((sums >= 0) & (sums < _SUM_LIMIT)).all())
    if not in_range:
        raise CarrierMismatchError(
            f"a word of the reduced carrier is no sum of carrier words (outside [0, 2**51) after scaling by "
            f"{multiplier}): the all-reduce did not sum what the compressor sent, or a worker's words were corrupted"
        )
    return sums, multiplier != 1
