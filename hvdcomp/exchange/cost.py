"""The cost model: bytes a worker sends on the wire under bandwidth-optimal (ring) collectives.

An all-gather over ``G`` workers sends ``(G - 1)`` times each worker's payload, an all-reduce
``2 (G - 1) / G`` times. ``choose_inter_node`` uses it to pick Birder's inter-node variant.
"""

from __future__ import annotations

from ..codec.packing import LaneLayout
from .protocol import Reduction

INTER_NODE_VARIANTS = ("auto", "allgather", "sum")


def ring_wire_bytes(reduction: Reduction, payload_bytes: int, group_size: int) -> float:
    """Bytes one worker sends in a ring collective over ``group_size`` workers that each contribute
    ``payload_bytes``: ``(G - 1) x`` for an all-gather, ``(G - 1) / G x`` for an all-to-all (all but its
    own chunk), ``2 (G - 1) / G x`` for an all-reduce."""
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


def choose_inter_node(num_nodes: int, chunk: int) -> str:
    """The inter-node variant that sends fewer bytes per worker under ring collectives (ties: allgather)."""
    gather = ring_wire_bytes(Reduction.ALLGATHER, inter_node_payload_bytes("allgather", num_nodes, chunk), num_nodes)
    lanes = ring_wire_bytes(Reduction.SUM, inter_node_payload_bytes("sum", num_nodes, chunk), num_nodes)
    return "allgather" if gather <= lanes else "sum"
