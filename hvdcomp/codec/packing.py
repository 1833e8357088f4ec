"""Bit packing: summable lanes (``LaneLayout``), plain bit planes (``bits_to_bytes``) and plainly packed
integers (``pack_planes``).

**Summable lanes.**

Each of W workers holds small integers ``v`` (one per element) in ``[-offset, span - offset]``.
They are stored offset-binary (``v + offset`` in ``[0, span]``) in lanes of
``lane_width = bit_length(span * W)`` bits, ``lanes_per_word = word_bits // lane_width`` lanes per
64-bit word. Because every lane can hold the sum of W lane values without carrying into its
neighbour, and the word's top bits stay clear, **the integer sum of the workers' words equals the
packed lane-wise sums** — in any reduction order, partial (ring) sums included. ``unpack`` recovers
the exact sums of ``v`` over the workers.

``word_bits`` is 63 for int64 words summed as integers (the sign bit stays clear, so no partial sum
overflows) and fewer for words carried as float64 values (see ``carrier.word_bits``).

Values fill words in one of two orders: consecutive values share a word (``pack_lanes``, ``LaneLayout``),
or, for Birder's bits and QSGD's levels, the **blocked order** of ``pack_lane_blocks``, in which consecutive
values sit in the same lane of consecutive words (faster fused kernels). Packer and decoder must use the same
order.

**Bit planes.** ``bits_to_bytes`` packs 0/1 values 8 per uint8 byte (least significant bit first) for
collectives that concatenate rather than sum (all-gathers); ``bytes_to_bits`` undoes it.

**Plain integers.** ``pack_planes`` stores non-negative ``width``-bit integers as ``width`` bit planes
(plane ``k`` holds bit ``k`` of every value, 8 values per byte): exactly ``width`` bits per value plus
at most 7 bits of padding per plane, whatever the number of workers. Such bytes cannot be summed;
they travel by all-to-all or all-gather (``hvdcomp.exchange.two_stage``). ``unpack_planes`` undoes it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .fused import FusedKernel, static

INT64_WORD_BITS = 63
WORD_STORAGE_BITS = 64
_BIT_SHIFTS = torch.arange(8, dtype=torch.uint8)
_BYTE_BITS = torch.arange(256).unsqueeze(1).bitwise_right_shift(torch.arange(8)).bitwise_and_(1).to(torch.int32)


@dataclass(frozen=True)
class LaneLayout:
    """How W workers' values in ``[-offset, span - offset]`` share int64 words.

    Attributes:
        span: each worker's offset value ``v + offset`` lies in ``[0, span]``; ``span >= 1``.
        world_size: number of workers whose words are summed, ``W >= 1``.
        word_bits: usable low bits of each word (63 for int64 Sum, fewer for float64 carriers).
        offset: added to each value before packing (``s`` for signed levels in ``[-s, s]``).
    """

    span: int
    world_size: int
    word_bits: int = INT64_WORD_BITS
    offset: int = 0

    def __post_init__(self) -> None:
        if self.span < 1:
            raise ValueError(f"span must be >= 1, got {self.span}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 1 <= self.word_bits <= INT64_WORD_BITS:
            raise ValueError(f"word_bits must be in [1, {INT64_WORD_BITS}], got {self.word_bits}")
        if not 0 <= self.offset <= self.span:
            raise ValueError(f"offset must be in [0, span={self.span}], got {self.offset}")
        if self.lane_width > self.word_bits:
            raise ValueError(
                f"a lane for span {self.span} summed over {self.world_size} workers needs "
                f"{self.lane_width} bits, more than the {self.word_bits} usable bits of a word"
            )

    @classmethod
    @functools.cache  # one immutable layout per argument tuple: codec calls ask per tensor
    def for_levels(cls, s: int, world_size: int, word_bits: int = INT64_WORD_BITS) -> LaneLayout:
        """Layout for signed levels in ``[-s, s]`` (stored as ``level + s`` in ``[0, 2s]``)."""
        return cls(span=2 * s, world_size=world_size, word_bits=word_bits, offset=s)

    @property
    def lane_width(self) -> int:
        """Bits per lane: ``ceil(log2(span * W + 1))``, enough for the largest possible sum."""
        return (self.span * self.world_size).bit_length()

    @property
    def lanes_per_word(self) -> int:
        return self.word_bits // self.lane_width

    @property
    def bits_per_element(self) -> float:
        """Wire bits per element (64-bit words; ignores the padding of the last word)."""
        return WORD_STORAGE_BITS / self.lanes_per_word

    def num_words(self, numel: int) -> int:
        return -(-numel // self.lanes_per_word)

    @property
    def lane_mask(self) -> int:
        return (1 << self.lane_width) - 1

    def lane_shifts(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """int64 ``[lanes_per_word]``: the shift of each lane in its word, its size static for fused kernels.
        One tensor per (lanes, width, device), made once: read-only (the stock path asks per tensor)."""
        return _lane_shifts(self.lanes_per_word, self.lane_width, torch.device(device))

    def pack(self, values: torch.Tensor, validate: bool = True) -> torch.Tensor:
        """Pack one worker's integer ``values`` (any integer dtype, 1-D) into int64 words (a fused kernel).

        Returns an int64 tensor of ``num_words(values.numel())`` words. With ``validate`` it raises
        ``ValueError`` for values outside ``[-offset, span - offset]``.
        """
        if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
            raise TypeError(f"pack expects an integer tensor, got {values.dtype}")
        flat = values.reshape(-1)
        if validate and flat.numel():
            lo, hi = torch.aminmax(flat)
            if lo.item() < -self.offset or hi.item() > self.span - self.offset:
                raise ValueError(
                    f"values in [{lo.item()}, {hi.item()}] outside the layout's "
                    f"[{-self.offset}, {self.span - self.offset}]"
                )
        return _pack_words(flat, self.lane_shifts(flat.device), self.offset)

    def check_words(self, word_sums: torch.Tensor, numel: int) -> None:
        """Raise unless ``word_sums`` is 1-D int64 with ``num_words(numel)`` words."""
        if word_sums.dtype != torch.int64 or word_sums.dim() != 1:
            raise TypeError(f"unpack expects 1-D int64 words, got {word_sums.dtype} {tuple(word_sums.shape)}")
        if word_sums.numel() != self.num_words(numel):
            raise ValueError(f"{word_sums.numel()} words cannot hold {numel} elements of this layout")

    def unpack(self, word_sums: torch.Tensor, numel: int) -> torch.Tensor:
        """Sums of the W workers' values (int64, length ``numel``) from the summed int64 words (a fused kernel)."""
        self.check_words(word_sums, numel)
        return _unpack_sums(word_sums, self.lane_shifts(word_sums.device), self.lane_mask, numel,
                            self.offset * self.world_size)


@functools.cache
def _lane_shifts(lanes: int, width: int, device: torch.device) -> torch.Tensor:
    return static(torch.arange(lanes, device=device, dtype=torch.int64) * width)


def pack_lanes(lanes: torch.Tensor, shifts: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """int64 words ``[ceil(n / L)]`` from integer lane values ``[n]`` plus ``offset`` (non-negative then),
    ``L = len(shifts)`` per word: word ``w`` is the sum over ``l`` of ``(lanes[w L + l] + offset) << shifts[l]``
    (missing lanes of the last word are 0). Pure tensor ops, one int64 buffer (fused kernels build on it).

    Two formulations of the same integers: eagerly one shift and one sum over the lane dimension of the
    zero-padded lanes (fewest ops); under ``torch.compile`` the whole words as an unrolled sum of the ``L``
    lane columns (``shifts`` is static there) plus the last, partial word apart, which Inductor turns into
    a vectorized loop over words without a bounds check per lane, faster than a reduction
    (docs/benchmarks.md#kernel-level-measurements)."""
    per_word, numel = shifts.numel(), lanes.numel()
    words = (numel + per_word - 1) // per_word
    if not torch.compiler.is_compiling():
        padded = torch.zeros(words * per_word, dtype=torch.int64, device=lanes.device)
        padded[:numel] = lanes
        if offset:
            padded[:numel] += offset
        return padded.view(words, per_word).bitwise_left_shift_(shifts).sum(dim=1)
    full = numel // per_word
    grid = lanes[: full * per_word].view(full, per_word).to(torch.int64) + offset
    total = grid[:, 0] << shifts[0]
    for lane in range(1, per_word):
        total = total + (grid[:, lane] << shifts[lane])
    index = full * per_word + torch.arange(per_word, device=lanes.device)  # the partial word's lanes (static size)
    last = torch.where(index < numel, lanes[index.clamp(max=numel - 1)].to(torch.int64) + offset, 0)
    return torch.cat([total, (last << shifts).sum().reshape(1)])[:words]


def word_lanes(words: torch.Tensor, shifts: torch.Tensor, mask: int | torch.Tensor) -> torch.Tensor:
    """int64 ``[len(words), len(shifts)]``: every lane of every word."""
    return words.unsqueeze(1).bitwise_right_shift(shifts).bitwise_and_(mask)


LANE_BLOCK_WORDS = 16  # words whose lanes interleave in the blocked word order (below)
DECODE_BLOCK_WORDS = 1 << 16  # words per call of a blocked-order decoder (``in_word_blocks``)


def lane_block_values(lanes: int) -> int:
    """Values in one block of ``LANE_BLOCK_WORDS`` words of ``lanes`` lanes each (the blocked order)."""
    return lanes * LANE_BLOCK_WORDS


def lane_block_words(numel: int, lanes: int) -> int:
    """Words that hold ``numel`` values of ``lanes`` lanes per word in the blocked order: whole blocks."""
    return -(-numel // lane_block_values(lanes)) * LANE_BLOCK_WORDS


def pack_lane_blocks(lanes: torch.Tensor, shifts: torch.Tensor) -> torch.Tensor:
    """int64 words ``[n / L]`` of integer lane values ``[n]`` (``n`` a multiple of ``L B``; ``L = len(shifts)``,
    ``B = LANE_BLOCK_WORDS``) in the **blocked order**: lane ``l`` of word ``B k + j`` holds value ``L B k + B l + j``,
    shifted by ``shifts[l]``. Summable as ``pack_lanes``' words are; only the order of the values differs.

    Every lane of ``B`` consecutive words then comes from ``B`` consecutive values, so a fused kernel reads
    and writes whole vectors (docs/benchmarks.md#kernel-level-measurements). Eagerly one shift and one sum over
    the lanes; compiled an unrolled sum (``shifts`` static)."""
    grid = lanes.view(-1, shifts.numel(), LANE_BLOCK_WORDS).to(torch.int64)
    if not torch.compiler.is_compiling():
        return grid.bitwise_left_shift(shifts.view(1, -1, 1)).sum(dim=1).view(-1)
    total = grid[:, 0] << shifts[0]
    for lane in range(1, shifts.numel()):
        total = total + (grid[:, lane] << shifts[lane])
    return total.view(-1)


def in_lane_blocks(numel: int, shifts: torch.Tensor, pack_whole: Callable[[int, torch.Tensor], object],
                   tail_lanes: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """int64 ``[lane_block_words(numel, L)]``: ``numel`` lane values in the blocked order (``pack_lane_blocks``).
    ``pack_whole(end, out)`` writes the words of the values ``[0, end)``, the whole blocks, into ``out`` (a fused
    kernel; ``out`` is the start of the result, no copy); ``tail_lanes(end)`` gives the values ``[end, numel)``,
    packed here after zeros pad them to one block."""
    lanes = shifts.numel()
    per_block = lane_block_values(lanes)
    whole = numel // per_block * per_block
    words = torch.empty(lane_block_words(numel, lanes), dtype=torch.int64, device=shifts.device)
    if whole:
        pack_whole(whole, words[: whole // lanes])
    if whole < numel:
        tail = torch.zeros(per_block, dtype=torch.int64, device=shifts.device)
        tail[: numel - whole] = tail_lanes(whole)
        words[whole // lanes:] = pack_lane_blocks(tail, shifts)
    return words


LaneMap = Callable[[torch.Tensor, "int | slice"], torch.Tensor]


def map_lane_blocks(words: torch.Tensor, shifts: torch.Tensor, mask: int | torch.Tensor, fn: LaneMap) -> torch.Tensor:
    """``[len(words) * L]`` in value order: ``fn(values, lanes)`` of every lane of words in the blocked order
    (``pack_lane_blocks``; whole blocks). ``values`` are int64 lane values ``[blocks, lanes, B]`` and ``lanes``
    says which: eagerly all at once (``slice(None)``), compiled one lane at a time (``[blocks, B]``, ``lanes``
    its index; a vectorized loop each), stacked. ``fn`` is elementwise, so both give the same values. Birder
    runs such kernels per ``DECODE_BLOCK_WORDS`` words (``in_word_blocks``), so their output stays in cache."""
    blocks = words.view(-1, 1, LANE_BLOCK_WORDS)
    if not torch.compiler.is_compiling():
        return fn(blocks.bitwise_right_shift(shifts.view(1, -1, 1)).bitwise_and_(mask), slice(None)).view(-1)
    lanes = [fn((blocks[:, 0] >> shifts[lane]) & mask, lane) for lane in range(shifts.numel())]
    return torch.stack(lanes, dim=1).view(-1)


def in_word_blocks(num_words: int, lanes: int, run: Callable[[slice, slice], object]) -> None:
    """``run(words, values)`` for consecutive blocks of at most ``DECODE_BLOCK_WORDS`` words: the slices of the
    block's words and of their ``lanes`` values each."""
    for lo in range(0, num_words, DECODE_BLOCK_WORDS):
        hi = min(lo + DECODE_BLOCK_WORDS, num_words)
        run(slice(lo, hi), slice(lo * lanes, hi * lanes))


def _unpack_sums_eager(word_sums: torch.Tensor, shifts: torch.Tensor, mask: int, numel: int,
                       offset: int) -> torch.Tensor:
    """int64 ``[numel]``: the lanes of ``word_sums`` minus ``offset`` (the W workers' offsets)."""
    return word_lanes(word_sums, shifts, mask).view(-1)[:numel].sub_(offset)


_pack_words = FusedKernel(pack_lanes)
_unpack_sums = FusedKernel(_unpack_sums_eager)


def as_uint8(bits: torch.Tensor) -> torch.Tensor:
    """A bool tensor viewed as uint8 0/1 (no copy); other dtypes unchanged."""
    return bits.view(torch.uint8) if bits.dtype == torch.bool else bits


def bits_to_bytes(bits: torch.Tensor) -> torch.Tensor:
    """bool (or 0/1 integer) ``[..., n]`` -> uint8 ``[..., ceil(n / 8)]`` along the last dimension, least
    significant bit first (a 0-d tensor counts as ``[1]``)."""
    bits = bits.reshape(1) if bits.dim() == 0 else bits
    numel = bits.shape[-1]
    nbytes = -(-numel // 8)
    padded = torch.zeros(*bits.shape[:-1], nbytes * 8, dtype=torch.uint8, device=bits.device)
    padded[..., :numel] = bits
    shifts = _BIT_SHIFTS.to(bits.device)
    return padded.view(*bits.shape[:-1], nbytes, 8).bitwise_left_shift_(shifts).sum(dim=-1, dtype=torch.uint8)


def bytes_to_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of ``bits_to_bytes`` along the last dimension: uint8 ``[..., nbytes]`` -> bool ``[..., numel]``."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"bytes_to_bits expects uint8, got {packed.dtype}")
    if packed.shape[-1] * 8 < numel:
        raise ValueError(f"{packed.shape[-1]} bytes cannot hold {numel} bits")
    shifts = _BIT_SHIFTS.to(packed.device)
    bits = packed.unsqueeze(-1).bitwise_right_shift(shifts).bitwise_and_(1)
    return bits.flatten(-2)[..., :numel].bool()


def plane_bytes(numel: int, width: int) -> int:
    """Bytes ``pack_planes`` uses for ``numel`` values of ``width`` bits: ``width * ceil(numel / 8)``."""
    return width * -(-numel // 8)


def pack_planes(values: torch.Tensor, width: int) -> torch.Tensor:
    """Integers in ``[0, 2**width)`` (any integer dtype, ``[..., n]``) -> uint8 ``[..., plane_bytes(n, width)]``:
    bit plane ``k`` (bit ``k`` of each value, as ``bits_to_bytes`` packs it) at bytes
    ``[k * ceil(n / 8), (k + 1) * ceil(n / 8))``. Values are not checked; their higher bits are dropped."""
    nbytes = -(-values.shape[-1] // 8)
    out = torch.empty(*values.shape[:-1], width, nbytes, dtype=torch.uint8, device=values.device)
    for k in range(width):  # one vectorized pass per bit plane
        out[..., k, :] = bits_to_bytes(values.bitwise_right_shift(k).bitwise_and_(1).to(torch.uint8))
    return out.flatten(-2)


def unpack_planes(packed: torch.Tensor, width: int, numel: int) -> torch.Tensor:
    """Inverse of ``pack_planes``: uint8 ``[..., plane_bytes(numel, width)]`` -> int64 ``[..., numel]``."""
    nbytes = -(-numel // 8)
    if packed.shape[-1] != width * nbytes:
        raise ValueError(f"{packed.shape[-1]} bytes are not {width} planes of {numel} values")
    planes = packed.view(*packed.shape[:-1], width, nbytes)
    table = _BYTE_BITS.to(packed.device)
    values = torch.zeros(*packed.shape[:-1], nbytes, 8, dtype=torch.int32, device=packed.device)
    for k in range(width):  # each byte of plane k gives bit k of 8 values
        values.add_(table[planes[..., k, :].long()].bitwise_left_shift_(k))
    return values.flatten(-2)[..., :numel].long()
