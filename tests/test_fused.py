"""Fused (torch.compile) codec kernels equal their eager reference bit for bit, keep the word format,
compile once per lane layout (not per size), and fall back to eager with one warning without a compiler.

The kernels compile here once per layout (a few seconds each, cached on disk by Inductor afterwards):
every test shares the module's few layouts."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from hvdcomp.codec import fused
from hvdcomp.codec.quantize import MaxNormQuantizer
from hvdcomp.codec.random import stream_words, uniform
from hvdcomp.exchange.elementwise import MaxNormCodec, simulate_max_norm

# (bits, world size, word bits): payload lanes 5, 12, 15 (+31 agreement lanes), 6
LAYOUTS = [((8,), 8, 63), ((2,), 3, 63), ((2, 6), 2, 63), ((4,), 5, 48)]
# segment lengths of one bucket: ragged tensors, empty ones, single elements, a large one
SEGMENTS = [[1000], [7, 0, 1, 513, 2], [0, 4099, 3], [2, 1], [65536 + 5, 17]]


@pytest.fixture(autouse=True)
def _fused_on(monkeypatch):
    monkeypatch.setenv(fused.ENV_SWITCH, "1")
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
        agreed = out["agreed"] = quantizer.agreed_scales(sum(votes), grads[0].numel(), world_size)
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
            scale = quantizer._scale_per_element(want["stats"], quantizer.scale_groups(numel, segments), numel)
            error = (got["mean"] - torch.stack(grads).mean(dim=0)).abs()
            assert bool((error <= scale / quantizer.coarse_levels * 1.0001).all())


def test_words_keep_the_lane_format():
    """The fused words are LaneLayout's: levels ``sign(x) floor(r s + U)`` plus ``s``, in lanes of the
    layout's width, element ``w L + l`` in lane ``l`` of word ``w`` (checked with Python integers)."""
    quantizer, world_size, numel = MaxNormQuantizer((2,)), 3, 101
    x = torch.randn(numel, generator=torch.Generator().manual_seed(1))
    groups = quantizer.scale_groups(numel)
    stats = quantizer.local_stats(x, groups)
    rng = stream_words(4, "format")
    words = quantizer.encode(x, stats, groups, None, world_size, rng=rng).tolist()
    layout = quantizer.payload_layout(world_size)
    ratio = (x.abs() / stats[0]).clamp(max=1.0)
    levels = (torch.floor(ratio * 3 + uniform(numel, rng)).clamp(max=3) * x.sign()).long().tolist()
    expected = [0] * layout.num_words(numel)
    for index, level in enumerate(levels):
        word, lane = divmod(index, layout.lanes_per_word)
        expected[word] += (level + 3) << (lane * layout.lane_width)
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


FALLBACK_SCRIPT = textwrap.dedent("""
    import warnings
    import torch
    from hvdcomp.codec import fused
    from hvdcomp.codec.quantize import MaxNormQuantizer
    from hvdcomp.exchange.elementwise import MaxNormCodec, simulate_max_norm

    grads = [torch.randn(3000, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    codecs = [MaxNormCodec(MaxNormQuantizer((2, 6))) for _ in grads]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [simulate_max_norm(codecs, grads, step=s) for s in range(2)]  # 3 kernels, twice
    with fused.eager():
        want = [simulate_max_norm(codecs, grads, step=s) for s in range(2)]
    ours = [str(w.message) for w in caught if "fused codec kernels" in str(w.message)]
    assert len(ours) == 1, ours
    assert all(torch.equal(a, b) for g, w in zip(got, want) for a, b in zip(g, w))
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
