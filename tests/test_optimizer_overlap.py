"""``hvdcomp.DistributedOptimizer.synchronize()`` over a transport that matches collectives by name: a bucket
encodes while an earlier bucket's payload is on the wire; over a blocking transport buckets finish in order."""

import pytest
import torch

import hvdcomp
from hvdcomp.exchange.protocol import Op, Transport


class _Handle:
    def __init__(self, name, result):
        self.name, self.result, self.done = name, result, True


class _TwoWorkerWire(Transport):
    """Two workers that hold the same gradients (SUM doubles, MAX returns the tensor). Nothing arrives
    during backward (``arrived`` False: a slow link); then bucket 0's payload stays on the wire until bucket
    1's payload has been sent, as when bucket 1's encode overlaps it; waiting for it earlier is the
    serialization that overlapping removes (an error here)."""

    size, rank, local_size, local_rank, cross_size, cross_rank, equal_nodes = 2, 0, 2, 0, 1, 0, True

    def __init__(self, blocking):
        self.blocking = blocking
        self.started = []
        self.held = None
        self.arrived = False

    def start(self, op, tensor, name=None):
        self.started.append(name)
        handle = _Handle(name, tensor.clone() if op.reduction.name == "MAX" else tensor * 2)
        if op is Op.PAYLOAD and ".bucket0." in name:
            handle.done, self.held = False, handle
        if op is Op.PAYLOAD and ".bucket1." in name and self.held is not None:
            self.held.done = True
        return handle

    def poll(self, handle):
        return self.arrived and handle.done

    def wait(self, handle):
        if not handle.done:
            raise TimeoutError(f"waited for {handle.name} before bucket 1 was encoded and sent")
        return handle.result

    def collective(self, op, tensor):
        return self.wait(self.start(op, tensor))


def _step(transport):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer = hvdcomp.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                             compression=hvdcomp.QSGDMaxNorm(8), transport=transport,
                                             bucket_size_mb=64 * 65 * 4 / 2**20)  # one bucket per layer
    assert len(optimizer._state.plan) == 2
    model(torch.randn(8, 64)).square().sum().backward()
    transport.arrived = True
    optimizer.synchronize()
    return model


def test_a_later_bucket_encodes_while_an_earlier_payload_is_on_the_wire():
    transport = _TwoWorkerWire(blocking=False)
    model = _step(transport)
    payloads = [name for name in transport.started if name.endswith("payload")]
    assert [".bucket0." in payloads[0], ".bucket1." in payloads[1]] == [True, True]
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_a_blocking_transport_finishes_buckets_in_order():
    with pytest.raises(TimeoutError, match="before bucket 1"):
        _step(_TwoWorkerWire(blocking=True))
