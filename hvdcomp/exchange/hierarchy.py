"""Hierarchical routing: full precision inside a node, the codec's compressed payload only between nodes.

Both routes first sum the bucket over the node's workers (``Op.LOCAL_SUM``, float32 on the fast
intra-node links) and take the node mean. Each local rank then owns a shard and runs the codec on it
with the workers of the same local rank on the other nodes (its ``WORLD`` collectives become
``CROSS`` ones, ``world_size`` = number of nodes), so every local rank carries 1/local_size of the
bucket across nodes. An ``Op.LOCAL_ALLGATHER`` of the shards gives every worker the full mean.
Nodes must have equal numbers of workers, so the mean of node means is the mean over all workers.

- ``hierarchical_elementwise``: shards are slices of the flat vector (``shard_bounds``); the codec
  learns where its slice lies in the bucket (``bucket.Segments``).
- ``hierarchical_tensors``: shards are whole tensors, balanced by size (e.g. PowerSGD).

``bucket_exchange`` picks the route of one bucket for any codec, hierarchical or over all workers.

``shard_bounds`` is the one sharding rule of the project (Birder's 1-bit exchange uses it too):
shards of ``ceil(numel / shards)`` elements, the last ones shorter or empty.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch

from ..codec.pieces import Pieces
from .bucket import BucketCodec, ElementwiseCodec, Segments
from .protocol import Exchange, Op, Topology, relay


def across_nodes(inner: Exchange) -> Exchange:
    """Run ``inner`` (``WORLD`` collectives only) among the workers sharing this local rank."""
    return relay(inner, lambda op, tensor: (op.across_nodes(), tensor))


def shard_length(numel: int, shards: int) -> int:
    """Elements of the largest shard: ``ceil(numel / shards)``."""
    return -(-numel // shards)


def shard_bounds(numel: int, shards: int, index: int) -> tuple[int, int]:
    """``[lo, hi)`` of shard ``index``: consecutive shards of ``shard_length`` elements, clipped to ``numel``."""
    length = shard_length(numel, shards)
    return min(index * length, numel), min((index + 1) * length, numel)


def hierarchical_elementwise(
    codec_exchange: Callable[[torch.Tensor, Sequence[int], Hashable, int], Exchange],
    flat: torch.Tensor,
    segments: Sequence[int],
    key: Hashable,
    local_size: int,
    local_rank: int,
    cross_size: int,
) -> Exchange:
    """Hierarchical exchange of a flat float32 vector (tensors of ``segments`` sizes); returns the mean
    over all workers.

    ``codec_exchange(shard, shard_segments, shard_key, world_size)`` builds the codec's exchange;
    ``shard_segments`` is a ``Segments``: this shard's place in the bucket, keyed ``key`` (so the
    codec can choose per tensor alike in every shard), and ``shard_key`` is ``(key, local_rank)``. It is
    built before the first collective (its configuration checks fail on every worker alike), over
    ``flat[lo:hi]``, which then receives the node mean: ``flat`` is scratch.
    """
    lo, hi = shard_bounds(flat.numel(), local_size, local_rank)
    shard = flat[lo:hi]
    inner = codec_exchange(shard, Segments(tuple(segments), key, lo, hi), (key, local_rank), cross_size)
    node_sum = yield Op.LOCAL_SUM, flat
    torch.div(node_sum[lo:hi], local_size, out=shard)
    shard_mean = yield from across_nodes(inner)
    return (yield Op.LOCAL_ALLGATHER, shard_mean)


def balanced_owners(sizes: Sequence[int], shards: int) -> list[int]:
    """Owner (local rank) of each tensor: largest first to the least loaded shard."""
    load = [0] * shards
    owners = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        owner = min(range(shards), key=lambda s: load[s])
        owners[index] = owner
        load[owner] += sizes[index]
    return owners


def hierarchical_tensors(
    codec_exchange: Callable[[list[torch.Tensor], Hashable, int], Exchange],
    grads: Sequence[torch.Tensor],
    key: Hashable,
    local_size: int,
    local_rank: int,
    cross_size: int,
) -> Exchange:
    """Hierarchical exchange of whole tensors; returns the list of means over all workers (float32).

    ``codec_exchange(tensors, shard_key, world_size)`` builds the codec's exchange over a list.
    """
    flat = torch.cat([g.reshape(-1).float() for g in grads]) if grads else torch.zeros(0)
    node_sum = yield Op.LOCAL_SUM, flat
    node_mean = node_sum.div_(local_size).split([g.numel() for g in grads])
    owners = balanced_owners([g.numel() for g in grads], local_size)
    mine = [node_mean[i].view(grads[i].shape) for i in range(len(grads)) if owners[i] == local_rank]
    means = yield from across_nodes(codec_exchange(mine, (key, local_rank), cross_size))
    flat_mine = torch.cat([m.reshape(-1).float() for m in means]) if means else flat.new_zeros(0)
    gathered = yield Op.LOCAL_ALLGATHER, flat_mine
    # the gather is ordered by local rank; within a rank, by tensor index
    order = sorted(range(len(grads)), key=lambda i: (owners[i], i))
    pieces = gathered.split([grads[i].numel() for i in order])
    out: list[torch.Tensor] = [torch.empty(0)] * len(grads)
    for index, piece in zip(order, pieces):
        out[index] = piece.view(grads[index].shape)
    return out


def bucket_exchange(codec: BucketCodec, flat: torch.Tensor, grads: Sequence[torch.Tensor], key: Hashable, step: int,
                    topology: Topology, hierarchical: bool, out: torch.Tensor | None = None,
                    pieces: Pieces | None = None) -> Exchange:
    """One bucket's exchange with ``codec``, hierarchical or over all ``topology.size`` workers.

    An ``ElementwiseCodec`` exchanges ``flat`` (float32, ``grads`` concatenated, filled by the caller;
    scratch when hierarchical) and returns the flat mean; a ``TensorCodec`` exchanges ``grads`` and returns
    the list of means. ``out``: where the flat mean should go, for a codec that ``takes_out``; ``pieces``: ``grads``
    as ``Pieces``, for a codec that ``reads_pieces``, ``flat`` then unfilled scratch (over all workers only;
    ``ElementwiseCodec.exchange``)."""
    t = topology
    if pieces is not None and (hierarchical or not isinstance(codec, ElementwiseCodec) or not codec.reads_pieces):
        raise ValueError("pieces go to an element-wise codec that reads them (reads_pieces), over all workers")
    if isinstance(codec, ElementwiseCodec):
        sizes = [g.numel() for g in grads]
        if not hierarchical:
            if pieces is not None:
                return codec.exchange(flat, sizes, key, step, t.size, pieces=pieces)
            if out is not None and codec.takes_out:
                return codec.exchange(flat, sizes, key, step, t.size, out=out)
            return codec.exchange(flat, sizes, key, step, t.size)

        def shard(x: torch.Tensor, segments: Sequence[int], shard_key: Hashable, size: int) -> Exchange:
            return codec.exchange(x, segments, shard_key, step, size)

        return hierarchical_elementwise(shard, flat, sizes, key, t.local_size, t.local_rank, t.cross_size)
    if not hierarchical:
        return codec.exchange(grads, key, step, t.size)

    def tensors(xs: list[torch.Tensor], shard_key: Hashable, size: int) -> Exchange:
        return codec.exchange(xs, shard_key, step, size)

    return hierarchical_tensors(tensors, grads, key, t.local_size, t.local_rank, t.cross_size)
