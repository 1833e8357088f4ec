"""Birder: a 1-bit adaptive optimizer with a Hierarchical-1-bit-All-Reduce (NeurIPS 2023).

Per worker, with one decay ``beta`` and flat float32 buffers over all parameters:

1. ``m <- beta m + (1 - beta) g``, ``b <- beta b + (1 - beta) |g|``, so ``|m| <= b`` element-wise;
2. ``z = m / b`` (0 where ``b == 0``); ``u = +1`` with probability ``(1 + z) / 2``, else ``-1`` (``E[u] = z``);
3. ``u_bar`` = the mean of ``u`` over the workers, by a 1-bit exchange (``hvdcomp.exchange.onebit``):
   hierarchical across multi-worker nodes, else the exact lane sum over all workers;
4. ``x <- x - lr (u_bar + weight_decay x)`` (decoupled weight decay) for each parameter with a gradient.

There is no uncompressed warm-up; learning-rate warm-up works through the usual torch schedulers.
The math is ``hvdcomp.codec.onebit``; this module is the optimizer: buffers, masking, state, stats.

**Chunks.** The world route updates the moments, draws and sums in chunks (``onebit.world_chunks``) that
``step()`` has in flight together under the one ``Runner`` (``hvdcomp.exchange.runner``): a chunk's codec work
overlaps the other chunks' sums, and each parameter is updated once the chunk that holds its end is decoded.
The bits and the mean are one whole draw's, and ``stats`` adds the chunks' (overlapping) seconds.

**Routes** (``onebit.one_bit_route``). ``hierarchical=True`` with several nodes of several workers uses
``hierarchical_one_bit_mean`` (``inter_node``: ``"auto"`` picks the variant that sends fewer bytes);
otherwise the workers' bits are summed in ``bit_length(W)``-bit lanes through ``Op.SUM`` (in chunks, above).
Left open (``hierarchical=None``, Horovod's setting unset) on equal nodes of several workers that the transport
connects by node, the first steps try the flat route, then the hierarchical one, and the faster is kept
(``hvdcomp.exchange.route``; ``route_trial``); both draw the same bits from the same moments.
``exchange="two_stage"`` replaces the inter-node stage (or the sum over all workers) by the two-stage
1-bit exchange (about 2 bits per element at any node count), ``"auto"`` lets the cost model choose.
``route`` says which ran last: ``"hierarchical:allgather"``, ``"hierarchical:sum"``,
``"hierarchical:two_stage"``, ``"world:sum"`` or ``"world:two_stage"``. A hierarchical step ends with a
node-local all-gather: before the script exits, ``hvd.barrier()``, or a node that exits first shuts Horovod
down under another node's last step.

**Masking.** An element is *active* once some worker has seen a non-zero gradient for it. The agreed
``active`` mask (identical on every rank) costs nothing per step beyond the ``Op.MAX`` of ``4 + P``
values (``P`` parameter tensors) that every step makes anyway (flags: some gradient non-finite; some
worker saw a first non-zero gradient; the element count, to catch mismatched models; per parameter,
some worker has a gradient for it). Only when the second flag is up do the workers sum their newly
active bits (packed lanes). Inactive elements still travel but get ``u_bar = 0``, so a parameter
whose gradient is always zero on every worker changes only through weight decay. ``b`` can underflow
back to 0 after thousands of zero-gradient steps; such an element stays active with ``z = 0`` (a fair
coin), which is still unbiased.

**Parameters without a gradient** (``.grad`` None, or ``requires_grad=False``) on every worker are
left alone, as AdamW does: no update, no weight decay, ``m`` and ``b`` kept. The flags of the
``Op.MAX`` make every worker skip the same ones; a worker without a gradient that another worker has
counts it as zero. A zero gradient tensor is a gradient: weight decay applies.

**Non-finite gradients**: if any worker's gradient holds NaN/Inf, every worker skips the step (no
state changes, no random draws), warns, and counts it in ``stats.skipped_steps``. **Agreement**: the first
step after construction or a load compares the settings and parameters of every worker
(``hvdcomp.exchange.state.agreement``): a difference raises on every worker.

**Randomness** is counter-based (``hvdcomp.codec.random``): the draw of ``u`` and the re-binarizations take
uniforms from two streams keyed by ``(seed, "birder", rank, purpose)`` and counted by (step, element), so only
the step count and the seed need saving, and CPU and GPU draw the same bits. The global RNGs are never touched.

**Statistics**: ``stats`` is ``hvdcomp.exchange.stats.Statistics``; the flags (``8 (4 + P)`` bytes) and
activity masks count as ``control_bytes``. Per worker and step, for ``n`` elements, ``c = ceil(n / L)`` and
``lanes(k) = floor(63 / bit_length(k))``: hierarchical, inter-node ``ceil(c / 8)`` bytes (all-gather) or
``8 ceil(c / lanes(N))`` (sum); intra-node ``8 ceil(n / lanes(L)) + 8 ceil(c / lanes(N))``; over all workers
``8 ceil(n / lanes(W))`` inter-node.

``state_dict()`` holds ``m``, ``b``, the active mask, the step count, the seed and the route trial's verdict: each
worker must save and load its own (``m`` and ``b`` follow its own gradients) for an exact resume.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..codec.packing import INT64_WORD_BITS, LaneLayout, lane_block_values
from ..codec.random import stream_words
from ..codec.validate import check_real
from ..exchange.cost import EXCHANGES, INTER_NODE_VARIANTS
from ..exchange.onebit import Route, drawn_lane_mean, drawn_route_mean, one_bit_route, world_chunks
from ..exchange.protocol import Exchange, Op, Placement, Topology, Transport, drive, single
from ..exchange.route import RouteTrial, runs_hierarchy
from ..exchange.runner import Runner
from ..exchange.simulator import simulate
from ..exchange.state import agreement
from ..exchange.stats import Statistics, Traffic, counted
from ..transport._compat import HOROVOD_WRAPPER_METHODS, called_by_broadcast_optimizer_state
from .birder_layout import FlatLayout, layout_key
from .birder_state import birder_state, load_birder_state, resync_birder
from .launch import resolve_hierarchical


def _check_hyperparameters(group: dict[str, Any]) -> None:
    check_real("Birder: lr", group["lr"], low_open=True)
    check_real("Birder: beta", group["beta"], 0.0, 1.0, low_open=True)
    check_real("Birder: weight_decay", group["weight_decay"])


_WRAPPED_MESSAGE = (
    "Birder exchanges 1-bit updates itself in step(); do not wrap it in hvd.DistributedOptimizer (which would "
    "all-reduce full-precision gradients first). Use Birder(model.parameters(), lr=...) directly."
)


class Birder(torch.optim.Optimizer):
    """Birder (see the module docstring): 1-bit adaptive updates, exchanged in ``step()``.

    Args:
        params: parameters or parameter groups (groups may set their own ``lr``, ``beta``,
            ``weight_decay``); all on one device, floating point.
        lr: learning rate (> 0).
        beta: decay of both moments, in (0, 1).
        weight_decay: decoupled weight decay ``lambda`` (>= 0): ``x <- x - lr (u_bar + lambda x)``.
        hierarchical: Hierarchical-1-bit-All-Reduce across nodes (needs equal nodes that cover all the
            transport's workers, else every worker raises at the first step; over Horovod, ``hvdcomp.init()``).
            ``False``, a single node, or one worker per node uses the exact 1-bit lane sum over all workers.
            ``None``: ``HOROVOD_HIERARCHICAL_ALLREDUCE`` if set, else the faster, timed on the first steps (Routes).
        inter_node: ``"auto"`` (fewest bytes), ``"allgather"`` or ``"sum"`` between nodes.
        exchange: ``"lanes"`` (as ``inter_node`` says), ``"two_stage"`` or ``"auto"`` (see the module docstring).
        transport: carries the collectives (``HorovodTransport`` / ``MPITransport`` or alike); default
            ``HorovodTransport(process_set)``, created at the first step.
        process_set: Horovod process set of the default transport.
        seed: with the rank, keys this worker's random streams.

    A parameter without a gradient (``.grad`` None or ``requires_grad=False``) on every worker is skipped,
    weight decay included; on some workers only, they count it as zero. Workers hold the same parameters.
    ``stats``: bytes and seconds of the last step and in total; ``route``: the last step's exchange; ``route_trial``:
    the timing of both routes where the route was left open (``RouteTrial``), else None.
    ``step_exchange(topology)`` is the step as an exchange generator (for ``simulate``; see ``simulate_step``).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        beta: float = 0.95,
        weight_decay: float = 0.0,
        hierarchical: bool | None = None,
        inter_node: str = "auto",
        transport: Any = None,
        exchange: str = "lanes",
        process_set: Any = None,
        seed: int = 0,
    ) -> None:
        self._check_not_wrapped()
        _check_hyperparameters({"lr": lr, "beta": beta, "weight_decay": weight_decay})
        if inter_node not in INTER_NODE_VARIANTS:
            raise ValueError(f"Birder: inter_node must be one of {INTER_NODE_VARIANTS}, got {inter_node!r}")
        if exchange not in EXCHANGES:
            raise ValueError(f"Birder: exchange must be one of {EXCHANGES}, got {exchange!r}")
        if transport is not None and process_set is not None:
            raise ValueError("Birder: give a transport or a process_set, not both")
        self._layout: FlatLayout | None = None
        super().__init__(params, {"lr": lr, "beta": beta, "weight_decay": weight_decay})
        self.hierarchical = resolve_hierarchical(hierarchical, default=None)
        self.inter_node, self.exchange = inter_node, exchange
        self.seed = seed
        self._transport = transport
        self._process_set = process_set
        self._rank: int | None = None  # of the last step, or of the loaded state
        self._warned_rank = False
        self._step = 0
        self.route: Route | None = None  # the last step's
        self.route_trial: RouteTrial | None = None  # set at each agreement where the route is left open
        self._saved_route: bool | None = None  # the route trial's verdict, from a loaded state
        self.stats = Statistics()
        self._runner: Runner | None = None
        self._agreed = False  # the settings were agreed since construction, a load or a re-synchronisation
        self._resynced = False  # Horovod elastic re-synchronised: the workers adopt the highest step

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # hvd.DistributedOptimizer builds type(name, (Birder,), dict(_DistributedOptimizer.__dict__)).
        super().__init_subclass__(**kwargs)
        if any(name in cls.__dict__ for name in HOROVOD_WRAPPER_METHODS):
            raise TypeError(_WRAPPED_MESSAGE)

    def _check_not_wrapped(self) -> None:
        if any(hasattr(type(self), name) for name in HOROVOD_WRAPPER_METHODS):
            raise TypeError(_WRAPPED_MESSAGE)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_layout", None) is not None:
            raise RuntimeError("Birder: add parameter groups before the first step (the flat buffers are fixed)")
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            _check_hyperparameters(group)
            for p in group["params"]:
                if not p.dtype.is_floating_point:
                    raise TypeError(f"Birder: parameters must be floating point, got {p.dtype}")
        except (ValueError, TypeError):
            self.param_groups.pop()
            raise

    # -- buffers ------------------------------------------------------------------------------

    def _ensure_buffers(self) -> FlatLayout:
        if self._layout is not None:
            if self._layout.key != layout_key(self.param_groups):
                raise RuntimeError("Birder: the parameters changed after the first step")
            return self._layout
        self._layout = layout = FlatLayout.of(self.param_groups)
        zeros = lambda dtype: torch.zeros(layout.numel, dtype=dtype, device=layout.device)  # noqa: E731
        self._m, self._b, self._grad = (zeros(torch.float32) for _ in range(3))
        self._mean = torch.zeros(layout.numel + lane_block_values(INT64_WORD_BITS), device=layout.device)  # padding
        self._bits, self._active = zeros(torch.bool), zeros(torch.bool)
        self._all_active = layout.numel == 0
        return layout

    def _stream(self, purpose: str, rank: int, device: torch.device) -> torch.Tensor:
        """This worker's random stream for ``purpose`` at this step (``random.stream_words``)."""
        return stream_words(self._step, self.seed, "birder", rank, purpose, device=device)

    # -- the step -----------------------------------------------------------------------------

    @property
    def transport(self) -> Transport:
        """The transport (created at first use: ``HorovodTransport(process_set)``)."""
        if self._transport is None:
            from ..transport.horovod import HorovodTransport

            self._transport = HorovodTransport(self._process_set)
        return self._transport

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Birder step over the transport (every worker must call it); returns ``closure()``'s loss.
        Called by ``hvd.broadcast_optimizer_state``: no step (Birder's state needs no first step); under Horovod
        elastic's re-synchronisation, the workers' states are agreed (``birder_state.resync_birder``).
        The update's exchanges (the world route's chunks) run under the one ``Runner``, in flight together."""
        if called_by_broadcast_optimizer_state():
            return resync_birder(self)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        transport = self.transport
        self._runner = self._runner or Runner(transport, self.stats, "hvdcomp.birder")
        self._runner.begin_step()
        update = drive(self._prepare(transport, self.stats.last_step, transport), transport)
        if update is None:
            self._runner.drop()
            self.stats.end_step(skipped=True)
            return loss
        started = time.perf_counter()
        for index, exchange in enumerate(self._update_exchanges(update)):  # each writes into Birder's buffers
            self._runner.launch_exchange(index, f"chunk{index}", exchange, lambda result: None)
        self._runner.finish()
        if self.route_trial is not None:
            self.route_trial.record(time.perf_counter() - started)
        self._step += 1
        return loss

    def step_exchange(self, topology: Topology | None = None) -> Exchange:
        """The step as an exchange generator; ``topology`` (a ``Placement`` or a transport) says where this
        worker sits (default: the transport). Run it to its end on every worker. The world route's chunks
        are summed one after another here; ``step()`` has their sums in flight together (the same result)."""
        topo = topology if topology is not None else self.transport
        traffic = self.stats.begin_step()
        update = yield from self._prepare(topo, traffic, None)
        if update is None:
            self.stats.end_step(skipped=True)
            return None
        started = time.perf_counter()
        for exchange in self._update_exchanges(update):
            yield from counted(exchange, traffic, topo)
        if self.route_trial is not None:
            self.route_trial.record(time.perf_counter() - started)
        self._step += 1
        self.stats.end_step()
        return None

    def _prepare(self, topo: Topology, traffic: Traffic, transport: Transport | None) -> Exchange:
        """The step's checks and agreement (the module docstring's flags and activity masks); returns the
        ``_Update`` to exchange, or None when every worker skips the step. ``transport``: None where simulated."""
        self._check_not_wrapped()
        if self.hierarchical and not topo.equal_nodes:  # agreed: every rank raises, or none
            raise ValueError("Birder: hierarchical=True needs the same number of workers on every node; "
                             "pass hierarchical=False")
        size, local_size, cross_size = topo.size, topo.local_size, topo.cross_size
        nodes_of_several = cross_size > 1 and local_size > 1
        if self.hierarchical and nodes_of_several and local_size * cross_size != size:
            raise ValueError(
                f"Birder: hierarchical=True needs the nodes ({cross_size} x {local_size}) to hold all {size} "
                "workers of the exchange (e.g. no smaller process set); pass hierarchical=False"
            )
        layout = self._ensure_buffers()
        numel = layout.numel
        if self._rank is not None and self._rank != topo.rank and not self._warned_rank:
            self._warned_rank = True
            warnings.warn(f"Birder: rank {topo.rank} runs with rank {self._rank}'s moments; each worker should load "
                          "its own state dict", RuntimeWarning, stacklevel=4)
        self._rank = topo.rank
        if not self._agreed:  # settings and parameters alike on every worker, or one clear error on each
            self._step, _ = yield from agreement("Birder", self._described(layout), self._step, self._resynced)
            self._agreed, self._resynced = True, False
            # equal_nodes first: a collective (over Horovod) that every rank must reach, whatever its node's size
            both = topo.equal_nodes and nodes_of_several and local_size * cross_size == size
            opened = self.hierarchical is None and both and (transport is None or runs_hierarchy(transport))
            release = None if transport is None else transport.release_hierarchy  # by a flat verdict
            self.route_trial = RouteTrial(choice=self._saved_route, release=release) if opened else None
        trial, grad = self.route_trial, self._grad
        has_grad, finite, fresh_here = layout.gather_grads(grad, None if self._all_active else self._active)
        flags = torch.tensor([float(not finite), float(finite and fresh_here), numel, -numel, *has_grad],
                             dtype=torch.float64)
        if trial is not None:  # where its verdict is due, the route trial's seconds ride in the same MAX
            flags = trial.ride(flags)
        flags = yield from counted(single(Op.MAX, flags), traffic, topo, control=True)
        flags = flags if trial is None else trial.land(flags)
        if int(flags[2]) != numel or int(-flags[3]) != numel:
            raise RuntimeError(f"Birder: workers hold different parameter counts ({int(-flags[3])} to {int(flags[2])})")
        if flags[0] > 0:
            warnings.warn(f"Birder: a worker's gradient holds NaN/Inf at step {self._step}; every worker skips "
                          "this step", RuntimeWarning, stacklevel=4)
            return None
        if flags[1] > 0:
            fresh = (grad.ne(0).logical_and_(self._active.logical_not()) if fresh_here
                     else torch.zeros(numel, dtype=torch.bool, device=layout.device))
            mask_layout = LaneLayout(span=1, world_size=size)
            word_sums = yield from counted(
                single(Op.SUM, mask_layout.pack(fresh.view(torch.uint8), validate=False)), traffic, topo, control=True)
            self._active.logical_or_(mask_layout.unpack(word_sums, numel) > 0)
            self._all_active = bool(self._active.all())
        traffic.uncompressed_bytes += 4 * numel
        hierarchical = self.hierarchical if self.hierarchical is not None else trial is not None and trial.second
        return _Update(layout, topo, hierarchical and nodes_of_several, (flags[4:] > 0).tolist())

    def _described(self, layout: FlatLayout) -> dict[str, Any]:
        """What every worker must configure alike (``hvdcomp.exchange.state.agreement``)."""
        groups = tuple((g["lr"], g["beta"], g["weight_decay"], len(g["params"])) for g in self.param_groups)
        return {"hierarchical": self.hierarchical, "route": self._saved_route, "inter_node": self.inter_node,
                "exchange": self.exchange, "seed": self.seed, "groups": groups,
                "parameters": tuple((p.numel(), str(p.dtype)) for p in layout.params)}

    def _update_exchanges(self, update: _Update) -> list[Exchange]:
        """Moments, the 1-bit draw, its exchange, and the update of the ``updated`` parameters (the others
        keep their moments; their bits travel, as the exchange covers the whole flat buffer): one exchange per
        chunk on the world route, else one; each updates the parameters whose elements it completed."""
        layout, topo, updated = update.layout, update.topology, update.updated
        m, b, numel, grad = self._m, self._b, layout.numel, self._grad
        runs = layout.moment_runs(self.param_groups, updated)
        draws = self._stream("draw", topo.rank, layout.device)
        self.route = one_bit_route(numel, topo, update.hierarchical, self.inter_node, self.exchange)
        mean, applied = self._mean[:numel], 0  # the world route decodes into mean; parameters before applied are done

        def apply_through(end: int) -> None:
            nonlocal applied
            active = None if self._all_active else self._active
            applied = layout.apply_update(self.param_groups, mean, active, updated, applied, end)

        if self.route is Route.WORLD_SUM and topo.size > 1:  # per chunk: moments and draw into summable lanes; update
            return [_then(drawn_lane_mean(m, b, draws, lo, hi, topo.size, self._mean, grad, runs), apply_through, hi)
                    for lo, hi in world_chunks(numel, topo.size)]
        rebinarize = self._stream("rebinarize", topo.rank, layout.device)

        def whole() -> Exchange:  # the route's mean (a buffer of its own on some routes), then every update
            nonlocal mean
            mean = yield from drawn_route_mean(self.route, m, b, draws, rebinarize, topo, self._bits, self._mean,
                                               grad, runs)
            apply_through(numel)
            return mean

        return [whole()]

    # -- checkpoints --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Torch's state dict plus ``"birder"``: this worker's m, b, active mask, step and seed."""
        return dict(super().state_dict(), birder=birder_state(self))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        load_birder_state(self, state_dict, super().load_state_dict)


@dataclass
class _Update:
    """What a step's checks agreed: layout, topology, route, per parameter whether some worker has a gradient."""

    layout: FlatLayout
    topology: Topology
    hierarchical: bool
    updated: list[bool]


def _then(exchange: Exchange, after: Callable[[int], None], end: int) -> Exchange:
    """``exchange``, then ``after(end)``; the same result."""
    value = yield from exchange
    after(end)
    return value


def simulate_step(optimizers: Sequence[Birder], local_size: int | None = None) -> list[object]:
    """One ``Birder`` step of W = len(optimizers) workers in this process (``simulate``),
    ``local_size`` workers per node (default: one node). ``optimizers[r]`` is rank r's."""
    world_size = len(optimizers)
    local_size = local_size or world_size
    return simulate(
        [opt.step_exchange(Placement(rank, world_size, local_size)) for rank, opt in enumerate(optimizers)],
        local_size=local_size,
    )
