"""The randomized Hadamard rotation (``hvdcomp.codec.rotation``) and the rotated max-norm codecs: the blocks, the
transform against an explicit Hadamard matrix, the native kernel against the torch path bit for bit (and its size
checks), the rotated codec's unbiasedness and its variance bound, and the workers' agreement on ``rotate``."""

import math

import pytest
import torch
from test_native import build, other_builds  # noqa: F401 (the fixtures)

from hvdcomp import QSGDMaxNorm, QSGDMaxNormMultiScale
from hvdcomp.codec import fused, native
from hvdcomp.codec.quantize import MaxNormQuantizer
from hvdcomp.codec.random import stream_words, uniform
from hvdcomp.codec.rotation import MAX_BLOCK, HadamardRotation, block_runs
from hvdcomp.exchange import Op, Transport
from hvdcomp.exchange.ahead import AheadMaxNorm
from hvdcomp.exchange.elementwise import MaxNormCodec, simulate_max_norm
from hvdcomp.exchange.plan import plan_buckets
from hvdcomp.exchange.simulator import simulate
from hvdcomp.exchange.state import ConfigurationMismatchError, ExchangeState
from hvdcomp.exchange.two_stage import TwoStageMaxNorm


@pytest.fixture
def native_on(monkeypatch):
    """The native kernels on (the suite runs eagerly: tests/conftest.py)."""
    monkeypatch.setenv(fused.ENV_SWITCH, "1")
    monkeypatch.delenv(native.ENV_SWITCH, raising=False)
    if native.library() is None:
        pytest.skip(f"the native kernels did not load: {fused._Mode.failed}")


def _hadamard(size: int) -> torch.Tensor:
    """The normalized Sylvester Hadamard matrix of ``size`` (a power of two), float64."""
    index = torch.arange(size)
    bits = torch.bitwise_and(index[:, None], index[None, :])
    parity = torch.zeros_like(bits)
    while bool(bits.any()):
        parity ^= bits & 1
        bits = bits >> 1
    return (1.0 - 2.0 * parity.double()) / math.sqrt(size)


@pytest.mark.parametrize("lengths", [[1], [7], [100], [65536], [65537 + 3], [0, 5, 0, 64, 1000], [131072 + 100]])
def test_blocks_are_powers_of_two_that_tile_each_group_largest_first(lengths):
    groups = torch.tensor(lengths)
    runs = block_runs(groups)
    position, blocks = 0, []
    for start, block, count in runs:
        assert start == position and block & (block - 1) == 0 and 1 <= block <= MAX_BLOCK
        blocks += [block] * count
        position += block * count
    assert position == sum(lengths)
    starts = iter(torch.tensor(lengths).cumsum(0).tolist())
    end, taken = next(starts), 0
    for block in blocks:  # within one group: full blocks, then the binary digits of the rest, decreasing
        while taken == end:
            end = next(starts)
        assert taken + block <= end and block == min(MAX_BLOCK, 1 << (end - taken).bit_length() - 1)
        taken += block


@pytest.mark.parametrize("path", ["eager", "native"])
def test_each_block_is_the_hadamard_matrix_times_the_signs(path, request):
    if path == "native":
        request.getfixturevalue("native_on")
    lengths = [64, 45, 8]  # blocks 64 | 32, 8, 4, 1 | 8
    x = torch.randn(sum(lengths), generator=torch.Generator().manual_seed(1))
    groups = torch.tensor(lengths)
    rotation = HadamardRotation(seed=5)
    with fused.eager() if path == "eager" else torch.no_grad():
        rotated = rotation.forward(x, groups, "k", 3).clone()
    signs = torch.where(uniform(x.numel(), stream_words(3, 5, "rotation", "k")) > 0.5, -1.0, 1.0)
    expected, start = [], 0
    for _, block, count in block_runs(groups):
        for _ in range(count):
            piece = x[start:start + block].double() * signs[start:start + block].double()
            expected.append(_hadamard(block) @ piece)
            start += block
    torch.testing.assert_close(rotated.double(), torch.cat(expected), atol=1e-5, rtol=1e-5)
    assert not torch.equal(rotated, x)


@pytest.mark.parametrize("max_block", [1, 16, MAX_BLOCK])
def test_inverse_undoes_forward_and_norms_are_kept(max_block):
    x = torch.randn(70000, generator=torch.Generator().manual_seed(2)) * 1e-3
    x[17] = 5.0  # an outlier
    groups = torch.tensor([30000, 40000])
    rotation = HadamardRotation(seed=1, max_block=max_block)
    rotated = rotation.forward(x, groups, ("b", 0), 9).clone()
    torch.testing.assert_close(rotated.norm(), x.norm(), rtol=1e-4, atol=0)
    if max_block == MAX_BLOCK:  # the outlier is spread over its block of 16384
        assert rotated.abs().max() < 0.1 * x.abs().max()
    back = rotation.inverse_(rotated, groups, ("b", 0), 9)
    torch.testing.assert_close(back, x, atol=1e-6, rtol=0)


def test_the_signs_are_shared_by_key_and_step_not_by_rank_and_change_with_the_step():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(3))
    groups = torch.tensor([4096])
    one, two = HadamardRotation(seed=7), HadamardRotation(seed=7)
    assert torch.equal(one.forward(x, groups, "k", 1), two.forward(x, groups, "k", 1))
    assert not torch.equal(one.forward(x, groups, "k", 1).clone(), two.forward(x, groups, "k", 2))
    assert not torch.equal(one.forward(x, groups, "k", 1).clone(), two.forward(x, groups, "j", 1))


@pytest.mark.usefixtures("native_on", "build")  # this CPU's build, then test_native's others
@pytest.mark.parametrize("lengths,max_block", [([1], MAX_BLOCK), ([100, 70000, 4096, 4096, 3], MAX_BLOCK),
                                                ([300000], MAX_BLOCK), ([5000] * 40, 256), ([0, 9, 0], 4)])
@pytest.mark.parametrize("inverse", [False, True])
def test_native_rotation_equals_the_torch_path_bit_for_bit(lengths, max_block, inverse):
    x = torch.randn(sum(lengths), generator=torch.Generator().manual_seed(4))
    groups = torch.tensor(lengths)
    words = stream_words(5, 1, "rotation", "k")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # [300000] splits over two threads
    try:
        native_result = native.rotate(x.clone(), groups, max_block, words, inverse)
    finally:
        torch.set_num_threads(threads)
    with fused.eager():
        rotation = HadamardRotation(seed=1, max_block=max_block)
        method = rotation.inverse_ if inverse else rotation.forward
        eager_result = method(x.clone(), groups, "k", 5)
    assert torch.equal(native_result, eager_result)


@pytest.mark.usefixtures("native_on")
@pytest.mark.parametrize("args", [
    (10, [10], 3, 0, 0, 10),  # max_block not a power of two
    (10, [10], 1 << 17, 0, 0, 10),  # max_block too large
    (10, [4, 9], 4, 0, 0, 10),  # the groups end before numel
    (10, [6, 4], 4, 0, 0, 10),  # the ends decrease
    (10, [10], 4, 2, 0, 10),  # inverse not 0 or 1
    (10, [10], 4, 0, 6, 5),  # first > last
    (10, [10], 4, 0, 0, 11),  # last past numel
    (10, [], 4, 0, 0, 10),  # no groups for values
])
def test_the_rotation_kernel_refuses_sizes_that_cannot_be_right(args):
    numel, ends, max_block, inverse, first, last = args
    x = torch.zeros(numel)
    ends = torch.tensor(ends, dtype=torch.int64)
    words = stream_words(0, 1)
    with pytest.raises(ValueError, match="hvdcomp_rotate refused"):
        native.library().hvdcomp_rotate(x.data_ptr(), numel, ends.data_ptr(), ends.numel(), max_block,
                                        words.data_ptr(), inverse, first, last)
    assert not bool(x.any())


@pytest.mark.parametrize("path", ["eager", "native"])
def test_the_wrapper_refuses_groups_that_do_not_split_the_values(path, request):
    if path == "native":
        request.getfixturevalue("native_on")
    rotation = HadamardRotation()
    with fused.eager() if path == "eager" else torch.no_grad(), pytest.raises(ValueError, match="do not split"):
        rotation.forward(torch.zeros(10), torch.tensor([4, 5]), "k", 0)
    with pytest.raises(ValueError, match="power of two"):
        HadamardRotation(max_block=24)


def _heavy_tailed(workers: int, numel: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(numel, generator=gen) * 1e-2 for _ in range(workers)]
    for grad in grads:
        grad[torch.randint(numel, (4,), generator=gen)] += 1.0  # a few outliers per worker
    return grads


def _rotated_bound(grads, lengths, seed, key, step, levels):
    """Per element ``(M_R / s)**2 / (4 W)``: ``M_R`` the MAX over the workers of each group's rotated maximum."""
    groups = torch.tensor(lengths)
    rotation = HadamardRotation(seed)
    maxima = torch.stack([torch.segment_reduce(rotation.forward(g, groups, key, step).abs(), "max", lengths=groups)
                          for g in grads]).amax(dim=0)
    return (maxima / levels).square().div(4 * len(grads)).repeat_interleave(groups)


@pytest.mark.parametrize("bits", [2, 4])
def test_the_rotated_mean_is_unbiased_and_within_the_rotated_variance_bound(bits):
    workers, numel, trials = 4, 1024, 200
    grads = _heavy_tailed(workers, numel, 5)
    truth = torch.stack(grads).mean(dim=0)
    codecs = [MaxNormCodec(MaxNormQuantizer((bits,)), seed=11, rotate=True) for _ in range(workers)]
    total, squared, bound = torch.zeros(numel), torch.zeros(numel), torch.zeros(numel)
    for step in range(trials):  # each step draws new signs and new roundings
        error = simulate_max_norm(codecs, grads, "k", step)[0] - truth
        total += error
        squared += error.square()
        bound += _rotated_bound(grads, [numel], 11, "k", step, 2**bits - 1)
    mse, bound = squared / trials, bound / trials
    # unbiased: the mean error over the trials shrinks as its standard error, sqrt(mse / trials), says
    assert (total / trials).square().mean() < 2.0 * mse.mean() / trials
    assert mse.mean() <= 1.05 * bound.mean()  # the bound holds on average over the elements ...
    assert bool((mse <= 1.6 * bound).all())  # ... and per element, up to the sampling error of 200 trials
    unrotated = (torch.stack(grads).abs().amax() / (2**bits - 1)) ** 2 / (4 * workers)
    assert mse.mean() < unrotated / 20  # the outliers no longer set the error


def test_a_biased_mean_would_fail_the_unbiasedness_check():
    """The check above can fail: the same statistic on a mean shifted by 15% of its error's spread."""
    workers, numel, trials = 4, 1024, 200
    grads = _heavy_tailed(workers, numel, 5)
    truth = torch.stack(grads).mean(dim=0)
    codecs = [MaxNormCodec(MaxNormQuantizer((2,)), seed=11, rotate=True) for _ in range(workers)]
    errors = torch.stack([simulate_max_norm(codecs, grads, "k", step)[0] - truth for step in range(trials)])
    mse = errors.square().mean(dim=0)
    shifted = errors.mean(dim=0) + 0.15 * mse.sqrt()
    assert shifted.square().mean() > 2.0 * mse.mean() / trials


def test_multiscale_chunks_and_the_ahead_scale_rotate_and_stay_unbiased():
    workers, numel, trials = 3, 1024, 100
    grads = _heavy_tailed(workers, numel, 6)
    truth = torch.stack(grads).mean(dim=0)
    for make in (lambda: MaxNormCodec(MaxNormQuantizer((2, 4), chunk_size=512), seed=1, rotate=True),
                 lambda: AheadMaxNorm(MaxNormCodec(MaxNormQuantizer((4,)), seed=1, rotate=True))):
        codecs = [make() for _ in range(workers)]
        for rank, codec in enumerate(codecs):
            codec.bind_rank(rank)
        errors, squared = torch.zeros(numel), torch.zeros(numel)
        for step in range(trials):
            results = simulate([c.exchange(g, [numel], "k", step, workers) for c, g in zip(codecs, grads)])
            assert all(torch.equal(results[0], r) for r in results)
            errors += results[0] - truth
            squared += (results[0] - truth).square()
        # as in the test above; the ahead codec's clipped excess is delayed, not lost: its errors' sum stays bounded
        assert (errors / trials).square().mean() < 2.0 * squared.mean() / trials**2


def test_the_ahead_codec_keeps_its_excess_unrotated():
    numel = 1024
    codec = AheadMaxNorm(MaxNormCodec(MaxNormQuantizer((8,)), seed=2, rotate=True))
    codec.bind_rank(0)
    small = torch.full((numel,), 1e-3)
    simulate([codec.exchange(small, [numel], "k", 0, 1)])  # agrees a small rotated scale
    large = torch.zeros(numel)
    large[3] = 1.0
    mean = simulate([codec.exchange(large, [numel], "k", 1, 1)])[0]
    indices, excess = codec.memory._excess["k"]
    owed = torch.zeros(numel).index_add_(0, indices, excess)
    torch.testing.assert_close(mean + owed, large, atol=1e-4, rtol=0)  # sent + owed = the unrotated values


def test_two_stage_rotates_and_refuses_error_feedback():
    workers, numel = 4, 4000
    grads = _heavy_tailed(workers, numel, 7)
    truth = torch.stack(grads).mean(dim=0)
    rotated = [TwoStageMaxNorm(MaxNormCodec(MaxNormQuantizer((4,)), seed=3, rotate=True), "two_stage")
               for _ in range(workers)]
    plain = [TwoStageMaxNorm(MaxNormCodec(MaxNormQuantizer((4,)), seed=3), "two_stage") for _ in range(workers)]
    errors = {}
    for name, codecs in (("rotated", rotated), ("plain", plain)):
        for rank, codec in enumerate(codecs):
            codec.bind_rank(rank)
        results = simulate([c.exchange(g, [numel], "k", 0, workers) for c, g in zip(codecs, grads)])
        assert all(torch.equal(results[0], r) for r in results)
        errors[name] = (results[0] - truth).square().mean()
    assert errors["rotated"] < errors["plain"] / 10
    assert "rotate" in rotated[0].config() and "rotate" not in plain[0].config()
    with pytest.raises(ValueError, match="no error feedback"):
        TwoStageMaxNorm(MaxNormCodec(MaxNormQuantizer((4,)), rotate=True), "two_stage", error_feedback=True)


def test_rotate_is_part_of_the_configuration_and_the_checkpoint():
    assert QSGDMaxNorm(4).config() == QSGDMaxNorm(4, rotate=False).config()
    assert QSGDMaxNorm(4, rotate=True).config() == (*QSGDMaxNorm(4).config()[:-1], "rotate", "ahead")
    assert QSGDMaxNormMultiScale(rotate=True).config() != QSGDMaxNormMultiScale().config()
    with pytest.raises(ValueError, match="they are configured differently"):
        QSGDMaxNorm(4).load_state_dict(QSGDMaxNorm(4, rotate=True).state_dict())
    with pytest.raises(ValueError, match="rotate must be True or False"):
        QSGDMaxNorm(4, rotate=1)


class _TwoWorkers(Transport):
    """This worker, and another whose agreement request is ``theirs``: MAX is the maximum of the two."""

    size, rank, local_size, local_rank, cross_size, cross_rank, equal_nodes = 2, 0, 2, 0, 1, 0, True

    def __init__(self, theirs=None):
        self.theirs, self.seen = theirs, []

    def start(self, op, tensor, name=None):
        self.seen.append(tensor.clone())
        if op is Op.MAX and self.theirs is not None:
            return torch.maximum(tensor, self.theirs)
        return tensor * self.size if op is not Op.MAX else tensor.clone()

    def poll(self, handle):
        return True

    def wait(self, handle):
        return handle

    def collective(self, op, tensor):
        return self.wait(self.start(op, tensor))


def _exchange_state(codec):
    params = [torch.nn.Parameter(torch.zeros(5))]
    state = ExchangeState(codec, "test", {})
    state.plan = plan_buckets(params, {params[0]: "a"}, 25.0)
    return state


@pytest.mark.parametrize("exchange", ["lanes", "two_stage"])
@pytest.mark.parametrize("theirs", [dict(bits=4, rotate=True), dict(bits=8, rotate=False)])
def test_workers_configured_differently_raise_a_configuration_mismatch(exchange, theirs):
    """Rotation, and (lanes or two-stage alike) the bits, are agreed before the first exchange."""
    from hvdcomp.integrations.resolve import resolve_codec

    def state(bits, rotate):
        return _exchange_state(resolve_codec(QSGDMaxNorm(bits, scale="exact", rotate=rotate), exchange))

    recorder = _TwoWorkers()
    state(**theirs).agree(recorder, "x")
    with pytest.raises(ConfigurationMismatchError, match="compression"):
        state(4, False).agree(_TwoWorkers(recorder.seen[-1]), "x")


def test_hierarchical_shards_rotate_alike_on_every_worker():
    from hvdcomp.exchange import Placement
    from hvdcomp.exchange.hierarchy import bucket_exchange

    workers, sizes = 4, [3000, 17, 1200]
    grads = _heavy_tailed(workers, sum(sizes), 8)
    truth = torch.stack(grads).mean(dim=0)
    for hierarchical in (False, True):
        errors = {}
        for rotate in (False, True):
            codecs = [MaxNormCodec(MaxNormQuantizer((8,)), seed=4, rotate=rotate) for _ in range(workers)]
            for rank, codec in enumerate(codecs):
                codec.bind_rank(rank)
            results = simulate([bucket_exchange(codec, flat.clone(), flat.split(sizes), "b", 0,
                                                Placement(rank, workers, 2), hierarchical)
                                for rank, (codec, flat) in enumerate(zip(codecs, grads))], local_size=2)
            assert all(torch.equal(results[0], r) for r in results)
            errors[rotate] = (results[0] - truth).square().mean()
        assert errors[True] < errors[False] / 10, hierarchical
