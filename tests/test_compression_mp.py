"""The hvdcomp compressors inside real Horovod workers, with Horovod's own DistributedOptimizer."""

import pytest
import torch

from hvdcomp.codec import carrier
from hvdcomp.exchange.elementwise import simulate_max_norm
from tests.harness import run_function

EMULATED_NODES = "localhost:2,127.0.0.1:2"

# exchanged exactly every step, so each step replays in the one-process simulation
COMPRESSORS = {
    "qsgd8": ("QSGDMaxNorm", {"bits": 8, "scale": "exact"}),
    "qsgd2_chunked": ("QSGDMaxNorm", {"bits": 2, "chunk_size": 7, "scale": "exact"}),
    "qsgd4_rotated": ("QSGDMaxNorm", {"bits": 4, "chunk_size": 300, "scale": "exact", "rotate": True}),
    "multiscale": ("QSGDMaxNormMultiScale", {"bits": (2, 6)}),
    "randk_ef": ("GlobalRandKMaxNorm", {"ratio": 0.3, "bits": 6}),
    "randk_rescaled": ("GlobalRandKMaxNorm", {"ratio": 0.2, "bits": 4, "error_feedback": False}),
    "randk_multiscale": ("GlobalRandKMaxNormMultiScale", {"ratio": 0.5, "bits": (3, 8)}),
}
# the default: the scale agreed one step ahead (tests/test_scale_ahead*.py check its math)
AHEAD = {"qsgd4_ahead_chunked": ("QSGDMaxNorm", {"bits": 4, "chunk_size": 50})}


def _make(name):
    import hvdcomp

    cls, kwargs = {**COMPRESSORS, **AHEAD}[name]
    return getattr(hvdcomp, cls)(**kwargs, min_compress_numel=0)  # these tensors are small


def _grads(rank, step):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    # one ordinary tensor, one with a per-rank outlier, one 0-d tensor, one empty tensor
    big = torch.randn(40, 50, generator=gen)
    big[0, 0] = 5.0 * (rank + 1)
    return [torch.randn(30, generator=gen), big, torch.randn((), generator=gen), torch.zeros(0)]


def _exchange_worker(ops):
    """Compress, all-reduce (each op), decompress, for every compressor, two steps."""
    import horovod.torch as hvd

    results = {}
    for name in COMPRESSORS:
        for op in ops:
            compressor = _make(name)
            for step in range(2):
                # like Horovod's optimizer: compress every gradient (backward), then decompress (synchronize)
                sent = [compressor.compress(grad) for grad in _grads(hvd.rank(), step)]
                for index, (payload, ctx) in enumerate(sent):
                    if op == "predivide":
                        reduced = hvd.allreduce(payload, op=hvd.Average, prescale_factor=1 / 3, postscale_factor=3)
                    else:
                        reduced = hvd.allreduce(payload, op=hvd.Sum if op == "sum" else hvd.Average)
                    results[(name, op, step, index)] = compressor.decompress(reduced, ctx)
            results[(name, op, "ratio")] = compressor.stats.total.compression_ratio
            results[(name, op, "steps")] = compressor.stats.steps
    # low-precision gradients come back in their dtype
    for dtype in (torch.float16, torch.bfloat16):
        compressor = _make("qsgd8")
        grad = _grads(hvd.rank(), 0)[0].to(dtype)
        payload, ctx = compressor.compress(grad)
        results[("dtype", dtype)] = compressor.decompress(hvd.allreduce(payload), ctx)
    return results


def _coarse_levels(name):
    bits = COMPRESSORS[name][1]["bits"]
    return 2 ** (bits[0] if isinstance(bits, tuple) else bits) - 1


def _simulated(name, world_size, step_grads):
    """The workers' exchanges replayed in one process, in the same order, with the workers' rounding
    generators and per-worker memories: the mean of the ranks' dequantized values."""
    codecs = [_make(name).max_norm for _ in range(world_size)]
    expected = {}
    for step, per_rank in enumerate(step_grads):
        for index in range(len(per_rank[0])):
            grads = [per_rank[rank][index].reshape(-1).float() for rank in range(world_size)]
            outputs = simulate_max_norm(codecs, grads, key=index, step=step, word_bits=carrier.word_bits(world_size))
            expected[(step, index)] = outputs[0].clone().view(per_rank[0][index].shape)  # random-k reuses it
    return expected


def test_exchange_is_exact_identical_and_matches_one_process_simulation():
    world_size = 2
    ops = ["average", "sum", "predivide"]
    results = run_function(_exchange_worker, np=world_size, kwargs={"ops": ops})
    step_grads = [[_grads(rank, step) for rank in range(world_size)] for step in range(2)]
    for name in COMPRESSORS:
        expected = _simulated(name, world_size, step_grads)
        for op in ops:
            assert results[0][(name, op, "ratio")] > 1 and results[0][(name, op, "steps")] == 2
            for (step, index), mean in expected.items():
                want = mean * world_size if op == "sum" else mean
                got = [results[rank][(name, op, step, index)] for rank in range(world_size)]
                assert got[0].shape == want.shape and got[0].dtype == want.dtype
                assert torch.equal(got[0], got[1]), (name, op, step, index)  # identical on every rank
                assert torch.equal(got[0], want), (name, op, step, index)  # bit-exact mean of dequantized
                if not name.startswith("randk") and "rotate" not in COMPRESSORS[name][1] and want.numel():
                    # dense unrotated schemes: each worker's rounding error is below one coarse unit M / s_1
                    pair = torch.stack([step_grads[step][rank][index] for rank in range(world_size)])
                    unit = pair.abs().max() / _coarse_levels(name)
                    true = pair.sum(dim=0) if op == "sum" else pair.mean(dim=0)
                    error = (got[0] - true).abs().max() / (world_size if op == "sum" else 1)
                    assert error <= unit * 1.0001, (name, op, step, index)
    for dtype in (torch.float16, torch.bfloat16):
        out = results[0][("dtype", dtype)]
        assert out.dtype == dtype and torch.equal(out, results[1][("dtype", dtype)])


def _mismatch_worker():
    import horovod.torch as hvd

    import hvdcomp

    caught = {}
    # equal carrier lengths, different bits: only the tag can tell
    compressor = hvdcomp.QSGDMaxNorm(bits=8 if hvd.rank() == 0 else 7, min_compress_numel=0)
    payload, ctx = compressor.compress(torch.ones(1))
    try:
        compressor.decompress(hvd.allreduce(payload), ctx)
    except hvdcomp.CarrierMismatchError as error:
        caught["bits"] = str(error)
    # the same carrier, rotated on one worker only
    compressor = hvdcomp.QSGDMaxNorm(bits=8, min_compress_numel=0, rotate=hvd.rank() == 0)
    payload, ctx = compressor.compress(torch.ones(1))
    try:
        compressor.decompress(hvd.allreduce(payload), ctx)
    except hvdcomp.CarrierMismatchError as error:
        caught["rotate"] = str(error)
    return caught


def test_mismatched_configuration_raises_on_every_rank():
    results = run_function(_mismatch_worker, np=2)
    for rank_result in results:
        assert "different" in rank_result["bits"] and "different" in rank_result["rotate"]


def _small_gradients_worker():
    """Default ``min_compress_numel``: gradients below it travel as float32, those at it are quantized."""
    import horovod.torch as hvd

    import hvdcomp
    from hvdcomp.integrations.codecs import MIN_COMPRESS_NUMEL

    gen = torch.Generator().manual_seed(hvd.rank())
    small, big = torch.randn(MIN_COMPRESS_NUMEL - 1, generator=gen), torch.randn(MIN_COMPRESS_NUMEL, generator=gen)
    half = torch.randn(5, 3, generator=gen).half()

    def exchange(compressor, gradient, name):
        payload, ctx = compressor.compress(gradient)
        sent = payload.clone()
        return sent, compressor.decompress(hvd.allreduce(payload, op=hvd.Average, name=name), ctx)

    out = {}
    for label, gradient in (("small", small), ("half", half), ("big", big)):
        compressor = hvdcomp.QSGDMaxNorm(4)
        sent, result = exchange(compressor, gradient, label)
        out[label] = {"sent": sent, "result": result, "exact": hvd.allreduce(gradient.float(), name=f"{label}.exact"),
                      "scale": hvd.allreduce(gradient.float().abs().max(), op=hvd.Max, name=f"{label}.max"),
                      "stats": compressor.stats.last_step.as_dict(), "steps": compressor.stock().state_dict()["steps"]}
    everything = hvdcomp.QSGDMaxNorm(4, min_compress_numel=0)
    out["small_compressed"] = exchange(everything, small, "small_compressed")[1]
    # workers that disagree on the threshold: both compress (carrier tags differ), or only one does
    both = hvdcomp.QSGDMaxNorm(4, min_compress_numel=100 if hvd.rank() == 0 else 0)
    try:
        exchange(both, torch.randn(200, generator=gen), "both")
    except hvdcomp.CarrierMismatchError as error:
        out["both"] = str(error)
    one = hvdcomp.QSGDMaxNorm(4, min_compress_numel=MIN_COMPRESS_NUMEL if hvd.rank() == 0 else 0)
    try:
        exchange(one, small, "one")
    except Exception as error:  # noqa: BLE001 (Horovod's own mismatch error)
        out["one"] = f"{type(error).__name__}: {error}"
    return out


def test_gradients_below_min_compress_numel_travel_uncompressed():
    results = run_function(_small_gradients_worker, np=2)
    for rank_result in results:
        for label in ("small", "half"):
            case = rank_result[label]
            assert case["sent"].dtype == torch.float32 and case["sent"].shape == case["exact"].shape, label
            assert torch.equal(case["result"], case["exact"].to(case["result"].dtype)), label  # as Compression.none
            assert case["steps"] == {} and case["stats"]["sent_bytes"] == 4 * case["exact"].numel(), label
        assert rank_result["half"]["result"].dtype == torch.float16
        big, small = rank_result["big"], rank_result["small"]
        assert big["sent"].dtype == torch.float64 and big["stats"]["compression_ratio"] > 3.5
        for result, case in ((big["result"], big), (rank_result["small_compressed"], small)):
            error = float((result - case["exact"]).abs().max())
            assert 0 < error <= case["scale"] / 15  # quantized: within one level of 4 bits
        assert "different" in rank_result["both"]
        assert "mismatch" in rank_result["one"].lower(), rank_result["one"]
    assert torch.equal(results[0]["big"]["result"], results[1]["big"]["result"])


def test_min_compress_numel_is_checked():
    import hvdcomp

    for bad in (-1, 1.5, "8"):
        with pytest.raises((TypeError, ValueError), match="min_compress_numel"):
            hvdcomp.QSGDMaxNorm(4, min_compress_numel=bad)


def _train_worker(names, op, predivide, passes, steps):
    """Train the same small model with Horovod's DistributedOptimizer per compressor."""
    import horovod.torch as hvd

    out = {}
    for name in names:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        # gradients are summed over the passes, and over the workers with op=Sum
        lr = 0.1 / passes / (hvd.size() if op == "sum" else 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        compression = hvd.Compression.none if name == "none" else _make(name)
        optimizer = hvd.DistributedOptimizer(
            optimizer,
            named_parameters=model.named_parameters(),
            compression=compression,
            op=hvd.Sum if op == "sum" else hvd.Average,
            gradient_predivide_factor=predivide,
            backward_passes_per_step=passes,
        )
        gen = torch.Generator().manual_seed(hvd.rank())
        target = torch.nn.Linear(8, 1)
        torch.nn.init.constant_(target.weight, 0.5)
        losses = []
        for _ in range(steps):
            optimizer.zero_grad()
            for _ in range(passes):
                x = torch.randn(32, 8, generator=gen)
                loss = torch.nn.functional.mse_loss(model(x), target(x).detach())
                loss.backward()
            optimizer.step()
            losses.append(loss.item())
        out[name] = {"params": [p.detach().clone() for p in model.parameters()], "first": losses[0],
                     "loss": sum(losses[-3:]) / 3}
    return out


def _check_training(results, names):
    for name in names:
        for rank_result in results[1:]:
            for a, b in zip(results[0][name]["params"], rank_result[name]["params"]):
                assert torch.equal(a, b), name  # every replica identical
    def mean(name, what):
        return sum(r[name][what] for r in results) / len(results)

    baseline = mean("none", "loss")
    for name in names:
        loss = mean(name, "loss")
        assert loss < 0.3 * mean(name, "first") and loss < 1.5 * baseline + 0.01, (name, loss, baseline)


ALL = ["none", *COMPRESSORS, *AHEAD]


# 4 workers on 2 cores run a blocking collective in ~0.2 s, so those cases train fewer steps.
@pytest.mark.parametrize(
    "np_,hosts,op,predivide,passes,steps",
    [
        (2, None, "average", 1.0, 1, 40),
        (4, None, "sum", 1.0, 2, 12),
        (4, EMULATED_NODES, "average", 2.0, 1, 12),
    ],
    ids=["np2-average", "np4-sum-2passes", "2nodes-predivide"],
)
def test_stock_optimizer_trains_identically_with_every_compressor(np_, hosts, op, predivide, passes, steps):
    kwargs = {"names": ALL, "op": op, "predivide": predivide, "passes": passes, "steps": steps}
    results = run_function(_train_worker, np=np_, hosts=hosts, kwargs=kwargs, timeout=300)
    _check_training(results, ALL)


@pytest.mark.mpi
def test_stock_optimizer_under_mpi():
    names = ["none", "qsgd8", "multiscale", "randk_ef"]
    results = run_function(
        _train_worker,
        np=2,
        launcher="mpi",
        timeout=300,
        kwargs={"names": names, "op": "average", "predivide": 1.0, "passes": 1, "steps": 40},
    )
    _check_training(results, names)


def test_bad_gradients_are_refused():
    import hvdcomp

    compressor = hvdcomp.QSGDMaxNorm(4)
    with pytest.raises(TypeError, match="floating"):
        compressor.compress(torch.ones(3, dtype=torch.int32))
    with pytest.raises(TypeError, match="sparse"):
        compressor.compress(torch.ones(3).to_sparse())
