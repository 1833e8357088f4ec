"""Horovod ``Compressor`` objects for the max-norm quantizer family.

Pass one to the stock optimizer, e.g.
``hvd.DistributedOptimizer(opt, named_parameters=..., compression=QSGDMaxNorm(8))``. For each gradient,
``compress`` runs the shared-scale exchange (one blocking MAX all-reduce of a few floats; for the
multi-scale variants also a blocking SUM of the packed agreement bits) and returns a float64 carrier
of the packed levels (see ``carrier``), which Horovod then reduces with the optimizer's op (Sum or
Average, predivide factor allowed). ``decompress`` returns what that op makes of the workers'
dequantized gradients — their mean (Average) or sum (Sum) — identical on every worker, in the
gradient's shape and dtype.

Gradients are identified by their order within a step (a step ends when Horovod starts
decompressing), so every worker must produce its gradients in the same order, as Horovod's own
unnamed collectives also require; a disagreement raises ``CarrierMismatchError``.
If any worker's gradient holds NaN/Inf, every worker gets an all-NaN result for that tensor (as an
uncompressed all-reduce would; ``torch.amp.GradScaler`` then skips the step) and a warning.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import horovod.torch as hvd
import torch
from horovod.torch.compression import Compressor

from . import carrier
from .protocol import Exchange, MaxNormScheme
from .quantize import MaxNormQuantizer
from .selection import RandomCoordinateSelector, stable_seed
from .transport import HorovodTransport


@dataclass
class _Context:
    exchange: Exchange
    shape: torch.Size
    dtype: torch.dtype
    world_size: int
    tag: int


def _flat_float(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise TypeError("hvdcomp compressors need dense gradients; sparse gradients are not supported")
    if not tensor.dtype.is_floating_point:
        raise TypeError(f"hvdcomp compressors quantize floating-point gradients, got {tensor.dtype}")
    return tensor.detach().reshape(-1).float()


class MaxNormCompressor(Compressor):
    """A ``MaxNormScheme`` as a Horovod compressor (see the module docstring).

    Args:
        scheme: quantizer, optional shared coordinate selection, error-feedback memory.
        seed: seeds the per-worker rounding generator (with the rank, so rounding stays independent
            across workers) and is part of the configuration every worker must share.
        process_set: the Horovod process set the optimizer reduces over (default: all workers).

    ``wire_bytes`` / ``uncompressed_bytes`` count what this worker sent (scales, agreement bits,
    carrier) and what the gradients would have taken uncompressed.
    """

    def __init__(self, scheme: MaxNormScheme, seed: int = 0, process_set: hvd.ProcessSet | None = None) -> None:
        self.scheme = scheme
        self.seed = seed
        self.transport = HorovodTransport(process_set)
        self._generators: dict[torch.device, torch.Generator] = {}
        self._step = 0
        self._index_in_step = 0
        self._decompressed = False
        self.wire_bytes = 0
        self.uncompressed_bytes = 0

    def rounding_generator(self, device: torch.device) -> torch.Generator:
        """This worker's rounding generator on ``device``, seeded by (seed, rank): independent across workers."""
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(stable_seed(self.seed, "rounding", self.transport.rank))
            self._generators[device] = generator
        return generator

    def _next_key(self) -> tuple[int, int]:
        if self._decompressed:
            self._step += 1
            self._index_in_step = 0
            self._decompressed = False
        key = (self._step, self._index_in_step)
        self._index_in_step += 1
        return key

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue exactly: memory, generators, step counters."""
        memory = self.scheme.memory
        return {
            "memory": None if memory is None else memory.state_dict(),
            "generators": {str(device): gen.get_state() for device, gen in self._generators.items()},
            "step": self._step,
            "index_in_step": self._index_in_step,
            "decompressed": self._decompressed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["memory"] is None) != (self.scheme.memory is None):
            raise ValueError("the saved state and this compressor disagree on error feedback")
        if self.scheme.memory is not None:
            self.scheme.memory.load_state_dict(state["memory"])
        for device, gen_state in state["generators"].items():
            self.rounding_generator(torch.device(device)).set_state(gen_state)
        self._step, self._index_in_step = state["step"], state["index_in_step"]
        self._decompressed = state["decompressed"]

    @property
    def compression_ratio(self) -> float:
        """Uncompressed bytes over bytes this worker sent, since construction."""
        return self.uncompressed_bytes / self.wire_bytes if self.wire_bytes else float("nan")

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, _Context]:
        flat = _flat_float(tensor)
        step, index = self._next_key()
        world_size = self.transport.size
        exchange = self.scheme.exchange(flat, index, step, world_size, carrier.word_bits(world_size),
                                        self.rounding_generator(flat.device))
        op, request = next(exchange)
        while op != "payload":
            self.wire_bytes += request.numel() * request.element_size()
            op, request = exchange.send(self.transport.collective(op, request))
        tag = carrier.to_tag(stable_seed(type(self).__name__, self.scheme.config(), self.seed, world_size,
                                         flat.numel(), step, index))
        payload = carrier.wrap(request, world_size, tag)
        self.wire_bytes += payload.numel() * payload.element_size()
        self.uncompressed_bytes += tensor.numel() * tensor.element_size()
        return payload, _Context(exchange, tensor.shape, tensor.dtype, world_size, tag)

    def decompress(self, tensor: torch.Tensor, ctx: _Context) -> torch.Tensor:
        """The mean of the workers' dequantized gradients if Horovod averaged, their sum if it summed."""
        self._decompressed = True
        word_sums, averaged = carrier.unwrap(tensor, ctx.world_size, ctx.tag)
        try:
            ctx.exchange.send(word_sums)
        except StopIteration as done:
            mean = done.value if averaged else done.value.mul_(ctx.world_size)
            return mean.view(ctx.shape).to(ctx.dtype)
        raise RuntimeError("the exchange protocol did not finish after its payload")


class QSGDMaxNorm(MaxNormCompressor):
    """QSGD with a shared max-norm scale: ``s = 2**bits - 1`` levels per sign, unbiased stochastic rounding.

    Scale ``M`` = max over workers of ``max|g|`` (per tensor, or per ``chunk_size`` elements). Each
    element's decoded value is unbiased with variance at most ``(M / s)**2 / 4``; the mean over ``W``
    workers has variance at most ``(M / s)**2 / (4 W)``. ``bits`` in [1, 16].
    """

    def __init__(self, bits: int = 8, chunk_size: int | None = None, seed: int = 0,
                 process_set: hvd.ProcessSet | None = None) -> None:
        super().__init__(MaxNormScheme(MaxNormQuantizer((bits,), chunk_size)), seed, process_set)


class QSGDMaxNormMultiScale(MaxNormCompressor):
    """QSGD max-norm at several resolutions ``bits=(b_1 < b_2 < ...)``, sent in ``b_1``'s range.

    Per element, the finest resolution ``s_j`` with ``|g| / M * s_j <= s_1`` on *every* worker (agreed
    through a SUM of packed 0/1 lanes, counted in ``wire_bytes``). Unbiased; variance per element at
    most ``(M / s_j)**2 / 4`` for the agreed ``j``.
    """

    def __init__(self, bits: Sequence[int] = (4, 8), chunk_size: int | None = None, seed: int = 0,
                 process_set: hvd.ProcessSet | None = None) -> None:
        super().__init__(MaxNormScheme(MaxNormQuantizer(bits, chunk_size)), seed, process_set)


class GlobalRandKMaxNorm(MaxNormCompressor):
    """QSGD max-norm on ``k`` (or ``ratio * numel``) coordinates shared by all workers each step.

    The coordinate set comes from a dedicated generator seeded by (seed, tensor, step), never the
    global RNG. Coordinates not sent stay in a per-worker error-feedback memory (default), so nothing
    is lost and every replica applies the same update; with ``error_feedback=False`` the sent mean is
    scaled by ``numel / k`` instead (unbiased). The scale ``M`` covers the sent values only.
    """

    def __init__(self, k: int | None = None, ratio: float | None = None, bits: int = 8,
                 error_feedback: bool = True, chunk_size: int | None = None, seed: int = 0,
                 process_set: hvd.ProcessSet | None = None) -> None:
        selector = RandomCoordinateSelector(k, ratio, seed)
        super().__init__(MaxNormScheme(MaxNormQuantizer((bits,), chunk_size), selector, error_feedback), seed,
                         process_set)


class GlobalRandKMaxNormMultiScale(MaxNormCompressor):
    """``GlobalRandKMaxNorm`` whose shared coordinates are quantized multi-scale (``bits=(b_1 < b_2 < ...)``)."""

    def __init__(self, k: int | None = None, ratio: float | None = None, bits: Sequence[int] = (4, 8),
                 error_feedback: bool = True, chunk_size: int | None = None, seed: int = 0,
                 process_set: hvd.ProcessSet | None = None) -> None:
        selector = RandomCoordinateSelector(k, ratio, seed)
        super().__init__(MaxNormScheme(MaxNormQuantizer(bits, chunk_size), selector, error_feedback), seed,
                         process_set)
