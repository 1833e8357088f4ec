"""The native CPU kernels (``hvdcomp.codec.native``) equal the eager reference bit for bit, on one thread or
several; they build once per cache (concurrent builders included); without a compiler the codec falls back
to eager with one warning."""

import contextlib
import ctypes
import math
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import test_fused
import torch

from hvdcomp.codec import fused, native, recycle
from hvdcomp.codec.onebit import (
    apply_updates,
    binarize_counts,
    count_bit_rows,
    draw_bits,
    draw_lane_words,
    gather_checked,
    mean_from_counts,
    mean_from_lane_counts,
    mean_from_lane_sums,
    pack_bit_rows,
    pack_lane_values,
    unpack_bit_rows,
    unpack_lane_values,
)
from hvdcomp.codec.packing import LaneLayout, bits_to_bytes, lane_block_words, pack_lane_blocks
from hvdcomp.codec.quantize import MaxNormQuantizer
from hvdcomp.codec.random import stream_words, uniform
from hvdcomp.codec.recycle import ResultBuffers
from hvdcomp.exchange import AheadMaxNorm, MaxNormCodec
from hvdcomp.exchange.simulator import simulate

ROOT = Path(__file__).resolve().parents[1]
STREAM_VALUES = 1 << 18  # native_kernels.cpp's kStreamValues: a call writing this many means streams them
SIZES = [0, 1, 2, 31, 33, 191, 192, 193, 4099, 65536 + 5, 300_007]
# (bits, world size, word bits): lane widths from 2 to 32 bits, 1 to 31 lanes per word
LAYOUTS = [((1,), 1, 63), ((2,), 2, 63), ((2,), 8, 63), ((4,), 5, 48), ((8,), 8, 63), ((8,), 3, 20),
           ((16,), 2, 63), ((16,), 1 << 14, 63)]


@pytest.fixture(autouse=True)
def _native_on(monkeypatch):
    monkeypatch.setenv(fused.ENV_SWITCH, "1")
    monkeypatch.delenv(native.ENV_SWITCH, raising=False)
    assert native.library() is not None, fused._Mode.failed


def _cpu_has_avx512() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.exists() and " avx512f" in cpuinfo.read_text()


# The builds every kernel test runs with: this CPU's ("native"); on x86-64 one without AVX2 ("portable": the loops
# of other CPUs); on a CPU with AVX-512 one without it ("avx2": the loops of AVX2 CPUs, which -march=native skips).
OTHER_BUILDS = {"portable": ("-march=x86-64",), "avx2": ("-march=x86-64-v3",)}
BUILDS = ["native", "portable"] + (["avx2"] if _cpu_has_avx512() else [])


@pytest.fixture(scope="module")
def other_builds(tmp_path_factory) -> dict[str, ctypes.CDLL]:
    """The kernels of ``BUILDS`` other than this CPU's, built once per module (none off x86-64)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return {}
    libraries = {}
    for name in BUILDS[1:]:
        path = tmp_path_factory.mktemp(name) / "native_kernels.so"
        native.build(native.compiler(), path,
                     tuple(f for f in native.FLAGS if f != "-march=native") + OTHER_BUILDS[name])
        libraries[name] = native.declare(ctypes.CDLL(str(path)))
    return libraries


@pytest.fixture(params=BUILDS)
def build(request, monkeypatch, other_builds):
    """Each test runs with this CPU's build, then (on x86-64) with the others of ``BUILDS``."""
    if request.param != "native":
        assert request.param in other_builds or platform.machine() not in ("x86_64", "AMD64")
        if request.param in other_builds:
            monkeypatch.setattr(native._Library, "handle", other_builds[request.param])
    return request.param


def _gradient(numel: int, seed: int) -> torch.Tensor:
    """Values over many magnitudes, exact zeros and negative zeros included."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen) * torch.rand(numel, generator=gen) ** 6
    x[::7] = 0.0
    x[3::11] = -0.0
    return x


def _groups(quantizer: MaxNormQuantizer, numel: int) -> torch.Tensor:
    """Ragged tensors, an empty one among them."""
    first, second = numel // 3, numel // 7
    return quantizer.scale_groups(numel, [first, 0, second, numel - first - second])


@pytest.fixture(params=[1, 3])
def threads(request):
    """The kernels split over this many threads (torch's), restored afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(previous)


def _moments(numel: int) -> tuple[torch.Tensor, torch.Tensor, torch.Generator]:
    """Random moments ``|m| <= b`` of ``numel`` elements, and the generator that drew them, to draw more."""
    gen = torch.Generator().manual_seed(numel)
    b = torch.rand(numel, generator=gen)
    return (torch.rand(numel, generator=gen) * 2 - 1) * b, b, gen


def _both(fn, *args):
    """``fn(*args)`` with the native kernels, and eagerly."""
    assert native.usable(torch.zeros(1))
    x_native = fn(*args)
    with fused.eager():
        assert not native.usable(torch.zeros(1))
        x_eager = fn(*args)
    return x_native, x_eager


@pytest.mark.parametrize("bits,world_size,word_bits", LAYOUTS)
def test_encode_and_decode_equal_eager(bits, world_size, word_bits, threads, build):
    quantizer = MaxNormQuantizer(bits)
    for numel in SIZES:
        x = _gradient(numel, numel)
        groups = _groups(quantizer, numel)
        stats = quantizer.local_stats(x, groups)
        if stats.numel() > 2:
            stats[0] *= 0.25  # an agreed scale below the group's maximum: clipped levels
            stats[1] = 0.0  # an all-zero group: the scale floor
        rng = stream_words(5 + numel, 0, "rounding", 1, numel)
        words, want = _both(quantizer.encode, x, stats, groups, None, world_size, word_bits, rng)
        assert torch.equal(words, want), (numel, bits, world_size)
        arbitrary = torch.randint(-(1 << 62), 1 << 62, want.shape, generator=torch.Generator().manual_seed(numel))
        for sums in (want * world_size, arbitrary):  # every worker sent these words; any words
            means, want_means = _both(quantizer.decode, sums, stats, groups, None, numel, world_size, word_bits)
            assert means.shape == (numel,) and torch.equal(means, want_means), (numel, bits, world_size)


@pytest.mark.parametrize("chunk_size", [None, 1000])
def test_encode_takes_the_local_stats_in_its_pass(chunk_size, threads, build):
    """``encode(local_out=)`` writes ``local_stats`` natively in the encode's pass, bit for bit (max of the finite
    ``|x|`` per group, then the NaN/Inf flag), with the same words; where ``x`` holds NaN/Inf, the same statistics."""
    quantizer = MaxNormQuantizer((4,), chunk_size=chunk_size)
    for numel in SIZES:
        x = _gradient(numel, numel + 1)
        groups = _groups(quantizer, numel)
        want_stats = quantizer.local_stats(x, groups)
        rng = stream_words(2, 0, "rounding", 0, numel)
        want = quantizer.encode(x, want_stats, groups, None, 3, 63, rng)
        local = torch.full((groups.numel() + 1,), -1.0)
        assert torch.equal(quantizer.encode(x, want_stats, groups, None, 3, 63, rng, local_out=local), want), numel
        assert torch.equal(local, want_stats) and not (local.signbit()).any(), numel
        if numel < 200:
            continue
        for bad in (float("nan"), float("inf"), -float("inf")):
            spoiled = x.clone()
            spoiled[[5, numel // 2, numel - 1]] = bad
            quantizer.encode(spoiled, want_stats, groups, None, 3, 63, rng, local_out=local)
            with fused.eager():
                expected = quantizer.local_stats(spoiled, groups)
            assert expected[-1] == 1.0 and torch.equal(local, expected), (numel, bad)


@pytest.mark.parametrize("rotate", [False, True])
def test_scale_ahead_decodes_into_out(rotate, build):
    """``AheadMaxNorm.exchange(out=)`` (the bucket itself, as the DDP door passes it): the mean lands there, bit for
    bit the mean returned without ``out``, on the exact first exchange and the agreed ones after (growing values:
    some clipped), natively and eagerly."""
    sizes = [70_000, 5, 1_234]  # the last lane block partial

    def workers():
        codecs = [AheadMaxNorm(MaxNormCodec(MaxNormQuantizer((4,)), rotate=rotate)) for _ in range(3)]
        for rank, codec in enumerate(codecs):
            codec.bind_rank(rank)
        return codecs

    for context in (contextlib.nullcontext, fused.eager):
        plain, into = workers(), workers()
        with context():
            for step in range(3):
                grads = [_gradient(sum(sizes), 10 * step + rank) * (1 + step) for rank in range(3)]
                want = simulate([c.exchange(g.clone(), sizes, "k", step, 3) for c, g in zip(plain, grads)])
                got = simulate([c.exchange(g, sizes, "k", step, 3, out=g) for c, g in zip(into, grads)])
                for mean, expected, grad in zip(got, want, grads):
                    assert mean.data_ptr() == grad.data_ptr() and torch.equal(mean, expected), (context, step)


def test_decode_writes_only_the_means_asked_for(build):
    quantizer, numel = MaxNormQuantizer((8,)), 1000 + 7  # 1007 values in 64 + 1 partial lane blocks
    x = _gradient(numel, 4)
    groups = quantizer.scale_groups(numel)
    stats = quantizer.local_stats(x, groups)
    words = quantizer.encode(x, stats, groups, None, 2, 63, stream_words(0, 0, "r", 0, "d")) * 2
    want = quantizer.decode(words, stats, groups, None, numel, 2)
    out = torch.full((numel + 9,), 7.0)
    assert quantizer.decode(words, stats, groups, None, numel, 2, out=out[:numel]).data_ptr() == out.data_ptr()
    assert torch.equal(out[:numel], want) and (out[numel:] == 7.0).all()


def test_threads_split_whole_lane_blocks():
    quantizer = MaxNormQuantizer((4,))
    numel = 5 * native.MIN_VALUES_PER_THREAD + 123  # several threads' worth
    x, groups = _gradient(numel, 0), _groups(quantizer, numel)
    stats, rng = quantizer.local_stats(x, groups), stream_words(1, 0, "rounding", 0, "t")
    previous = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 4):
            torch.set_num_threads(threads)
            words = quantizer.encode(x, stats, groups, None, 4, 63, rng)
            results.append((words, quantizer.decode(words * 4, stats, groups, None, numel, 4)))
    finally:
        torch.set_num_threads(previous)
    assert all(torch.equal(a, b) for result in results[1:] for a, b in zip(result, results[0]))


@pytest.mark.parametrize("first", [0, 3, 8, 61, 1 << 20, (1 << 35) - 512])  # the last: block 2**32 inside
@pytest.mark.parametrize("numel", [1, 7, 64, 65, 1000])
def test_draws_equal_the_streams(first, numel, build):
    for step in (0, 1, (1 << 32) + 5):  # both counter words
        rng = stream_words(step, 7, "rounding", 3, "key")
        assert torch.equal(native.uniform(numel, rng, first), uniform(numel, rng, first))


def test_multi_scale_and_other_dtypes_take_the_other_kernels(monkeypatch):
    assert not native.usable(torch.zeros(4, dtype=torch.float16))
    assert not native.usable(torch.zeros(4, 2).t())
    assert native.usable(torch.zeros(4)) and native.usable(torch.zeros(4, dtype=torch.int64), torch.int64)
    quantizer = MaxNormQuantizer((2, 6))
    x = _gradient(1000, 1)
    groups = quantizer.scale_groups(1000)
    stats = quantizer.local_stats(x, groups)
    agreed = quantizer.agreed_resolutions(quantizer.agreement_words(x, stats, groups, 1), 1000, 1)
    rng = stream_words(0, 0, "rounding", 0, "m")
    monkeypatch.setattr(native, "encode", None)  # calling it would raise
    words, want = _both(quantizer.encode, x, stats, groups, agreed, 1, 63, rng)
    assert torch.equal(words, want)


def test_switch_off(monkeypatch):
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    assert fused.enabled() and not native.usable(torch.zeros(4))


def _run(script: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=dict(os.environ, **env),
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


BUILD_SCRIPT = """
    import torch
    from hvdcomp.codec import native
    assert native.usable(torch.zeros(1)), "not built"
    print("LIBRARY", native.library_path(native.compiler()))
"""


def test_built_once_per_cache_even_by_concurrent_workers(tmp_path):
    env = {native.CACHE_ENV: str(tmp_path), fused.ENV_SWITCH: "1"}
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(BUILD_SCRIPT)], env=dict(os.environ, **env),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT) for _ in range(3)]
    outputs = [proc.communicate(timeout=300) for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), [err[-2000:] for _, err in outputs]
    paths = {line.split()[1] for out, _ in outputs for line in out.splitlines() if line.startswith("LIBRARY")}
    cache = tmp_path / "native"
    assert len(paths) == 1 and [p.name for p in cache.iterdir()] == [Path(paths.pop()).name]  # no temporary left
    built = next(cache.iterdir()).stat().st_mtime_ns
    again = _run(BUILD_SCRIPT, **env)
    assert again.returncode == 0, again.stderr[-2000:]
    assert next(cache.iterdir()).stat().st_mtime_ns == built  # reused, not rebuilt


FALLBACK_SCRIPT = """
    import warnings
    import torch
    from hvdcomp.codec import fused, native
    from hvdcomp.exchange.elementwise import MaxNormCodec, simulate_max_norm
    from hvdcomp.codec.quantize import MaxNormQuantizer

    grads = [torch.randn(5000, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    codecs = [MaxNormCodec(MaxNormQuantizer((4,))) for _ in grads]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [simulate_max_norm(codecs, grads, step=s) for s in range(2)]
    with fused.eager():
        want = [simulate_max_norm(codecs, grads, step=s) for s in range(2)]
    ours = [str(w.message) for w in caught if "fused codec kernels" in str(w.message)]
    assert len(ours) == 1, ours
    assert native.library() is None and not fused.enabled()
    assert all(torch.equal(a, b) for g, w in zip(got, want) for a, b in zip(g, w))
    print("FALLBACK-OK", ours[0])
"""


def test_without_a_compiler_falls_back_with_one_warning(tmp_path):
    done = _run(FALLBACK_SCRIPT, CXX=str(tmp_path / "no-such-c++"), **{native.CACHE_ENV: str(tmp_path / "cache"),
                                                                       fused.ENV_SWITCH: "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "FALLBACK-OK" in done.stdout and "no-such-c++" in done.stdout



def test_result_buffers_are_reused_only_once_nothing_refers_to_them():
    buffers = ResultBuffers()
    first = buffers.take("k", 10, torch.float32, torch.device("cpu"))
    pointer = first.data_ptr()
    del first
    assert buffers.take("k", 10, torch.float32, torch.device("cpu")).data_ptr() == pointer
    held = buffers.take("k", 10, torch.float32, torch.device("cpu"))[:4].view(2, 2)  # a view, as p.grad is
    assert buffers.take("k", 10, torch.float32, torch.device("cpu")).data_ptr() != held.data_ptr()
    array = buffers.take("k", 10, torch.float32, torch.device("cpu")).numpy()
    assert buffers.take("k", 10, torch.float32, torch.device("cpu")).data_ptr() != array.ctypes.data
    assert buffers.take("k", 12, torch.float32, torch.device("cpu")).numel() == 12
    assert buffers.take("other", 12, torch.float32, torch.device("cpu")).data_ptr() != pointer


@pytest.mark.parametrize("ahead", [False, True])
def test_a_held_result_is_never_rewritten(ahead):
    """A mean the caller still holds keeps its values through later exchanges; once dropped, its memory decodes
    the next one (no new gradient-sized buffer per step)."""
    codecs = [MaxNormCodec(MaxNormQuantizer((4,))) for _ in range(2)]
    if ahead:
        codecs = [AheadMaxNorm(codec) for codec in codecs]
    for rank, codec in enumerate(codecs):
        codec.bind_rank(rank)
    grads = [_gradient(5000, rank) for rank in range(2)]

    def exchange(step):
        return simulate([codec.exchange(g, [3000, 2000], "bucket", step, 2) for codec, g in zip(codecs, grads)])

    exchange(0)  # with ahead: agrees the scale
    held = [mean.view(50, 100) for mean in exchange(1)]  # as p.grad views of the means
    kept = [mean.clone() for mean in held]
    later = exchange(2)
    assert all(torch.equal(h, k) for h, k in zip(held, kept))
    assert all(m.data_ptr() != h.data_ptr() for m, h in zip(later, held))
    pointers = [m.data_ptr() for m in later]
    del held, later
    assert [m.data_ptr() for m in exchange(3)] == pointers


@pytest.mark.parametrize("misaligned", [False, True])
def test_means_streamed_past_the_caches_equal_eager(misaligned, threads, build):
    """A range of STREAM_VALUES means or more is stored past the caches where 32-byte aligned (one thread here),
    plainly where not (misaligned, or three threads' shorter ranges): QSGD's and Birder's means as eager."""
    numel, world_size = 2 * STREAM_VALUES + 1001, 3
    quantizer = MaxNormQuantizer((4,))
    x = _gradient(numel, 1)
    groups = _groups(quantizer, numel)
    stats = quantizer.local_stats(x, groups)
    sums = quantizer.encode(x, stats, groups, None, world_size, 63, stream_words(1, "streamed")) * world_size
    out = torch.full((numel + 1,), 7.0)[int(misaligned):][:numel]
    means = quantizer.decode(sums, stats, groups, None, numel, world_size, 63, out=out)
    with fused.eager():
        want = quantizer.decode(sums, stats, groups, None, numel, world_size, 63)
    assert means.data_ptr() == out.data_ptr() and torch.equal(means, want)
    layout = LaneLayout(span=1, world_size=world_size)
    padded = lane_block_words(numel, layout.lanes_per_word) * layout.lanes_per_word  # whole lane blocks
    counts = torch.randint(0, world_size + 1, (padded,), generator=torch.Generator().manual_seed(1))
    words = pack_lane_blocks(counts, layout.lane_shifts())
    out = torch.full((counts.numel() + 1,), 7.0)[int(misaligned):]
    means = mean_from_lane_sums(words, layout, numel, out)
    with fused.eager():
        want = mean_from_lane_sums(words, layout, numel)
    assert means.data_ptr() == out.data_ptr() and torch.equal(means, want)


@pytest.mark.parametrize("world_size", [1, 2, 3, 8, 64, 1 << 20])
def test_birder_draw_and_mean_equal_eager(world_size, threads, build):
    layout = LaneLayout(span=1, world_size=world_size)
    for numel in SIZES:
        m, b, gen = _moments(numel)
        m[::5], b[::5] = 0.0, 0.0  # where b == 0 the draw is a fair coin
        rng = stream_words(numel, 4, "birder", 1, "draw")
        for first in (0, 8, 64 * 1001):
            words, want = _both(draw_lane_words, m, b, rng, layout, first)
            assert torch.equal(words, want), (numel, world_size, first)
        sums = torch.randint(0, world_size + 1, (words.numel() * layout.lanes_per_word,), generator=gen)
        sums = pack_lane_blocks(sums, layout.lane_shifts()) if sums.numel() else words
        out = torch.full((sums.numel() * layout.lanes_per_word + 5,), 7.0)
        means, want_means = _both(mean_from_lane_sums, sums, layout, numel, out.clone())
        assert torch.equal(means, want_means), (numel, world_size)


@pytest.mark.parametrize("world_size", [2, 8])
def test_birder_moments_in_the_draw_equal_eager(world_size, threads, build):
    """The moments updated over runs of their own betas (gaps between them untouched) in the draw's pass equal
    ``update_moment_runs`` then the draw, split over threads inside and across runs."""
    layout = LaneLayout(span=1, world_size=world_size)
    for numel in SIZES:
        m, b, gen = _moments(numel)
        grad = torch.randn(numel, generator=gen)
        runs = [(0, numel // 3, 0.9), (numel // 3 + 1, numel // 2, 0.5), (numel // 2, numel, 0.999)]
        runs = [run for run in runs if run[0] < run[1]]
        rng = stream_words(numel, 4, "birder", 1, "draw")
        for first in (0, 64 * 1001):
            (m_native, b_native), (m_eager, b_eager) = [(m.clone(), b.clone()) for _ in range(2)]
            words = draw_lane_words(m_native, b_native, rng, layout, first, grad, runs)
            with fused.eager():
                want = draw_lane_words(m_eager, b_eager, rng, layout, first, grad, runs)
            assert torch.equal(words, want), (numel, world_size, first)
            assert torch.equal(m_native, m_eager) and torch.equal(b_native, b_eager), (numel, first)
            if numel > 2:
                assert not torch.equal(m_native, m)
                assert torch.equal(m_native[numel // 3], m[numel // 3])  # between runs


def test_birder_moment_runs_are_checked():
    m = torch.zeros(100)
    for runs in ([(10, 5, 0.9)], [(0, 50, 0.9), (40, 60, 0.9)], [(0, 101, 0.9)], [(-1, 5, 0.9)]):
        with pytest.raises(ValueError, match="ascending, disjoint"):
            native.draw_bit_words(m, m.clone(), stream_words(0, 0), 31, 2, 0, torch.zeros(100), runs)
    with pytest.raises(ValueError, match="needs a gradient of 100"):
        native.draw_bit_words(m, m.clone(), stream_words(0, 0), 31, 2, 0, torch.zeros(99), [(0, 5, 0.9)])


@pytest.mark.parametrize("world_size,local_size,scope,exchange,kernels", [
    (3, 3, "world", "lanes", {"draw_bit_words", "counts_mean"}),
    (4, 2, "hierarchical", "lanes", {"draw_bools", "binarize_counts", "pack_bits", "count_bits", "unpack_lanes",
                                      "pack_lanes", "lane_counts_mean"}),
    (3, 3, "world:two_stage", "two_stage", {"draw_bools", "binarize_counts", "pack_bits", "count_bits",
                                            "unpack_bits"})])
def test_birder_steps_equal_eager(world_size, local_size, scope, exchange, kernels, monkeypatch):
    calls = []
    for name in kernels:
        kernel = getattr(native, name)
        monkeypatch.setattr(native, name, lambda *args, kernel=kernel, name=name: calls.append(name) or kernel(*args))
    test_fused.test_birder_steps_fused_equal_eager(world_size, local_size, scope, exchange)
    assert set(calls) == kernels


def test_birder_bools_and_binarize_equal_eager(threads, build):
    """Birder's draw into bools (its moments updated over runs in the same pass) and the re-binarization of counts
    equal the eager reference, split over threads."""
    for numel in SIZES:
        m, b, gen = _moments(numel)
        m[::7], b[::7] = 0.0, 0.0
        grad = torch.randn(numel, generator=gen)
        runs = [run for run in [(0, numel // 2, 0.9), (numel // 2 + 3, numel, 0.5)] if run[0] < run[1]]
        rng = stream_words(numel, 4, "birder", 1, "draw")
        (m_native, b_native), (m_eager, b_eager) = [(m.clone(), b.clone()) for _ in range(2)]
        bits = draw_bits(m_native, b_native, rng, torch.empty(numel, dtype=torch.bool), grad, runs)
        with fused.eager():
            want = draw_bits(m_eager, b_eager, rng, torch.empty(numel, dtype=torch.bool), grad, runs)
        assert torch.equal(bits, want) and torch.equal(m_native, m_eager) and torch.equal(b_native, b_eager), numel
        counts = torch.randint(0, 4, (numel,), generator=gen)  # 0 and 3 of 3: certain outcomes
        for first in (0, 8, 64 * 1001):
            for length in (numel, numel + 13):  # the bits past the counts are False
                got, want = _both(binarize_counts, counts, 3, length, rng, first)
                assert torch.equal(got, want) and not got[numel:].any(), (numel, first, length)


@pytest.mark.parametrize("span,world_size", [(1, 2), (1, 3), (2, 1), (5, 1), (1, 1 << 20)])
def test_consecutive_lanes_equal_packing(span, world_size, build):
    """Words of consecutive lanes (the hierarchical route's), their sums and the means of +1 counts in them equal
    ``LaneLayout``'s functions and ``mean_from_counts``."""
    layout = LaneLayout(span=span, world_size=world_size)
    for numel in SIZES:
        gen = torch.Generator().manual_seed(numel)
        values = torch.randint(0, span + 1, (numel,), generator=gen)
        words, want = _both(pack_lane_values, layout, values)
        assert torch.equal(words, want), numel
        sums = words * world_size  # every worker sent these values
        got, want = _both(unpack_lane_values, layout, sums, numel)
        assert torch.equal(got, want) and torch.equal(got, values * world_size), numel
        group = span * world_size
        means = [torch.full((numel + 3,), 7.0) for _ in range(2)]
        mean_from_lane_counts(layout, sums, numel, group, means[0][:numel])
        with fused.eager():
            mean_from_lane_counts(layout, sums, numel, group, means[1][:numel])
        assert torch.equal(means[0], means[1]) and (means[0][numel:] == 7.0).all(), numel
        assert torch.equal(means[0][:numel], mean_from_counts(values * world_size, group)), numel
    with pytest.raises(ValueError, match="cannot hold"):
        unpack_lane_values(layout, torch.zeros(3, dtype=torch.int64), 1000)


@pytest.mark.parametrize("rows", [1, 3])
def test_bit_rows_equal_packing(rows, build):
    """Packing bools into bytes, unpacking them and counting set bits across rows equal ``packing``'s functions."""
    for numel in SIZES:
        gen = torch.Generator().manual_seed(numel)
        bits = torch.rand(rows, numel, generator=gen) < 0.3
        packed, want = _both(pack_bit_rows, bits)
        assert torch.equal(packed, want) and torch.equal(pack_bit_rows(bits[0]), bits_to_bytes(bits[0])), numel
        for size in (numel, max(0, numel - 5)):  # every bit, or fewer than the bytes hold
            got, want = _both(unpack_bit_rows, packed, size)
            assert torch.equal(got, want) and torch.equal(unpack_bit_rows(packed[0], size), want[0]), (numel, size)
            counts, want_counts = _both(count_bit_rows, packed, size)
            assert counts.dtype == torch.int64 and torch.equal(counts, want_counts), (numel, size)
        assert torch.equal(want_counts, bits[:, :numel - 5 if numel >= 5 else 0].sum(dim=0))


def test_encode_writes_into_out():
    """``encode(out=...)`` writes the words there, natively and (by a copy) on the other paths."""
    quantizer = MaxNormQuantizer((8,))
    x = _gradient(70000, 3)
    groups = quantizer.scale_groups(x.numel())
    stats, rng = quantizer.local_stats(x, groups), stream_words(0, 0, "r", 0, "k")
    want = quantizer.encode(x, stats, groups, None, 2, 63, rng)
    for context in (contextlib.nullcontext, fused.eager):
        with context():
            out = torch.full((want.numel() + 3,), -1, dtype=torch.int64)
            assert quantizer.encode(x, stats, groups, None, 2, 63, rng, out[:-3]).data_ptr() == out.data_ptr()
            assert torch.equal(out[:-3], want) and (out[-3:] == -1).all()


def test_without_torchs_reference_count_nothing_is_reused(monkeypatch):
    monkeypatch.setattr(recycle, "_USE_COUNT", None)
    monkeypatch.setattr(recycle, "_ALONE", 0)
    buffers = ResultBuffers()
    first = buffers.take("k", 10, torch.float32, torch.device("cpu"))
    pointer = first.data_ptr()
    del first  # the buffers still hold it while they allocate the next: a new one has another address
    assert buffers.take("k", 10, torch.float32, torch.device("cpu")).data_ptr() != pointer


def _gradients(generator):
    """Birder's gradients of every kind: float32 (one of them past a tile of 4096), float64, bfloat16,
    non-contiguous, empty, and None; and their offsets in the flat buffer."""
    sources = [torch.randn(4099, generator=generator), torch.randn(33, generator=generator).double(), None,
               torch.randn(200_001, generator=generator), torch.randn(8, 6, generator=generator).t(),
               torch.randn(191, generator=generator).bfloat16(), torch.zeros(0), torch.randn(1, generator=generator)]
    sizes = [0 if s is None else s.numel() for s in sources]
    sizes[2] = 65
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    return sources, offsets, sum(sizes)


@pytest.mark.parametrize("masked", [False, True], ids=["all-active", "masked"])
def test_gather_checked_equals_eager_and_finds_non_finite_and_fresh_gradients(masked, threads):
    generator = torch.Generator().manual_seed(3)
    sources, offsets, numel = _gradients(generator)
    active = (torch.rand(numel, generator=generator) < 0.5) if masked else None

    def both(sources, active):
        results = []
        for path in ("native", "eager"):
            flat = torch.full((numel,), 7.0)  # garbage where a gradient is None
            with fused.eager() if path == "eager" else contextlib.nullcontext():
                results.append((gather_checked(sources, offsets, flat, active), flat))
        (checks, flat), (eager_checks, eager_flat) = results
        assert checks == eager_checks and torch.equal(flat.view(torch.int32), eager_flat.view(torch.int32))
        return checks, flat

    checks, flat = both(sources, active)
    assert checks == (True, masked)
    assert torch.equal(flat[offsets[2]:offsets[3]], torch.zeros(65))
    assert torch.equal(flat[offsets[3]:offsets[4]], sources[3]) and torch.equal(flat[offsets[4]:offsets[5]],
                                                                                 sources[4].reshape(-1))
    for bad in (float("nan"), float("inf"), float("-inf")):
        spoiled = [s.clone() if s is not None else None for s in sources]
        spoiled[3][4500] = bad  # in the second tile of a float32 gradient
        assert both(spoiled, active)[0][0] is False
    assert both(sources, torch.ones(numel, dtype=torch.bool))[0] == (True, False)
    quiet = torch.ones(numel, dtype=torch.bool)
    quiet[offsets[3] + 200_000] = False  # the last element of the long gradient (another thread's), non-zero: fresh
    assert both(sources, quiet)[0] == (True, True)


def test_apply_updates_equals_eager_and_tells_autograd(threads):
    generator = torch.Generator().manual_seed(4)
    shapes = [(4099,), (3, 11), (200_001,), (1,), (0,)]
    mean = torch.randint(-2, 3, (sum(math.prod(s) for s in shapes) + 5,), generator=generator).float() / 2
    offsets = [sum(math.prod(s) for s in shapes[:i]) for i in range(len(shapes))]
    keeps, steps = [1 - 0.004 * 0.1, 1.0, 1 - 0.1 * 0.3, 0.5, 1.0], [-0.004, -0.01, -0.1, -1e-3, -0.2]
    start = [torch.randn(s, generator=generator) for s in shapes]
    start.append(torch.randn(7, generator=generator).double())  # not float32, and not contiguous:
    start.append(torch.randn(4, 5, generator=generator).t().contiguous().t())  # the eager path in both runs
    offsets += [3, 10]
    keeps += [0.9, 0.99]
    steps += [-0.5, -0.25]
    results = []
    for path in ("native", "eager"):
        params = [torch.nn.Parameter(p.clone()) for p in start]
        versions = [p._version for p in params]
        with fused.eager() if path == "eager" else contextlib.nullcontext():
            apply_updates(params, offsets, keeps, steps, mean)
        assert all(p._version > v for p, v in zip(params, versions) if p.numel())
        results.append(params)
    for native_param, eager_param, p, offset, keep, step in zip(*results, start, offsets, keeps, steps):
        assert torch.equal(native_param, eager_param)
        want = p * keep + (mean[offset:offset + p.numel()].view_as(p) * step).to(p.dtype)
        assert torch.equal(native_param.detach(), want)
