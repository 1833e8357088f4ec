"""``Pieces``: a flat float32 vector held as the tensors it is made of, one after another (a bucket's gradients),
read in place by the native kernels.

To its codec a bucket is one flat vector, but a door holds its gradients apart. Copying them into a flat buffer
costs a read and a write of the whole bucket, about as much as the encode after it
(docs/benchmarks.md#the-gradients-read-where-they-lie). The kernels that read a bucket once (the scale-ahead encodes,
lanes and bit planes, with their statistics, and the clipped excess) take its pieces instead: each tile of a few
thousand values that one piece holds is read where it lies, one that spans pieces is gathered into a stack buffer.
A codec that needs the flat vector itself (an exact exchange, error feedback, rotation, an excess to add) ``fill``s
it. A flat tensor is one piece.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class Pieces:
    """``tensors`` (contiguous float32 CPU tensors of any shapes) as one flat vector of their ``numel`` values, in
    order; never written. ``ValueError`` for any other tensor."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        for tensor in tensors:
            if not (tensor.device.type == "cpu" and tensor.dtype == torch.float32 and tensor.is_contiguous()):
                raise ValueError(f"the kernels take each piece as a contiguous float32 CPU tensor, not {tensor.dtype} "
                                 f"on {tensor.device} (contiguous: {tensor.is_contiguous()})")
        self.tensors = [tensor.view(-1) for tensor in tensors]
        self.lengths = [tensor.numel() for tensor in self.tensors]
        lengths = torch.tensor([0] + self.lengths, dtype=torch.int64)
        self.numel = int(lengths.sum())
        # what the kernels read: each piece's address and its cumulative end (alive as long as this object)
        self._pointers = torch.tensor([tensor.data_ptr() for tensor in self.tensors], dtype=torch.int64)
        self._ends = lengths.cumsum(0)[1:].contiguous()

    @classmethod
    def of(cls, values: torch.Tensor | Pieces) -> Pieces:
        """``values`` itself, or a flat tensor as one piece (checked as ``Pieces`` checks its tensors)."""
        return values if isinstance(values, Pieces) else cls([values])

    def arguments(self) -> tuple[int, int, int, int]:
        """The kernels' first four arguments: the pieces' addresses, their cumulative ends, their count and ``numel``
        (valid while this object lives)."""
        return self._pointers.data_ptr(), self._ends.data_ptr(), len(self.tensors), self.numel

    def fill(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` (``[numel]`` of a floating dtype) <- the values, one after another, rounded to its dtype as
        ``Tensor.copy_`` rounds; returns ``flat``."""
        if flat.shape != (self.numel,) or not flat.dtype.is_floating_point:
            raise ValueError(f"{self.numel} values fill a floating-point [{self.numel}] vector, not {flat.dtype} "
                             f"{tuple(flat.shape)}")
        if flat.dtype == torch.float32:
            return torch.cat(self.tensors, out=flat) if self.tensors else flat
        for tensor, part in zip(self.tensors, flat.split(self.lengths)):  # torch.cat rounds to another dtype slower
            part.copy_(tensor)
        return flat


def checked_pieces(pieces: Pieces | None, flat: torch.Tensor, reads: bool) -> None:
    """``ValueError`` unless ``pieces`` is None, or goes to a codec that ``reads`` them and holds ``flat``'s count of
    values."""
    if pieces is not None and (not reads or pieces.numel != flat.numel()):
        raise ValueError(f"pieces of {pieces.numel} values go to a codec that reads them (reads_pieces: {reads}) "
                         f"exchanging as many ({flat.numel()})")


def as_vector(values: torch.Tensor | Pieces, flat: torch.Tensor) -> torch.Tensor:
    """``values`` as a flat tensor: itself, or its pieces filled into ``flat``."""
    return values.fill(flat) if isinstance(values, Pieces) else values
