"""Sizes, dtypes and contiguity are checked before the native kernels run (``hvdcomp.codec.native``), and the public
codec functions raise ``ValueError`` for mismatched sizes on the native and the eager path alike; each case runs in a
subprocess, where a kernel reading or writing out of bounds would crash or return garbage instead."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hvdcomp.codec import fused, native
from hvdcomp.codec.agreed import AgreedScales
from hvdcomp.codec.validate import LISTED_GROUPS, group_total

ROOT = Path(__file__).resolve().parents[1]

PRELUDE = """
    import torch
    from hvdcomp.codec import fused, native, onebit
    from hvdcomp.codec.packing import LaneLayout
    from hvdcomp.codec.quantize import MaxNormQuantizer
    from hvdcomp.codec.random import stream_words

    assert native.usable(torch.zeros(1)), "the native kernels did not load"
    rng = stream_words(0, 1, 2)
    q = MaxNormQuantizer((4,), chunk_size=64)
    x = torch.randn(64 * 40)
    groups = q.scale_groups(x.numel())  # 40 groups of 64
    stats = q.local_stats(x, groups)


    def attempt(name, call):
        for path in ("native", "eager"):
            try:
                with fused.eager() if path == "eager" else torch.no_grad():
                    call()
            except ValueError as error:
                print(name, path, "ValueError", str(error)[:80])
            else:
                print(name, path, "NO-ERROR")
"""

CASES = {
    "encode_short_stats": "attempt('c', lambda: q.encode(x, stats[:3], groups, None, 2, rng=rng))",
    "decode_short_stats": """
        words = q.encode(x, stats, groups, None, 2, rng=rng)
        attempt('c', lambda: q.decode(words, stats[:3], groups, None, x.numel(), 2))
    """,
    "decode_groups_past_the_words": """
        words = q.encode(x, stats, groups, None, 2, rng=rng)
        many = torch.full((400,), 64, dtype=torch.int64)
        big = torch.ones(401)
        attempt('c', lambda: q.decode(words, big, many, None, x.numel(), 2))
    """,
    "decode_into_a_short_out": """
        words = q.encode(x, stats, groups, None, 2, rng=rng)
        attempt('c', lambda: q.decode(words, stats, groups, None, x.numel(), 2, out=torch.empty(x.numel() - 1)))
    """,
    "native_decode_more_means_than_words": """
        words = q.encode(x, stats, groups, None, 2, rng=rng)
        attempt('c', lambda: native.decode(words, groups, torch.ones(40), 7, 9, 0, torch.empty(1 << 20), 1 << 20))
    """,
    "native_encode_short_stats_out": """
        attempt('c', lambda: native.encode(x, groups, torch.ones(40), 15, 4, 15, rng, stats=torch.empty(3)))
    """,
    "draw_bits_short_b": """
        m = torch.randn(1 << 16)
        out = torch.empty(m.numel(), dtype=torch.bool)
        attempt('c', lambda: onebit.draw_bits(m, m.abs()[:100].clone(), rng, out))
    """,
    "draw_lane_words_short_b": """
        m = torch.randn(1 << 16)
        attempt('c', lambda: onebit.draw_lane_words(m, m.abs()[:100].clone(), rng, LaneLayout(1, 2, 63)))
    """,
    "local_stats_groups_past_the_input": """
        many = torch.full((40,), 1 << 14, dtype=torch.int64)
        attempt('c', lambda: q.local_stats(x, many))
    """,
    "native_encode_short_factors": """
        attempt('c', lambda: native.encode(x, groups, torch.ones(2), 15, 4, 15, rng))
    """,
    "native_encode_negative_group": """
        wrapped = torch.tensor([-64] + [64] * 39 + [128])  # adds up to the input, one length negative
        attempt('c', lambda: native.encode(x, wrapped, torch.ones(41), 15, 4, 15, rng))
    """,
    "native_encode_groups_short_of_the_input": """
        attempt('c', lambda: native.encode(x, groups[1:], torch.ones(39), 15, 4, 15, rng))
    """,
    "native_decode_negative_group": """
        words = native.encode(x, groups, torch.ones(40), 15, 4, 15, rng)
        wrapped = torch.tensor([-64] + [64] * 39 + [128])
        attempt('c', lambda: native.decode(words, wrapped, torch.ones(41), 4, 15, 0))
    """,
    "native_unpack_bits_short_rows": """
        attempt('c', lambda: native.unpack_bits(torch.zeros(4, 2, dtype=torch.uint8), 1 << 20))
    """,
    "native_count_bits_short_rows": """
        attempt('c', lambda: native.count_bits(torch.zeros(4, 2, dtype=torch.uint8), 1 << 20))
    """,
    "native_unpack_lanes_short_words": """
        attempt('c', lambda: native.unpack_lanes(torch.zeros(2, dtype=torch.int64), 1 << 20, 4, 15))
    """,
    "native_lane_counts_mean_short_words": """
        out = torch.empty(1 << 20)
        attempt('c', lambda: native.lane_counts_mean(torch.zeros(2, dtype=torch.int64), 1 << 20, 4, 15, 2, out))
    """,
    "native_binarize_long_counts": """
        counts = torch.ones(1 << 20, dtype=torch.int64)
        attempt('c', lambda: native.binarize_counts(counts, 2, 16, rng, 0))
    """,
    "native_short_stream": """
        attempt('c', lambda: native.uniform(1 << 10, torch.zeros(1, dtype=torch.int64)))
    """,
    "native_wrong_dtype": """
        attempt('c', lambda: native.pack_lanes(torch.zeros(1 << 10, dtype=torch.int32), 4, 15))
    """,
    "native_strided_moments": """
        m = torch.randn(2, 1 << 14)[:, 0]
        attempt('c', lambda: native.draw_bit_words(m, m.abs(), rng, 4, 15, 0))
    """,
    "gather_checked_short_gradient": """
        attempt('c', lambda: onebit.gather_checked([torch.zeros(10), torch.zeros(5)], [0, 100], torch.zeros(1 << 16)))
    """,
    "apply_updates_past_the_mean": """
        p = torch.zeros(1 << 16)
        attempt('c', lambda: onebit.apply_updates([p], [100], [1.0], [-0.1], torch.zeros(1 << 16)))
    """,
    "kernel_refuses_gradient_past_the_flat_buffer": """
        flat, flags = torch.zeros(16), torch.zeros(2, dtype=torch.int64)
        spans = [torch.tensor(values, dtype=torch.int64) for values in ([flat.data_ptr()], [16], [8])]
        attempt('c', lambda: native.library().hvdcomp_gather_checked(*(t.data_ptr() for t in spans), 1,
                                                                     flat.data_ptr(), 16, None, flags.data_ptr(),
                                                                     0, 16))
    """,
    "kernel_refuses_parameter_past_the_mean": """
        p, mean, factors = torch.zeros(16), torch.zeros(16), torch.ones(1)
        spans = [torch.tensor(values, dtype=torch.int64) for values in ([p.data_ptr()], [16], [1])]
        attempt('c', lambda: native.library().hvdcomp_birder_update(*(t.data_ptr() for t in spans), factors.data_ptr(),
                                                                    factors.data_ptr(), 1, mean.data_ptr(), 16, 0, 16))
    """,
    "kernel_refuses_short_rows": """
        packed, out = torch.zeros(2, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)
        attempt('c', lambda: native.library().hvdcomp_unpack_bits(packed.data_ptr(), 1, 2, 1 << 20, out.data_ptr()))
    """,
    "kernel_refuses_wide_lanes": """
        values, words = torch.ones(8, dtype=torch.int64), torch.zeros(8, dtype=torch.int64)
        attempt('c', lambda: native.library().hvdcomp_pack_lanes(values.data_ptr(), 8, 2, 40, words.data_ptr()))
    """,
    "kernel_refuses_a_total_past_int32": """
        sums, planes = torch.zeros(8, dtype=torch.int32), torch.zeros(8, dtype=torch.uint8)
        attempt('c', lambda: native.library().hvdcomp_requantize_planes(sums.data_ptr(), 8, 1 << 31, 3, 3, 1.0,
                                                                        rng.data_ptr(), 0, 8, planes.data_ptr()))
    """,
    "kernel_refuses_partial_blocks": """
        sums, out = torch.zeros(16, dtype=torch.int64), torch.zeros(64)
        attempt('c', lambda: native.library().hvdcomp_counts_mean(sums.data_ptr(), 4, 15, 2, 0, 65, out.data_ptr()))
    """,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_mismatched_sizes_raise(case):
    script = textwrap.dedent(PRELUDE) + textwrap.dedent(CASES[case])
    env = dict(os.environ, **{fused.ENV_SWITCH: "1"})
    env.pop(native.ENV_SWITCH, None)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert done.returncode == 0, (done.returncode, done.stdout[-2000:], done.stderr[-3000:])
    lines = [line for line in done.stdout.splitlines() if line.startswith("c ")]
    assert len(lines) == 2 and all(" ValueError " in line for line in lines), done.stdout


def test_agreed_stats_of_other_groups_are_absent():
    """State saved with one ``chunk_size`` and resumed with another: the agreed scales do not fit the groups, so the
    next exchange is exact (it agrees a new scale) instead of handing the kernels stats of the wrong length."""
    saved = AgreedScales()
    numel = 1000
    saved.agree("w", numel, 2, torch.cat([torch.ones(10), torch.zeros(1)]))  # 10 scales, all finite
    resumed = AgreedScales()
    resumed.load_state_dict(saved.state_dict())
    assert resumed.scales("w", numel, 2, 100) is None
    assert resumed.scales("w", numel, 2, 10) is not None


@pytest.mark.parametrize("count", [0, 1, LISTED_GROUPS, LISTED_GROUPS + 1, 5000])
def test_group_checks_agree_for_few_and_many_groups(count):
    """``group_total`` reads few groups as ints and reduces many in torch: both accept the same and refuse the same."""
    lengths = torch.full((count,), 7, dtype=torch.int64)
    assert group_total(lengths, 7 * count) == group_total(lengths, None) == 7 * count
    if count:
        with pytest.raises(ValueError, match="do not split"):
            group_total(lengths, 7 * count + 1)
    if count > 1:
        negative = lengths.clone()
        negative[-1], negative[0] = -7, 21  # the same total, one length negative
        for numel in (7 * count, None):
            with pytest.raises(ValueError, match="do not split"):
                group_total(negative, numel)
    with pytest.raises(ValueError, match="vector"):
        group_total(lengths.view(1, -1), 7 * count)
