"""The counter-based generator: Philox4x32's known answers (7 rounds, the draws', and 10), and the statistics
of its uniforms and of stochastic rounding with them (uniformity, bias, correlation across ranks, steps, tensors
and neighbours)."""

import pytest
import torch

from hvdcomp.codec.random import philox4x32, stream_words, uniform

DRAWS = 1 << 18


def _words(values):
    return tuple(torch.tensor([v], dtype=torch.int64) for v in values)


# Random123's kat_vectors (philox4x32 with 7 and 10 rounds): rounds, counter, key, expected output.
_ONES = ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2)
_PI = ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0))
KNOWN_ANSWERS = [
    (7, (0, 0, 0, 0), (0, 0), (0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48)),
    (7, *_ONES, (0x5207DDC2, 0x45165E59, 0x4D8EE751, 0x8C52F662)),
    (7, *_PI, (0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A)),
    (10, (0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    (10, *_ONES, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (10, *_PI, (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("int32_lanes", [False, True])
@pytest.mark.parametrize("rounds,counter,key,expected", KNOWN_ANSWERS)
def test_philox_known_answers(rounds, counter, key, expected, int32_lanes):
    out = philox4x32(_words(counter), _words(key), int32_lanes, rounds)
    assert tuple(int(word) for word in out) == expected


def test_draws_use_seven_rounds():
    words = stream_words(0, "seed")
    block = philox4x32(tuple(torch.tensor([v]) for v in (0, 0, int(words[2]), int(words[3]))),
                       (words[0:1], words[1:2]), rounds=7)
    halves = [int(word) >> 16 for word in block] + [int(word) & 0xFFFF for word in block]
    assert uniform(8, words).tolist() == [(h + 0.5) / 2**16 for h in halves]


def test_both_lane_widths_give_the_same_words():
    counter = tuple(torch.randint(0, 2**32, (4096,), dtype=torch.int64, generator=torch.Generator().manual_seed(i))
                    for i in range(4))
    key = _words((0xDEADBEEF, 0x01234567))
    assert all(torch.equal(a, b) for a, b in zip(philox4x32(counter, key), philox4x32(counter, key, True)))


def test_uniforms_are_16_bit_floats_in_unit_interval_and_addressable_by_block():
    words = stream_words(3, "seed", "test", 0)
    u = uniform(1001, words)
    assert u.dtype == torch.float32 and u.shape == (1001,)
    assert 0 < float(u.min()) and float(u.max()) < 1
    halves = u * 2**16 - 0.5
    assert torch.equal(halves, halves.floor())  # 16 bits h each: (h + 1/2) 2**-16
    for first in (8, 4, 5, 1000):  # element i is the same draw in any call, from any first element
        assert torch.equal(uniform(1001 - first, words, first=first), u[first:]), first
    assert torch.equal(uniform(1001, stream_words(3, "seed", "test", 0)), u)  # stateless


def test_uniformity_chi_square():
    u = uniform(DRAWS, stream_words(0, 1, "rounding", 0, "bucket"))
    bins = 256
    counts = torch.bincount((u * bins).long(), minlength=bins).double()
    chi2 = float(((counts - DRAWS / bins) ** 2 / (DRAWS / bins)).sum())
    # chi-square with 255 degrees of freedom: mean 255, sd ~22.6; 6 sd either side
    assert 255 - 6 * 22.6 < chi2 < 255 + 6 * 22.6
    low_bits = torch.bincount((u * 2**16).long() % 64, minlength=64).double()  # the least significant bits too
    chi2_low = float(((low_bits - DRAWS / 64) ** 2 / (DRAWS / 64)).sum())
    assert 63 - 6 * 11.2 < chi2_low < 63 + 6 * 11.2


def _correlation(a, b):
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


@pytest.mark.parametrize("other", [
    (0, 1, "rounding", 1, "bucket"),  # another rank
    (1, 1, "rounding", 0, "bucket"),  # the next step
    (0, 1, "rounding", 0, "other bucket"),  # another tensor
    (0, 2, "rounding", 0, "bucket"),  # another seed
])
def test_streams_are_uncorrelated(other):
    base = uniform(DRAWS, stream_words(0, 1, "rounding", 0, "bucket"))
    u = uniform(DRAWS, stream_words(*other))
    # Pearson's r of independent streams is ~N(0, 1/n): |r| sqrt(n) below 5
    assert abs(_correlation(base, u)) * DRAWS**0.5 < 5
    assert not torch.equal(base[:64], u[:64])


def test_neighbouring_elements_are_uncorrelated():
    u = uniform(DRAWS, stream_words(0, 1, "rounding", 0, "bucket"))
    for lag in (1, 2, 3, 4, 5, 8, 9):  # within a Philox block (lags up to 7; 4: the same word) and across blocks
        assert abs(_correlation(u[:-lag], u[lag:])) * DRAWS**0.5 < 5, lag


@pytest.mark.parametrize("value", [0.0, 0.3, 0.5, 0.999])
def test_stochastic_rounding_is_unbiased(value):
    """``floor(v s + U)`` has mean ``v s``: bias z-scores of the mean over many draws, per step and rank."""
    levels = 255
    target = value * levels
    for step, rank in ((0, 0), (1, 0), (0, 1)):
        u = uniform(DRAWS, stream_words(step, 7, "rounding", rank, "w"))
        rounded = torch.floor(torch.full((DRAWS,), target, dtype=torch.float32) + u).double()
        spread = max(float(rounded.std()), 1e-12)
        z = abs(float(rounded.mean()) - target) / (spread / DRAWS**0.5)
        assert z < 5 if spread > 1e-12 else float(rounded.mean()) == target


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_same_bits_on_gpu():
    words = stream_words(5, "seed", 3, "key")
    assert torch.equal(uniform(4099, words.cuda()).cpu(), uniform(4099, words))


def test_codec_state_needs_no_generators_and_other_layouts_are_refused():
    from hvdcomp.codec.quantize import MaxNormQuantizer
    from hvdcomp.exchange.elementwise import MaxNormCodec

    codec = MaxNormCodec(MaxNormQuantizer((4,)))
    codec.bind_rank(2)
    assert codec.state_dict() == {"memory": None, "rank": 2}
    restored = MaxNormCodec(MaxNormQuantizer((4,)))
    with pytest.raises(ValueError, match="not a MaxNormCodec state"):
        restored.load_state_dict({"memory": None, "rank": 2, "generators": {"cpu": torch.Generator().get_state()}})
    assert restored.rank is None
    restored.load_state_dict(codec.state_dict())
    assert restored.rank == 2
    assert torch.equal(restored.rounding_stream("k", 5, "cpu"), codec.rounding_stream("k", 5, "cpu"))
