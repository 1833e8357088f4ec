"""Random-k's fused gather (``hvdcomp.codec.sparse``) equals its eager reference bit for bit, and so does the
whole MaxNormCodec exchange with a selector: k and ratio selectors, with and without error feedback, ragged
buckets and a shard, a step where one worker's gradient holds NaN/Inf, 2 workers (multi-scale) and 3.

The kernels compile once per process (a few seconds, cached on disk by Inductor afterwards)."""

import contextlib

import pytest
import torch

from hvdcomp.codec import fused, sparse
from hvdcomp.codec.quantize import MaxNormQuantizer
from hvdcomp.codec.selection import RandomCoordinateSelector
from hvdcomp.exchange.bucket import Segments
from hvdcomp.exchange.elementwise import MaxNormCodec, simulate_max_norm
from hvdcomp.exchange.simulator import simulate

SIZES = [0, 1, 2, 31, 33, 4099, 65536 + 5]  # ragged: empty, one element, within one word, > 65536
# one bucket's tensor sizes (empty tensors, single elements, > 65536), and a shard of the last bucket
LAYOUTS = [Segments((1000,), "a"), Segments((7, 0, 1, 513, 2), "b"), Segments((0, 4099, 3), "c"), Segments((2, 1), "d"),
           Segments((65536 + 5, 17, 300), "e"), Segments((65536 + 5, 17, 300), "e", 40000, 65700)]
SELECTIONS = [{"k": 5}, {"ratio": 0.01}]
BITS = {2: (2, 6), 3: (2,)}  # per world size: multi-scale and one resolution (test_fused's lane layouts)
NONFINITE_STEP = 2


@pytest.fixture(autouse=True)
def _fused_on(monkeypatch):
    monkeypatch.setenv(fused.ENV_SWITCH, "1")
    assert fused.enabled(), fused._Mode.failed


def _poison(x: torch.Tensor, position: int, value: float) -> torch.Tensor:
    x = x.clone()
    x[position] = value
    return x


@pytest.mark.parametrize("with_memory", [False, True])
def test_gather_fused_equals_eager_and_checks_every_element(with_memory):
    """Values (plus residuals) at the chosen coordinates and the NaN/Inf flag over the whole bucket, on both
    paths; a NaN/Inf at a coordinate that is not chosen clears the flag too."""
    gen = torch.Generator().manual_seed(7)
    for numel in SIZES:
        flat, residual = torch.randn(numel, generator=gen), torch.randn(numel, generator=gen)
        indices = torch.randperm(numel, generator=gen)[: max(1, numel // 7)].sort().values if numel else \
            torch.zeros(0, dtype=torch.int64)
        cases = [(flat, True)]
        if numel > 1:  # the last element is never chosen
            indices = indices[indices != numel - 1]
            cases += [(_poison(flat, numel - 1, bad), False) for bad in (float("nan"), float("inf"), -float("inf"))]
        memory = residual if with_memory else None
        for values_in, finite in cases:
            got = sparse.gather(values_in, indices, memory)
            with fused.eager():
                want = sparse.gather(values_in, indices, memory)
            expected = values_in[indices] + residual[indices] if with_memory else values_in[indices]
            assert torch.equal(got[0], want[0]) and torch.equal(got[0], expected), numel
            assert got[1].dtype == torch.bool and bool(got[1]) == bool(want[1]) == finite, numel
    kernel = sparse._gather_with_memory if with_memory else sparse._gather
    assert kernel._compiled is not None and fused.enabled(), fused._Mode.failed  # it ran compiled


def _exchanges(selection: dict, error_feedback: bool, world_size: int) -> tuple[list, list]:
    """Four steps of every layout over ``world_size`` workers (one worker's gradient holds NaN/Inf at
    ``NONFINITE_STEP``): each step's results and each worker's final state."""
    codecs = [MaxNormCodec(MaxNormQuantizer(BITS[world_size]), RandomCoordinateSelector(seed=3, **selection),
                           error_feedback, seed=5) for _ in range(world_size)]
    for rank, codec in enumerate(codecs):
        codec.bind_rank(rank)
    gen = torch.Generator().manual_seed(world_size)
    results = []
    for layout in LAYOUTS:
        for step in range(4):
            grads = [torch.randn(sum(layout), generator=gen) * 10.0 ** (rank - 1) for rank in range(world_size)]
            nonfinite = step == NONFINITE_STEP
            if nonfinite:
                grads[-1] = _poison(grads[-1], -1, float("inf"))
                before = [codec.state_dict()["memory"] for codec in codecs]
            with pytest.warns(RuntimeWarning, match="NaN/Inf") if nonfinite else contextlib.nullcontext():
                outputs = simulate([c.exchange(g, layout, layout.key, step, world_size) for c, g in zip(codecs, grads)])
            if not nonfinite:
                assert all(torch.equal(out, outputs[0]) for out in outputs), (layout, step)  # every worker alike
            else:
                assert all(bool(out.isnan().all()) for out in outputs), layout
                for codec, memory in zip(codecs, before):  # the memory is left as it was
                    after = codec.state_dict()["memory"]
                    assert memory is after is None or all(torch.equal(memory["residuals"][key], residual)
                                                          for key, residual in after["residuals"].items())
            results.append(outputs[0].clone())  # the codec reuses its result buffer
    return results, [codec.state_dict() for codec in codecs]


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("error_feedback", [True, False])
@pytest.mark.parametrize("selection", SELECTIONS)
def test_randk_exchange_fused_equals_eager(selection, error_feedback, world_size):
    """Every step's mean and the final error-feedback memories are equal on both paths."""
    got, got_state = _exchanges(selection, error_feedback, world_size)
    assert fused.enabled(), fused._Mode.failed
    with fused.eager():
        want, want_state = _exchanges(selection, error_feedback, world_size)
    for step, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b) or (bool(a.isnan().all()) and bool(b.isnan().all())), step
    for state, state_eager in zip(got_state, want_state):
        assert state["rank"] == state_eager["rank"]
        if error_feedback:
            residuals, eager_residuals = state["memory"]["residuals"], state_eager["memory"]["residuals"]
            assert residuals.keys() == eager_residuals.keys() == {layout.key for layout in LAYOUTS if sum(layout)}
            assert all(torch.equal(residuals[key], eager_residuals[key]) for key in residuals)
            assert all(bool(r.isfinite().all()) for r in residuals.values())
        else:
            assert state["memory"] is None and state_eager["memory"] is None


def test_simulate_max_norm_with_a_selector_fused_equals_eager():
    """``simulate_max_norm`` of one large tensor with error feedback, two steps, on both paths."""
    grads = [torch.randn(70001, generator=torch.Generator().manual_seed(r)) for r in range(3)]

    def run():
        codecs = [MaxNormCodec(MaxNormQuantizer((2,)), RandomCoordinateSelector(ratio=0.05), seed=9) for _ in grads]
        return [simulate_max_norm(codecs, grads, key="layer", step=step)[0].clone() for step in range(2)], codecs

    got, codecs = run()
    with fused.eager():
        want, codecs_eager = run()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert 0 < int((got[0] != 0).sum()) <= round(0.05 * 70001)
    assert torch.equal(codecs[0].memory.residual("layer", grads[0]), codecs_eager[0].memory.residual("layer", grads[0]))


def test_the_result_buffer_is_reused_and_rewritten_whole():
    """With a selector a codec's result is its buffer for the key (``reuses_result``): the next exchange of the
    key overwrites all of it, whatever the caller wrote into it or a NaN/Inf step left there."""
    sizes, world_size = [50, 3, 40], 2
    gen = torch.Generator().manual_seed(1)
    steps = [[torch.randn(sum(sizes), generator=gen) for _ in range(world_size)] for _ in range(3)]
    steps[1][0] = _poison(steps[1][0], 0, float("nan"))

    def run(scribble):
        codecs = [MaxNormCodec(MaxNormQuantizer((2,)), RandomCoordinateSelector(k=4)) for _ in range(world_size)]
        for rank, codec in enumerate(codecs):
            codec.bind_rank(rank)
        buffers = []
        for step, grads in enumerate(steps):
            with pytest.warns(RuntimeWarning, match="NaN/Inf") if step == 1 else contextlib.nullcontext():
                outputs = simulate([c.exchange(g, sizes, "b", step, world_size) for c, g in zip(codecs, grads)])
            buffers.append(outputs[0])
            last = outputs[0].clone()
            if scribble:
                outputs[0].fill_(7.0)  # what a caller may do with its result
        assert codecs[0].reuses_result and all(buffer is buffers[0] for buffer in buffers)
        return last

    scribbled, fresh = run(scribble=True), run(scribble=False)
    assert torch.equal(scribbled, fresh) and 0 < int((fresh != 0).sum()) <= 4 * len(sizes)
