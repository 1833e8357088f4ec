"""Element-wise bucket codecs: plain all-reduce, float16 and bfloat16, and the max-norm quantizer family.

Each is an ``ElementwiseCodec`` (see ``bucket``): one bucket's flat float32 vector in, its mean over
the workers out. ``MaxNormCodec`` is the all-reduce-compatible scheme of the paper: every worker
quantizes with the same scale and, optionally, the same random coordinates, so the levels are summed.
"""

from __future__ import annotations

import warnings
from abc import abstractmethod
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from ..codec.half import HalfBuffers, add_rounding_error, mean_from_half_sums, round_to_half, sum_rows_to_half
from ..codec.memory import ErrorFeedback
from ..codec.packing import INT64_WORD_BITS
from ..codec.pieces import Pieces, checked_pieces
from ..codec.quantize import MaxNormQuantizer
from ..codec.random import stream_words
from ..codec.recycle import ResultBuffers
from ..codec.rotation import HadamardRotation
from ..codec.selection import RandomCoordinateSelector
from ..codec.sparse import gather, keep_unsent, scatter
from ..codec.validate import check_bool
from .bucket import ElementwiseCodec, Segments
from .protocol import Exchange, Op, last
from .simulator import simulate


def warn_nonfinite(key: Hashable, step: int) -> None:
    """The warning every worker gives when some worker's values of ``key`` held NaN/Inf at ``step``."""
    warnings.warn(f"hvdcomp: a worker's gradient {key!r} holds NaN/Inf at step {step}; every worker gets NaN for it",
                  RuntimeWarning, stacklevel=3)


class NoCompression(ElementwiseCodec):
    """Plain all-reduce of the bucket (AllReduce-SGD): one ``Op.SUM`` of 32 bits per element, or 64 for float64
    gradients, which are summed in float64 as Horovod sums them."""

    takes_out = True

    def flat_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float64 if dtype == torch.float64 else torch.float32

    def exchange(self, flat: torch.Tensor, segments: Sequence[int], key: Hashable, step: int,
                 world_size: int, out: torch.Tensor | None = None) -> Exchange:
        """See ``ElementwiseCodec.exchange``: the mean goes into ``out`` where given; where ``out`` is ``flat`` itself,
        ``flat`` is summed in place (``Op.SUM_IN_PLACE``)."""
        in_place = out is not None and out.data_ptr() == flat.data_ptr()
        total = yield last(Op.SUM_IN_PLACE if in_place else Op.SUM, flat)
        return total.div_(world_size) if out is None else torch.div(total, world_size, out=out)

    @property
    def reuses_result(self) -> bool:
        """False: the result is the SUM's (``flat`` itself over a transport that sums in place)."""
        return False

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, None]:
        """Horovod's ``Compression.none`` for its stock optimizer: ``tensor`` as it is, no context."""
        return tensor, None

    def decompress(self, tensor: torch.Tensor, ctx: None) -> torch.Tensor:
        """The reduced ``tensor`` as it is."""
        return tensor


class HalfCodec(ElementwiseCodec):
    """A sum over the workers in a 16-bit float dtype (``half_dtype``), 16 bits per element on the wire: the
    exchange ``FP16`` and ``BF16`` share.

    Over a transport that sums ``half_dtype`` at the wire's rate (``sums_natively``, read from the transport by
    ``bind_transport``), one ``Op.SUM`` of the 16-bit bucket (the transport's rounding: a ring rounds each partial
    sum, the pieces round once). Otherwise a reduce-scatter and an all-gather: ``Op.ALLTOALL`` of the 16-bit bucket
    (padded to a multiple of W) gives each worker one chunk from every worker, which it sums at float32 and rounds
    to ``half_dtype`` once, then ``Op.ALLGATHER_EQUAL`` of the 16-bit chunk sums (one shape on every worker). The
    bytes of a ring all-reduce. Either way every worker gets the same sums; the mean is float32 (the doors write it
    into gradients of any floating dtype).

    With ``error_feedback`` each worker keeps what rounding to ``half_dtype`` lost and adds it next step. Values
    beyond its range become Inf; a step whose sum holds NaN/Inf (the same on every worker; ``torch.amp.GradScaler``
    then skips it) leaves the memory as it was.

    The math is ``hvdcomp.codec.half``'s (one fused pass each for the chunk sum, the mean with its NaN/Inf
    check, and the memory's update), into buffers kept per bucket. The mean is the caller's to keep: a buffer
    of ``ResultBuffers``, handed out again only once nothing refers to it.
    """

    half_dtype: torch.dtype
    takes_out = True
    # Small buckets keep the first bucket's rounding and the last one's mean short, outside the wire's time
    # (docs/benchmarks.md); within one of DDP's buckets a rounding copy is too short to overlap anything, and fewer
    # collectives win (docs/benchmarks.md#ddps-own-buckets-for-the-16-bit-codecs).
    bucket_mb = 8.0
    splits_deliveries = False

    def __init__(self, error_feedback: bool = False) -> None:
        self.memory = ErrorFeedback() if error_feedback else None
        self.reads_pieces = self.memory is None  # rounded where they lie; the memory's update reads the vector
        self.sums_natively = False  # whether the transport sums half_dtype at the wire's rate (bind_transport)
        self._buffers: dict[Hashable, HalfBuffers] = {}  # per bucket, reused every step
        self.results = ResultBuffers()  # per bucket, the mean's

    @abstractmethod
    def transport_sums(self, transport: Any) -> bool:
        """Whether ``transport`` (a ``protocol.Transport``) sums ``half_dtype`` at the wire's rate."""

    def bind_transport(self, transport: Any) -> None:
        super().bind_transport(transport)
        self.sums_natively = self.transport_sums(transport)

    def config(self) -> tuple:
        """What every worker must share: whether rounding errors are fed back."""
        return (self.memory is not None,)

    def _buffers_for(self, key: Hashable, numel: int, world_size: int, device: torch.device) -> HalfBuffers:
        chunked = not self.sums_natively  # the all-to-all sends W equal parts
        buffers = self._buffers.get(key)
        if buffers is None or not buffers.fits(numel, world_size, chunked, device, self.half_dtype):
            buffers = self._buffers[key] = HalfBuffers(numel, world_size, chunked, device, self.half_dtype)
        return buffers

    def exchange(self, flat: torch.Tensor, segments: Sequence[int], key: Hashable, step: int,
                 world_size: int, out: torch.Tensor | None = None, pieces: Pieces | None = None) -> Exchange:
        """See ``ElementwiseCodec.exchange``: the mean goes into ``out`` where given, unless rounding errors are
        fed back (their update reads ``flat`` after the mean); ``pieces`` (without error feedback,
        ``reads_pieces``): the values, rounded into the 16-bit buffer from where they lie."""
        checked_pieces(pieces, flat, self.reads_pieces)
        buffers = self._buffers_for(key, flat.numel(), world_size, flat.device)
        half = buffers.send[:flat.numel()]
        residual = None if self.memory is None else self.memory.residual(key, flat)
        if pieces is None:
            round_to_half(flat, residual, out=half)
        else:
            pieces.fill(half)  # rounded as round_to_half rounds without a residual
        if self.sums_natively:  # the send buffer is scratch once sent, but for the memory's update
            total = yield last(Op.SUM if residual is not None else Op.SUM_IN_PLACE, buffers.send)
        else:
            received = yield Op.ALLTOALL, buffers.send  # [W * chunk]: my chunk of every worker's, by rank
            sum_rows_to_half(received.view(world_size, -1), out=buffers.chunk_sum)
            total = yield Op.ALLGATHER_EQUAL, buffers.chunk_sum
        if out is not None and residual is None:
            mean = out
        else:
            mean = self.results.take(key, flat.numel(), torch.float32, flat.device)
        finite = mean_from_half_sums(total[:flat.numel()], world_size, mean, check_finite=residual is not None)
        if residual is not None and finite:  # what rounding lost
            add_rounding_error(residual, flat, half)
        return mean

    @property
    def reuses_result(self) -> bool:
        """False: the mean is a ``ResultBuffers`` buffer, never rewritten while the caller refers to it."""
        return False

    def state_dict(self) -> dict[str, Any]:
        return {} if self.memory is None else self.memory.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.memory is not None:
            self.memory.load_state_dict(state)


class FP16(HalfCodec):
    """Float16 sum over the workers (Horovod's fp16 compression; ``HalfCodec``'s exchange), 16 bits per element.

    The transports that sum float16 at the wire's rate (``Transport.sums_float16``): torch.distributed's Gloo and
    NCCL, as DDP's ``fp16_compress_hook`` uses them, and ``HorovodTransport`` where Horovod's Gloo has the F16C/AVX
    sum; elsewhere (MPI, Horovod as released) the all-to-all and all-gather. Values beyond float16's range become
    Inf, as with Horovod's own fp16 compression.
    """

    half_dtype = torch.float16

    def transport_sums(self, transport: Any) -> bool:
        return transport.sums_float16

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        """Horovod's ``Compression.fp16`` for its stock optimizer: a floating-point ``tensor`` cast to float16 (others
        as they are), and its dtype as the context. Error feedback needs the bucket exchange: ``TypeError``."""
        if self.memory is not None:
            raise TypeError("FP16(error_feedback=True) needs whole buckets: use hvdcomp.DistributedOptimizer or "
                            "hvdcomp.ddp, or FP16() in Horovod's optimizer")
        return (tensor.to(torch.float16) if tensor.dtype.is_floating_point else tensor), tensor.dtype

    def decompress(self, tensor: torch.Tensor, ctx: torch.dtype) -> torch.Tensor:
        """The reduced float16 ``tensor`` back in its dtype ``ctx``."""
        return tensor.to(ctx) if ctx.is_floating_point else tensor


class BF16(HalfCodec):
    """Bfloat16 sum over the workers (``HalfCodec``'s exchange), 16 bits per element: float32's range with 8
    significant bits, so no gradient overflows where float32 would not.

    The sum runs where ``FP16``'s does. Over torch.distributed (``Transport.sums_bfloat16``: Gloo and NCCL sum
    bfloat16) one ``Op.SUM`` of the bfloat16 bucket, what DDP's ``bf16_compress_hook`` sends, so the DDP door costs
    what its peer costs (a ring rounds each partial sum to bfloat16). Horovod 0.28 has no bfloat16 tensors and
    MPI no bfloat16 datatype: there the all-to-all and all-gather route, whose transports carry bfloat16 as 16-bit
    words (``HorovodTransport`` and ``MPITransport`` view it as int16) and whose chunk sums run at float32, rounded
    to bfloat16 once. Either way 16 bits per element cross the wire.

    Horovod's own ``hvd.DistributedOptimizer`` cannot send bfloat16: ``compress`` raises ``TypeError``.
    """

    half_dtype = torch.bfloat16

    def transport_sums(self, transport: Any) -> bool:
        return transport.sums_bfloat16

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        """``TypeError``: Horovod 0.28 all-reduces no bfloat16 tensors; ``BF16`` runs in hvdcomp's doors."""
        raise TypeError("BF16() needs hvdcomp's bucket exchange (Horovod has no bfloat16 all-reduce): use "
                        "hvdcomp.DistributedOptimizer or hvdcomp.ddp")


class MaxNormCodec(ElementwiseCodec):
    """Shared-scale quantization, optionally of shared random coordinates, with its state.

    Requests: ``Op.MAX`` of the per-tensor (or per-chunk) scales and a NaN/Inf flag; for several
    resolutions an ``Op.SUM`` of packed agreement bits; ``Op.PAYLOAD`` of the packed levels.

    Args:
        quantizer: the level math (resolutions, scale granularity).
        selector: shared random coordinates to send each step, or ``None`` to send all.
        error_feedback: with a selector, keep the coordinates not sent in a per-worker memory that is
            added to the next gradient (default: nothing is lost, every replica applies the same
            update). If ``False``, scale each tensor's sent mean by its ``numel / k`` instead (unbiased).
        seed: with the rank (``bind_rank``), the bucket key and the step, keys this worker's rounding
            stream (``hvdcomp.codec.random``: counter-based, stateless), so rounding is independent across
            workers, tensors and steps, and a replay of (key, step) draws the same bits in any order; part
            of the configuration every worker must share.
        rotate: quantize the values rotated by a randomized Hadamard transform shared by every worker
            (``hvdcomp.codec.rotation``, keyed by ``seed``, the bucket key and the step, in the blocks of each scale
            group) and rotate the decoded mean back: the scale is the rotated maximum (docs/rotation.md).
    """

    def __init__(self, quantizer: MaxNormQuantizer, selector: RandomCoordinateSelector | None = None,
                 error_feedback: bool = True, seed: int = 0, rotate: bool = False) -> None:
        self.quantizer = quantizer
        self.selector = selector
        self.memory = ErrorFeedback() if selector is not None and error_feedback else None
        self.seed = seed
        self.rotation = HadamardRotation(seed) if check_bool("rotate", rotate) else None
        self.rank: int | None = None
        self._results: dict[Hashable, torch.Tensor] = {}  # with a selector: per key, the mean's buffer
        self.buffers = ResultBuffers()  # per key, without a selector: the decode's mean

    @property
    def reuses_result(self) -> bool:
        """Whether a result is this codec's buffer, overwritten by its next exchange of the same key (with a
        selector: the sparse mean is scattered into it, not into a new zero-filled bucket each step)."""
        return self.selector is not None

    def bind_rank(self, rank: int) -> None:
        self.rank = rank

    def rounding_stream(self, key: Hashable, step: int, device: torch.device) -> torch.Tensor:
        """This worker's rounding stream for bucket ``key`` at ``step``: int64 ``[4]`` stream words."""
        if self.rank is None:
            raise RuntimeError("MaxNormCodec: bind_rank(rank) must be called before the first exchange")
        return stream_words(step, self.seed, "rounding", self.rank, key, device=device)

    def config(self) -> tuple:
        """What every worker must share (part of the carrier tag)."""
        selector = self.selector
        selection = None if selector is None else (selector.k, selector.ratio, selector.seed)
        config = (self.quantizer.bits, self.quantizer.chunk_size, selection, self.memory is not None)
        return config if self.rotation is None else (*config, "rotate")

    def exchange(self, flat: torch.Tensor, segments: Sequence[int], key: Hashable, step: int, world_size: int,
                 word_bits: int = INT64_WORD_BITS) -> Exchange:
        """See ``ElementwiseCodec.exchange``; ``word_bits`` are the usable bits of a payload word
        (fewer for float carriers). ``key`` also keys the error-feedback memory. If any worker's values
        hold NaN/Inf, every worker returns all-NaN (with a warning) and the memory is left unchanged.

        With a selector, ``k`` (or ``ratio``) counts coordinates per tensor: tensor ``(key, i)`` of
        ``Segments.of(segments, key)`` sends its own set, chosen over the whole tensor, so that a shard
        sends the chosen coordinates that fall in it; a tensor smaller than ``k`` is sent whole. The result is then
        a buffer of this codec (``reuses_result``), valid until its next exchange of ``key``."""
        layout = Segments.of(segments, key)
        if sum(layout) != flat.numel():
            raise ValueError(f"segments {list(layout)[:8]}... do not split the {flat.numel()} elements of flat")
        return self._exchange(flat, layout, key, step, world_size, word_bits)

    def _selection(self, layout: Segments, step: int, device: torch.device) -> tuple[torch.Tensor, list[int],
                                                                                       torch.Tensor | None]:
        """The coordinates of ``flat`` to send (sorted int64 on ``device``), how many fall in each piece of
        ``layout``, and without error feedback per coordinate its tensor's ``numel / k`` (float32)."""
        selector = self.selector
        parts, counts, factors, offset = [], [], [], 0
        for index, first, length in layout.pieces():
            numel = layout.sizes[index]
            chosen = selector.indices(numel, (layout.key, index), step)  # sorted, over the whole tensor
            if length < numel:  # this piece holds [first, first + length) of the tensor
                lo, hi = torch.searchsorted(chosen, torch.tensor([first, first + length])).tolist()
                chosen = chosen[lo:hi]
            parts.append(chosen + (offset - first))
            counts.append(chosen.numel())
            factors.append(numel / selector.count(numel))
            offset += length
        indices = torch.cat(parts).to(device)
        if self.memory is not None:
            return indices, counts, None
        factor = torch.tensor(factors).repeat_interleave(torch.tensor(counts), output_size=indices.numel())
        return indices, counts, factor.to(device)

    def _result_buffer(self, key: Hashable, like: torch.Tensor) -> torch.Tensor:
        """The float32 buffer of ``like``'s size and device that ``key``'s sparse means are scattered into."""
        result = self._results.get(key)
        if result is None or result.numel() != like.numel() or result.device != like.device:
            result = self._results[key] = torch.empty(like.numel(), dtype=torch.float32, device=like.device)
        return result

    def _exchange(self, flat: torch.Tensor, layout: Segments, key: Hashable, step: int, world_size: int,
                  word_bits: int) -> Exchange:
        quantizer = self.quantizer
        numel = flat.numel()
        rng = self.rounding_stream(key, step, flat.device)
        indices = factor = residual = finite = None
        values = flat
        segments: Sequence[int] = layout
        if self.selector is not None and numel:
            indices, segments, factor = self._selection(layout, step, flat.device)
            residual = None if self.memory is None else self.memory.residual(key, flat)
            values, finite = gather(flat, indices, residual)  # the NaN/Inf flag covers all of flat
        groups = quantizer.scale_groups(values.numel(), segments)
        if self.rotation is not None:
            values = self.rotation.forward(values, groups, key, step)

        scale_stats = yield Op.MAX, quantizer.local_stats(values, groups, finite)
        nonfinite = quantizer.saw_nonfinite(scale_stats)
        if nonfinite:
            warn_nonfinite(key, step)
            values = torch.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0)
        elif residual is not None:
            keep_unsent(residual, flat, indices)

        agreed = None
        if quantizer.multiscale:
            counts = yield Op.SUM, quantizer.agreement_words(values, scale_stats, groups, world_size)
            agreed = quantizer.agreed_resolutions(counts, values.numel(), world_size)

        word_sums = yield last(Op.PAYLOAD, quantizer.encode(values, scale_stats, groups, agreed, world_size, word_bits,
                                                            rng))
        mean = quantizer.decode(word_sums, scale_stats, groups, agreed, values.numel(), world_size, word_bits,
                                self.buffers if indices is None else None, key)
        if self.rotation is not None and not nonfinite:
            mean = self.rotation.inverse_(mean, groups, key, step)
        if indices is not None:
            mean = scatter(mean, indices, self._result_buffer(key, flat), factor)  # factor: None with error feedback
        if nonfinite:
            mean.fill_(float("nan"))
        return mean

    def state_dict(self) -> dict[str, Any]:
        """Error-feedback memory and the rank (the rounding streams are stateless)."""
        return {"memory": None if self.memory is None else self.memory.state_dict(), "rank": self.rank}

    def check_state(self, state: Any) -> None:
        """``ValueError`` unless ``state`` is a ``state_dict()`` of a codec with this one's error feedback."""
        if not isinstance(state, dict) or set(state) != {"memory", "rank"}:
            raise ValueError(f"not a MaxNormCodec state: {state!r:.200}")
        if (state["memory"] is None) != (self.memory is None):
            raise ValueError("the saved state and this codec disagree on error feedback")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        if self.memory is not None:
            self.memory.load_state_dict(state["memory"])
        if self.rank is None and state["rank"] is not None:
            self.bind_rank(state["rank"])
        elif state["rank"] is not None and state["rank"] != self.rank:
            warnings.warn(f"hvdcomp: loading rank {state['rank']}'s codec state on rank {self.rank}: its "
                          "error-feedback memories are that rank's; each worker should load its own", RuntimeWarning,
                          stacklevel=2)


def simulate_max_norm(
    codecs: Sequence[MaxNormCodec],
    grads: Sequence[torch.Tensor],
    key: Hashable = 0,
    step: int = 0,
    word_bits: int = INT64_WORD_BITS,
) -> list[torch.Tensor]:
    """One exchange of W = len(grads) flat gradients (one tensor each) in this process; ``codecs[i]``
    is worker i's (bound to rank i), all configured alike. Returns each worker's result."""
    if len(codecs) != len(grads):
        raise ValueError("one codec per worker")
    for rank, codec in enumerate(codecs):
        codec.bind_rank(rank)
    return simulate([codec.exchange(grad, [grad.numel()], key, step, len(grads), word_bits)
                     for codec, grad in zip(codecs, grads)])
