"""``Pieces``: a flat float32 vector held as the tensors it is made of, one after another (a bucket's gradients),
read in place by the native kernels.

To its codec a bucket is one flat vector, but a door holds its gradients apart. Copying them into a flat buffer
costs a read and a write of the whole bucket, about as much as the encode after it
(docs/benchmarks.md#the-gradients-read-where-they-lie). The kernels that read a bucket once (the scale-ahead encodes,
lanes and bit planes, with their statistics, and the clipped excess) take its pieces instead: each tile of a few
thousand values that one piece holds is read where it lies, one that spans pieces is gathered into a stack buffer.
An excess owed from earlier steps (``hvdcomp.codec.agreed``: a few values per clipped gradient) rides along as a
sparse addend (``plus``): the kernels add it to the tiles it falls in, which they gather. A codec that needs the flat
vector itself (an exact exchange, error feedback, rotation) ``fill``s it. A flat tensor is one piece.
"""

from __future__ import annotations

import copy
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
        self.added: tuple[torch.Tensor, torch.Tensor] | None = None  # (int64 places, ascending; float32 values)

    @classmethod
    def of(cls, values: torch.Tensor | Pieces) -> Pieces:
        """``values`` itself, or a flat tensor as one piece (checked as ``Pieces`` checks its tensors)."""
        return values if isinstance(values, Pieces) else cls([values])

    def plus(self, places: torch.Tensor, values: torch.Tensor) -> Pieces:
        """These pieces read as if ``values`` (float32 ``[k]``) were added (one float32 addition each, as
        ``Tensor.index_add_``) to the values at ``places`` (int64 ``[k]``, strictly ascending, within ``numel``);
        nothing is written. ``ValueError`` otherwise, or where an addend rides along already."""
        if self.added is not None:
            raise ValueError("these pieces carry an addend already")
        if not (places.dtype == torch.int64 and values.dtype == torch.float32 and places.dim() == values.dim() == 1
                and places.numel() == values.numel() and places.device.type == values.device.type == "cpu"):
            raise ValueError(f"an addend is int64 [k] places and float32 [k] values on the CPU, not {places.dtype} "
                             f"{tuple(places.shape)} and {values.dtype} {tuple(values.shape)}")
        if not ascending_within(places, self.numel):
            raise ValueError(f"an addend's places ascend strictly within the {self.numel} values")
        summed = copy.copy(self)
        summed.added = (places.contiguous(), values.contiguous())
        return summed

    def arguments(self) -> tuple[int, int, int, int, int, int, int]:
        """The kernels' first seven arguments: the pieces' addresses, their cumulative ends, their count and ``numel``,
        then the addend's places, values and count (valid while this object lives)."""
        places, values = self.added if self.added is not None else (None, None)
        return (self._pointers.data_ptr(), self._ends.data_ptr(), len(self.tensors), self.numel,
                0 if places is None else places.data_ptr(), 0 if values is None else values.data_ptr(),
                0 if places is None else places.numel())

    def fill(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` (``[numel]`` of a floating dtype; float32 where an addend rides along) <- the values, one after
        another (plus the addend), rounded to its dtype as ``Tensor.copy_`` rounds; returns ``flat``."""
        if flat.shape != (self.numel,) or not flat.dtype.is_floating_point or (
                self.added is not None and flat.dtype != torch.float32):
            raise ValueError(f"{self.numel} values fill a floating-point [{self.numel}] vector (float32 with an "
                             f"addend), not {flat.dtype} {tuple(flat.shape)}")
        if flat.dtype == torch.float32:
            if self.tensors:
                torch.cat(self.tensors, out=flat)
            return flat if self.added is None else flat.index_add_(0, *self.added)
        for tensor, part in zip(self.tensors, flat.split(self.lengths)):  # torch.cat rounds to another dtype slower
            part.copy_(tensor)
        return flat


def ascending_within(places: torch.Tensor, numel: int | None = None) -> bool:
    """Whether int64 ``places`` (``[k]``) ascend strictly from 0 on (and stay below ``numel``, where given): as an
    addend's places and a clipped excess's indices do."""
    if not places.numel():
        return True
    return int(places[0]) >= 0 and (numel is None or int(places[-1]) < numel) and bool((places[1:] > places[:-1]).all())


def checked_pieces(pieces: Pieces | None, flat: torch.Tensor, reads: bool) -> None:
    """``ValueError`` unless ``pieces`` is None, or goes to a codec that ``reads`` them and holds ``flat``'s count of
    values."""
    if pieces is not None and (not reads or pieces.numel != flat.numel()):
        raise ValueError(f"pieces of {pieces.numel} values go to a codec that reads them (reads_pieces: {reads}) "
                         f"exchanging as many ({flat.numel()})")


def as_vector(values: torch.Tensor | Pieces, flat: torch.Tensor) -> torch.Tensor:
    """``values`` as a flat tensor: itself, or its pieces filled into ``flat``."""
    return values.fill(flat) if isinstance(values, Pieces) else values
