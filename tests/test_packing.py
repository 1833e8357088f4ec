"""Packed lanes: the integer sum of the workers' words is the lane-wise sum, for any W, span, length."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hvdcomp.codec import carrier
from hvdcomp.codec.packing import INT64_WORD_BITS, LaneLayout

FLOAT64_WORD_BITS = carrier.word_bits(1)  # the float carrier's widest words


@st.composite
def layouts_and_values(draw):
    word_bits = draw(st.sampled_from([INT64_WORD_BITS, FLOAT64_WORD_BITS]))
    world_size = draw(st.integers(1, 4096))
    max_span = (2**word_bits - 1) // world_size
    span = draw(st.integers(1, min(max_span, 2**20)))
    offset = draw(st.integers(0, span))
    layout = LaneLayout(span=span, world_size=world_size, word_bits=word_bits, offset=offset)
    numel = draw(st.integers(0, 40))
    workers = min(world_size, 64)  # distinct rows; the rest of the W workers repeat them
    kind = draw(st.sampled_from(["random", "all_max", "all_min"]))
    if kind == "random":
        seed = draw(st.integers(0, 2**31))
        gen = torch.Generator().manual_seed(seed)
        rows = torch.randint(-offset, span - offset + 1, (workers, numel), generator=gen)
    else:
        fill = span - offset if kind == "all_max" else -offset
        rows = torch.full((workers, numel), fill, dtype=torch.int64)
    return layout, rows


def _all_workers_words(layout, rows):
    """Words of all W workers: row i % len(rows) for worker i; summed in a shuffled order."""
    words = torch.stack([layout.pack(row) for row in rows])
    counts = torch.full((len(rows),), layout.world_size // len(rows), dtype=torch.int64)
    counts[: layout.world_size % len(rows)] += 1
    return words, counts


@settings(max_examples=300, deadline=None)
@given(layouts_and_values())
def test_word_sums_unpack_to_lane_sums(case):
    layout, rows = case
    words, counts = _all_workers_words(layout, rows)
    expected = (rows * counts[:, None]).sum(dim=0)
    # Partial sums in any order must stay non-negative and below 2**word_bits (ring all-reduce).
    total = torch.zeros(words.shape[1], dtype=torch.int64)
    for i in torch.randperm(len(rows)).tolist():
        total += words[i] * counts[i]
        assert (total >= 0).all() and (total <= 2**layout.word_bits - 1).all()
    assert torch.equal(layout.unpack(total, rows.shape[1]), expected)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 2**16), st.integers(1, 4096), st.sampled_from([INT64_WORD_BITS, FLOAT64_WORD_BITS]))
def test_bits_per_element_formula(s, world_size, word_bits):
    layout = LaneLayout.for_levels(s, world_size, word_bits)
    width = math.ceil(math.log2(2 * s * world_size + 1))
    assert layout.lane_width == width
    assert layout.bits_per_element == 64 / (word_bits // width)
    assert layout.num_words(1000) == -(-1000 // (word_bits // width))


def test_known_layouts():
    assert LaneLayout.for_levels(255, 2).lane_width == 10  # 2*255*2 = 1020 < 1024
    assert LaneLayout.for_levels(255, 2).lanes_per_word == 6
    assert LaneLayout.for_levels(1, 1).lane_width == 2
    assert LaneLayout(span=1, world_size=4096).lane_width == 13


def test_bad_layouts_and_values():
    with pytest.raises(ValueError):
        LaneLayout(span=0, world_size=2)
    with pytest.raises(ValueError):
        LaneLayout(span=3, world_size=0)
    with pytest.raises(ValueError, match="needs"):
        LaneLayout(span=2**30, world_size=2**20, word_bits=FLOAT64_WORD_BITS)
    layout = LaneLayout.for_levels(3, 4)
    with pytest.raises(ValueError, match="outside"):
        layout.pack(torch.tensor([4]))
    with pytest.raises(TypeError):
        layout.pack(torch.tensor([1.0]))
    with pytest.raises(ValueError):
        layout.unpack(torch.zeros(5, dtype=torch.int64), 3)
