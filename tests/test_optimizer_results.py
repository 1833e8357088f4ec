"""``hvdcomp.DistributedOptimizer`` hands each gradient its mean without a copy where the codec's result is the
caller's to keep (a new tensor each exchange), and copies it where the codec reuses a buffer (random-k) or the
transport summed the bucket's own buffer in place: a gradient kept from one step never changes at the next."""

import pytest
import torch

import hvdcomp
from hvdcomp.exchange.protocol import Reduction, Transport


class _Handle:
    def __init__(self, result):
        self.result = result


class _TwoEqualWorkers(Transport):
    """Rank 0 of two workers holding the same gradients: SUM doubles, MAX returns the tensor, an all-gather
    repeats it, an all-to-all brings part 0 twice. ``in_place``: the SUM doubles the sent tensor itself (as
    a transport that sums in place), else it returns a new tensor."""

    size, rank, local_size, local_rank, cross_size, cross_rank, equal_nodes = 2, 0, 2, 0, 1, 0, True
    blocking = False

    def __init__(self, in_place=False):
        self.in_place = in_place

    def start(self, op, tensor, name=None):
        if op.reduction is Reduction.SUM:
            return _Handle(tensor.mul_(2) if self.in_place else tensor * 2)
        if op.reduction is Reduction.ALLGATHER:
            return _Handle(torch.cat([tensor, tensor]))
        if op.reduction is Reduction.ALLTOALL:
            return _Handle(torch.cat([tensor.chunk(2)[0]] * 2))
        return _Handle(tensor.clone())

    def poll(self, handle):
        return True

    def wait(self, handle):
        return handle.result

    def collective(self, op, tensor):
        return self.wait(self.start(op, tensor))


def _steps(compression, transport, steps=3):
    """Gradients after each of ``steps`` steps (the tensors themselves and their values then), and the optimizer."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer = hvdcomp.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), compression=compression,
                                             transport=transport, warmup_steps=0)
    kept, values, raw = [], [], []
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(5, 16)).square().sum().backward()
        raw.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
        kept.append([p.grad for p in model.parameters()])
        values.append([p.grad.clone() for p in model.parameters()])
    return kept, values, raw, optimizer


# storages of the 4 gradients over a transport that returns new sums, and one that sums in place: 1 when they
# are views of the codec's result (a new tensor each exchange), 4 when copied (NoCompression's in-place sum is
# the bucket's buffer; random-k reuses its buffer)
@pytest.mark.parametrize("make,storages", [(hvdcomp.NoCompression, (1, 4)), (lambda: hvdcomp.QSGDMaxNorm(8), (1, 1)),
                                           (hvdcomp.FP16, (1, 1)), (lambda: hvdcomp.FP16(error_feedback=True), (1, 1)),
                                           (lambda: hvdcomp.GlobalRandKMaxNorm(ratio=0.5), (4, 4))])
@pytest.mark.parametrize("in_place", [False, True])
def test_gradients_are_means_and_kept_ones_never_change(make, storages, in_place):
    """Three steps of equal workers (one bucket): each step's gradients hold the mean and stay as they were
    through the later steps; without a copy only where the result is the optimizer's to keep."""
    compression = make()
    kept, values, raw, optimizer = _steps(compression, _TwoEqualWorkers(in_place))
    for step_kept, step_values in zip(kept, values):
        assert all(torch.equal(g, v) for g, v in zip(step_kept, step_values))  # later steps left them alone
    if isinstance(compression, hvdcomp.NoCompression):  # equal workers: the mean is each worker's gradient
        assert all(torch.equal(g, r) for g, r in zip(values[-1], raw[-1]))
    else:
        assert all(torch.allclose(g, r, rtol=0.02, atol=0.02 * r.abs().max().item())
                   for g, r in zip(values[-1], raw[-1]))
    held = {g.untyped_storage().data_ptr() for g in kept[-1]}
    buffer = optimizer._state.plan[0].flat(torch.float32).untyped_storage().data_ptr()
    assert len(optimizer._state.plan) == 1 and buffer not in held
    assert len(held) == storages[in_place]


@pytest.mark.parametrize("make,bucket_size_mb,bucket_mb", [
    (lambda: hvdcomp.QSGDMaxNorm(8), None, 8.0),  # the scale agreed ahead: its codec's 8 MiB
    (lambda: hvdcomp.QSGDMaxNorm(8, scale="exact"), None, 25.0),
    (hvdcomp.NoCompression, None, 25.0),
    (hvdcomp.FP16, None, 8.0),
    (lambda: hvdcomp.QSGDMaxNorm(8), 25.0, 25.0),  # the caller's size wins
])
def test_default_bucket_size_is_the_codecs(make, bucket_size_mb, bucket_mb):
    """Without ``bucket_size_mb`` the buckets are the codec's ``bucket_mb`` (else 25 MiB): 3M float32 gradients
    (11.4 MiB) make two buckets of 8 MiB, one of 25 MiB."""
    params = [torch.nn.Parameter(torch.zeros(1_000_000)) for _ in range(3)]
    sgd = torch.optim.SGD(params, lr=0.1)
    optimizer = hvdcomp.DistributedOptimizer(sgd, named_parameters=[(f"p{i}", p) for i, p in enumerate(params)],
                                             compression=make(), transport=_TwoEqualWorkers(),
                                             bucket_size_mb=bucket_size_mb)
    assert [len(bucket.params) for bucket in optimizer._state.plan] == ([2, 1] if bucket_mb == 8.0 else [3])
    optimizer.close()
