"""Uncompressed warm-up, as DeepSpeed's ``freeze_step`` and PyTorch's ``start_powerSGD_iter`` offer.

For its first ``warmup_steps`` steps an entry point exchanges the exact float32 mean (``NoCompression``,
over the same route: flat, or hierarchical) and never calls the codec: its memories, rounding
generators, coordinate steps and PowerSGD's Qs stay as they were, and the statistics show the step
uncompressed (as many bytes sent as ``uncompressed_bytes``). Compression starts at step ``warmup_steps``
as it would have started at step 0 of a run without warm-up (step-keyed choices, such as coordinate
sets, follow the exchange step, which counts warm-up steps).

``send_uncompressed`` also sends the stock compressors' gradients below their ``min_compress_numel``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..exchange.protocol import Op, Topology
from ..exchange.stats import Statistics


@dataclass
class UncompressedContext:
    """A stock-path gradient sent uncompressed (warm-up, or smaller than ``min_compress_numel``): Horovod
    reduces it as it is (float32)."""

    dtype: torch.dtype

    def decompress(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.dtype)


def send_uncompressed(tensor: torch.Tensor, stats: Statistics,
                      topology: Topology) -> tuple[torch.Tensor, UncompressedContext]:
    """What a stock-path compressor returns for a gradient it does not compress (during warm-up, or one smaller
    than its ``min_compress_numel``): the float32 gradient (counted as sent and as uncompressed) and its
    context; Horovod then reduces it with the optimizer's op, as with ``hvd.Compression.none``."""
    flat = tensor.float()
    for traffic in (stats.last_step, stats.total):
        traffic.count(Op.SUM, flat, topology)
        traffic.uncompressed_bytes += tensor.numel() * tensor.element_size()
    return flat, UncompressedContext(tensor.dtype)
