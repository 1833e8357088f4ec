"""Float64 carriers survive Sum, Average and predivide scaling exactly, and catch disagreement."""

import pytest
import torch

from hvdcomp.codec import carrier
from hvdcomp.codec.packing import LaneLayout


def _reduce(carriers, op, predivide=1.0):
    """What Horovod does to float carriers: prescale 1/f, sum, postscale f/W (Average) or 1 (Sum)."""
    world_size = len(carriers)
    total = sum(c * (1.0 / predivide) for c in carriers)
    return total * (predivide / world_size) if op == "average" else total * predivide


@pytest.mark.parametrize("op,predivide", [("sum", 1.0), ("average", 1.0), ("average", 3.0), ("average", 7.0)])
@pytest.mark.parametrize("world_size", [1, 2, 7, 64, 4096])
def test_word_sums_exact_after_reduction(op, predivide, world_size):
    layout = LaneLayout.for_levels(255, world_size, carrier.word_bits(world_size))
    gen = torch.Generator().manual_seed(world_size)
    n = 200
    # adversarial: every worker at the top of the range, except random rows
    rows = [torch.full((n,), 255, dtype=torch.int64)] * (world_size - 1)
    rows.append(torch.randint(-255, 256, (n,), generator=gen))
    carriers = [carrier.wrap(layout.pack(r), world_size, tag=4321) for r in rows]
    reduced = _reduce(carriers, op, predivide)
    word_sums, averaged = carrier.unwrap(reduced, world_size, tag=4321)
    assert averaged == (op == "average" and world_size > 1)
    assert torch.equal(layout.unpack(word_sums, n), torch.stack(rows).sum(dim=0))
    assert word_sums.data_ptr() == reduced[carrier.HEADER:].data_ptr()  # written over the words: no new tensor


def test_nothing_is_written_on_a_mismatch():
    reduced = _reduce([carrier.wrap(torch.tensor([3, 4]), 2, 5)] * 2, "average")
    before = reduced.clone()
    with pytest.raises(carrier.CarrierMismatchError):
        carrier.unwrap(reduced, 2, 6)
    assert torch.equal(reduced, before)
    assert carrier.unwrap(reduced, 2, 5)[0].tolist() == [6, 8]


def test_seal_writes_the_header_in_front_of_words_in_place():
    message = torch.tensor([-1.0] * carrier.HEADER + [3.0, 4.0], dtype=torch.float64)
    assert carrier.seal(message, 2, 5) is message
    assert torch.equal(message, carrier.wrap(torch.tensor([3, 4]), 2, 5))
    for wrong in (torch.zeros(carrier.HEADER + 2), torch.zeros(carrier.HEADER - 1, dtype=torch.float64)):
        with pytest.raises(ValueError, match="float64"):
            carrier.seal(wrong, 2, 5)


def test_disagreeing_tags_are_caught_on_every_worker():
    words = torch.zeros(3, dtype=torch.int64)
    reduced = _reduce([carrier.wrap(words, 3, t) for t in (10, 20, 30)], "average")
    for tag in (10, 20, 30):
        with pytest.raises(carrier.CarrierMismatchError, match="different"):
            carrier.unwrap(reduced, 3, tag)


def test_disagreeing_world_sizes_are_caught():
    words = torch.zeros(3, dtype=torch.int64)
    reduced = _reduce([carrier.wrap(words, 2, 5), carrier.wrap(words, 4, 5)], "sum")
    for size in (2, 4):
        with pytest.raises(carrier.CarrierMismatchError):
            carrier.unwrap(reduced, size, 5)


def test_unexpected_scaling_and_corrupt_carriers():
    words = torch.zeros(3, dtype=torch.int64)
    reduced = _reduce([carrier.wrap(words, 2, 5)] * 2, "sum") * 0.3
    with pytest.raises(carrier.CarrierMismatchError, match="canary"):
        carrier.unwrap(reduced, 2, 5)
    with pytest.raises(carrier.CarrierMismatchError):
        carrier.unwrap(torch.zeros(2, dtype=torch.float64), 2, 5)
    with pytest.raises(carrier.CarrierMismatchError):
        carrier.unwrap(torch.zeros(6, dtype=torch.float32), 2, 5)


def test_tags_are_small_and_positive():
    for seed in (0, 1, 2**62, 12345678901):
        assert 1 <= carrier.to_tag(seed) < 2**carrier.TAG_BITS


def test_stamps_pass_agreeing_max_rounds_and_catch_disagreeing_ones_on_every_worker():
    stats = [torch.tensor([0.5, 0.0]), torch.tensor([2.0, 1.0])]
    agreed = torch.stack([carrier.stamp(s, 777) for s in stats]).amax(dim=0)
    assert torch.equal(carrier.unstamp(agreed, 777), torch.tensor([2.0, 1.0]))
    mixed = torch.stack([carrier.stamp(s, t) for s, t in zip(stats, (777, 778))]).amax(dim=0)
    for tag in (777, 778):
        with pytest.raises(carrier.CarrierMismatchError, match="different tensors.*see here"):
            carrier.unstamp(mixed, tag, "; see here")
    assert carrier.stamp(torch.zeros(0, dtype=torch.int64), 2**16 - 1).tolist() == [2**16 - 1, 1 - 2**16]
    with pytest.raises(TypeError, match="float32"):
        carrier.stamp(torch.zeros(2, dtype=torch.bfloat16), 5)
