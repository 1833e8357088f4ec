"""1-bit exchanges of ±1 values (Birder's): an exact mean over all workers, and the Hierarchical-1-bit-All-Reduce.

Values travel as bits (True for +1). N nodes of L workers each (see ``protocol.Placement``).

**Over all workers** (``one_bit_mean``): the workers' bits are summed in ``LaneLayout(span=1,
world_size=W)`` lanes (``bit_length(W)`` bits per element) through one ``Op.SUM``: the exact mean.

**Hierarchical** (``hierarchical_one_bit_mean``):

- intra-node: each worker's bits travel in summable lanes through one ``Op.LOCAL_SUM``: every worker
  gets the exact node count ``c`` of +1s, i.e. the node mean ``2 c / L - 1`` at full precision;
- chunks: local rank ``j`` owns shard ``j`` (``hierarchy.shard_bounds``, padded to ``shard_length``)
  and re-binarizes only that shard of the node mean, unbiasedly (+1 with probability ``c / L``);
- inter-node: 1 bit per element and node, either an ``Op.CROSS_ALLGATHER_EQUAL`` of the bits packed 8 per
  byte, an ``Op.CROSS_SUM`` of ``bit_length(N)``-bit lanes, or ``"two_stage"`` (below, among the
  nodes): ``cost.choose_inter_node`` picks among those allowed the one that sends fewest bytes under
  ring collectives (of the first two, the all-gather wins for N <= 6 and N = 8);
- an ``Op.LOCAL_ALLGATHER`` of the shards' node counts (``bit_length(N)``-bit lanes; one bit after
  the two-stage variant) gives every worker the full ``u_bar``, bitwise identical on all ranks.

**Two-stage** (``two_stage_one_bit_mean``, about 2 bits per element at any group size ``G``): an
``Op.ALLTOALL`` sends part ``j`` of the packed bits to worker ``j``, which counts its part's +1s
exactly and re-binarizes it (+1 with probability ``count / G``); an ``Op.ALLGATHER_EQUAL`` of the parts.

``E[u_bar]`` is the mean over workers of each worker's ``E[u]``: given the draws, a node's (or a
part owner's) re-binarized value has expectation the mean it re-binarizes; nodes are of equal size.
Re-binarizations draw from the caller's counter-based stream ``rng`` (``codec.random.stream_words``; it
should differ from the stream of the bits themselves): uniforms from 0 for a node's shard, then, after
them, for a two-stage part.
``one_bit_route`` / ``route_mean`` pick and run the exchange of a step (Birder's ``route``); ``drawn_route_mean``
draws the bits first, and ``world_chunks`` / ``drawn_lane_mean`` split the world route's draw and sum into
word-aligned chunks (one whole draw's bits), which Birder keeps in flight together.
"""

from __future__ import annotations

from enum import Enum

import torch

from ..codec.onebit import (
    MomentRuns,
    binarize_counts,
    bit_lane_words,
    bits_to_signs,
    count_bit_rows,
    draw_bits,
    draw_lane_words,
    mean_from_counts_into,
    mean_from_lane_counts,
    mean_from_lane_sums,
    pack_bit_rows,
    pack_lane_values,
    runs_within,
    unpack_bit_rows,
    unpack_lane_values,
)
from ..codec.packing import LaneLayout, as_uint8, lane_block_values
from ..codec.random import OUTPUTS_PER_BLOCK
from .cost import INTER_NODE_VARIANTS, choose_inter_node
from .hierarchy import across_nodes, shard_bounds, shard_length
from .protocol import Exchange, Op, Topology


def one_bit_mean(bits: torch.Tensor, world_size: int, out: torch.Tensor | None = None) -> Exchange:
    """Exact mean (float32) of the workers' ±1 values (``bits``: True for +1), one ``Op.SUM`` of lanes
    (``codec.onebit.bit_lane_words``); it is decoded into ``out`` (``codec.onebit.mean_from_lane_sums``:
    ``bits.numel() + bit_padding(layout)`` elements always suffice) if given and several workers exchange."""
    numel = bits.numel()
    if world_size == 1 or numel == 0:
        return bits_to_signs(bits)
    layout = LaneLayout(span=1, world_size=world_size)
    return (yield from lane_words_mean(bit_lane_words(bits, layout), numel, world_size, out))


def lane_words_mean(words: torch.Tensor, numel: int, world_size: int, out: torch.Tensor | None = None) -> Exchange:
    """``one_bit_mean`` of bits this worker has already packed into ``LaneLayout(span=1, world_size)`` words
    (int64 ``bit_lane_words``, e.g. by ``codec.onebit.draw_lane_words``): one ``Op.SUM`` of them, decoded into
    ``out`` if given."""
    layout = LaneLayout(span=1, world_size=world_size)
    word_sums = yield Op.SUM, words
    return mean_from_lane_sums(word_sums, layout, numel, out)


WORLD_CHUNK_ELEMENTS = 1 << 21  # Birder's world route sums its draw in chunks of about this many elements


def world_chunks(numel: int, world_size: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` chunks of about ``WORLD_CHUNK_ELEMENTS`` that cover ``numel`` elements, each starting on a
    whole block of words of ``LaneLayout(span=1, world_size)`` in the blocked order (``bit_lane_words``), which
    is also a block of the random streams (``packing.LANE_BLOCK_WORDS`` is a multiple of their 8 outputs)."""
    unit = lane_block_values(LaneLayout(span=1, world_size=world_size).lanes_per_word)
    size = -(-numel // max(1, -(-numel // WORLD_CHUNK_ELEMENTS)))
    size = max(unit, -(-size // unit) * unit)
    return [(lo, min(lo + size, numel)) for lo in range(0, numel, size)]


def drawn_lane_mean(m: torch.Tensor, b: torch.Tensor, rng: torch.Tensor, lo: int, hi: int, world_size: int,
                    out: torch.Tensor, grad: torch.Tensor | None = None, runs: MomentRuns = ()) -> Exchange:
    """The exact mean over the workers of their draws of elements ``[lo, hi)`` of float32 ``m`` and ``b``
    (``codec.onebit.draw_lane_words``, uniforms ``lo ...`` of ``rng``: the bits of the whole draw; ``lo`` from
    ``world_chunks``), after updating those elements' moments over ``runs`` from ``grad`` (in the draw's pass):
    one ``Op.SUM`` of lane words, decoded into ``out[lo:]`` (float32; ``hi - lo + bit_padding(layout)`` elements
    past ``lo`` suffice). Returns that ``[hi - lo]`` view."""
    layout = LaneLayout(span=1, world_size=world_size)
    words = draw_lane_words(m[lo:hi], b[lo:hi], rng, layout, first=lo,
                            grad=None if grad is None else grad[lo:hi], runs=runs_within(runs, lo, hi))
    return (yield from lane_words_mean(words, hi - lo, world_size, out[lo:]))


def drawn_route_mean(route: Route, m: torch.Tensor, b: torch.Tensor, rng: torch.Tensor, rebinarize: torch.Tensor,
                     topology: Topology, bits: torch.Tensor, out: torch.Tensor | None = None,
                     grad: torch.Tensor | None = None, runs: MomentRuns = ()) -> Exchange:
    """``route_mean`` of this worker's draw ``codec.onebit.draw_bits(m, b, rng, bits, grad, runs)`` (``bits``: bool,
    ``m``'s size; the moments over ``runs`` updated first, in the draw's pass), re-binarizing from the stream
    ``rebinarize``."""
    return (yield from route_mean(route, draw_bits(m, b, rng, bits, grad, runs), rebinarize, topology, out))


def hierarchical_one_bit_mean(
    bits: torch.Tensor,
    rng: torch.Tensor,
    local_size: int,
    local_rank: int,
    num_nodes: int,
    inter_node: str = "auto",
    out: torch.Tensor | None = None,
) -> Exchange:
    """Hierarchical-1-bit-All-Reduce of the workers' ±1 values (``bits``: 1-D bool, True for +1).

    Returns float32 ``u_bar``, the same on every worker, unbiased for the mean of the workers' values (a view of
    ``out``, 1-D float32, where it holds ``bits.numel() + bit_padding`` elements). With one node it is
    ``one_bit_mean`` (exact). ``rng`` draws this worker's re-binarizations.
    ``inter_node``: ``"auto"`` (``"allgather"`` or ``"sum"``, fewer bytes), or one of those or ``"two_stage"``.
    """
    if inter_node not in (*INTER_NODE_VARIANTS, "two_stage"):
        raise ValueError(f"inter_node must be one of {INTER_NODE_VARIANTS}, got {inter_node!r}")
    bits = bits.reshape(-1)
    numel = bits.numel()
    if num_nodes == 1 or numel == 0:
        return (yield from one_bit_mean(bits, local_size, out))
    chunk = shard_length(numel, local_size)
    lo, hi = shard_bounds(numel, local_size, local_rank)
    # 1. intra-node: exact count of +1s over the node's workers (decoded for this local rank's shard only).
    if local_size > 1:
        local_layout = LaneLayout(span=1, world_size=local_size)
        word_sums = yield Op.LOCAL_SUM, local_layout.pack(as_uint8(bits), validate=False)
        per_word = local_layout.lanes_per_word
        first, last = lo // per_word, -(-hi // per_word)
        shard_counts = unpack_lane_values(local_layout, word_sums[first:last],
                                          min(last * per_word, numel) - first * per_word)
        node_counts = shard_counts[lo - first * per_word:hi - first * per_word]
    else:
        node_counts = bits[lo:hi].to(torch.int64)
    # 2. re-binarize this local rank's shard of the node mean: +1 with probability count / L.
    node_bits = binarize_counts(node_counts, local_size, chunk, rng)
    # 3. inter-node: 1 bit per element and node.
    variant = choose_inter_node(num_nodes, chunk) if inter_node == "auto" else inter_node
    span = num_nodes
    if variant == "two_stage":
        node_means = yield from across_nodes(two_stage_one_bit_mean(node_bits, rng, num_nodes, _after(chunk)))
        counts = node_means.to(torch.int64)
        span = 1
    elif variant == "allgather":
        gathered = yield Op.CROSS_ALLGATHER_EQUAL, pack_bit_rows(node_bits)
        counts = count_bit_rows(gathered.view(num_nodes, -1), chunk)
    else:
        cross_layout = LaneLayout(span=1, world_size=num_nodes)
        word_sums = yield Op.CROSS_SUM, cross_layout.pack(as_uint8(node_bits), validate=False)
        counts = unpack_lane_values(cross_layout, word_sums, chunk)
    # 4. every worker gets every shard's counts and decodes their means, shard by shard.
    if out is None or out.numel() < local_size * chunk:
        out = torch.empty(local_size * chunk, dtype=torch.float32, device=bits.device)
    if local_size == 1:
        return mean_from_counts_into(counts, span, out[:chunk])
    count_layout = LaneLayout(span=span, world_size=1)
    words = yield Op.LOCAL_ALLGATHER, pack_lane_values(count_layout, counts)
    per_shard = count_layout.num_words(chunk)
    for shard in range(local_size):
        mean_from_lane_counts(count_layout, words[shard * per_shard:(shard + 1) * per_shard], chunk, span,
                              out[shard * chunk:(shard + 1) * chunk])
    return out[:numel]


def _after(numel: int) -> int:
    """The first uniform of a stream after ``numel`` used ones (a block boundary)."""
    return -(-numel // OUTPUTS_PER_BLOCK) * OUTPUTS_PER_BLOCK


def two_stage_one_bit_mean(bits: torch.Tensor, rng: torch.Tensor, group_size: int, first: int = 0) -> Exchange:
    """Bits (1-D bool ``[n]``, True for +1) re-binarized from the group's mean in two stages (module docstring):
    bit ``e`` is True with probability the fraction of the ``group_size`` workers' bits ``e`` that are True,
    the same on every worker. This worker's part draws uniforms ``first ...`` of the stream ``rng``."""
    numel = bits.numel()
    if group_size == 1 or numel == 0:
        return bits
    part = shard_length(numel, group_size)
    padded = bits
    if group_size * part != numel:
        padded = torch.zeros(group_size * part, dtype=torch.bool, device=bits.device)
        padded[:numel] = bits
    received = yield Op.ALLTOALL, pack_bit_rows(padded.view(group_size, part)).reshape(-1)
    counts = count_bit_rows(received.view(group_size, -1), part)
    mine = binarize_counts(counts, group_size, part, rng, first)
    gathered = yield Op.ALLGATHER_EQUAL, pack_bit_rows(mine)
    return unpack_bit_rows(gathered.view(group_size, -1), part).reshape(-1)[:numel]


class Route(str, Enum):
    """Birder's exchange of a step: over all workers or hierarchical, and the variant between nodes (a ``str``
    enum: its value is what ``Birder.route`` reports, e.g. ``"world:sum"``)."""

    WORLD_SUM = "world:sum"
    WORLD_TWO_STAGE = "world:two_stage"
    HIERARCHICAL_ALLGATHER = "hierarchical:allgather"
    HIERARCHICAL_SUM = "hierarchical:sum"
    HIERARCHICAL_TWO_STAGE = "hierarchical:two_stage"

    @property
    def hierarchical(self) -> bool:
        return self in (Route.HIERARCHICAL_ALLGATHER, Route.HIERARCHICAL_SUM, Route.HIERARCHICAL_TWO_STAGE)

    @property
    def variant(self) -> str:
        """Between nodes: ``"allgather"``, ``"sum"`` or ``"two_stage"`` (``cost.INTER_NODE_VARIANTS``)."""
        return _VARIANTS[self]

    @classmethod
    def of(cls, hierarchical: bool, variant: str) -> Route:
        return next(route for route in cls if route.hierarchical == hierarchical and route.variant == variant)


_VARIANTS = {Route.WORLD_SUM: "sum", Route.WORLD_TWO_STAGE: "two_stage", Route.HIERARCHICAL_ALLGATHER: "allgather",
             Route.HIERARCHICAL_SUM: "sum", Route.HIERARCHICAL_TWO_STAGE: "two_stage"}


def one_bit_route(numel: int, topology: Topology, hierarchical: bool, inter_node: str, exchange: str) -> Route:
    """The exchange of a step. ``exchange``: ``"lanes"`` (``inter_node`` picks between nodes), ``"two_stage"``, or
    ``"auto"`` (the fewest bytes per worker of both, ``cost.choose_inter_node``), the same on every worker."""
    if hierarchical:
        lanes = ("allgather", "sum") if inter_node == "auto" else (inter_node,)
        variants = {"lanes": lanes, "two_stage": ("two_stage",), "auto": (*lanes, "two_stage")}[exchange]
        return Route.of(True, choose_inter_node(topology.cross_size, shard_length(numel, topology.local_size),
                                                variants))
    variants = {"lanes": ("sum",), "two_stage": ("two_stage",), "auto": ("sum", "two_stage")}[exchange]
    return Route.of(False, choose_inter_node(topology.size, numel, variants))


def route_mean(route: Route, bits: torch.Tensor, rng: torch.Tensor, topology: Topology,
               out: torch.Tensor | None = None) -> Exchange:
    """Float32 ``u_bar`` of the workers' bits by ``route`` (``one_bit_route``), re-binarizing from the stream
    ``rng``, written into ``out`` if given (1-D float32 of ``bits.numel()`` elements and ``bit_padding``)."""
    variant = route.variant
    if route.hierarchical:
        return (yield from hierarchical_one_bit_mean(bits, rng, topology.local_size, topology.local_rank,
                                                     topology.cross_size, variant, out))
    if variant == "two_stage":
        drawn = yield from two_stage_one_bit_mean(bits.reshape(-1), rng, topology.size)
        return bits_to_signs(drawn, None if out is None else out[:drawn.numel()])
    return (yield from one_bit_mean(bits.reshape(-1), topology.size, out))
