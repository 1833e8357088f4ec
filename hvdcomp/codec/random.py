"""Counter-based random numbers: Philox4x32-10, keyed by (seed, purpose, rank, tensor key), counted by
(step, element index).

Philox4x32-10 (Salmon, Moraes, Dror, Shaw: "Parallel random numbers: as easy as 1, 2, 3", SC 2011; the
generator behind cuRAND's and JAX's counter streams) maps a 128-bit counter and a 64-bit key to 128 random
bits with ten rounds of two 32 x 32 -> 64-bit multiplications; it passes TestU01's BigCrush. Here:

- key: ``stable_seed(seed, purpose, rank, tensor key)`` (63 bits) split into two 32-bit words;
- counter: ``(j mod 2**32, j // 2**32, step mod 2**32, step // 2**32)`` for block ``j``;
- element ``i`` of a draw takes the 32-bit output word ``i % 4`` of block ``j = i // 4``; its uniform is
  the word's top 24 bits times ``2**-24``, a float32 in [0, 1) (every value exact).

Every 32-bit word is held in an int64 tensor and every operation is an integer add, xor, shift, mask or a
product below ``2**63`` in magnitude (``mulhilo`` multiplies by ``m - 2**32``), so the same bits come out
eagerly or compiled (``hvdcomp.codec.fused``), on CPU or GPU, with no overflow anywhere. No state: a draw is
a pure function of its key, step and element index, so it resumes, replays and reorders exactly.
"""

from __future__ import annotations

import torch

from .seeding import stable_seed

WORD_MASK = 0xFFFFFFFF
PHILOX_MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
PHILOX_KEY_INCREMENTS = (0x9E3779B9, 0xBB67AE85)
PHILOX_ROUNDS = 10
UNIFORM_BITS = 24
OUTPUTS_PER_BLOCK = 4


def _mulhilo(a: torch.Tensor, multiplier: int) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of ``a * multiplier`` (``a`` in [0, 2**32), ``multiplier`` in [2**31, 2**32)).

    ``q = a (multiplier - 2**32)`` fits in int64; ``a * multiplier = q + a 2**32`` gives both words (the high
    one, ``floor(q / 2**32) + a``, is already in [0, 2**32): no mask)."""
    q = a * (multiplier - (1 << 32))
    return (q >> 32) + a, q & WORD_MASK


def philox4x32(counter: tuple[torch.Tensor, ...], key: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10 of four counter words and two key words (int64 tensors of 32-bit values, broadcastable)."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for round_index in range(PHILOX_ROUNDS):
        if round_index:
            k0 = (k0 + PHILOX_KEY_INCREMENTS[0]) & WORD_MASK
            k1 = (k1 + PHILOX_KEY_INCREMENTS[1]) & WORD_MASK
        hi0, lo0 = _mulhilo(c0, PHILOX_MULTIPLIERS[0])
        hi1, lo1 = _mulhilo(c2, PHILOX_MULTIPLIERS[1])
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def stream_words(step: int, *key_parts: object, device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 ``[4]``: the key words of ``stable_seed(*key_parts)`` and the counter words of ``step`` (>= 0).

    Pass it to ``uniform``; e.g. ``stream_words(step, seed, "rounding", rank, tensor_key)``."""
    if step < 0 or step >= 1 << 64:
        raise ValueError(f"step must be in [0, 2**64), got {step}")
    key = stable_seed(*key_parts)
    words = [key & WORD_MASK, key >> 32, step & WORD_MASK, step >> 32 & WORD_MASK]
    return torch.tensor(words, dtype=torch.int64, device=device)


def uniform(numel: int, words: torch.Tensor, first: int | torch.Tensor = 0) -> torch.Tensor:
    """float32 ``[numel]`` in [0, 1): elements ``first .. first + numel - 1`` of the stream ``words``.

    ``first`` must be a multiple of 4 (a block boundary). Pure tensor ops: compilable by ``torch.compile``."""
    blocks = (numel + OUTPUTS_PER_BLOCK - 1) // OUTPUTS_PER_BLOCK
    block = torch.arange(blocks, dtype=torch.int64, device=words.device) + first // OUTPUTS_PER_BLOCK
    counter = (block & WORD_MASK, block >> 32, words[2].expand(blocks), words[3].expand(blocks))
    outputs = philox4x32(counter, (words[0], words[1]))
    scale = 2.0 ** -UNIFORM_BITS
    draws = [(word >> (32 - UNIFORM_BITS)).to(torch.float32) * scale for word in outputs]
    return torch.stack(draws, dim=1).view(-1)[:numel]
