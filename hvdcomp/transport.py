"""Blocking Horovod collectives over one process set (the transport the compressors need)."""

from __future__ import annotations

import horovod.torch as hvd
import torch


class HorovodCollectives:
    """MAX and SUM all-reduce over ``process_set`` (default: all workers). Requires ``hvd.init()``."""

    def __init__(self, process_set: hvd.ProcessSet | None = None) -> None:
        self.process_set = process_set if process_set is not None else hvd.global_process_set

    @property
    def size(self) -> int:
        return self.process_set.size()

    @property
    def rank(self) -> int:
        return hvd.rank()

    def max(self, tensor: torch.Tensor) -> torch.Tensor:
        return hvd.allreduce(tensor, op=hvd.Max, process_set=self.process_set)

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return hvd.allreduce(tensor, op=hvd.Sum, process_set=self.process_set)
