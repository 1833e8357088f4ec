"""Transports for single-process tests."""

from hvdcomp.exchange import Reduction, Transport


class EchoTransport(Transport):
    """``size`` workers that all sent what this one sends, on one node: SUM multiplies by the size, MAX and the
    rest return it; blocking (collectives complete in ``start``). ``ops`` logs every request."""

    rank, local_rank, cross_size, cross_rank = 0, 0, 1, 0
    equal_nodes = blocking = True

    def __init__(self, size=3):
        self.size = self.local_size = size
        self.ops = []

    def collective(self, op, tensor):
        self.ops.append(op)
        return tensor * self.size if op.reduction is Reduction.SUM else tensor.clone()

    def start(self, op, tensor, name=None):
        return self.collective(op, tensor)

    def poll(self, handle):
        return True

    def wait(self, handle):
        return handle
