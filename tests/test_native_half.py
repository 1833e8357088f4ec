"""The native 16-bit mean (``hvdcomp.codec.native_half``) equals the eager reference bit for bit for every float16 and
bfloat16 value, on one thread or several, with this CPU's build and the others of ``test_native.BUILDS``;
``mean_from_half_sums`` takes it where the kernels are usable; the kernel and its wrapper refuse arguments that do not
fit."""

import pytest
import torch
from test_native import STREAM_VALUES, _native_on, build, other_builds, threads  # noqa: F401 (fixtures)

from hvdcomp.codec import fused, half, native, native_half

HALF_DTYPES = [torch.float16, torch.bfloat16]


def _every_value(dtype: torch.dtype, copies: int = 1) -> torch.Tensor:
    """Every 16-bit pattern of ``dtype`` ``copies`` times, then 5 more: a length that ends in the scalar tail."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).repeat(copies)
    return torch.cat([bits, bits[:5]]).view(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, but any NaN for a NaN."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("world_size", [1, 2, 3, 7, 4096])
def test_every_value_equals_the_eager_mean(build, threads, dtype, world_size):  # noqa: F811 (the fixtures)
    sums = _every_value(dtype, copies=threads)  # 3 copies: one range per thread
    out, expected = torch.full(sums.shape, 7.0), torch.empty(sums.shape)
    assert native_half.half_mean(sums, world_size, out, check_finite=False)
    half._mean_eager(sums, world_size, expected)
    assert _same(out, expected)


@pytest.mark.parametrize("misaligned", [False, True])
def test_means_streamed_past_the_caches_equal_eager(build, threads, misaligned):  # noqa: F811 (the fixtures)
    """A range of STREAM_VALUES means or more is stored past the caches where 32-byte aligned (one thread here),
    plainly where not (misaligned, or three threads' shorter ranges): the same means either way."""
    sums = _every_value(torch.float16, copies=-(-STREAM_VALUES // 2**16) + 1)
    out, expected = torch.full((sums.numel() + 1,), 7.0)[int(misaligned):][:sums.numel()], torch.empty(sums.shape)
    assert native_half.half_mean(sums, 3, out, check_finite=True) is False  # the infinities among every value
    half._mean_eager(sums, 3, expected)
    assert _same(out, expected)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_the_flag_finds_a_nonfinite_mean_in_any_range(build, threads, dtype):  # noqa: F811 (the fixtures)
    numel = 3 * 2**16 + 5
    sums, out = torch.ones(numel, dtype=dtype), torch.empty(numel)
    assert native_half.half_mean(sums, 2, out, check_finite=True)
    for position in (0, numel // 2, numel - 6, numel - 1):  # the first thread's range, a later one's, the tail
        for bad in (float("inf"), float("-inf"), float("nan")):
            sums[position] = bad
            assert not native_half.half_mean(sums, 2, out, check_finite=True)
            assert native_half.half_mean(sums, 2, out, check_finite=False)  # not asked: no check
            assert not half._mean_all_finite_eager(sums, 2, torch.empty(numel))
            sums[position] = 1.0


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("check_finite", [False, True])
def test_mean_from_half_sums_runs_the_kernel_where_usable(monkeypatch, dtype, check_finite):
    sums = (torch.randn(1001) * 100).to(dtype)
    calls = []
    kernel = native_half.half_mean
    monkeypatch.setattr(native_half, "half_mean", lambda *args: calls.append(args) or kernel(*args))
    out, expected = torch.empty(1001), torch.empty(1001)
    assert half.mean_from_half_sums(sums, 3, out, check_finite)
    assert len(calls) == 1
    with fused.eager():  # compiled kernels off: the eager reference, not the native kernel
        assert half.mean_from_half_sums(sums, 3, expected, check_finite)
    assert len(calls) == 1 and _same(out, expected)


@pytest.mark.parametrize("kind, divisor, first, last", [
    (2, 1.0, 0, 16), (-1, 1.0, 0, 16), (0, 0.5, 0, 16), (0, float("nan"), 0, 16), (1, 0.0, 0, 16),
    (0, 1.0, -1, 16), (0, 1.0, 9, 8), (1, 1.0, 0, 17),
])
def test_the_kernel_refuses_what_cannot_be_right(kind, divisor, first, last):
    sums, out = torch.zeros(16, dtype=torch.int16), torch.full((16,), 7.0)
    with pytest.raises(ValueError, match="refused"):
        native.library().hvdcomp_half_mean(sums.data_ptr(), 16, kind, divisor, first, last, out.data_ptr(), None)
    assert bool((out == 7.0).all())  # untouched


def test_the_wrapper_refuses_what_does_not_fit():
    out = torch.empty(16)
    for sums, world_size in [(torch.zeros(15, dtype=torch.float16), 2), (torch.zeros(16), 2),
                             (torch.zeros(32, dtype=torch.bfloat16)[::2], 2), (torch.zeros(16, dtype=torch.float16), 0),
                             (torch.zeros(16, dtype=torch.float16), 1.5)]:
        with pytest.raises(ValueError):
            native_half.half_mean(sums, world_size, out, check_finite=False)
    with pytest.raises(ValueError):
        native_half.half_mean(torch.zeros(16, dtype=torch.float16), 2, torch.empty(32)[::2], check_finite=False)
