"""``QSGDMaxNorm`` with its default ``scale="ahead"`` inside real Horovod workers (2 Gloo workers)."""

import pytest
import torch

import hvdcomp
from hvdcomp.codec import carrier
from hvdcomp.exchange.elementwise import simulate_max_norm
from tests.harness import run_function

STEPS = 7
NAN_STEP = 4  # rank 1's first gradient holds NaN at this step
RESUME_AFTER = 2  # a fresh compressor loads the state saved after this step and replays the rest
BITS = 8


def _grads(rank, step):
    """Gradients that grow 1.5x a step (so the scale agreed the step before clips them), a 0-d one."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    grads = [torch.randn(300, generator=gen) * 1.5**step, torch.randn(20, 10, generator=gen),
             torch.randn((), generator=gen)]
    if step == NAN_STEP and rank == 1:
        grads[0][3] = float("nan")
    return grads


def _ahead_worker():
    import copy
    import warnings

    import horovod.torch as hvd

    import hvdcomp  # noqa: F811 (imported again inside the worker)

    def run(compressor, steps, out):
        for step in steps:
            sent = [compressor.compress(grad) for grad in _grads(hvd.rank(), step)]
            out[("carrier", step)] = [payload.numel() for payload, _ in sent]
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out[("mean", step)] = [compressor.decompress(hvd.allreduce(payload, op=hvd.Average), ctx)
                                       for payload, ctx in sent]
            out[("warned", step)] = any("NaN" in str(w.message) for w in caught)
            out[("state", step)] = copy.deepcopy(compressor.state_dict())

    original, resumed = {}, {}
    compressor = hvdcomp.QSGDMaxNorm(BITS, min_compress_numel=0)
    run(compressor, range(STEPS), original)
    fresh = hvdcomp.QSGDMaxNorm(BITS, min_compress_numel=0)
    fresh.load_state_dict(original[("state", RESUME_AFTER)])
    run(fresh, range(RESUME_AFTER + 1, STEPS), resumed)
    return {"original": original, "resumed": resumed}


@pytest.mark.slow
def test_ahead_scale_in_horovod_is_identical_lossless_and_resumes_exactly():
    world_size = 2
    results = run_function(_ahead_worker, np=world_size, timeout=180)
    original = [r["original"] for r in results]
    # every worker decodes the same values, the NaN step included
    for key, value in original[0].items():
        if key[0] == "mean":
            for a, b in zip(value, original[1][key]):
                torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    # the first step is the exact exchange (header carriers only), bit-exactly the one-process simulation
    assert all(size == carrier.HEADER for size in original[0][("carrier", 0)])
    codecs = [hvdcomp.QSGDMaxNorm(BITS).max_norm for _ in range(world_size)]
    for index in range(3):
        grads = [_grads(rank, 0)[index].reshape(-1) for rank in range(world_size)]
        want = simulate_max_norm(codecs, grads, key=index, word_bits=carrier.word_bits(world_size))[0]
        assert torch.equal(original[0][("mean", 0)][index].reshape(-1), want)
    # later steps carry their payload in the carrier Horovod reduces; no blocking exchange
    assert all(size > carrier.HEADER for size in original[0][("carrier", 1)])
    # the NaN step: NaN on every worker for that tensor only, a warning, excess memory left alone, and
    # that tensor's next exchange exact
    nan_means = original[0][("mean", NAN_STEP)]
    assert nan_means[0].isnan().all() and not nan_means[1].isnan().any()
    assert all(r[("warned", NAN_STEP)] for r in original)
    for r in original:
        before, after = (r[("state", s)]["inner"]["agreed"]["excess"] for s in (NAN_STEP - 1, NAN_STEP))
        assert before[0][0].numel() > 0, "the growing gradient must have been clipped before the NaN step"
        assert all(torch.equal(a, b) for a, b in zip(before[0], after[0]))
    sizes = original[0][("carrier", NAN_STEP + 1)]
    assert sizes[0] == carrier.HEADER and sizes[1] > carrier.HEADER
    # nothing is lost to clipping: over the steps before the NaN, the decoded means plus the workers'
    # kept excess add up to the mean gradient, within the rounding units of those steps
    last = NAN_STEP - 1
    for index in range(3):
        total_grad = sum(_grads(rank, step)[index] for rank in range(world_size) for step in range(last + 1))
        total_sent = sum(original[0][("mean", step)][index] for step in range(last + 1))
        kept = torch.zeros(total_grad.numel())
        for r in original:
            # called directly, the compressor keys gradients by their position in the step
            indices_values = r[("state", last)]["inner"]["agreed"]["excess"].get(index)
            if indices_values is not None:
                kept.index_add_(0, *indices_values)
        kept = kept.view(total_grad.shape)
        bound = sum(max(g.abs().max() for g in (_grads(rank, step)[index] for rank in range(world_size)))
                    for step in range(last + 1)) * 2 / (2**BITS - 1)
        error = (total_sent + kept / world_size - total_grad / world_size).abs().max()
        assert error <= bound, (index, error, bound)
    # resuming from a saved state replays the same steps bit-exactly
    for result in results:
        for step in range(RESUME_AFTER + 1, STEPS):
            for a, b in zip(result["original"][("mean", step)], result["resumed"][("mean", step)]):
                torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
