"""One tensor's compressed exchange as a transport-free protocol.

``MaxNormScheme.exchange`` is a generator: it yields ``(op, tensor)`` requests — ``"max"`` or
``"sum"`` for an all-reduce across the workers, and finally ``"payload"``, the packed levels to be
summed — receives each reduced tensor back through ``send``, and returns the decoded mean gradient.
Any transport can drive it: ``simulate`` runs W workers in lockstep in one process (tests,
benchmarks), ``compression`` drives it over Horovod.
"""

from __future__ import annotations

import warnings
from collections.abc import Generator, Sequence

import torch

from .memory import ErrorFeedback
from .packing import INT64_WORD_BITS
from .quantize import MaxNormQuantizer
from .selection import RandomCoordinateSelector

Exchange = Generator[tuple[str, torch.Tensor], torch.Tensor, torch.Tensor]
REDUCE_OPS = ("max", "sum", "payload")


class MaxNormScheme:
    """Shared-scale quantization, optionally of shared random coordinates, with its state.

    Args:
        quantizer: the level math (resolutions, scale granularity).
        selector: shared random coordinates to send each step, or ``None`` to send all.
        error_feedback: with a selector, keep the coordinates not sent in a per-worker memory that is
            added to the next gradient (default: nothing is lost, every replica applies the same
            update). If ``False``, scale the sent mean by ``numel / k`` instead (unbiased).
    """

    def __init__(
        self,
        quantizer: MaxNormQuantizer,
        selector: RandomCoordinateSelector | None = None,
        error_feedback: bool = True,
    ) -> None:
        self.quantizer = quantizer
        self.selector = selector
        self.memory = ErrorFeedback() if selector is not None and error_feedback else None

    def config(self) -> tuple:
        """What every worker must share (part of the carrier tag)."""
        selector = self.selector
        selection = None if selector is None else (selector.k, selector.ratio, selector.seed)
        return (self.quantizer.bits, self.quantizer.chunk_size, selection, self.memory is not None)

    def exchange(
        self,
        grad: torch.Tensor,
        key: object,
        step: int,
        world_size: int,
        word_bits: int = INT64_WORD_BITS,
        generator: torch.Generator | None = None,
    ) -> Exchange:
        """Protocol for one flat float32 gradient; returns the float32 mean over the workers.

        ``key`` identifies the tensor across steps (error-feedback memory, coordinate sets); ``step``
        picks the coordinate set. If any worker's values hold NaN/Inf, every worker returns all-NaN
        (with a warning) and the memory is left unchanged.
        """
        quantizer = self.quantizer
        numel = grad.numel()
        indices = None
        values = grad
        residual = None
        if self.selector is not None and numel:
            indices = self.selector.indices(numel, key, step, grad.device)
            values = grad[indices]
            if self.memory is not None:
                residual = self.memory.residual(key, grad)
                values += residual[indices]

        stats = yield "max", quantizer.local_stats(values, source=grad if indices is not None else None)
        nonfinite = quantizer.saw_nonfinite(stats)
        if nonfinite:
            warnings.warn(
                f"hvdcomp: a worker's gradient {key!r} holds NaN/Inf at step {step}; every worker gets NaN for it",
                RuntimeWarning,
                stacklevel=2,
            )
            values = torch.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0)
        elif residual is not None:
            residual.add_(grad)
            residual[indices] = 0.0

        agreed = None
        if quantizer.multiscale:
            counts = yield "sum", quantizer.agreement_words(values, stats, world_size)
            agreed = quantizer.agreed_scales(counts, values.numel(), world_size)

        word_sums = yield "payload", quantizer.encode(values, stats, agreed, world_size, word_bits, generator)
        mean = quantizer.decode(word_sums, stats, agreed, values.numel(), world_size, word_bits)
        if indices is not None:
            if self.memory is None:
                mean.mul_(numel / indices.numel())
            mean = torch.zeros(numel, dtype=torch.float32, device=grad.device).index_copy_(0, indices, mean)
        if nonfinite:
            mean.fill_(float("nan"))
        return mean


def simulate(
    schemes: Sequence[MaxNormScheme],
    grads: Sequence[torch.Tensor],
    key: object = 0,
    step: int = 0,
    word_bits: int = INT64_WORD_BITS,
    generators: Sequence[torch.Generator] | None = None,
) -> list[torch.Tensor]:
    """Run one exchange for W = len(grads) workers in this process; returns each worker's result.

    ``schemes[i]`` is worker i's scheme object (its own memory); all must be configured alike.
    """
    if len(schemes) != len(grads):
        raise ValueError("one scheme per worker")
    world_size = len(grads)
    generators = generators if generators is not None else [None] * world_size
    protocols = [
        scheme.exchange(grad, key, step, world_size, word_bits, gen)
        for scheme, grad, gen in zip(schemes, grads, generators)
    ]
    requests = [next(protocol) for protocol in protocols]
    while True:
        ops = {op for op, _ in requests}
        if len(ops) != 1:
            raise RuntimeError(f"workers asked for different reductions: {ops}")
        op = ops.pop()
        stacked = torch.stack([tensor for _, tensor in requests])
        reduced = stacked.amax(dim=0) if op == "max" else stacked.sum(dim=0)
        results = []
        for protocol in protocols:
            try:
                results.append(protocol.send(reduced.clone()))
            except StopIteration as done:
                results.append(done)
        if all(isinstance(r, StopIteration) for r in results):
            return [r.value for r in results]
        requests = results
