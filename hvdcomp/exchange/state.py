"""``ExchangeState``: what every bucketed entry point keeps between steps, checkpoints and agrees on.

One state per entry point (``hvdcomp.DistributedOptimizer``, the DDP hook): the codec, the exchange step
(coordinate sets, PowerSGD's start and shared Qs follow it), the statistics, the bucket plan, and the
codec's state at construction (what a reset returns it to).

**Agreement.** Before the first exchange after construction, ``load_state_dict`` or an elastic
re-synchronisation, every worker takes part in one float64 ``Op.MAX`` (not counted in ``stats``): the
exchange step, and per setting a tag of its value (the codec's type and ``config()``, warm-up, op,
``backward_passes_per_step``, hierarchical, exchange mode, and the bucket plan as (name, numel, dtype) per
tensor), each as ``[x, -x]`` so that the maximum shows whether all workers hold the same. Every worker sees
the same maximum, so a mismatch raises the same ``ConfigurationMismatchError`` on every worker, naming what
differs, before any exchange could mix or hang. After an elastic re-synchronisation the workers instead adopt
the highest exchange step and reset their codecs, with one log line.

**Checkpoints.** ``state_dict()`` is ``{"version", "codec_type", "codec_config", "codec", "exchange_step",
"world_size"}``; ``check_state`` validates one (version, keys, codec type and configuration, and the codec's
own ``load_state_dict`` on a copy) and raises ``ValueError`` naming the saved and the current codec before
anything is changed; ``load_state_dict`` then applies it. A state saved by another number of workers keeps
the exchange step and resets the per-worker codec state, with a ``RuntimeWarning``.
"""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from ..codec.seeding import stable_seed
from .bucket import BucketCodec
from .elementwise import NoCompression
from .plan import Bucket, signature
from .protocol import Exchange, Op, Transport
from .stats import Statistics

LOG = logging.getLogger("hvdcomp")  # without logging configured, warnings still reach stderr
STATE_VERSION = 1
STATE_KEYS = ("version", "codec_type", "codec_config", "codec", "exchange_step", "world_size")
_TAG_RANGE = 2**52  # tags below this are exact in float64, and so is their negation
WARMUP_CODEC = NoCompression()  # stateless: one serves every entry point


class ConfigurationMismatchError(RuntimeError):
    """The workers of one exchange are configured differently (raised on every worker alike)."""


def describe(codec: BucketCodec) -> str:
    """``codec``'s type and configuration, as errors name it."""
    return f"{type(codec).__name__}{codec.config()!r}"


class ExchangeState:
    """See the module docstring.

    Args:
        codec: the bucket codec (bound to the transport by the entry point).
        door: the entry point's name, for messages (``"hvdcomp.DistributedOptimizer"``).
        settings: what every worker must configure alike besides the codec (e.g. ``{"op": "average"}``);
            values with a ``repr`` that is the same in every process.
        warmup_steps: the first ``warmup_steps`` exchanges send exact means (``NoCompression``), the codec
            untouched.
    """

    def __init__(self, codec: BucketCodec, door: str, settings: dict[str, Any], warmup_steps: int = 0) -> None:
        self.codec = codec
        self.door = door
        self.settings = dict(settings, warmup_steps=warmup_steps)
        self.warmup_steps = warmup_steps
        self.step = 0
        self.stats = Statistics()
        self.plan: list[Bucket] = []
        self.agreed = False
        self.resync = False  # an elastic re-synchronisation happened: adopt the highest step at the next agreement
        self._fresh = copy.deepcopy(codec.state_dict())

    def step_codec(self) -> BucketCodec:
        """The codec of this step's exchanges: ``NoCompression`` during warm-up."""
        return WARMUP_CODEC if self.step < self.warmup_steps else self.codec

    def reset(self, transport: Transport) -> None:
        """The codec as at construction, bound to ``transport`` (this worker's current rank)."""
        self.codec.load_state_dict(copy.deepcopy(self._fresh))
        self.codec.bind_transport(transport)

    # -- agreement ---------------------------------------------------------------------------------------------
    def _described(self, plan: Sequence[Bucket]) -> dict[str, Any]:
        return dict(self.settings, compression=describe(self.codec), buckets=signature(plan))

    def agree(self, transport: Transport, name: str) -> None:
        """The agreement of the module docstring (a blocking collective named ``name``; every worker calls it
        at the same point)."""
        exchange = agreement(self.door, self._described(self.plan), self.step, self.resync)
        op, request = next(exchange)
        try:
            exchange.send(transport.wait(transport.start(op, request, name)))
        except StopIteration as done:
            highest, resync = done.value
        if resync:
            self.resync = False
            if highest > 0:
                self.reset(transport)
                self.step = highest
                if transport.rank == 0:
                    LOG.warning("hvdcomp: workers changed (elastic): the codec state (error-feedback memories, "
                                "agreed scales, PowerSGD's Qs) is reset on all %d workers; the model, the optimizer's "
                                "state and the exchange step (%d) are kept", transport.size, highest)
        self.agreed = True

    # -- checkpoints -------------------------------------------------------------------------------------------
    def state_dict(self, world_size: int) -> dict[str, Any]:
        return {"version": STATE_VERSION, "codec_type": type(self.codec).__name__,
                "codec_config": list(self.codec.config()), "codec": self.codec.state_dict(),
                "exchange_step": self.step, "world_size": world_size}

    def check_state(self, state: Any, world_size: int) -> None:
        """``ValueError`` if ``load_state_dict(state, ...)`` would fail; changes nothing."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION or set(state) != set(STATE_KEYS):
            version = state.get("version") if isinstance(state, dict) else None
            raise ValueError(f"{self.door}: not an hvdcomp exchange state of version {STATE_VERSION} (version "
                             f"{version!r}, keys {sorted(state) if isinstance(state, dict) else type(state)})")
        saved = f"{state['codec_type']}{tuple(state['codec_config'])!r}"
        if saved != describe(self.codec):
            raise ValueError(f"{self.door}: the checkpoint was saved with compression {saved} and cannot be loaded "
                             f"into {describe(self.codec)}; build the optimizer with the compression it was saved "
                             "with")
        step = state["exchange_step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"{self.door}: the checkpoint's exchange step {step!r} is not an integer >= 0")
        if state["world_size"] == world_size:
            try:
                copy.deepcopy(self.codec).load_state_dict(copy.deepcopy(state["codec"]))
            except (KeyError, TypeError, ValueError, RuntimeError, AttributeError, IndexError) as error:
                raise ValueError(f"{self.door}: the checkpoint's {saved} state does not load: {error}") from error

    def load_state_dict(self, state: dict[str, Any], transport: Transport) -> None:
        """Apply a state ``check_state`` accepted; the next exchange agrees again."""
        self.step = state["exchange_step"]
        self.agreed = False
        if state["world_size"] == transport.size:
            self.codec.load_state_dict(state["codec"])
            return
        self.reset(transport)
        warnings.warn(f"hvdcomp: this state was saved by {state['world_size']} workers and is loaded into "
                      f"{transport.size}: the exchange step is kept; the per-worker codec state (error-feedback "
                      "memories, agreed scales, PowerSGD's Qs) starts afresh", RuntimeWarning, stacklevel=3)


def agreement(door: str, described: dict[str, Any], step: int, resync: bool) -> Exchange:
    """The workers' agreement (the module docstring) as an exchange of one ``Op.MAX``: ``described`` maps each
    setting to a value whose ``repr`` is the same in every process. Returns the highest exchange step and
    whether some worker re-synchronised (then the steps may differ); raises ``ConfigurationMismatchError``, on
    every worker alike, naming the settings that differ, or when the steps differ without a re-synchronisation."""
    fields = sorted(described)
    tags = [float(stable_seed(field, described[field]) % _TAG_RANGE) for field in fields]
    request = torch.tensor([float(step), -float(step), float(resync)] + [x for tag in tags for x in (tag, -tag)],
                           dtype=torch.float64)
    seen = (yield Op.MAX, request).tolist()
    highest, lowest, resync_seen = int(seen[0]), int(-seen[1]), seen[2] > 0
    differ = [field for index, field in enumerate(fields) if seen[3 + 2 * index] != -seen[4 + 2 * index]]
    if differ:
        here = "; ".join(f"{field} = {_short(described[field])}" for field in differ)
        raise ConfigurationMismatchError(
            f"{door}: the workers are configured differently (what differs: {', '.join(differ)}; on this worker "
            f"{here}): build it with the same compression, settings and parameters on every worker")
    if highest != lowest and not resync_seen:
        raise ConfigurationMismatchError(
            f"{door}: the workers hold different hvdcomp states (exchange steps {lowest} to {highest}): every "
            "worker must load its own state_dict() (or, at another world size, any worker's; "
            "hvd.broadcast_optimizer_state does not carry hvdcomp's per-worker state), or none")
    return highest, resync_seen


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 160 else f"{text[:150]}... ({len(text)} characters)"


class ExchangeStateView:
    """What a door's user reads of its ``ExchangeState`` (``self._state``): the codec, the statistics and the steps
    exchanged (the DDP hook's and FSDP's states)."""

    __slots__ = ()
    _state: ExchangeState

    @property
    def codec(self) -> BucketCodec:
        return self._state.codec

    @property
    def stats(self) -> Statistics:
        return self._state.stats

    @property
    def step(self) -> int:
        """Exchange steps: DDP's synchronizing steps, FSDP's backward passes."""
        return self._state.step
