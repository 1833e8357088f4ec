"""The cost model: bytes a worker sends on the wire under bandwidth-optimal (ring) collectives, and
the time a bucket's exchange takes on a node's uplink.

An all-gather over ``G`` workers sends ``(G - 1)`` times each worker's payload, an all-reduce
``2 (G - 1) / G`` times, an all-to-all ``(G - 1) / G`` times (the parts for the other workers).
``choose_inter_node`` uses it to pick Birder's inter-node variant.

``exchange_cost`` models the exchanges of summed max-norm levels on ``N`` nodes of ``L`` workers
(``W = N L``) with an uplink of given bandwidth and latency: the lanes grow with ``W``
(``bit_length(2 s W)`` bits), the two-stage exchange does not (``2 (bits + 1)`` bits in all) but its
all-to-all sends ``L`` workers' parts through one uplink, where a ring sends one worker's. So
``choose_exchange`` (what ``exchange="auto"`` calls per bucket with error feedback; without, it times both
exchanges, ``hvdcomp.exchange.route``) picks two-stage for one worker per
node (or across nodes in hierarchical mode) once the bucket is large enough for its per-chunk
headers, and lanes for flat exchanges over nodes of several workers.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..codec.packing import LaneLayout, lane_block_words, plane_bytes
from .protocol import Reduction

INTER_NODE_VARIANTS = ("auto", "allgather", "sum")


def ring_wire_bytes(reduction: Reduction, payload_bytes: int, group_size: int) -> float:
    """Bytes one worker sends in a ring collective over ``group_size`` workers that each contribute
    ``payload_bytes``: ``(G - 1) x`` for an all-gather, ``2 (G - 1) / G x`` for an all-reduce, ``(G - 1) / G x``
    for an all-to-all."""
    if group_size <= 1:
        return 0.0
    if reduction is Reduction.ALLGATHER:
        return float((group_size - 1) * payload_bytes)
    if reduction is Reduction.ALLTOALL:
        return (group_size - 1) * payload_bytes / group_size
    return 2.0 * (group_size - 1) * payload_bytes / group_size


def inter_node_payload_bytes(variant: str, num_nodes: int, chunk: int) -> int:
    """Bytes one worker hands to the inter-node collective of the 1-bit exchange for ``chunk`` elements:
    packed bits (``"allgather"``) or ``bit_length(num_nodes)``-bit summable lanes (``"sum"``)."""
    if variant == "allgather":
        return -(-chunk // 8)
    if variant == "sum":
        return 8 * LaneLayout(span=1, world_size=num_nodes).num_words(chunk)
    raise ValueError(f"inter-node variant must be 'allgather' or 'sum', got {variant!r}")


def one_bit_wire_bytes(variant: str, group_size: int, chunk: int) -> float:
    """Bytes one worker sends under ring collectives for the 1-bit exchange of ``chunk`` elements among
    ``group_size`` workers: ``"allgather"`` / ``"sum"`` (``inter_node_payload_bytes``) or ``"two_stage"`` (an
    all-to-all of ``group_size`` packed parts of ``ceil(chunk / group_size)`` bits, an all-gather of one)."""
    if variant == "two_stage":
        part = plane_bytes(-(-chunk // group_size), 1)
        return (ring_wire_bytes(Reduction.ALLTOALL, group_size * part, group_size)
                + ring_wire_bytes(Reduction.ALLGATHER, part, group_size))
    reduction = Reduction.ALLGATHER if variant == "allgather" else Reduction.SUM
    return ring_wire_bytes(reduction, inter_node_payload_bytes(variant, group_size, chunk), group_size)


def choose_inter_node(num_nodes: int, chunk: int, variants: tuple[str, ...] = ("allgather", "sum")) -> str:
    """The 1-bit variant among ``variants`` that sends fewest bytes per worker (``one_bit_wire_bytes``; ties: the
    first listed)."""
    return min(variants, key=lambda variant: (one_bit_wire_bytes(variant, num_nodes, chunk), variants.index(variant)))

# -- the exchanges of summed max-norm levels: lanes, two-stage, and their variants -----------------------------

EXCHANGES = ("auto", "lanes", "two_stage")
SCHEMES = ("lanes", "two_stage", "reduce_scatter_lanes", "hierarchical_lanes", "hierarchical_two_stage")
TWO_STAGE_HEADER_BYTES = 4  # per chunk: its index (int32) in the all-to-all, its scale (float32) in the all-gather
SCALE_ROUND_BYTES = 8  # the shared scale's MAX (one float32 scale and the NaN/Inf flag, per tensor)


@dataclass(frozen=True)
class Link:
    """A node's uplink: ``bandwidth`` in bytes per second, ``latency`` in seconds per message step."""

    bandwidth: float = 1.25e9
    latency: float = 50e-6


@dataclass(frozen=True)
class CodecCost:
    """A worker's codec seconds per element of a bucket (compress and decompress, one core) for each exchange:
    the lanes' encode and decode, and the two-stage exchange's planes, its owner's sum and re-quantization and its
    decode (native kernels, AMD EPYC: docs/benchmarks.md, "Codec cost of the exchanges")."""

    lanes: float = 2.4e-9
    two_stage: float = 5.4e-9

    def seconds(self, scheme: str, numel: int) -> float:
        """The codec time of a flat ``scheme`` (``SCHEMES``; the reduce-scatter of lanes as two-stage) on ``numel``
        elements."""
        return numel * (self.lanes if scheme == "lanes" else self.two_stage)


def plain_width(bits: int) -> int:
    """Bits of a plainly packed signed level in ``[-s, s]``, ``s = 2**bits - 1``: ``bits + 1``."""
    return (2 * (2**bits - 1)).bit_length()


def lanes_payload_bytes(numel: int, bits: int, group_size: int) -> int:
    """Bytes of one worker's summable lanes of ``numel`` levels over ``group_size`` workers (int64 words)."""
    return 8 * lane_block_words(numel, LaneLayout.for_levels(2**bits - 1, group_size).lanes_per_word)


def two_stage_row_bytes(numel: int, bits: int, group_size: int) -> int:
    """Bytes of one chunk of the two-stage exchange (header and ``plain_width(bits)`` bit planes of
    ``ceil(numel / group_size)`` levels): a worker sends ``group_size`` rows to the all-to-all, one to the
    all-gather."""
    return TWO_STAGE_HEADER_BYTES + plane_bytes(-(-numel // group_size), plain_width(bits))


def node_uplink_bytes(reduction: Reduction, payload_bytes: float, group_size: int, workers_per_node: int) -> float:
    """Bytes that leave a node through its uplink for one collective over ``group_size`` workers laid out node by
    node, ``workers_per_node`` of them per node, each contributing ``payload_bytes``. A ring crosses each node
    boundary once, so a ring collective loads the uplink as one worker's ``ring_wire_bytes``; an all-to-all sends
    every worker's parts for the other nodes: ``workers_per_node (G - workers_per_node) / G x``."""
    if group_size <= workers_per_node:
        return 0.0
    if reduction is Reduction.ALLTOALL:
        return workers_per_node * (group_size - workers_per_node) * payload_bytes / group_size
    return ring_wire_bytes(reduction, payload_bytes, group_size)


def _steps(reduction: Reduction, group_size: int) -> int:
    """Message steps of one collective: ``2 (G - 1)`` for a ring all-reduce, ``G - 1`` otherwise."""
    return (2 if reduction in (Reduction.SUM, Reduction.MAX) else 1) * max(group_size - 1, 0)


def exchange_cost(scheme: str, numel: int, bits: int, world_size: int, workers_per_node: int = 1,
                  link: Link = Link(), codec: CodecCost = CodecCost()) -> tuple[float, float]:
    """``(uplink bytes, seconds)`` of one bucket of ``numel`` elements at ``bits`` bits, ``world_size`` workers of
    ``workers_per_node`` per node, for ``scheme`` (``SCHEMES``); seconds = uplink bytes / bandwidth + message
    steps x latency + the codec's time (the node's uplink binds and intra-node traffic is free; on a single node,
    each worker's own link). Per scheme:

    - ``lanes``: the shared scale's MAX, then one SUM of ``bit_length(2 s W)``-bit lanes;
    - ``two_stage``: the MAX, an all-to-all of plain chunks, an all-gather of the re-quantized chunks;
    - ``reduce_scatter_lanes``: the MAX, a reduce-scatter of the lanes, an all-gather of re-quantized chunks
      (modelled only);
    - ``hierarchical_*``: a full-precision sum inside each node (free here), then each of the node's workers
      runs the flat scheme on ``1 / workers_per_node`` of the bucket among the ``N`` nodes (one worker per node
      in each group), all of them through the same uplink.
    """
    local = max(workers_per_node, 1) if world_size > workers_per_node else 1  # one node: each worker's link binds
    if scheme.startswith("hierarchical_"):
        nodes = world_size // local
        shard = -(-numel // local)
        uplink, seconds = exchange_cost(scheme[len("hierarchical_"):], shard, bits, nodes, 1, link, codec)
        return local * uplink, seconds + (local * uplink - uplink) / link.bandwidth
    # (reduction, bytes per worker, workers per node whose parts leave the node): ring collectives load an uplink as
    # one worker does; a reduce-scatter, as a ring, sends (G - 1) / G of the lanes, which an all-to-all of one
    # worker per node models.
    rounds = [(Reduction.MAX, float(SCALE_ROUND_BYTES), 1)]
    lanes = float(lanes_payload_bytes(numel, bits, world_size))
    row = float(two_stage_row_bytes(numel, bits, world_size))
    if scheme == "lanes":
        rounds.append((Reduction.SUM, lanes, 1))
    elif scheme == "two_stage":
        rounds += [(Reduction.ALLTOALL, world_size * row, local), (Reduction.ALLGATHER, row, 1)]
    elif scheme == "reduce_scatter_lanes":
        rounds += [(Reduction.ALLTOALL, lanes, 1), (Reduction.ALLGATHER, row, 1)]
    else:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    uplink, seconds = 0.0, codec.seconds(scheme, numel)
    for reduction, payload, per_node in rounds:
        moved = node_uplink_bytes(reduction, payload, world_size, per_node)
        uplink += moved
        seconds += moved / link.bandwidth + _steps(reduction, world_size) * link.latency
    return uplink, seconds


def choose_exchange(numel: int, bits: int, world_size: int, workers_per_node: int = 1, link: Link = Link(),
                    codec: CodecCost = CodecCost()) -> str:
    """``"lanes"`` or ``"two_stage"`` for one bucket, whichever ``exchange_cost`` says is faster (ties: lanes): the
    two-stage exchange's extra codec time must be paid for by the bytes it saves on ``link``."""
    lanes = exchange_cost("lanes", numel, bits, world_size, workers_per_node, link, codec)[1]
    two_stage = exchange_cost("two_stage", numel, bits, world_size, workers_per_node, link, codec)[1]
    return "two_stage" if two_stage < lanes else "lanes"
