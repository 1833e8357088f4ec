"""Birder: a 1-bit adaptive optimizer with a Hierarchical-1-bit-All-Reduce (NeurIPS 2023).

Per worker, with one decay ``beta`` and flat float32 buffers over all parameters:

1. ``m <- beta m + (1 - beta) g``, ``b <- beta b + (1 - beta) |g|``, so ``|m| <= b`` element-wise;
2. ``z = m / b`` (0 where ``b == 0``); ``u = +1`` with probability ``(1 + z) / 2``, else ``-1`` (``E[u] = z``);
3. ``u_bar`` = the mean of ``u`` over the workers, estimated by a 1-bit exchange (below);
4. ``x <- x - lr (u_bar + weight_decay x)`` (decoupled weight decay).

There is no uncompressed warm-up; learning-rate warm-up works through the usual torch schedulers.

**Hierarchical-1-bit-All-Reduce** (``hierarchical_one_bit_mean``; N nodes of L workers each):

- intra-node: each worker's ``u`` travels as a bit (1 for +1) in summable lanes (``LaneLayout(span=1,
  world_size=L)``) through one ``"local_sum"``: every worker gets the exact node count ``c`` of +1s,
  i.e. the node mean ``s / L = 2 c / L - 1`` at full precision;
- chunks ("all_gather_by_chunks"): local rank ``j`` owns chunk ``j`` (``ceil(n / L)`` elements) and
  re-binarizes only that chunk of the node mean, unbiasedly (+1 with probability ``c / L``), with its
  own generator;
- inter-node: 1 bit per element and node. Either a ``"cross_allgather"`` of the bits packed 8 per
  uint8 byte (each node's bits; counted after unpacking), or a ``"cross_sum"`` of summable lanes
  (``LaneLayout(span=1, world_size=N)``, lane width ``bit_length(N)`` = ``ceil(log2(N + 1))``).
  ``inter_node="auto"`` picks the variant that moves fewer bytes per worker under bandwidth-optimal
  (ring) collectives: an allgather sends ``(N - 1)`` times its payload, an all-reduce ``2 (N - 1) / N``
  times. Per element that is ``N - 1`` bits against ``2 (N - 1) / N * 64 / floor(63 / bit_length(N))``
  bits: the allgather wins for N <= 6 and N = 8, the lane sum for N = 7 and N >= 9 (lane widths
  step at N = 4, 8, 16, ...; ``choose_inter_node`` compares exact byte counts for the chunk);
- a ``"local_allgather"`` of the chunks' node counts (values in ``[0, N]``, packed in
  ``bit_length(N)``-bit lanes) gives every worker the full ``u_bar = 2 count / N - 1`` (the mean over
  nodes of the node-binarized values); every worker decodes the same integers, so ``u_bar`` is
  bitwise identical on all ranks.

``E[u_bar]`` is the mean over workers of ``z``: given the draws ``u``, a node's re-binarized value
has expectation ``s / L`` (the node's mean ``u``), whose expectation is the node's mean ``z``; nodes
are of equal size.

**Flat path** (one node, one worker per node, or ``hierarchical=False``): ``flat_one_bit_mean`` sums
the workers' bits in ``LaneLayout(span=1, world_size=W)`` lanes (``bit_length(W)`` bits per element)
through the flat ``"sum"``: the exact mean of the workers' ``u``. It is the hierarchical exchange
with every worker its own node and the ``"sum"`` variant: the protocol's flat ops have no allgather,
and both on one node
(node-local ops) and with one worker per node (cross-node ops) the collectives would need a Horovod
process set equal to the global one, which Horovod refuses to add. So the flat path always uses the
lane sum, works with plain ``hvd.init()`` and with a sub-``process_set``, and ``inter_node`` is ignored
there (it only concerns the stage between multi-worker nodes). Its exchange counts as inter-node bytes
in ``stats`` (as in ``hvdcomp.optimizer``).

**Masking.** An element is *active* once some worker has seen a non-zero gradient for it. The agreed
``active`` mask (identical on every rank) is kept with no per-step cost beyond a 4-value ``"max"``
all-reduce that every step makes anyway (flags: some gradient non-finite; some worker saw a first
non-zero gradient; the parameter count, to catch mismatched models). Only when that flag is up do the
workers ``"sum"`` their newly active bits (packed lanes, counted as ``control_bytes``). Inactive
elements still travel (the layout stays fixed) but get ``u_bar = 0``, so a parameter whose gradient
is always zero on every worker changes only through weight decay. (A 0 in the intra-node sum could
not survive the 1-bit stage between nodes; the agreed mask avoids that.) ``b`` can underflow back to
0 after thousands of zero-gradient steps; such an element stays active with ``z = 0`` (a fair coin),
which is still unbiased.

**Non-finite gradients**: if any worker's gradient holds NaN/Inf, every worker skips the step (no
state changes, no random draws) and warns.

**Randomness** comes from one ``torch.Generator`` per worker, seeded by ``stable_seed(seed, "birder",
rank)``; the global RNGs are never touched.

**Statistics** (``optimizer.stats``, the last step): ``intra_node_bytes`` / ``inter_node_bytes`` /
``control_bytes`` are the bytes this worker handed to collectives; ``*_wire_bytes`` estimate what it
sends under ring collectives. For ``n`` elements, ``c = ceil(n / L)``, ``lanes(k) = floor(63 /
bit_length(k))``, per worker and step:

- hierarchical, inter-node: ``ceil(c / 8)`` bytes (allgather: 1 bit per element per node, ``1 / L``
  bits per element per worker) or ``8 ceil(c / lanes(N))`` (sum);
- hierarchical, intra-node: ``8 ceil(n / lanes(L))`` (local sum) + ``8 ceil(c / lanes(N))`` (local
  allgather of the counts); e.g. 2 x 2: about ``2.06 + 1.03`` bits per element;
- flat: ``8 ceil(n / lanes(W))`` inter-node (about 2.06 bits per element for W = 2, 3.05 for W = 4);
- control: 32 bytes, plus ``8 ceil(n / lanes(W))`` in steps where new elements become active.

``state_dict()`` holds ``m``, ``b``, the active mask, the step count and the generator state: each
worker must save and load its own (``m`` and ``b`` follow its own gradients) for an exact resume.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .packing import LaneLayout
from .protocol import Exchange, simulate
from .selection import stable_seed

INTER_NODE_VARIANTS = ("auto", "allgather", "sum")
_BIT_SHIFTS = torch.arange(8, dtype=torch.uint8)
_HOROVOD_WRAPPER_METHODS = ("_allreduce_grad_async", "synchronize")


@dataclass(frozen=True)
class Topology:
    """Where a worker sits: rank ``r`` is local rank ``r % local_size`` of node ``r // local_size``
    (as ``protocol.simulate`` lays workers out). Transports offer the same attributes."""

    rank: int
    size: int
    local_size: int

    @property
    def local_rank(self) -> int:
        return self.rank % self.local_size

    @property
    def cross_size(self) -> int:
        return self.size // self.local_size

    @property
    def cross_rank(self) -> int:
        return self.rank // self.local_size


# ----------------------------------------------------------------------------------------------
# Pure math
# ----------------------------------------------------------------------------------------------


def unbiased_direction(m: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``z = m / b`` in [-1, 1], 0 where ``b == 0`` (``|m| <= b`` up to rounding; clamped)."""
    z = torch.div(m, b, out=out) if out is not None else m / b
    return z.masked_fill_(b <= 0, 0.0).clamp_(-1.0, 1.0)


def binarize(prob_plus: torch.Tensor, generator: torch.Generator | None,
             rand_out: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Bits (True for +1) that are 1 with probability ``prob_plus`` (float, in [0, 1]) each."""
    if rand_out is None:
        rand = torch.rand(prob_plus.shape, generator=generator, device=prob_plus.device, dtype=prob_plus.dtype)
    else:
        rand = torch.rand(prob_plus.shape, generator=generator, out=rand_out)
    return torch.lt(rand, prob_plus, out=out) if out is not None else rand < prob_plus


def signs_from_direction(z: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """The ±1 draw ``u`` of step 2 as float32: +1 with probability ``(1 + z) / 2`` (``E[u] = z``)."""
    bits = binarize((z + 1) * 0.5, generator)
    return bits.to(torch.float32).mul_(2).sub_(1)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """1-D bool (or 0/1 integer) tensor -> uint8, 8 bits per byte, least significant bit first."""
    numel = bits.numel()
    nbytes = -(-numel // 8)
    padded = torch.zeros(nbytes * 8, dtype=torch.uint8, device=bits.device)
    padded[:numel] = bits.reshape(-1)
    shifts = _BIT_SHIFTS.to(bits.device)
    return padded.view(nbytes, 8).bitwise_left_shift_(shifts).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of ``pack_bits`` along the last dimension: ``[..., nbytes]`` uint8 -> ``[..., numel]`` bool."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_bits expects uint8, got {packed.dtype}")
    if packed.shape[-1] * 8 < numel:
        raise ValueError(f"{packed.shape[-1]} bytes cannot hold {numel} bits")
    shifts = _BIT_SHIFTS.to(packed.device)
    bits = packed.unsqueeze(-1).bitwise_right_shift(shifts).bitwise_and_(1)
    return bits.flatten(-2)[..., :numel].bool()


def chunk_length(numel: int, local_size: int) -> int:
    """Elements per local rank's chunk: ``ceil(numel / local_size)`` (the last chunks are padded)."""
    return -(-numel // local_size)


def ring_wire_bytes(op: str, payload_bytes: int, group_size: int) -> float:
    """Bytes a worker sends in a bandwidth-optimal (ring) collective over ``group_size`` workers that
    each contribute ``payload_bytes``: ``(G - 1) x`` for an allgather, ``2 (G - 1) / G x`` for an all-reduce."""
    if group_size <= 1:
        return 0.0
    if op.endswith("allgather"):
        return float((group_size - 1) * payload_bytes)
    return 2.0 * (group_size - 1) * payload_bytes / group_size


def inter_node_payload_bytes(variant: str, num_nodes: int, chunk: int) -> int:
    """Bytes one worker hands to the inter-node collective for a chunk of ``chunk`` elements."""
    if variant == "allgather":
        return -(-chunk // 8)
    if variant == "sum":
        return 8 * LaneLayout(span=1, world_size=num_nodes).num_words(chunk)
    raise ValueError(f"inter-node variant must be 'allgather' or 'sum', got {variant!r}")


def choose_inter_node(num_nodes: int, chunk: int) -> str:
    """The inter-node variant that sends fewer bytes per worker under ring collectives (ties: allgather)."""
    costs = {
        variant: ring_wire_bytes(
            "cross_allgather" if variant == "allgather" else "cross_sum",
            inter_node_payload_bytes(variant, num_nodes, chunk),
            num_nodes,
        )
        for variant in ("allgather", "sum")
    }
    return "allgather" if costs["allgather"] <= costs["sum"] else "sum"


def _as_uint8(bits: torch.Tensor) -> torch.Tensor:
    return bits.view(torch.uint8) if bits.dtype == torch.bool else bits


def _mean_from_counts(counts: torch.Tensor, group: int) -> torch.Tensor:
    """``(2 count - group) / group`` as float32: the mean of ``group`` ±1 values with ``count`` +1s."""
    return counts.mul(2).sub_(group).to(torch.float32).div_(group)


# ----------------------------------------------------------------------------------------------
# Exchanges
# ----------------------------------------------------------------------------------------------


def flat_one_bit_mean(bits: torch.Tensor, world_size: int) -> Exchange:
    """Exact mean of the workers' ±1 values (``bits``: True for +1), one ``"sum"`` of packed lanes."""
    numel = bits.numel()
    if world_size == 1 or numel == 0:
        return bits.to(torch.float32).mul_(2).sub_(1)
    layout = LaneLayout(span=1, world_size=world_size)
    word_sums = yield "sum", layout.pack(_as_uint8(bits.reshape(-1)), validate=False)
    return _mean_from_counts(layout.unpack(word_sums, numel), world_size)


def hierarchical_one_bit_mean(
    bits: torch.Tensor,
    generator: torch.Generator | None,
    local_size: int,
    local_rank: int,
    num_nodes: int,
    inter_node: str = "auto",
) -> Exchange:
    """Hierarchical-1-bit-All-Reduce of the workers' ±1 values (``bits``: 1-D bool, True for +1).

    Returns float32 ``u_bar`` (mean over nodes of the node-binarized node means), the same on every
    worker; unbiased for the mean of the workers' values. With one node it is ``flat_one_bit_mean``
    (the exact mean). ``generator`` draws this worker's re-binarization of its chunk.
    """
    if inter_node not in INTER_NODE_VARIANTS:
        raise ValueError(f"inter_node must be one of {INTER_NODE_VARIANTS}, got {inter_node!r}")
    bits = bits.reshape(-1)
    numel = bits.numel()
    if num_nodes == 1 or numel == 0:
        return (yield from flat_one_bit_mean(bits, local_size))
    chunk = chunk_length(numel, local_size)
    # 1. intra-node: exact count of +1s over the node's workers.
    if local_size > 1:
        local_layout = LaneLayout(span=1, world_size=local_size)
        word_sums = yield "local_sum", local_layout.pack(_as_uint8(bits), validate=False)
        node_counts = local_layout.unpack(word_sums, numel)
    else:
        node_counts = bits.to(torch.int64)
    # 2. re-binarize this local rank's chunk of the node mean: +1 with probability count / L.
    lo = min(local_rank * chunk, numel)
    mine = node_counts[lo:lo + chunk]
    prob = torch.zeros(chunk, dtype=torch.float32, device=bits.device)
    prob[: mine.numel()] = mine.to(torch.float32).div_(local_size)
    node_bits = binarize(prob, generator)
    # 3. inter-node: 1 bit per element and node.
    variant = choose_inter_node(num_nodes, chunk) if inter_node == "auto" else inter_node
    if variant == "allgather":
        gathered = yield "cross_allgather", pack_bits(node_bits)
        counts = unpack_bits(gathered.view(num_nodes, -1), chunk).sum(dim=0, dtype=torch.int64)
    else:
        cross_layout = LaneLayout(span=1, world_size=num_nodes)
        word_sums = yield "cross_sum", cross_layout.pack(_as_uint8(node_bits), validate=False)
        counts = cross_layout.unpack(word_sums, chunk)
    # 4. every worker gets every chunk's counts.
    if local_size > 1:
        count_layout = LaneLayout(span=num_nodes, world_size=1)
        words = yield "local_allgather", count_layout.pack(counts, validate=False)
        per_chunk = count_layout.num_words(chunk) * count_layout.lanes_per_word
        all_counts = count_layout.unpack(words, local_size * per_chunk).view(local_size, per_chunk)
        counts = all_counts[:, :chunk].reshape(-1)
    return _mean_from_counts(counts[:numel], num_nodes)


# ----------------------------------------------------------------------------------------------
# The optimizer
# ----------------------------------------------------------------------------------------------


@dataclass
class _Layout:
    params: list[torch.Tensor]
    offsets: list[int]
    group_bounds: list[tuple[int, int]]  # [lo, hi) of each param group in the flat buffer
    group_members: list[list[tuple[torch.Tensor, int]]]  # (param, offset) of each group
    numel: int
    device: torch.device
    key: tuple


def _check_number(name: str, value: Any, low: float, high: float, low_open: bool, high_open: bool) -> None:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"Birder: {name} must be a finite number in {interval}, got {value!r}")


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
        hierarchical: Hierarchical-1-bit-All-Reduce across nodes (needs the transport's nodes to cover
            all its workers; over Horovod, ``hvd.init(process_sets="dynamic")``). ``False``, a single
            node, or one worker per node uses the flat 1-bit lane sum.
        inter_node: ``"auto"`` (fewest bytes), ``"allgather"`` or ``"sum"`` between nodes.
        transport: carries the collectives (``HorovodTransport`` / ``MPITransport`` or alike); default
            ``HorovodTransport(process_set)``, created at the first step.
        process_set: Horovod process set of the default transport.
        seed: with the rank, seeds this worker's generator.

    A ``.grad`` of ``None`` counts as a zero gradient (every worker must hold the same parameters).
    ``stats`` describes the last step. ``step_exchange(topology)`` is the step as an exchange generator
    (for ``protocol.simulate``; see ``simulate_step``).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        beta: float = 0.95,
        weight_decay: float = 0.0,
        hierarchical: bool = True,
        inter_node: str = "auto",
        transport: Any = None,
        process_set: Any = None,
        seed: int = 0,
    ) -> None:
        self._check_not_wrapped()
        _check_number("lr", lr, 0.0, math.inf, True, True)
        _check_number("beta", beta, 0.0, 1.0, True, True)
        _check_number("weight_decay", weight_decay, 0.0, math.inf, False, True)
        if inter_node not in INTER_NODE_VARIANTS:
            raise ValueError(f"Birder: inter_node must be one of {INTER_NODE_VARIANTS}, got {inter_node!r}")
        if transport is not None and process_set is not None:
            raise ValueError("Birder: give a transport or a process_set, not both")
        self._layout: _Layout | None = None
        super().__init__(params, {"lr": lr, "beta": beta, "weight_decay": weight_decay})
        self.hierarchical = bool(hierarchical)
        self.inter_node = inter_node
        self.seed = seed
        self._transport = transport
        self._process_set = process_set
        self._generator: torch.Generator | None = None
        self._generator_rank: int | None = None
        self._warned_rank = False
        self._step = 0
        self.stats: dict[str, Any] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # hvd.DistributedOptimizer builds type(name, (Birder,), dict(_DistributedOptimizer.__dict__)).
        super().__init_subclass__(**kwargs)
        if any(name in cls.__dict__ for name in _HOROVOD_WRAPPER_METHODS):
            raise TypeError(_WRAPPED_MESSAGE)

    def _check_not_wrapped(self) -> None:
        if any(hasattr(type(self), name) for name in _HOROVOD_WRAPPER_METHODS):
            raise TypeError(_WRAPPED_MESSAGE)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_layout", None) is not None:
            raise RuntimeError("Birder: add parameter groups before the first step (the flat buffers are fixed)")
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            _check_number("lr", group["lr"], 0.0, math.inf, True, True)
            _check_number("beta", group["beta"], 0.0, 1.0, True, True)
            _check_number("weight_decay", group["weight_decay"], 0.0, math.inf, False, True)
            for p in group["params"]:
                if not p.dtype.is_floating_point:
                    raise TypeError(f"Birder: parameters must be floating point, got {p.dtype}")
        except (ValueError, TypeError):
            self.param_groups.pop()
            raise

    # -- buffers ------------------------------------------------------------------------------

    def _current_layout_key(self) -> tuple:
        return tuple((id(p), p.numel()) for group in self.param_groups for p in group["params"])

    def _ensure_buffers(self) -> _Layout:
        key = self._current_layout_key()
        if self._layout is not None:
            if self._layout.key != key:
                raise RuntimeError("Birder: the parameters changed after the first step")
            return self._layout
        params, offsets, bounds, members, offset = [], [], [], [], 0
        for group in self.param_groups:
            start = offset
            members.append([])
            for p in group["params"]:
                params.append(p)
                offsets.append(offset)
                members[-1].append((p, offset))
                offset += p.numel()
            bounds.append((start, offset))
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(f"Birder: all parameters must be on one device, got {sorted(map(str, devices))}")
        device = devices.pop() if devices else torch.device("cpu")
        self._layout = _Layout(params, offsets, bounds, members, offset, device, key)
        zeros = lambda dtype: torch.zeros(offset, dtype=dtype, device=device)  # noqa: E731
        self._m, self._b, self._grad = zeros(torch.float32), zeros(torch.float32), zeros(torch.float32)
        self._z, self._rand = zeros(torch.float32), zeros(torch.float32)
        self._bits, self._active = zeros(torch.bool), zeros(torch.bool)
        self._all_active = offset == 0
        return self._layout

    def _seed_generator(self, rank: int, device: torch.device) -> torch.Generator:
        if self._generator is None:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(stable_seed(self.seed, "birder", rank))
            self._generator_rank = rank
        return self._generator

    def _gather_grads(self, layout: _Layout) -> torch.Tensor:
        flat = self._grad
        for p, offset in zip(layout.params, layout.offsets):
            part = flat[offset:offset + p.numel()]
            grad = p.grad
            if grad is None:
                part.zero_()
                continue
            if grad.is_sparse or grad.layout != torch.strided:
                raise TypeError("Birder does not support sparse gradients")
            part.copy_(grad.detach().reshape(-1))
        return flat

    # -- the step -----------------------------------------------------------------------------

    @property
    def transport(self) -> Any:
        """The transport (created at first use: ``HorovodTransport(process_set)``)."""
        if self._transport is None:
            from .transport import HorovodTransport

            self._transport = HorovodTransport(self._process_set)
        return self._transport

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Birder step over the transport (every worker must call it); returns ``closure()``'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        transport = self.transport
        exchange = self.step_exchange(transport)
        try:
            request = next(exchange)
            while True:
                request = exchange.send(transport.collective(*request))
        except StopIteration:
            pass
        return loss

    def step_exchange(self, topology: Any = None) -> Exchange:
        """The step as an exchange generator; ``topology`` (``Topology`` or a transport) says where this
        worker sits (default: the transport). Run it to its end on every worker."""
        self._check_not_wrapped()
        topo = topology if topology is not None else self.transport
        size, local_size, cross_size = topo.size, topo.local_size, topo.cross_size
        hierarchical = self.hierarchical and cross_size > 1 and local_size > 1
        if hierarchical and local_size * cross_size != size:
            raise ValueError(
                f"Birder: hierarchical=True needs the nodes ({cross_size} x {local_size}) to hold all {size} "
                "workers of the exchange (e.g. no smaller process set); pass hierarchical=False"
            )
        layout = self._ensure_buffers()
        numel = layout.numel
        generator = self._seed_generator(topo.rank, layout.device)
        if self._generator_rank != topo.rank and not self._warned_rank:
            self._warned_rank = True
            warnings.warn(f"Birder: rank {topo.rank} runs with rank {self._generator_rank}'s generator state; "
                          "each worker should load its own state dict", RuntimeWarning, stacklevel=3)
        grad = self._gather_grads(layout)
        stats = {
            "step": self._step, "skipped": False, "elements": numel,
            "path": "hierarchical" if hierarchical else "flat", "inter_node": None,
            "intra_node_bytes": 0, "inter_node_bytes": 0, "control_bytes": 0,
            "intra_node_wire_bytes": 0.0, "inter_node_wire_bytes": 0.0,
        }
        self.stats = stats

        nonfinite = not bool(torch.isfinite(grad).all())
        fresh = None if nonfinite or self._all_active else grad.ne(0).logical_and_(self._active.logical_not())
        flags = torch.tensor([float(nonfinite), float(fresh is not None and bool(fresh.any())), numel, -numel],
                             dtype=torch.float64)
        flags = yield from self._counted(_single("max", flags), topo, control=True)
        if int(flags[2]) != numel or int(-flags[3]) != numel:
            raise RuntimeError(f"Birder: workers hold different parameter counts ({int(-flags[3])} to {int(flags[2])})")
        if flags[0] > 0:
            warnings.warn(f"Birder: a worker's gradient holds NaN/Inf at step {self._step}; every worker skips "
                          "this step", RuntimeWarning, stacklevel=3)
            stats["skipped"] = True
            return None
        if flags[1] > 0:
            fresh = fresh if fresh is not None else torch.zeros(numel, dtype=torch.bool, device=layout.device)
            mask_layout = LaneLayout(span=1, world_size=size)
            word_sums = yield from self._counted(
                _single("sum", mask_layout.pack(fresh.view(torch.uint8), validate=False)), topo, control=True)
            self._active.logical_or_(mask_layout.unpack(word_sums, numel) > 0)
            self._all_active = bool(self._active.all())

        m, b, z = self._m, self._b, self._z
        for group, (lo, hi) in zip(self.param_groups, layout.group_bounds):
            beta = group["beta"]
            m[lo:hi].mul_(beta).add_(grad[lo:hi], alpha=1 - beta)
            b[lo:hi].mul_(beta).add_(torch.abs(grad[lo:hi], out=z[lo:hi]), alpha=1 - beta)
        unbiased_direction(m, b, out=z)
        bits = binarize(z.add_(1).mul_(0.5), generator, rand_out=self._rand, out=self._bits)

        if hierarchical:
            chunk = chunk_length(numel, local_size)
            variant = choose_inter_node(cross_size, chunk) if self.inter_node == "auto" else self.inter_node
            stats["inter_node"] = variant
            exchange = hierarchical_one_bit_mean(bits, generator, local_size, topo.local_rank, cross_size, variant)
        else:
            stats["inter_node"] = "sum"
            exchange = flat_one_bit_mean(bits, size)
        mean = yield from self._counted(exchange, topo, control=False)
        if not self._all_active:
            mean.masked_fill_(~self._active, 0.0)

        with torch.no_grad():
            for group, members in zip(self.param_groups, layout.group_members):
                lr, decay = group["lr"], group["weight_decay"]
                for p, offset in members:
                    if decay:
                        p.mul_(1 - lr * decay)
                    p.add_(mean[offset:offset + p.numel()].view_as(p).to(p.dtype), alpha=-lr)
        self._step += 1
        stats["step"] = self._step
        return None

    def _counted(self, exchange: Exchange, topo: Any, control: bool) -> Exchange:
        """Pass ``exchange``'s requests through, adding their bytes to ``stats``."""
        stats = self.stats
        try:
            request = next(exchange)
            while True:
                op, tensor = request
                payload = tensor.numel() * tensor.element_size()
                if control:
                    stats["control_bytes"] += payload
                else:
                    kind = "intra_node" if op.startswith("local_") else "inter_node"
                    group = topo.local_size if op.startswith("local_") else (
                        topo.cross_size if op.startswith("cross_") else topo.size)
                    stats[f"{kind}_bytes"] += payload
                    stats[f"{kind}_wire_bytes"] += ring_wire_bytes(op, payload, group)
                request = exchange.send((yield request))
        except StopIteration as done:
            return done.value

    # -- checkpoints --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Torch's state dict plus ``"birder"``: this worker's m, b, active mask, step and generator state."""
        state = super().state_dict()
        self._ensure_buffers()
        state["birder"] = {
            "numel": self._layout.numel,
            "step": self._step,
            "m": self._m.clone(),
            "b": self._b.clone(),
            "active": self._active.clone(),
            "rank": self._generator_rank,
            "generator": None if self._generator is None else self._generator.get_state(),
        }
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        birder = state_dict.pop("birder", None)
        if birder is None:
            raise ValueError("Birder.load_state_dict: no 'birder' entry (not a Birder state dict)")
        layout = self._ensure_buffers()
        if birder["numel"] != layout.numel:
            raise ValueError(f"Birder.load_state_dict: {birder['numel']} elements saved, {layout.numel} here")
        super().load_state_dict(state_dict)
        self._step = int(birder["step"])
        self._m.copy_(birder["m"])
        self._b.copy_(birder["b"])
        self._active.copy_(birder["active"])
        self._all_active = bool(self._active.all())
        if birder["generator"] is None:
            self._generator, self._generator_rank = None, None
        else:
            if self._generator_rank is not None and birder["rank"] != self._generator_rank:
                warnings.warn(f"Birder: loading rank {birder['rank']}'s state on rank {self._generator_rank}; "
                              "each worker should load its own", RuntimeWarning, stacklevel=2)
            self._generator = torch.Generator(device=layout.device)
            self._generator.set_state(birder["generator"])
            self._generator_rank = birder["rank"]


def _single(op: str, tensor: torch.Tensor) -> Exchange:
    return (yield op, tensor)


def simulate_step(optimizers: Sequence[Birder], local_size: int | None = None) -> list[object]:
    """One ``Birder`` step of W = len(optimizers) workers in this process (``protocol.simulate``),
    ``local_size`` workers per node (default: one node). ``optimizers[r]`` is rank r's."""
    world_size = len(optimizers)
    local_size = local_size or world_size
    return simulate(
        [opt.step_exchange(Topology(rank, world_size, local_size)) for rank, opt in enumerate(optimizers)],
        local_size=local_size,
    )
