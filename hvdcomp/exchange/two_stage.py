"""The two-stage exchange of max-norm levels: constant bits per element at any world size.

Summable lanes (``MaxNormCodec``) need ``bit_length(2 s W)`` bits per element, which grows with the
``W`` workers. The two-stage exchange sends plain ``bits + 1``-bit levels (``codec.packing.pack_planes``)
twice instead, whatever ``W`` is:

1. every worker quantizes its values with the shared scale ``M`` (``Op.MAX``, per tensor or chunk, as
   ``MaxNormCodec``) to levels ``q_i`` in ``[-s, s]``, ``s = 2**bits - 1``, and cuts them into ``W``
   chunks of ``ceil(n / W)`` elements (``hierarchy.shard_bounds``);
2. ``Op.ALLTOALL`` sends chunk ``j`` (its index in a 4-byte header) to worker ``j``;
3. the owner of chunk ``j`` sums the ``W`` workers' levels exactly, ``t = sum_i q_i / (W s)`` in
   ``[-1, 1]`` (the mean in units of each element's ``M``), and re-quantizes it unbiasedly with its
   own chunk scale ``m = max |t|``: levels ``r = sign(t) floor(|t| s / m + U)``;
4. ``Op.ALLGATHER`` of every chunk's ``r`` with ``m`` (float32, in the header): every worker decodes
   ``r m / s * M``, bitwise the same everywhere.

Per worker that is ``(W - 1) / W`` of the plain payload twice: about ``2 (bits + 1)`` bits per element
on the wire (``cost.exchange_cost``), against ``2 bit_length(2 s W)`` for ring-summed lanes.

**Statistics.** Both quantizations are unbiased (``U`` uniform on (0, 1), up to ``2**-17`` of a level, drawn
from the worker's counter-based rounding streams), so the result is: ``E[result] = mean_i x_i``. Per element
with scale ``M``, stage 1 contributes at most ``(M / s)**2 / (4 W)`` (``W`` independent roundings of variance at most
``(M / s)**2 / 4``, averaged) and stage 2 at most ``(m M / s)**2 / 4 <= (M / s)**2 / 4``:

    Var[result] <= (M / s)**2 (1 + 1 / W) / 4        (lanes: (M / s)**2 / (4 W))

so the constant wire cost is paid in variance (up to ``W + 1`` times the lanes', less where the chunk
means are smaller than ``M``: ``m < 1``).

**The scale agreed ahead** (``scale="ahead"``, ``QSGDMaxNorm``'s default; ``hvdcomp.exchange.ahead``): with the scale
every worker agreed at the bucket's previous exchange, step 1 needs no MAX round: each worker quantizes at once
(an element above ``M`` as ``sign(x) M``, its excess kept for the next step, ``hvdcomp.codec.agreed``) and appends its
``local_stats`` (float32 ``[G + 1]``) to every row of the all-to-all, so each owner receives every worker's and all
take their maximum alike: the next exchange's scale. A bucket without an agreed scale (its first exchange, a new
size, the step after a NaN/Inf) runs the exact exchange above, whose MAX seeds it; a NaN/Inf on any worker gives
all-NaN with a warning, and the next exchange is exact. Not with error feedback or rotation (``ValueError``).

**Rotation** (``inner``'s ``rotate``): stage 1 quantizes the rotated values (``hvdcomp.codec.rotation``) and every
worker rotates the gathered result back; the bound holds with the rotated ``M``. It takes no error feedback: the
chunk owners' memories would hold one step's rotated values.
**Error feedback** (``error_feedback=True``, both stages): each worker adds what its stage-1 rounding
lost last time to its values before the shared scale (the memory of ``key``), and each chunk owner
adds what its re-quantization lost (in value units) to its chunk's mean before choosing ``m`` (the
memory of ``(key, "owner")``). Non-finite steps leave both untouched.

``TwoStageMaxNorm`` is the bucket codec: per bucket it runs the lanes (its ``MaxNormCodec``) or this
exchange, as ``exchange`` says. ``"auto"`` times both on the job's first steps and keeps the faster (its
``trial``, ``hvdcomp.exchange.route``: the runner times the steps and reaches the verdict; the scale agreed ahead
serves both), since whether the bytes saved pay for the second codec pass depends on the link and the cores
(docs/benchmarks.md#the-exchange-measured). With error feedback, whose memories one exchange would leave behind,
``"auto"`` takes ``cost.choose_exchange``'s pick from the bucket's size, the bits, ``W`` and ``workers_per_node``.
Inside a hierarchical exchange its ``WORLD`` ops become ``CROSS`` ones: the node-level variant.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch

from ..codec import native, native_planes
from ..codec.agreed import AgreedScales
from ..codec.memory import ErrorFeedback
from ..codec.packing import pack_planes, plane_bytes, unpack_planes
from ..codec.pieces import Pieces, as_vector, checked_pieces
from ..codec.quantize import MaxNormQuantizer, stochastic_levels
from ..codec.validate import check_bool, check_int
from .ahead import AheadMaxNorm
from .bucket import ElementwiseCodec, Segments
from .cost import EXCHANGES, TWO_STAGE_HEADER_BYTES, choose_exchange, plain_width
from .elementwise import MaxNormCodec, warn_nonfinite
from .hierarchy import shard_length
from .protocol import Exchange, Op, last
from .route import RouteTrial

_TINY = torch.finfo(torch.float32).tiny  # the smallest chunk scale divided by
# timed steps of each exchange in ``"auto"``'s trial: more than a route trial's, since the two are often within a few
# per cent of each other and single steps spike by a fifth (docs/benchmarks.md#the-exchange-measured)
EXCHANGE_TRIAL_ROUNDS = 5


def stage_one_rows(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` (uint8 ``[W, row]``, the stage-one message) with each row's header written (row ``j``: ``j`` as
    int32), the rest left for the bit planes; returns ``rows``."""
    world_size = rows.shape[0]
    indices = torch.arange(world_size, dtype=torch.int32, device=rows.device)
    rows[:, :TWO_STAGE_HEADER_BYTES] = indices.view(torch.uint8).view(world_size, -1)
    return rows


def stage_one_message(levels: torch.Tensor, quantizer: MaxNormQuantizer, world_size: int) -> torch.Tensor:
    """uint8 ``[W, row]``: this worker's levels (int64 ``[n]`` in ``[-s, s]``) cut into ``W`` chunks, chunk
    ``j`` as row ``j``: its index (int32) then its levels offset to ``[0, 2 s]`` in bit planes."""
    s, width = quantizer.coarse_levels, plain_width(quantizer.bits[0])
    chunk = shard_length(levels.numel(), world_size)
    padded = torch.full((world_size * chunk,), s, dtype=torch.int32, device=levels.device)
    padded[: levels.numel()] += levels.to(torch.int32)
    rows = stage_one_rows(torch.empty(world_size, TWO_STAGE_HEADER_BYTES + plane_bytes(chunk, width),
                                      dtype=torch.uint8, device=levels.device))
    rows[:, TWO_STAGE_HEADER_BYTES:] = pack_planes(padded.view(world_size, chunk), width)
    return rows


def stage_two_message(levels: torch.Tensor, scale: torch.Tensor, quantizer: MaxNormQuantizer) -> torch.Tensor:
    """uint8 ``[row]``: the owner's chunk scale (float32 ``[1]``) then its re-quantized levels (int64 ``[chunk]``
    in ``[-s, s]``) offset to ``[0, 2 s]`` in bit planes."""
    offset = levels + quantizer.coarse_levels
    return torch.cat([scale.to(torch.float32).view(torch.uint8), pack_planes(offset, plain_width(quantizer.bits[0]))])


class TwoStageMaxNorm(ElementwiseCodec):
    """Max-norm levels exchanged by lanes or in two stages, per bucket (see the module docstring).

    Args:
        inner: the ``MaxNormCodec`` of the scheme (one resolution, no coordinate selection for the two-stage
            exchange); its quantizer, seed and rounding streams serve both exchanges.
        exchange: ``"auto"`` (the faster of both on the first steps, ``trial``; with error feedback
            ``cost.choose_exchange`` per bucket), ``"lanes"`` or ``"two_stage"``.
        error_feedback: keep what each stage's rounding lost (worker- and chunk-owner-side) for the next step.
        workers_per_node: workers sharing a node's uplink within one exchange (1 in hierarchical mode, where
            each group spans one worker per node); only ``"auto"`` reads it.
        scale: ``"exact"`` (a MAX round before each payload) or ``"ahead"`` (the scale agreed at the bucket's previous
            exchange, for both exchanges: the lanes of ``AheadMaxNorm``; see the module docstring).
    """

    def __init__(self, inner: MaxNormCodec, exchange: str = "auto", error_feedback: bool = False,
                 workers_per_node: int = 1, scale: str = "exact") -> None:
        if exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
        self.supports_two_stage = not inner.quantizer.multiscale and inner.selector is None
        if exchange == "two_stage" and not self.supports_two_stage:
            raise ValueError("exchange='two_stage' needs a single-resolution max-norm codec without coordinate "
                             "selection (QSGDMaxNorm); use 'lanes' or 'auto' for the others")
        if error_feedback and inner.rotation is not None:
            raise ValueError("a rotated two-stage exchange keeps no error feedback: the chunk owners' memories would "
                             "hold values rotated by a step's rotation; pass error_feedback=False or rotate=False")
        if scale not in ("exact", "ahead"):
            raise ValueError(f"scale must be 'exact' or 'ahead', got {scale!r}")
        if scale == "ahead" and (error_feedback or inner.rotation is not None):
            raise ValueError("a two-stage exchange with the scale agreed ahead takes no error feedback and no "
                             "rotation: pass scale='exact' (QSGDMaxNorm(..., scale='exact')) for them")
        self.inner = inner
        self.mode = exchange
        self.memory = ErrorFeedback() if check_bool("error_feedback", error_feedback) else None
        self.workers_per_node = check_int("workers_per_node", workers_per_node, 1)
        self.ahead = AheadMaxNorm(inner) if scale == "ahead" else None  # its lanes, and the agreed scales of both
        if self.ahead is not None:
            self.bucket_mb = self.ahead.bucket_mb
        self.reads_pieces = self.ahead is not None  # the encodes of an agreed scale read them in place
        # the lanes first, then the two-stage exchange
        self.trial = RouteTrial(EXCHANGE_TRIAL_ROUNDS) if self._tried else None

    @property
    def reuses_result(self) -> bool:
        """``inner``'s (False without a selector): the two-stage exchange, like the lanes, decodes into a new tensor
        each time, or into a buffer nothing else refers to any more (``hvdcomp.codec.recycle``), so the door keeps the
        means without a copy."""
        return self.inner.reuses_result

    def config(self) -> tuple:
        """What every worker must share: ``inner``'s configuration (bits, scale chunks, seed, rotation) and whether
        both stages feed back their errors (the exchange mode is the doors' own setting)."""
        return (*self.inner.config(), self.memory is not None) + (() if self.ahead is None else ("ahead",))

    def bind_rank(self, rank: int) -> None:
        self.inner.bind_rank(rank)

    def bind_transport(self, transport: Any) -> None:
        super().bind_transport(transport)
        if self.ahead is not None:
            self.ahead.bind_transport(transport)

    @property
    def _tried(self) -> bool:
        """Whether ``"auto"`` is decided by timing both exchanges (see the module docstring)."""
        return self.mode == "auto" and self.supports_two_stage and self.memory is None

    def choose(self, numel: int, world_size: int) -> str:
        """``"lanes"`` or ``"two_stage"`` for a bucket of ``numel`` elements over ``world_size`` workers: the mode,
        else the trial's route of this step, else (error feedback) the cost model's pick."""
        if self.mode != "auto":
            return self.mode
        if not self.supports_two_stage or world_size == 1:
            return "lanes"
        if self.trial is not None:
            return "two_stage" if self.trial.second else "lanes"
        return choose_exchange(numel, self.inner.quantizer.bits[0], world_size, self.workers_per_node)

    def exchange(self, flat: torch.Tensor, segments: Sequence[int], key: Hashable, step: int, world_size: int,
                 pieces: Pieces | None = None) -> Exchange:
        """See ``ElementwiseCodec.exchange`` (``pieces`` with the scale agreed ahead: ``reads_pieces``); every worker
        chooses alike (from sizes every worker shares)."""
        checked_pieces(pieces, flat, self.reads_pieces)
        if self.choose(flat.numel(), world_size) == "lanes":
            if self.ahead is None:
                return self.inner.exchange(flat, segments, key, step, world_size)
            return self.ahead.exchange(flat, segments, key, step, world_size, pieces=pieces)
        layout = Segments.of(segments, key)
        if sum(layout) != flat.numel():
            raise ValueError(f"segments {list(layout)[:8]}... do not split the {flat.numel()} elements of flat")
        return self._two_stage(flat, layout, key, step, world_size, pieces)

    def _two_stage(self, flat: torch.Tensor, layout: Segments, key: Hashable, step: int, world_size: int,
                   pieces: Pieces | None) -> Exchange:
        quantizer = self.inner.quantizer
        s, width, numel = quantizer.coarse_levels, plain_width(quantizer.bits[0]), flat.numel()
        chunk = shard_length(numel, world_size)
        rounding = self.inner.rounding_stream(key, step, flat.device)
        agreed = None if self.ahead is None else self.ahead.memory  # (then no error feedback, no rotation)
        residual = None if self.memory is None else self.memory.residual(key, flat)
        values = agreed.with_excess(key, flat, pieces) if agreed is not None else flat if residual is None else (
            flat + residual)
        groups = quantizer.scale_groups(numel, layout)
        if self.inner.rotation is not None:
            values = self.inner.rotation.forward(values, groups, key, step)
        # the native kernels compute what the eager steps below compute, without their level-sized temporaries
        kernels = residual is None and numel > 0 and native.usable(flat)

        scale_stats = None if agreed is None else agreed.scales(key, numel, world_size, groups.numel())
        if scale_stats is None or not kernels:  # pieces only to the kernels of an agreed scale
            values = as_vector(values, flat)
        local = None
        if scale_stats is None:  # 1. the shared scale
            scale_stats = yield Op.MAX, quantizer.local_stats(values, groups)
            nonfinite = quantizer.saw_nonfinite(scale_stats)
            if agreed is not None and agreed.agree(key, numel, world_size, scale_stats):
                agreed.keep_excess(key, None)  # this exchange sends it
            if nonfinite:
                warn_nonfinite(key, step)
        else:  # agreed ahead: this worker's statistics ride in stage one (the others' arrive with it); the kernels
            # find them in their encode's pass
            local = torch.zeros(groups.numel() + 1) if kernels else quantizer.local_stats(values, groups)
            nonfinite = quantizer.saw_nonfinite(local)
        if nonfinite:
            values = torch.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0)
        extra = 0 if local is None else 4 * local.numel()  # the statistics' bytes after each row's planes
        if kernels:
            row = TWO_STAGE_HEADER_BYTES + plane_bytes(chunk, width) + extra  # messages and result reused every step
            buffers = self.inner.buffers
            message = stage_one_rows(buffers.take((key, "stage one"), world_size * row, torch.uint8,
                                                  flat.device).view(world_size, row))
            units = quantizer.group_units(scale_stats)
            native_planes.encode_planes(values, groups, units, s, width, rounding, chunk, message,
                                        TWO_STAGE_HEADER_BYTES, local)
            if local is not None and quantizer.saw_nonfinite(local):  # encoded again without them: of no use, defined
                nonfinite, values = True, torch.nan_to_num(as_vector(values, flat), nan=0.0, posinf=0.0, neginf=0.0)
                native_planes.encode_planes(values, groups, units, s, width, rounding, chunk, message,
                                            TWO_STAGE_HEADER_BYTES)
            if extra:
                message[:, row - extra:] = local.view(torch.uint8)
        else:
            levels = quantizer.quantize_levels(values, scale_stats, groups, None, rounding)
            if residual is not None and not nonfinite:
                torch.sub(values, levels * quantizer.step_sizes(scale_stats, groups, numel), out=residual)
            message = stage_one_message(levels, quantizer, world_size)
            if extra:
                message = torch.cat([message, local.view(torch.uint8).expand(world_size, -1)], dim=1)
        excess = None if local is None or nonfinite else agreed.clipped(values, local, scale_stats, groups)

        received = yield Op.ALLTOALL, message.reshape(-1)  # 2.
        rows = received.view(world_size, -1)
        if extra:  # every worker's statistics: their maximum is the next exchange's scale, alike on every worker
            reduced = rows[:, rows.shape[1] - extra:].contiguous().view(torch.float32).amax(dim=0)
            nonfinite = not agreed.agree(key, numel, world_size, reduced)
            if nonfinite:
                warn_nonfinite(key, step)
        index = int(rows[0, :TWO_STAGE_HEADER_BYTES].view(torch.int32))  # 3. this worker's chunk, summed exactly
        owner_rounding = self.inner.rounding_stream((key, "owner"), step, flat.device)
        if kernels:
            reply = self._requantize_natively(rows, chunk, width, world_size, owner_rounding, key)
        else:
            reply = self._requantize(rows, index, chunk, scale_stats, groups, numel, world_size, key,
                                     owner_rounding, nonfinite)

        gathered = yield last(Op.ALLGATHER, reply)  # 4.
        rows = gathered.view(world_size, -1)
        row_steps = rows[:, :TWO_STAGE_HEADER_BYTES].contiguous().view(torch.float32) / s
        if kernels:
            result = native_planes.decode_planes(rows, TWO_STAGE_HEADER_BYTES, width, chunk, numel,
                                                 row_steps.reshape(-1), groups, quantizer.group_steps(scale_stats), s,
                                                 buffers.take(key, numel, torch.float32, flat.device))
        else:
            result = (unpack_planes(rows[:, TWO_STAGE_HEADER_BYTES:], width, chunk) - s).to(torch.float32)
            result = result.mul_(row_steps).reshape(-1)[:numel]
            result.mul_(quantizer.step_sizes(scale_stats, groups, numel)).mul_(s)
        if nonfinite:
            return result.fill_(float("nan"))
        if local is not None:
            agreed.keep_excess(key, excess)
        return result if self.inner.rotation is None else self.inner.rotation.inverse_(result, groups, key, step)

    def _requantize_natively(self, rows: torch.Tensor, chunk: int, width: int, world_size: int,
                             rounding: torch.Tensor, key: Hashable) -> torch.Tensor:
        """Step 3 by the kernels, without error feedback: the stage-two message of this worker's chunk (uint8, header
        and planes), in ``key``'s reused buffers as the owner's sums are."""
        s = self.inner.quantizer.coarse_levels
        total = world_size * s
        buffers = self.inner.buffers
        sums = native_planes.sum_planes(rows, TWO_STAGE_HEADER_BYTES, width, chunk,
                                        buffers.take((key, "owner sums"), chunk, torch.int32, rows.device))
        reply = buffers.take((key, "stage two"), TWO_STAGE_HEADER_BYTES + plane_bytes(chunk, width), torch.uint8,
                             rows.device)
        low, high = torch.aminmax(sums)
        chunk_scale = torch.tensor([max(int(high) - total, total - int(low))], dtype=torch.float32).div_(total)
        reply[:TWO_STAGE_HEADER_BYTES] = chunk_scale.view(torch.uint8)
        native_planes.requantize_planes(sums, total, s, width, max(float(chunk_scale), _TINY), rounding,
                                 reply[TWO_STAGE_HEADER_BYTES:])
        return reply

    def _requantize(self, rows: torch.Tensor, index: int, chunk: int, scale_stats: torch.Tensor,
                    groups: torch.Tensor, numel: int, world_size: int, key: Hashable, rounding: torch.Tensor,
                    nonfinite: bool) -> torch.Tensor:
        """Step 3 in eager steps, with the owner's error feedback: the stage-two message of chunk ``index``."""
        quantizer = self.inner.quantizer
        s, width = quantizer.coarse_levels, plain_width(quantizer.bits[0])
        planes = rows[:, TWO_STAGE_HEADER_BYTES:TWO_STAGE_HEADER_BYTES + plane_bytes(chunk, width)]  # no statistics
        level_sums = unpack_planes(planes, width, chunk).sum(dim=0) - world_size * s
        mean = level_sums.to(torch.float32).div_(world_size * s)  # in units of each element's M
        lo, hi = min(index * chunk, numel), min((index + 1) * chunk, numel)
        owner_residual = None
        if self.memory is not None:
            owner_residual = self.memory.residual((key, "owner"), mean)
            scale = torch.zeros_like(mean)
            scale[: hi - lo] = quantizer.step_sizes(scale_stats, groups, numel)[lo:hi] * s
            sent = torch.zeros_like(mean, dtype=torch.bool)  # where M is 0 nothing can travel: the memory waits
            sent[: hi - lo] = quantizer.maxima(scale_stats, groups, numel)[lo:hi] > 0
            mean.add_(torch.where(sent, owner_residual / torch.where(sent, scale, 1.0), 0.0))
        chunk_scale = mean.abs().amax().reshape(1) if chunk else mean.new_zeros(1)
        ratio = mean.abs().div_(chunk_scale.clamp_min(_TINY))
        requantized = stochastic_levels(ratio.mul_(s), mean, rounding, s)
        if owner_residual is not None and not nonfinite:
            lost = (mean - requantized * (chunk_scale / s)).mul_(scale)
            torch.where(sent, lost, owner_residual, out=owner_residual)
        return stage_two_message(requantized, chunk_scale, quantizer)

    def state_dict(self) -> dict[str, Any]:
        """The inner codec's state, both stages' error-feedback memories, with the scale agreed ahead the agreed
        scales and the clipped excess (``"agreed"``), and where ``"auto"`` tries both exchanges its verdict
        (``"exchange_verdict"``: None until reached, True for the two-stage exchange)."""
        state = {"inner": self.inner.state_dict(), "memory": None if self.memory is None else self.memory.state_dict()}
        if self.trial is not None:
            state["exchange_verdict"] = self.trial.choice
        return state if self.ahead is None else {**state, "agreed": self.ahead.memory.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["memory"] is None) != (self.memory is None):
            raise ValueError("the saved state and this codec disagree on error feedback")
        if ("agreed" in state) != (self.ahead is not None):
            raise ValueError("the saved state and this codec disagree on the scale (a state saved with scale='exact' "
                             "loads with scale='exact', one saved with scale='ahead' with scale='ahead')")
        if self.ahead is not None:
            AgreedScales.check_state(state["agreed"])
        verdict = state.get("exchange_verdict")  # absent: saved with another exchange, or before the trial
        if verdict is not None and not isinstance(verdict, bool):
            raise ValueError(f"the saved exchange verdict must be None, True or False, got {verdict!r}")
        self.inner.load_state_dict(state["inner"])
        if self._tried:  # a verdict saved is kept, else the trial starts again
            self.trial = RouteTrial(EXCHANGE_TRIAL_ROUNDS, choice=verdict)
        if self.ahead is not None:
            self.ahead.memory.load_state_dict(state["agreed"])
        if self.memory is not None:
            self.memory.load_state_dict(state["memory"])
