"""Fused (torch.compile) codec kernels equal their eager reference bit for bit, keep the word format,
compile once per lane layout (not per size), and fall back to eager with one warning without a compiler.

The kernels compile here once per layout (a few seconds each, cached on disk by Inductor afterwards):
every test shares the module's few layouts."""

import contextlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from hvdcomp.codec import fused, native, packing, random
from hvdcomp.codec.onebit import (
    binarize,
    bit_lane_words,
    bit_padding,
    draw_bits,
    draw_lane_words,
    gradient_checks,
    mean_from_counts,
    mean_from_lane_sums,
    update_moments,
    zero_inactive,
)
from hvdcomp.codec.packing import LaneLayout
from hvdcomp.codec.quantize import MaxNormQuantizer
from hvdcomp.codec.random import stream_words, uniform
from hvdcomp.exchange.elementwise import MaxNormCodec, simulate_max_norm
from hvdcomp.integrations.birder import Birder, simulate_step

# (bits, world size, word bits): payload lanes 5, 12, 15 (+31 agreement lanes), 6
LAYOUTS = [((8,), 8, 63), ((2,), 3, 63), ((2, 6), 2, 63), ((4,), 5, 48)]
# segment lengths of one bucket: ragged tensors, empty ones, single elements, a large one
SEGMENTS = [[1000], [7, 0, 1, 513, 2], [0, 4099, 3], [2, 1], [65536 + 5, 17]]
SIZES = [0, 1, 2, 31, 33, 4099, 65536 + 5]  # ragged: empty, one element, within one word, > 65536


@pytest.fixture(autouse=True)
def _fused_on(monkeypatch):
    monkeypatch.setenv(fused.ENV_SWITCH, "1")
    monkeypatch.setenv(native.ENV_SWITCH, "0")  # the torch.compile kernels here; tests/test_native.py: the others
    assert fused.enabled(), fused._Mode.failed


def _round_trip(quantizer, grads, segments, world_size, word_bits, step):
    """Every stage of one exchange in this process: stats, agreement, each worker's words, the mean."""
    groups = quantizer.scale_groups(grads[0].numel(), segments)
    stats = torch.stack([quantizer.local_stats(g, groups) for g in grads]).amax(dim=0)
    out = {"stats": stats}
    agreed = None
    if quantizer.multiscale:
        votes = [quantizer.agreement_words(g, stats, groups, world_size) for g in grads]
        out["votes"] = torch.stack(votes)
        agreed = out["agreed"] = quantizer.agreed_resolutions(sum(votes), grads[0].numel(), world_size)
    words = [quantizer.encode(g, stats, groups, agreed, world_size, word_bits, stream_words(step, 0, rank))
             for rank, g in enumerate(grads)]
    out["words"] = torch.stack(words)
    out["mean"] = quantizer.decode(sum(words), stats, groups, agreed, grads[0].numel(), world_size, word_bits)
    return out


@pytest.mark.parametrize("bits,world_size,word_bits", LAYOUTS)
def test_fused_equals_eager_on_every_shape(bits, world_size, word_bits):
    quantizer = MaxNormQuantizer(bits, chunk_size=None if len(bits) > 1 else 300)
    gen = torch.Generator().manual_seed(sum(bits) + world_size)
    for step, segments in enumerate(SEGMENTS):
        numel = sum(segments)
        grads = [torch.randn(numel, generator=gen) * torch.rand(numel, generator=gen) ** 4 for _ in range(world_size)]
        got = _round_trip(quantizer, grads, segments, world_size, word_bits, step)
        with fused.eager():
            want = _round_trip(quantizer, grads, segments, world_size, word_bits, step)
        for name in want:
            assert torch.equal(got[name], want[name]), (name, segments)
        if numel:  # the mean is within one coarse unit M / s_1 of the truth
            scale = quantizer._per_element(want["stats"][:-1], quantizer.scale_groups(numel, segments), numel)
            error = (got["mean"] - torch.stack(grads).mean(dim=0)).abs()
            assert bool((error <= scale / quantizer.coarse_levels * 1.0001).all())


@pytest.mark.parametrize("int32_lanes", [False, True])
def test_draws_in_either_lane_width_equal_eager(int32_lanes, monkeypatch):
    """Compiled draws in int32 lanes (CPUs without AVX-512) or int64 lanes give the eager bits, also across the
    counter's 2**32-block boundary."""
    fused._choose_cpu_lanes()  # before the patch: a later first compile must not override it
    monkeypatch.setattr(random, "CPU_INT32_LANES", int32_lanes)
    draw = torch.compile(uniform, dynamic=True)
    words = stream_words(2**33 + 5, "seed", 3)
    for numel, first in ((4099, 0), (37, 8 * (2**32 - 2) + 4), (65536 + 5, 2**40)):  # blocks 2**32 - 2 .. 2**32 + 2
        assert torch.equal(draw(numel, words, first), uniform(numel, words, first)), (numel, first)


def test_words_keep_the_lane_format():
    """The fused words are LaneLayout's lanes in the blocked order: levels ``sign(x) floor(r s + U)`` plus
    ``s``, in lanes of the layout's width, element ``L B k + B l + j`` in lane ``l`` of word ``B k + j`` (two whole
    blocks and a partial one; checked with Python integers)."""
    quantizer, world_size = MaxNormQuantizer((2,)), 3
    layout, block = quantizer.payload_layout(world_size), packing.LANE_BLOCK_WORDS
    per_block = layout.lanes_per_word * block
    numel = 2 * per_block + 101
    x = torch.randn(numel, generator=torch.Generator().manual_seed(1))
    groups = quantizer.scale_groups(numel)
    stats = quantizer.local_stats(x, groups)
    rng = stream_words(4, "format")
    words = quantizer.encode(x, stats, groups, None, world_size, rng=rng).tolist()
    levels = (torch.floor(x.abs() * (3 / stats[0]) + uniform(numel, rng)).clamp(max=3) * x.sign()).long().tolist()
    expected = [0] * (3 * block)
    for index, level in enumerate(levels):
        k, rest = divmod(index, per_block)
        lane, j = divmod(rest, block)
        expected[block * k + j] += (level + 3) << (lane * layout.lane_width)
    assert words == expected


def test_sizes_do_not_recompile():
    quantizer, world_size = MaxNormQuantizer((8,)), 8
    before = None
    for numel in (3000, 3001, 12345, 70001):
        x = torch.randn(numel)
        _round_trip(quantizer, [x] * world_size, [numel], world_size, 63, 0)
        if before is None:
            before = counters["stats"]["unique_graphs"]  # the first size may compile
    assert counters["stats"]["unique_graphs"] == before


def test_codec_exchange_fused_equals_eager():
    """A whole MaxNormCodec exchange (rounding streams keyed by seed, rank, key, step) on both paths."""
    grads = [torch.randn(5000, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    codecs = [MaxNormCodec(MaxNormQuantizer((2,)), seed=9) for _ in grads]
    got = simulate_max_norm(codecs, grads, key="layer", step=2)
    with fused.eager():
        want = simulate_max_norm(codecs, grads, key="layer", step=2)
        other_step = simulate_max_norm(codecs, grads, key="layer", step=3)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert not torch.equal(want[0], other_step[0])  # a new step draws new bits


@pytest.mark.parametrize("world_size", [2, 3, 8])
@pytest.mark.parametrize("decode_words", [None, 32])
def test_lane_packing_and_bit_means_fused_equal_eager(world_size, decode_words, monkeypatch):
    """Birder's lanes (bits of W workers) in the blocked order, and a signed layout with an offset in
    ``pack_lanes``' order: pack, unpack and the mean of the summed bits on both paths, and the sums are the
    workers' sums; the mean decoded in one call or in calls of two blocks of words (the last one ragged)."""
    if decode_words is not None:
        monkeypatch.setattr(packing, "DECODE_BLOCK_WORDS", decode_words)
    gen = torch.Generator().manual_seed(world_size)
    bit_layout, signed = LaneLayout(span=1, world_size=world_size), LaneLayout.for_levels(2, world_size)
    for numel in SIZES:
        values = [torch.randint(-2, 3, (numel,), generator=gen, dtype=torch.int64) for _ in range(world_size)]
        words = [signed.pack(v, validate=False) for v in values]
        word_sums = torch.stack(words).sum(dim=0)
        got = (torch.stack(words), signed.unpack(word_sums, numel))
        with fused.eager():
            want = (torch.stack([signed.pack(v, validate=False) for v in values]), signed.unpack(word_sums, numel))
        assert all(torch.equal(g, w) for g, w in zip(got, want)), numel
        assert torch.equal(got[1], torch.stack(values).sum(dim=0))

        bits = [torch.randint(0, 2, (numel,), generator=gen, dtype=torch.uint8) for _ in range(world_size)]
        bit_words = torch.stack([bit_lane_words(v, bit_layout) for v in bits])
        with fused.eager():
            assert torch.equal(bit_words, torch.stack([bit_lane_words(v.bool(), bit_layout) for v in bits]))
        assert bit_words.shape[1] == packing.lane_block_words(numel, bit_layout.lanes_per_word)
        bit_sums = bit_words.sum(dim=0)
        buffer = torch.full((numel + bit_padding(bit_layout),), 7.0)  # whole blocks are decoded into it
        mean = mean_from_lane_sums(bit_sums, bit_layout, numel, out=buffer)
        with fused.eager():
            assert torch.equal(mean, mean_from_lane_sums(bit_sums, bit_layout, numel))
        assert mean._base is buffer or not numel  # a view of the buffer (0 elements: no storage)
        assert torch.equal(mean, mean_from_counts(torch.stack(bits).long().sum(dim=0), world_size))
    with pytest.raises(ValueError):
        mean_from_lane_sums(torch.zeros(16, dtype=torch.int64), signed, 3)
    with pytest.raises(ValueError):
        mean_from_lane_sums(torch.zeros(16, dtype=torch.int64), bit_layout, 3, out=torch.zeros(3))
    with pytest.raises(ValueError):
        mean_from_lane_sums(torch.zeros(1, dtype=torch.int64), bit_layout, 3)  # not a whole block


def test_blocked_order_places_values():
    """Lane ``l`` of word ``B k + j`` holds value ``L B k + B l + j``, eagerly and compiled."""
    layout = LaneLayout(span=1, world_size=2)
    lanes, block = layout.lanes_per_word, packing.LANE_BLOCK_WORDS
    numel = 2 * lanes * block + 5
    index = torch.arange(numel)
    for value in range(0, numel, 7):
        bits = (index == value).to(torch.uint8)
        for context in (contextlib.nullcontext(), fused.eager()):
            with context:
                words = bit_lane_words(bits, layout)
            k, rest = divmod(value, lanes * block)
            lane, j = divmod(rest, block)
            expected = torch.zeros(3 * block, dtype=torch.int64)
            expected[block * k + j] = 1 << (lane * layout.lane_width)
            assert torch.equal(words, expected), value


def test_birder_moments_and_draws_fused_equal_eager():
    """m and b in one pass into slices of the buffers; the draw as bits and as summable lane words, from the
    counter-based stream: the same bits on both paths, the words are the bits packed; b == 0 draws a fair coin."""
    gen = torch.Generator().manual_seed(3)
    for numel in SIZES:
        grad = torch.randn(numel, generator=gen) * (torch.rand(numel, generator=gen) > 0.2)
        start = [torch.randn(numel + 3, generator=gen), torch.rand(numel + 3, generator=gen) * 2]
        start[0][: numel // 3] = start[1][: numel // 3] = 0.0  # never active: m == b == 0
        rng, layout = stream_words(numel, 5, "draw"), LaneLayout(span=1, world_size=3)
        outputs = []
        for context in (contextlib.nullcontext(), fused.eager()):
            m, b = start[0].clone(), start[1].clone()
            with context:
                update_moments(m[1:-2], b[1:-2], grad, 0.9)
                bits = draw_bits(m, b, rng, torch.zeros(numel + 3, dtype=torch.bool))
                words = draw_lane_words(m, b, rng, layout)
                rebinarized = binarize(torch.full((numel,), 0.25), rng, first=8)
            outputs.append((m, b, bits, words, rebinarized))
        assert all(torch.equal(g, w) for g, w in zip(*outputs)), numel
        m, b, bits, words, _ = outputs[0]
        assert torch.equal(m[0], start[0][0]) and torch.equal(b[-1], start[1][-1])  # outside the slices: kept
        inner = slice(1, numel + 1)
        torch.testing.assert_close(m[inner], 0.9 * start[0][inner] + 0.1 * grad, rtol=1e-6, atol=1e-6)
        assert torch.equal(words, bit_lane_words(bits, layout))
        v = uniform(numel + 3, rng) * 2 - 1
        assert torch.equal(bits, (v * b < m) | ((b == 0) & (v < 0)))
        if numel > 4000:
            fair = bits[b == 0].float()
            assert abs(fair.mean().item() - 0.5) < 4.5 * 0.5 / fair.numel() ** 0.5
    with pytest.raises(ValueError, match="span 1"):
        draw_lane_words(torch.zeros(3), torch.ones(3), stream_words(0, 0), LaneLayout.for_levels(1, 2))


def test_gradient_checks_and_masking_fused_equal_eager():
    """NaN/Inf anywhere, a non-zero gradient outside the active mask, and zeroing the inactive elements."""
    gen = torch.Generator().manual_seed(5)
    for numel in SIZES:
        active = torch.rand(numel, generator=gen) < 0.7
        grad = torch.randn(numel, generator=gen).masked_fill_(~active, 0.0)
        cases = [(grad, None, (True, False)), (grad, active, (True, False))]
        if numel:
            fresh, fresh_active = grad.clone(), active.clone()
            fresh[numel // 2], fresh_active[numel // 2] = 0.5, False  # a first non-zero gradient
            cases.append((fresh, fresh_active, (True, True)))
            for bad in (float("nan"), float("inf"), -float("inf")):
                nonfinite = grad.clone()
                nonfinite[numel - 1] = bad
                cases += [(nonfinite, None, (False, False)), (nonfinite, active.clone().fill_(True), (False, False))]
        for values, mask, expected in cases:
            with fused.eager():
                assert gradient_checks(values, mask) == expected, (numel, expected)
            assert gradient_checks(values, mask) == expected, (numel, expected)
        masked = [torch.randn(numel, generator=torch.Generator().manual_seed(numel)) for _ in range(2)]
        zero_inactive(masked[0], active)
        with fused.eager():
            zero_inactive(masked[1], active)
        assert torch.equal(masked[0], masked[1]) and not masked[0][~active].any()


@pytest.mark.parametrize("world_size,local_size,scope,exchange", [(3, 3, "world", "lanes"),
                                                                   (4, 2, "hierarchical", "lanes"),
                                                                   (3, 3, "world:two_stage", "two_stage")])
def test_birder_steps_fused_equal_eager(world_size, local_size, scope, exchange):
    """A few Birder steps (a parameter without gradient, one with zero gradient, > 65536 elements) leave the
    same parameters and state with fused kernels on and off, over all workers and across 2 nodes."""
    shapes = [(300, 221), (7,), (5, 3), (1,)]

    def run():
        workers = []
        for _ in range(world_size):
            params = [torch.nn.Parameter(torch.ones(shape)) for shape in shapes]
            workers.append((params, Birder([{"params": params[:2]}, {"params": params[2:], "beta": 0.5}], lr=0.01,
                                           weight_decay=0.1, seed=4, exchange=exchange, hierarchical=True)))
        for step in range(3):
            for rank, (params, _) in enumerate(workers):
                gen = torch.Generator().manual_seed(10 * step + rank)
                params[0].grad = torch.randn(shapes[0], generator=gen)
                params[1].grad = torch.zeros(shapes[1]) if step < 2 else torch.randn(shapes[1], generator=gen)
                params[2].grad = None  # no gradient: moments kept, bits still drawn from them
                params[3].grad = torch.randn(shapes[3], generator=gen)
            simulate_step([optimizer for _, optimizer in workers], local_size)
        assert workers[0][1].route.startswith(scope)
        return [([p.detach() for p in params], optimizer.state_dict()["birder"]) for params, optimizer in workers]

    got = run()
    assert fused.enabled(), fused._Mode.failed  # the kernels ran compiled
    with fused.eager():
        want = run()
    for (params, state), (params_eager, state_eager) in zip(got, want):
        assert all(torch.equal(a, b) for a, b in zip(params, params_eager))
        assert state.keys() == state_eager.keys()
        for key, value in state.items():
            same = torch.equal if isinstance(value, torch.Tensor) else lambda a, b: a == b
            assert same(value, state_eager[key]), key
    assert not torch.equal(got[0][0][0], torch.ones(shapes[0]))


FALLBACK_SCRIPT = textwrap.dedent("""
    import warnings
    import torch
    from hvdcomp.codec import fused
    from hvdcomp.codec.onebit import update_moments
    from hvdcomp.codec.quantize import MaxNormQuantizer
    from hvdcomp.exchange.elementwise import MaxNormCodec, simulate_max_norm

    grads = [torch.randn(3000, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    codecs = [MaxNormCodec(MaxNormQuantizer((2, 6))) for _ in grads]
    moments = [[torch.ones(3000), torch.ones(3000)] for _ in range(2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        update_moments(*moments[0], grads[0], 0.9)  # in place: fails first, then eager
        got = [simulate_max_norm(codecs, grads, step=s) for s in range(2)]  # 3 kernels, twice
    with fused.eager():
        update_moments(*moments[1], grads[0], 0.9)
        want = [simulate_max_norm(codecs, grads, step=s) for s in range(2)]
    ours = [str(w.message) for w in caught if "fused codec kernels" in str(w.message)]
    assert len(ours) == 1, ours
    assert all(torch.equal(a, b) for g, w in zip(got, want) for a, b in zip(g, w))
    assert all(torch.equal(a, b) for a, b in zip(*moments))  # updated once, as eagerly
    print("FALLBACK-OK", ours[0])
""")


@pytest.mark.slow
def test_without_a_compiler_falls_back_with_one_warning(tmp_path):
    env = dict(os.environ, CXX=str(tmp_path / "no-such-c++"), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"))
    env[fused.ENV_SWITCH] = "1"
    done = subprocess.run([sys.executable, "-c", FALLBACK_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=600, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "FALLBACK-OK" in done.stdout


def test_switch_off_runs_eagerly(monkeypatch):
    monkeypatch.setenv(fused.ENV_SWITCH, "0")
    assert not fused.enabled()
    calls = []
    kernel = fused.FusedKernel(lambda x: calls.append(x) or x + 1)
    assert torch.equal(kernel(torch.zeros(3)), torch.ones(3)) and len(calls) == 1
