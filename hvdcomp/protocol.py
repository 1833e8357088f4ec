"""Compressed exchanges as transport-free protocols, and a one-process simulator.

An *exchange* is a generator run identically on every worker: it yields ``(op, tensor)`` requests,
receives each collective's result through ``send``, and returns its result (e.g. the averaged
gradient). Any transport can drive it — ``simulate`` runs W workers in lockstep in one process
(tests, benchmarks); ``compression`` drives it over Horovod's stock optimizer. The requests:

========================  =====================================================================
``"max"`` / ``"sum"``     element-wise all-reduce over all workers
``"payload"``             ``"sum"`` of the packed words that carry the result; a transport may move
                          them differently (the stock-Horovod path wraps them in a float carrier)
``"local_sum"``           sum over the workers of this node (``"local_max"``: max)
``"cross_sum"``           sum over the workers with this worker's local rank, one per node
                          (``"cross_max"``: max)
``"local_allgather"``     concatenation along dim 0 over this node's workers, by local rank
``"cross_allgather"``     concatenation along dim 0 over the workers with this local rank, by node
========================  =====================================================================

Workers are laid out node by node: rank ``r`` is local rank ``r % local_size`` of node
``r // local_size`` (as horovodrun places them).
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
FLAT_OPS = ("max", "sum", "payload")
GROUP_OPS = tuple(f"{scope}_{op}" for scope in ("local", "cross") for op in ("sum", "max", "allgather"))


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
        segments: Sequence[int] | None = None,
    ) -> Exchange:
        """Protocol for one flat float32 gradient; returns the float32 mean over the workers.

        ``key`` identifies the tensor across steps (error-feedback memory, coordinate sets); ``step``
        picks the coordinate set; ``segments`` (sizes of the tensors concatenated in ``grad``, default
        one) gives each tensor its own scale. If any worker's values hold NaN/Inf, every worker returns
        all-NaN (with a warning) and the memory is left unchanged.
        """
        quantizer = self.quantizer
        numel = grad.numel()
        segments = [numel] if segments is None else list(segments)
        indices = None
        values = grad
        residual = None
        if self.selector is not None and numel:
            indices = self.selector.indices(numel, key, step, grad.device)
            values = grad[indices]
            if self.memory is not None:
                residual = self.memory.residual(key, grad)
                values += residual[indices]
            ends = torch.tensor(segments, device=indices.device).cumsum(0)
            segments = torch.bincount(torch.searchsorted(ends, indices, right=True), minlength=len(segments)).tolist()
        groups = quantizer.scale_groups(values.numel(), segments)

        stats = yield "max", quantizer.local_stats(values, groups, source=grad if indices is not None else None)
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
            counts = yield "sum", quantizer.agreement_words(values, stats, groups, world_size)
            agreed = quantizer.agreed_scales(counts, values.numel(), world_size)

        word_sums = yield "payload", quantizer.encode(values, stats, groups, agreed, world_size, word_bits, generator)
        mean = quantizer.decode(word_sums, stats, groups, agreed, values.numel(), world_size, word_bits)
        if indices is not None:
            if self.memory is None:
                mean.mul_(numel / indices.numel())
            mean = torch.zeros(numel, dtype=torch.float32, device=grad.device).index_copy_(0, indices, mean)
        if nonfinite:
            mean.fill_(float("nan"))
        return mean


def simulate_schemes(
    schemes: Sequence[MaxNormScheme],
    grads: Sequence[torch.Tensor],
    key: object = 0,
    step: int = 0,
    word_bits: int = INT64_WORD_BITS,
    generators: Sequence[torch.Generator | None] | None = None,
) -> list[torch.Tensor]:
    """One ``MaxNormScheme`` exchange for W = len(grads) workers; ``schemes[i]`` is worker i's
    (its own memory), all configured alike. Returns each worker's result."""
    if len(schemes) != len(grads):
        raise ValueError("one scheme per worker")
    generators = generators if generators is not None else [None] * len(grads)
    return simulate([
        scheme.exchange(grad, key, step, len(grads), word_bits, gen)
        for scheme, grad, gen in zip(schemes, grads, generators)
    ])


def _group_of(op: str, rank: int, local_size: int) -> int:
    if op in FLAT_OPS:
        return 0
    return rank // local_size if op.startswith("local") else rank % local_size


def _collective(op: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    if op.endswith("max"):
        return torch.stack(tensors).amax(dim=0)
    if op.endswith("allgather"):
        return torch.cat(tensors)
    return torch.stack(tensors).sum(dim=0)


def simulate(exchanges: Sequence[Exchange], local_size: int | None = None) -> list[object]:
    """Drive one exchange per worker in lockstep; returns each worker's result.

    ``local_size`` workers per node (default: all on one node); it must divide the worker count.
    """
    world_size = len(exchanges)
    local_size = local_size or world_size
    if world_size % local_size:
        raise ValueError(f"{world_size} workers do not fill nodes of {local_size}")
    requests: list[object] = []
    for exchange in exchanges:
        try:
            requests.append(next(exchange))
        except StopIteration as done:
            requests.append(done)
    while True:
        if all(isinstance(r, StopIteration) for r in requests):
            return [r.value for r in requests]
        if any(isinstance(r, StopIteration) for r in requests):
            raise RuntimeError("some workers finished their exchange while others still communicate")
        ops = {op for op, _ in requests}
        if len(ops) != 1:
            raise RuntimeError(f"workers asked for different collectives: {sorted(ops)}")
        op = ops.pop()
        if op not in FLAT_OPS + GROUP_OPS:
            raise ValueError(f"unknown collective {op!r}")
        groups: dict[int, list[int]] = {}
        for rank in range(world_size):
            groups.setdefault(_group_of(op, rank, local_size), []).append(rank)
        reduced = {}
        for members in groups.values():
            result = _collective(op, [requests[rank][1] for rank in members])
            reduced.update({rank: result for rank in members})
        requests = []
        for rank, exchange in enumerate(exchanges):
            try:
                requests.append(exchange.send(reduced[rank].clone()))
            except StopIteration as done:
                requests.append(done)
