"""Counter-based random numbers: Philox4x32-7, keyed by (seed, purpose, rank, tensor key), counted by
(step, element index).

Philox4x32 (Salmon, Moraes, Dror, Shaw: "Parallel random numbers: as easy as 1, 2, 3", SC 2011; the
generator behind cuRAND's and JAX's counter streams, with 10 rounds) maps a 128-bit counter and a 64-bit key to
128 random bits with rounds of two 32 x 32 -> 64-bit multiplications. Its authors report it Crush-resistant (it
passes TestU01's SmallCrush, Crush and BigCrush) from 7 rounds, and use 10 by default for a safety margin. We use
7 rounds, the fewest that are Crush-resistant, because the draw is a large part of the codec's cost
(measurements: docs/benchmarks.md#kernel-level-measurements). ``tests/test_random.py`` checks Random123's known
answers for 7 and 10 rounds and the statistics of the draws. Here:

- key: ``stable_seed(seed, purpose, rank, tensor key)`` (63 bits) split into two 32-bit words;
- counter: ``(j mod 2**32, j // 2**32, step mod 2**32, step // 2**32)`` for block ``j``;
- element ``i`` of a draw takes 16 bits of block ``j = i // 8``: for ``r = i % 8``, the high half of output word
  ``r`` (``r < 4``) or the low half of word ``r - 4``; its uniform is ``(h + 1/2) 2**-16`` for those 16 bits
  ``h``, a float32 in (0, 1) (every value exact), symmetric about 1/2.

Each draw takes 16 bits, so one Philox block serves 8 elements (measurements:
docs/benchmarks.md#kernel-level-measurements). Stochastic rounding ``floor(m + U)`` is then off by at most
``2**-17`` of a level either way (zero on average over the fractions of ``m``), below float32's own rounding of ``m
+ U`` near the top of 8-bit levels (``2**-16``).

Each 32-bit word is held in an int64 tensor, and every operation is an integer add, xor, shift, mask or a product
below ``2**63`` in magnitude (``_mulhilo_int64`` multiplies by ``m - 2**32``): no overflow anywhere. Compiled for
a CPU without AVX-512 (``CPU_INT32_LANES``), whose vectors have no 64-bit multiply, the words are held in int32
tensors as their two's-complement bits instead, and every operation is an int32 add, xor, mask, shift or product
that keeps the low 32 bits (torch's integer arithmetic wraps); the high word of a 32 x 32-bit product then comes
from four products of 16-bit halves (``_mulhilo_int32``). Compiled, int32 lanes are the faster form on such a
CPU; eagerly, int64 lanes are (fewer passes; docs/benchmarks.md#kernel-level-measurements).
Both give the same bits, eagerly or compiled (``hvdcomp.codec.fused``), on CPU or GPU. No state: a draw is a
pure function of its key, step and element index, so it resumes, replays and reorders exactly.
"""

from __future__ import annotations

import torch

from .seeding import stable_seed

WORD_MASK = 0xFFFFFFFF
PHILOX_MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
PHILOX_KEY_INCREMENTS = (0x9E3779B9, 0xBB67AE85)
PHILOX_ROUNDS = 7  # the module docstring; Random123 publishes known answers for 7 and 10
UNIFORM_BITS = 16
UNIFORM_MASK = (1 << UNIFORM_BITS) - 1
OUTPUTS_PER_BLOCK = 8  # uniforms per Philox block


LOW_HALF = 0xFFFF
# Whether compiled CPU kernels draw in int32 lanes: set by ``hvdcomp.codec.fused`` before its first compile, True
# unless Inductor vectorizes for AVX-512 (which multiplies 64-bit lanes); the draws are the same bits either way.
CPU_INT32_LANES = False


def _int32(value: int) -> int:
    """The int32 whose two's-complement bits are the 32-bit word ``value`` (in [0, 2**32))."""
    return value - (1 << 32) if value >= 1 << 31 else value


def _words_to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 32-bit words (in [0, 2**32)) -> int32 tensors of the same bits (no conversion out of range)."""
    return (((words + (1 << 31)) & WORD_MASK) - (1 << 31)).to(torch.int32)


def _mulhilo_int64(a: torch.Tensor, multiplier: int) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low words of ``a * multiplier`` in int64 lanes (``a`` in [0, 2**32)): ``q = a (multiplier -
    2**32)`` fits in int64, and ``a * multiplier = q + a 2**32``."""
    q = a * (multiplier - (1 << 32))
    return (q >> 32) + a, q & WORD_MASK


def _mulhilo_int32(a: torch.Tensor, multiplier: int) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low words of ``a * multiplier`` in int32 lanes (``a``: the bits of a 32-bit word). The low word
    is the wrapped int32 product; the high one sums the four products of 16-bit halves (each below 2**32:
    wrapped bits, read back with shifts and masks) with the carry of the middle column."""
    m_low, m_high = multiplier & LOW_HALF, multiplier >> 16
    a_low, a_high = a & LOW_HALF, (a >> 16) & LOW_HALF
    low_low, low_high, high_low = a_low * m_low, a_low * m_high, a_high * m_low
    middle = ((low_low >> 16) & LOW_HALF) + (low_high & LOW_HALF) + (high_low & LOW_HALF)  # below 3 * 2**16
    high = a_high * m_high + ((low_high >> 16) & LOW_HALF) + ((high_low >> 16) & LOW_HALF) + (middle >> 16)
    return high, a * _int32(multiplier)


def _philox(counter: tuple[torch.Tensor, ...], key: tuple[torch.Tensor, torch.Tensor], int64_lanes: bool,
            rounds: int = PHILOX_ROUNDS) -> tuple[torch.Tensor, ...]:
    """Philox4x32 (``rounds`` rounds) of words in int64 lanes (values in [0, 2**32)) or int32 lanes (their bits)."""
    mulhilo = _mulhilo_int64 if int64_lanes else _mulhilo_int32
    step0, step1 = PHILOX_KEY_INCREMENTS if int64_lanes else map(_int32, PHILOX_KEY_INCREMENTS)
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for round_index in range(rounds):
        if round_index:  # int32 lanes wrap by themselves
            k0, k1 = k0 + step0, k1 + step1
            if int64_lanes:
                k0, k1 = k0 & WORD_MASK, k1 & WORD_MASK
        hi0, lo0 = mulhilo(c0, PHILOX_MULTIPLIERS[0])
        hi1, lo1 = mulhilo(c2, PHILOX_MULTIPLIERS[1])
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def philox4x32(counter: tuple[torch.Tensor, ...], key: tuple[torch.Tensor, torch.Tensor],
               int32_lanes: bool = False, rounds: int = PHILOX_ROUNDS) -> tuple[torch.Tensor, ...]:
    """Philox4x32 with ``rounds`` rounds (the draws' 7 by default) of four counter words and two key words (int64
    tensors of 32-bit values, broadcastable): int64 words in [0, 2**32), computed in int64 lanes or
    (``int32_lanes``) int32 ones (the same words)."""
    if not int32_lanes:
        return _philox(counter, key, True, rounds)
    out = _philox(tuple(map(_words_to_int32, counter)), tuple(map(_words_to_int32, key)), False, rounds)
    return tuple(word.to(torch.int64) & WORD_MASK for word in out)


def stream_words(step: int, *key_parts: object, device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 ``[4]``: the key words of ``stable_seed(*key_parts)`` and the counter words of ``step`` (>= 0).

    Pass it to ``uniform``; e.g. ``stream_words(step, seed, "rounding", rank, tensor_key)``."""
    if step < 0 or step >= 1 << 64:
        raise ValueError(f"step must be in [0, 2**64), got {step}")
    key = stable_seed(*key_parts)
    words = [key & WORD_MASK, key >> 32, step & WORD_MASK, step >> 32 & WORD_MASK]
    return torch.tensor(words, dtype=torch.int64, device=device)


def uniform(numel: int, words: torch.Tensor, first: int = 0) -> torch.Tensor:
    """float32 ``[numel]`` in (0, 1), multiples of ``2**-16`` plus ``2**-17``: elements ``first .. first + numel -
    1`` of the stream ``words`` (any ``first >= 0``). Pure tensor ops: compilable by ``torch.compile``."""
    skip = first % OUTPUTS_PER_BLOCK  # draws of the first block before element ``first``
    blocks = (skip + numel) // OUTPUTS_PER_BLOCK + 2  # enough, and never 1: torch.compile specializes size 1
    block = torch.arange(blocks, dtype=torch.int64, device=words.device) + first // OUTPUTS_PER_BLOCK
    int64_lanes = not (CPU_INT32_LANES and words.device.type == "cpu" and torch.compiler.is_compiling())
    lanes = (lambda w: w) if int64_lanes else _words_to_int32
    counter = (lanes(block & WORD_MASK), lanes(block >> 32), lanes(words[2]).expand(blocks),
               lanes(words[3]).expand(blocks))
    outputs = _philox(counter, (lanes(words[0]), lanes(words[1])), int64_lanes)
    halves = [word >> UNIFORM_BITS for word in outputs] + list(outputs)  # high halves, then low ones
    draws = [((half & UNIFORM_MASK).to(torch.float32) + 0.5) * 2.0**-UNIFORM_BITS for half in halves]
    return torch.stack(draws, dim=1).view(-1)[skip:skip + numel]
