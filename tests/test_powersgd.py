"""One-process tests of the PowerSGD bucket codec (``hvdcomp.exchange.powersgd``), driven by ``simulate``."""

import io

import pytest
import torch

from hvdcomp.exchange.powersgd import PowerSGD
from hvdcomp.exchange.protocol import Op
from hvdcomp.exchange.simulator import simulate


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The matrices are tiny: extra threads only cost (a lot on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _grads(world_size, shapes, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(shape, generator=gen).to(dtype) for shape in shapes] for _ in range(world_size)]


def _mean(grads):
    """Exact per-tensor mean (float32, or float64 for float64), with the simulator's arithmetic (sum, divide)."""
    world_size = len(grads)
    means = []
    for i in range(len(grads[0])):
        dtype = torch.promote_types(grads[0][i].dtype, torch.float32)
        means.append(torch.stack([g[i].to(dtype) for g in grads]).sum(dim=0) / world_size)
    return means


def _run(codecs, grads, step=0, key="bucket", log=None):
    """One exchange per worker; returns each worker's list of results (``log`` records the requests)."""
    exchanges = [codec.exchange(g, key, step, len(codecs)) for codec, g in zip(codecs, grads)]
    if log is not None:
        exchanges = [_recorded(exchanges[0], log)] + exchanges[1:]
    return simulate(exchanges)


def _recorded(exchange, log):
    request = next(exchange)
    while True:
        log.append((request[0], request[1].numel(), request[1].dtype))
        reply = yield request
        try:
            request = exchange.send(reply)
        except StopIteration as done:
            return done.value


def _assert_same_on_all_workers(outputs):
    for out in outputs[1:]:
        for a, b in zip(out, outputs[0]):
            assert torch.equal(a, b)


def _memories(codec, key="bucket"):
    return codec.state_dict()["buckets"][key]["memories"]


@pytest.mark.parametrize("shape", [(12, 7), (7, 12), (8, 3, 3, 3), (9, 9)])
def test_full_rank_gives_exact_mean(shape):
    world_size = 3
    codecs = [PowerSGD(rank=64, min_compression_rate=0) for _ in range(world_size)]
    for step in range(3):  # with error feedback, every step (not just the first)
        grads = _grads(world_size, [shape, (5,)], seed=step)
        log = []
        outputs = _run(codecs, grads, step, log=log)
        assert [op for op, _, _ in log] == [Op.SUM, Op.SUM]  # it was compressed
        _assert_same_on_all_workers(outputs)
        for result, mean in zip(outputs[0], _mean(grads)):
            assert result.shape == mean.shape
            torch.testing.assert_close(result, mean, rtol=1e-4, atol=1e-4)
    if shape[0] <= shape[1]:  # P spans everything: the local error is zero
        assert all(m.abs().max() < 1e-5 for m in _memories(codecs[0]))


def test_low_rank_result_lies_in_rank_r_space():
    world_size, rank = 4, 2
    codecs = [PowerSGD(rank=rank) for _ in range(world_size)]
    for step in range(2):
        outputs = _run(codecs, _grads(world_size, [(32, 20), (20, 4, 4)], seed=step), step)
        _assert_same_on_all_workers(outputs)
        for result in outputs[0]:
            singular = torch.linalg.svdvals(result.reshape(result.shape[0], -1).double())
            assert singular[rank - 1] > 1e-3 * singular[0]
            assert singular[rank:].max() < 1e-5 * singular[0]


def test_warm_start_power_iteration_converges_to_best_rank_r_approximation():
    world_size, rank, n, m = 2, 2, 24, 16
    gen = torch.Generator().manual_seed(3)
    u, _ = torch.linalg.qr(torch.randn(n, m, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(m, m, generator=gen, dtype=torch.float64))
    spectrum = torch.tensor([10.0, 6.0] + [1.0 / (i + 1) for i in range(m - 2)], dtype=torch.float64)
    target = (u * spectrum) @ v.T  # the workers' mean
    noise = torch.randn(n, m, generator=gen, dtype=torch.float64)
    grads = [[(target + noise).float()], [(target - noise).float()]]
    best = ((u[:, :rank] * spectrum[:rank]) @ v[:, :rank].T).float()
    codecs = [PowerSGD(rank=rank, error_feedback=False) for _ in range(world_size)]
    for step in range(12):
        outputs = _run(codecs, grads, step)
    torch.testing.assert_close(outputs[0][0], best, rtol=0, atol=1e-4)
    # every stored Q has orthonormal columns spanning the result's rows
    q = codecs[0].state_dict()["buckets"]["bucket"]["qs"][0][0]
    torch.testing.assert_close(q.T @ q, torch.eye(rank), rtol=0, atol=1e-5)
    torch.testing.assert_close(outputs[0][0] @ q @ q.T, outputs[0][0], rtol=0, atol=1e-4)


def test_error_feedback_loses_nothing():
    world_size, steps = 3, 60
    grads = _grads(world_size, [(16, 12), (12,), (10, 3, 2)], seed=1)  # fixed gradients
    means = _mean(grads)
    codecs = [PowerSGD(rank=1) for _ in range(world_size)]
    applied = [torch.zeros_like(mean) for mean in means]
    errors = {}
    for step in range(steps):
        outputs = _run(codecs, grads, step)
        _assert_same_on_all_workers(outputs)
        for total, result in zip(applied, outputs[0]):
            total += result
        if step + 1 in (10, steps):
            errors[step + 1] = max(
                float((a - (step + 1) * m).norm() / ((step + 1) * m).norm()) for a, m in zip(applied, means)
            )
    # what was applied plus the workers' mean memory is exactly everything that came in
    memories = [torch.stack(ms).mean(dim=0) for ms in zip(*(_memories(c) for c in codecs))]
    for index, memory in zip((0, 2), memories):
        torch.testing.assert_close(
            applied[index] + memory.view_as(applied[index]), steps * means[index], rtol=0, atol=1e-3
        )
    torch.testing.assert_close(applied[1], steps * means[1])  # the vector goes uncompressed: exact
    assert errors[steps] < 0.15
    assert errors[steps] < 0.5 * errors[10]


def test_uncompressed_tensors_come_back_as_exact_mean():
    world_size = 3
    # (3, 3): rate 1.5; (2, 50): rate 100/52; (0, 4) and () and (10,) are never compressed
    shapes = [(10,), (), (3, 3), (2, 50), (0, 4), (40, 30)]
    grads = _grads(world_size, shapes, seed=5)
    for start_iter, step in [(0, 0), (3, 1)]:
        codecs = [PowerSGD(start_iter=start_iter) for _ in range(world_size)]
        outputs = _run(codecs, grads, step)
        _assert_same_on_all_workers(outputs)
        means = _mean(grads)
        exact = range(len(shapes)) if step < start_iter else range(len(shapes) - 1)
        for i in exact:
            assert outputs[0][i].shape == means[i].shape
            assert torch.equal(outputs[0][i], means[i])


def test_rounds_and_sizes():
    world_size, start_iter = 2, 2
    # compressed at rank 2: (40, 30), two (16, 16) (one batch), (4, 4, 4) as 4 x 16 at rank 2 (rate 64 / 40)
    shapes = [(40, 30), (7,), (16, 16), (3, 3), (16, 16), (4, 4, 4)]
    compressed = [(40, 30), (16, 16), (16, 16), (4, 16)]
    uncompressed_numel = 7 + 9
    codecs = [PowerSGD(rank=2, start_iter=start_iter, min_compression_rate=1.6) for _ in range(world_size)]
    for step in range(4):
        log = []
        _run(codecs, _grads(world_size, shapes, seed=step), step, log=log)
        if step < start_iter:
            assert log == [(Op.SUM, sum(torch.Size(s).numel() for s in shapes), torch.float32)]
            assert codecs[0].state_dict()["buckets"] == {}  # no state touched before start_iter
        else:
            assert log == [
                (Op.SUM, uncompressed_numel + sum(n * 2 for n, _ in compressed), torch.float32),
                (Op.SUM, sum(m * 2 for _, m in compressed), torch.float32),
            ]
    # a rate exactly at min_compression_rate compresses: 4 x 4 at rank 1 has rate 16 / 8 = 2
    log = []
    _run([PowerSGD() for _ in range(world_size)], _grads(world_size, [(4, 4)]), log=log)
    assert log == [(Op.SUM, 4, torch.float32), (Op.SUM, 4, torch.float32)]
    # nothing to compress: one round, also after start_iter
    log = []
    _run([PowerSGD() for _ in range(world_size)], _grads(world_size, [(5,), (3, 3)]), step=7, log=log)
    assert log == [(Op.SUM, 14, torch.float32)]


def test_q_is_shared_and_independent_of_the_global_rng():
    world_size = 3
    grads = _grads(world_size, [(20, 12), (12, 20)], seed=2)
    runs = []
    for global_seed in (1, 2):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(global_seed)
            rng_state = torch.get_rng_state()
            codecs = [PowerSGD(rank=2, seed=7) for _ in range(world_size)]
            outputs = _run(codecs, grads)
            assert torch.equal(torch.get_rng_state(), rng_state)
        _assert_same_on_all_workers(outputs)
        qs = [c.state_dict()["buckets"]["bucket"]["qs"] for c in codecs]
        for other in qs[1:]:
            assert all(torch.equal(a, b) for a, b in zip(other, qs[0]))
        runs.append(outputs[0])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    # the seed and the key pick the random projection
    for codec_seed, key in [(8, "bucket"), (7, "other")]:
        other = _run([PowerSGD(rank=2, seed=codec_seed) for _ in range(world_size)], grads, key=key)[0]
        assert not torch.allclose(other[0], runs[0][0])


def test_warm_start_reuses_q_cold_start_redraws_it_each_step():
    world_size = 2
    grads = _grads(world_size, [(24, 18)], seed=4)
    warm = [PowerSGD(error_feedback=False) for _ in range(world_size)]
    cold = [PowerSGD(error_feedback=False, warm_start=False) for _ in range(world_size)]
    warm_results = [_run(warm, grads, step)[0][0] for step in range(3)]
    cold_results = [_run(cold, grads, step)[0][0] for step in range(3)]
    assert not torch.allclose(warm_results[2], cold_results[2])
    # warm start: power iteration on a fixed matrix, the approximation error does not grow
    mean = _mean(grads)[0]
    warm_errors = [float((r - mean).norm()) for r in warm_results]
    assert warm_errors[2] <= warm_errors[0] + 1e-4
    # cold start keeps no Q; each step's draw depends on (seed, key, index, step) only, not on history
    assert cold[0].state_dict()["buckets"]["bucket"]["qs"] == [None]
    assert not torch.allclose(cold_results[1], cold_results[2])
    fresh = _run([PowerSGD(error_feedback=False, warm_start=False) for _ in range(world_size)], grads, step=2)
    assert torch.equal(fresh[0][0], cold_results[2])


def test_state_dict_round_trip_continues_bit_exactly():
    world_size, steps, split = 2, 8, 4
    shapes = [(24, 16), (10,), (24, 16), (8, 4, 3)]
    options = dict(rank=2, start_iter=1, min_compression_rate=1.5)
    data = [_grads(world_size, shapes, seed=100 + step) for step in range(steps)]

    unbroken = [PowerSGD(**options) for _ in range(world_size)]
    expected = [_run(unbroken, data[step], step) for step in range(steps)]

    first = [PowerSGD(**options) for _ in range(world_size)]
    for step in range(split):
        _run(first, data[step], step)
    saved = []
    for codec in first:
        buffer = io.BytesIO()
        torch.save(codec.state_dict(), buffer)
        buffer.seek(0)
        saved.append(torch.load(buffer, weights_only=True))
    _run(first, data[split], split)  # changes the codecs' state, not the saved copies
    resumed = [PowerSGD(**options) for _ in range(world_size)]
    for codec, state in zip(resumed, saved):
        codec.load_state_dict(state)
    for step in range(split, steps):
        outputs = _run(resumed, data[step], step)
        for out, ref in zip(outputs, expected[step]):
            assert all(torch.equal(a, b) for a, b in zip(out, ref))

    with pytest.raises(ValueError, match="rank"):
        PowerSGD(rank=3).load_state_dict(saved[0])
    PowerSGD(**{**options, "start_iter": 0}).load_state_dict(saved[0])  # start_iter may change


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_dtypes_round_trip(dtype):
    world_size = 2
    grads = _grads(world_size, [(12, 10), (6,), (10, 12)], dtype=dtype)
    grads = [g + [torch.randn(8, 8).float()] for g in grads]  # a float32 tensor in the same bucket
    codecs = [PowerSGD(rank=16, min_compression_rate=0) for _ in range(world_size)]  # full rank: exact
    log = []
    outputs = _run(codecs, grads, log=log)
    wire = torch.float64 if dtype == torch.float64 else torch.float32
    assert [d for _, _, d in log] == [wire, wire]
    for result, grad, mean in zip(outputs[0], grads[0], _mean(grads)):
        assert result.dtype == grad.dtype and result.shape == grad.shape
        tol = {torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float32: 1e-5, torch.float64: 1e-12}[grad.dtype]
        torch.testing.assert_close(result, mean.to(grad.dtype), rtol=tol, atol=tol)


def test_zero_gradient_gives_zeros_and_q_recovers():
    world_size, shape = 2, (10, 6)
    codecs = [PowerSGD(rank=6, min_compression_rate=0) for _ in range(world_size)]
    zeros = [[torch.zeros(shape)] for _ in range(world_size)]
    assert torch.equal(_run(codecs, zeros, 0)[0][0], torch.zeros(shape))  # no NaN from 0 / 0
    grads = _grads(world_size, [shape], seed=9)
    # Q came back all zero; it was redrawn, so the full-rank approximation is exact again
    torch.testing.assert_close(_run(codecs, grads, 1)[0][0], _mean(grads)[0])


def test_non_finite_gradient_gives_nan_and_leaves_state():
    world_size = 2
    shapes = [(16, 12), (5,), (16, 12)]
    codecs = [PowerSGD() for _ in range(world_size)]
    skipping = [PowerSGD() for _ in range(world_size)]  # never sees the bad step
    _run(codecs, _grads(world_size, shapes, seed=0), 0)
    _run(skipping, _grads(world_size, shapes, seed=0), 0)
    before = codecs[0].state_dict()
    bad = _grads(world_size, shapes, seed=1)
    bad[1][2][3, 4] = float("inf")
    with pytest.warns(RuntimeWarning, match="non-finite"):
        outputs = _run(codecs, bad, 1)
    _assert_same_on_all_workers([[o.nan_to_num(1.0) for o in out] for out in outputs])
    assert torch.isnan(outputs[0][2]).all()
    assert torch.isfinite(outputs[0][0]).all() and torch.equal(outputs[0][1], _mean(bad)[1])
    after = codecs[0].state_dict()["buckets"]["bucket"]
    for name in ("memories", "qs"):
        assert all(torch.equal(a, b) for a, b in zip(after[name], before["buckets"]["bucket"][name]))
    good = _grads(world_size, shapes, seed=2)
    for a, b in zip(_run(codecs, good, 2)[0], _run(skipping, good, 2)[0]):
        assert torch.equal(a, b)


def test_layout_change_resets_the_bucket_state():
    world_size = 2
    codecs = [PowerSGD() for _ in range(world_size)]
    _run(codecs, _grads(world_size, [(16, 12)]), 0)
    grads = _grads(world_size, [(12, 16), (4,)], seed=1)
    fresh = _run([PowerSGD() for _ in range(world_size)], grads, 1)
    for a, b in zip(_run(codecs, grads, 1)[0], fresh[0]):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"rank": 0},
        {"rank": 1.5},
        {"rank": True},
        {"start_iter": -1},
        {"min_compression_rate": -1.0},
        {"min_compression_rate": float("nan")},
        {"error_feedback": 1},
        {"warm_start": None},
        {"orthogonalization_epsilon": -1e-8},
        {"seed": "0"},
    ],
)
def test_bad_options_raise(kwargs):
    with pytest.raises(ValueError):
        PowerSGD(**kwargs)


def test_bad_exchange_arguments_raise():
    codec = PowerSGD()
    good = [torch.randn(8, 8)]
    for grads, step, world_size in [
        ([torch.ones(8, 8, dtype=torch.int32)], 0, 2),
        ([torch.randn(8, 8), torch.empty(3, device="meta")], 0, 2),
        (good, -1, 2),
        (good, 0, 0),
    ]:
        with pytest.raises(ValueError):
            codec.exchange(grads, "bucket", step, world_size)


def test_orthogonalization_holds_on_ill_conditioned_matrices():
    world_size, n, m = 2, 48, 32
    gen = torch.Generator().manual_seed(11)
    u, _ = torch.linalg.qr(torch.randn(n, m, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(m, m, generator=gen, dtype=torch.float64))
    target = ((u * torch.logspace(0, -8, m, dtype=torch.float64)) @ v.T).float()
    grads = [[target], [target]]
    codecs = [PowerSGD(rank=m, min_compression_rate=0, error_feedback=False) for _ in range(world_size)]
    for step in range(2):  # step 1 starts from the warm Q, itself orthonormalized
        result = _run(codecs, grads, step)[0][0]
        torch.testing.assert_close(result, target, rtol=0, atol=1e-6)


def test_empty_bucket_communicates_nothing():
    with pytest.raises(StopIteration) as done:
        next(PowerSGD().exchange([], "bucket", 0, 2))
    assert done.value.value == []
