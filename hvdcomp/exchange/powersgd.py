"""PowerSGD (Vogels et al., 2019): low-rank gradient compression as a bucket codec.

``PowerSGD`` is a ``TensorCodec`` (see ``bucket``): its exchange (see ``protocol``) takes one
bucket — a list of gradients of any shapes and float dtypes on one device — and returns each
gradient's mean over the workers, identical on every worker, in its shape and dtype. Each tensor is viewed as a matrix
``n x m`` (``n = shape[0]``, ``m = numel / n``); 0-d/1-d tensors and matrices whose compression rate
``n * m / ((n + m) * r)`` is below ``min_compression_rate`` (``r = min(rank, n, m)``) are averaged
uncompressed, the others are replaced by a rank-``r`` approximation of their mean, computed with one
step of subspace (power) iteration:

1. ``M = grad + memory`` (error feedback), ``P = M Q``; round 1 sums the uncompressed tensors and
   every ``P`` (``n x r``) in one flat buffer; ``P <- orthogonalize(sum / W)``;
2. ``Q = M^T P``; round 2 sums every ``Q`` (``m x r``); ``Q <- sum / W``;
3. the result is ``P Q^T``; ``memory <- M - P Q_local^T`` with this worker's own ``Q_local`` (before
   round 2), as in the paper's reference code (epfml/powersgd).

Both rounds are ``Op.SUM`` requests of flat float32 buffers (float64 if the bucket holds a float64
tensor), so exactly ``numel(uncompressed) + sum(n * r)`` and ``sum(m * r)`` floats travel. Before
step ``start_iter`` (and for buckets where nothing is compressed) a single ``Op.SUM`` round carries
everything uncompressed and the state is left alone.

Differences from PyTorch's ``powerSGD_hook`` (which this mirrors):

- ``start_iter`` defaults to 0 (torch's ``start_powerSGD_iter`` defaults to 1000 and must be > 1
  with error feedback or warm start, a DDP bucket-rebuild constraint that does not apply here).
- Memories, ``P`` and ``Q`` are kept and communicated in float32 whatever the gradient dtype
  (torch uses the bucket dtype, so fp16 buckets overflow/underflow in Gram-Schmidt).
- The error-feedback memory is the paper's "local error" ``M - P Q_local^T`` (torch:
  ``M - P Q_mean^T``). The workers' mean memory, and hence every result, is the same in exact
  arithmetic, but torch's memories also accumulate each worker's whole deviation from the mean
  gradient (a random walk), whereas ours drop its part in the span of ``P`` every step (none is left
  when ``r = n``). Smaller memories cancel with less rounding in the sums; the price is one more
  batched matmul (``n x r`` by ``r x m``) per step.
- Orthogonalization is always Gram-Schmidt (vectorised over the matrices of a batch and, for the
  projections, over columns), with a second pass for ``r > 1``. Torch uses one pass for ``r <= 2``
  or half precision and ``torch.linalg.qr`` otherwise (which ignores the epsilon); one pass loses
  orthogonality when ``P`` is ill-conditioned, as it becomes under warm start on gradients with a
  decaying spectrum.
- Matrices of a bucket with the same ``n x m`` are stacked into one ``[B, n, m]`` batch (the stack is
  the ``M = grad + memory`` buffer, which then becomes the next memory), as torch's
  ``batch_tensors_with_same_shape=True``.
- ``P`` is averaged (divided by ``W``) before orthogonalization, so ``orthogonalization_epsilon``
  acts on the scale of one worker's gradient whatever the world size.
- A tensor is compressed when its rate is at least ``min_compression_rate`` (torch: strictly above).
- With ``orthogonalization_epsilon=0`` an all-zero column stays zero (torch divides by zero and
  produces NaN), so an all-zero gradient comes back as zeros. A warm-start ``Q`` column that comes
  back exactly zero (e.g. after a zero gradient) is redrawn at random, identically on every worker;
  otherwise it would stay zero forever and that matrix would never be updated again.
- Non-finite values: if anything reduced in a bucket is NaN/Inf, every worker gets NaN for the
  compressed tensors concerned (the uncompressed ones are averaged as they are), a warning is issued,
  and the memories and ``Q``s are left unchanged (the step ``torch.amp.GradScaler`` skips).
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..codec.lowrank import flatten_into, orthogonalize, split_views, unflatten_like
from ..codec.seeding import stable_seed
from ..codec.validate import check_bool, check_int, check_real
from .bucket import TensorCodec
from .protocol import Exchange, Op

# Options that shape the stored state; ``load_state_dict`` refuses a state saved with other values.
_STATE_OPTIONS = ("rank", "min_compression_rate", "error_feedback", "warm_start", "orthogonalization_epsilon", "seed")


@dataclass(frozen=True)
class _Group:
    """The compressed tensors of a bucket that share a matrix shape, batched as ``[B, n, m]``."""

    n: int
    m: int
    rank: int
    indices: tuple[int, ...]  # positions in the bucket


@dataclass(frozen=True)
class _Plan:
    signature: tuple  # what the stored state depends on: the bucket's shapes and the working dtype
    dtype: torch.dtype  # working / wire dtype
    uncompressed: tuple[int, ...]
    groups: tuple[_Group, ...]


@dataclass
class _BucketState:
    signature: tuple
    memories: list[torch.Tensor | None]  # per group, [B, n, m] (error feedback)
    qs: list[torch.Tensor | None]  # per group, [B, m, r], orthonormal columns (warm start)


class PowerSGD(TensorCodec):
    """PowerSGD bucket codec with its per-bucket state (error-feedback memories, warm-start ``Q``s).

    Every worker runs its own instance, configured alike. Options mirror torch's ``PowerSGDState``:

    Args:
        rank: approximation rank ``r >= 1`` (capped at ``min(n, m)`` per matrix).
        start_iter: steps (``step < start_iter``) of plain averaging before compressing; default 0
            (torch's ``start_powerSGD_iter`` defaults to 1000).
        min_compression_rate: compress a matrix only if ``n * m >= min_compression_rate * (n + m) * r``.
        error_feedback: keep what the approximation missed and add it to the next gradient.
        warm_start: reuse last step's ``Q`` (one more power-iteration step per training step) instead of
            drawing a fresh random one each step.
        orthogonalization_epsilon: added to each column norm in Gram-Schmidt (0: exact, zero-safe).
        seed: shared seed of the random ``Q``s; every worker must pass the same value.
    """

    def __init__(
        self,
        rank: int = 1,
        start_iter: int = 0,
        min_compression_rate: float = 2.0,
        error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0.0,
        seed: int = 0,
    ) -> None:
        self.rank = check_int("rank", rank, 1)
        self.start_iter = check_int("start_iter", start_iter, 0)
        self.min_compression_rate = check_real("min_compression_rate", min_compression_rate)
        self.error_feedback = check_bool("error_feedback", error_feedback)
        self.warm_start = check_bool("warm_start", warm_start)
        self.orthogonalization_epsilon = check_real("orthogonalization_epsilon", orthogonalization_epsilon)
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        self.seed = int(seed)
        self._buckets: dict[object, _BucketState] = {}

    def config(self) -> tuple:
        """What every worker must share."""
        return (
            self.rank,
            self.start_iter,
            self.min_compression_rate,
            self.error_feedback,
            self.warm_start,
            self.orthogonalization_epsilon,
            self.seed,
        )

    # ------------------------------------------------------------------ planning and state

    def _plan(self, grads: Sequence[torch.Tensor]) -> _Plan:
        dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
        uncompressed: list[int] = []
        by_shape: dict[tuple[int, int], list[int]] = {}
        for index, grad in enumerate(grads):
            if grad.dim() >= 2 and grad.numel() > 0:
                n = grad.shape[0]
                m = grad.numel() // n
                rank = min(self.rank, n, m)
                if n * m >= self.min_compression_rate * (n + m) * rank:
                    by_shape.setdefault((n, m), []).append(index)
                    continue
            uncompressed.append(index)
        groups = tuple(_Group(n, m, min(self.rank, n, m), tuple(ix)) for (n, m), ix in by_shape.items())
        signature = (tuple(tuple(g.shape) for g in grads), str(dtype).replace("torch.", ""))
        return _Plan(signature, dtype, tuple(uncompressed), groups)

    def _state(self, key: object, plan: _Plan, device: torch.device) -> _BucketState:
        """The bucket's state, reset if its layout changed, moved to ``device`` if needed."""
        state = self._buckets.get(key)
        if state is None or state.signature != plan.signature:
            state = _BucketState(plan.signature, [None] * len(plan.groups), [None] * len(plan.groups))
            self._buckets[key] = state
        for buffers in (state.memories, state.qs):
            for i, buffer in enumerate(buffers):
                if buffer is not None and buffer.device != device:
                    buffers[i] = buffer.to(device)
        return state

    def _draw_q(
        self, key: object, group: _Group, step: int | None, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """Orthonormalized Gaussian ``[B, m, r]`` from dedicated CPU generators, one per tensor, seeded by
        ``(seed, key, index)`` (plus ``step`` unless None): the same on every worker, global RNG untouched."""
        draws = []
        for index in group.indices:
            parts = (self.seed, key, index) if step is None else (self.seed, key, index, step)
            generator = torch.Generator().manual_seed(stable_seed(*parts))
            draws.append(torch.randn(group.m, group.rank, generator=generator, dtype=dtype))
        return orthogonalize(torch.stack(draws).to(device), self.orthogonalization_epsilon)

    # ------------------------------------------------------------------ the protocol

    def exchange(self, grads: Sequence[torch.Tensor], key: Hashable, step: int, world_size: int) -> Exchange:
        """Protocol for one bucket; returns the list of mean gradients (same shapes and dtypes).

        ``grads``: this worker's gradients (float tensors of any shapes, one device); every worker
        passes the same shapes in the same order. ``key`` identifies the bucket across steps (state)
        and seeds ``Q``; it needs a ``repr`` that is the same in every process (int, str, tuple).
        ``step`` is the training step (``start_iter``; cold-start ``Q`` seeds).

        Requests: once compressing, ``Op.SUM`` of ``[uncompressed values..., P...]`` then ``Op.SUM`` of
        ``[Q...]`` (flat, float32, or float64 for a bucket with a float64 tensor; tensors in bucket
        order, ``P``/``Q`` grouped by matrix shape in order of first appearance, each ``[B, n, r]`` /
        ``[B, m, r]`` row-major). Before ``start_iter``, or if nothing is compressed, a single ``Op.SUM``
        of every tensor flattened in bucket order. An empty bucket communicates nothing and returns ``[]``.
        """
        grads = list(grads)
        for grad in grads:
            if not isinstance(grad, torch.Tensor) or not grad.is_floating_point():
                raise ValueError(f"gradients must be floating-point tensors, got {getattr(grad, 'dtype', grad)!r}")
        grads = [g.detach() for g in grads]
        device = grads[0].device if grads else torch.device("cpu")
        if any(g.device != device for g in grads):
            raise ValueError("all tensors of a bucket must be on one device")
        check_int("world_size", world_size, 1)
        check_int("step", step, 0)
        return self._exchange(grads, key, step, world_size, device)

    def _exchange(
        self, grads: list[torch.Tensor], key: object, step: int, world_size: int, device: torch.device
    ) -> Exchange:
        if not grads:  # e.g. a shard that owns no tensor: nothing to communicate
            return []
        plan = self._plan(grads)
        dtype = plan.dtype
        if step < self.start_iter or not plan.groups:
            flat = flatten_into(grads, dtype, device)
            reduced = yield Op.SUM, flat
            return unflatten_like(reduced.div_(world_size), grads)

        state = self._state(key, plan, device)
        eps = self.orthogonalization_epsilon
        uncompressed = [grads[i] for i in plan.uncompressed]
        u_numel = sum(g.numel() for g in uncompressed)
        p_sizes = [len(g.indices) * g.n * g.rank for g in plan.groups]
        q_sizes = [len(g.indices) * g.m * g.rank for g in plan.groups]

        # Round 1: uncompressed values and P = M Q.
        send = torch.empty(u_numel + sum(p_sizes), dtype=dtype, device=device)
        flatten_into(uncompressed, dtype, device, out=send[:u_numel])
        matrices = []
        for gi, (group, p_view) in enumerate(zip(plan.groups, split_views(send[u_numel:], p_sizes))):
            batch = torch.empty(len(group.indices), group.n, group.m, dtype=dtype, device=device)
            for j, index in enumerate(group.indices):
                batch[j].copy_(grads[index].reshape(group.n, group.m))
            if self.error_feedback and state.memories[gi] is not None:
                batch.add_(state.memories[gi])
            matrices.append(batch)
            q = state.qs[gi] if self.warm_start else None
            if q is None:
                q = self._draw_q(key, group, None if self.warm_start else step, dtype, device)
            torch.bmm(batch, q, out=p_view.view(-1, group.n, group.rank))
        reduced = yield Op.SUM, send
        reduced.div_(world_size)
        finite = torch.isfinite(reduced).all()
        results: list[torch.Tensor | None] = [None] * len(grads)
        for index, mean in zip(plan.uncompressed, unflatten_like(reduced[:u_numel], uncompressed)):
            results[index] = mean
        p_views = split_views(reduced[u_numel:], p_sizes)
        ps = [orthogonalize(p.view(-1, g.n, g.rank), eps) for g, p in zip(plan.groups, p_views)]

        # Round 2: Q = M^T P; the memory keeps what this worker's own approximation P Q^T misses.
        send = torch.empty(sum(q_sizes), dtype=dtype, device=device)
        for group, batch, p, q_view in zip(plan.groups, matrices, ps, split_views(send, q_sizes)):
            q_local = q_view.view(-1, group.m, group.rank)
            torch.bmm(batch.transpose(1, 2), p, out=q_local)
            if self.error_feedback:
                batch.baddbmm_(p, q_local.transpose(1, 2), alpha=-1)
        reduced = yield Op.SUM, send
        reduced.div_(world_size)
        finite &= torch.isfinite(reduced).all()

        qs = [q.view(-1, g.m, g.rank) for g, q in zip(plan.groups, split_views(reduced, q_sizes))]
        for group, p, q in zip(plan.groups, ps, qs):
            approx = torch.bmm(p, q.transpose(1, 2))
            ok = torch.isfinite(p).flatten(1).all(1) & torch.isfinite(q).flatten(1).all(1)
            approx.masked_fill_(~ok.view(-1, 1, 1), float("nan"))
            for j, index in enumerate(group.indices):
                results[index] = approx[j].view(grads[index].shape).to(grads[index].dtype)

        dead = []
        if self.warm_start:  # next step's Q: orthonormalized now; all-zero columns are redrawn below
            for q in qs:
                orthogonalize(q, eps)
                dead.append((q.abs().amax(dim=1) == 0).flatten())
        flags = torch.cat([(~finite).view(1)] + dead).tolist()  # the one host sync of a step
        if flags[0]:
            warnings.warn(
                f"hvdcomp: non-finite values in PowerSGD bucket {key!r} at step {step}; "
                "the compressed tensors concerned come back as NaN and the memories and Qs are left unchanged",
                RuntimeWarning,
                stacklevel=2,
            )
            return results
        if self.error_feedback:
            state.memories = matrices
        if self.warm_start:
            offset = 1
            for gi, (group, q) in enumerate(zip(plan.groups, qs)):
                count = q.shape[0] * q.shape[2]
                if any(flags[offset : offset + count]):
                    mask = torch.tensor(flags[offset : offset + count], device=device).view(q.shape[0], q.shape[2])
                    fresh = self._draw_q(key, group, step, dtype, device)
                    q.copy_(orthogonalize(torch.where(mask.unsqueeze(1), fresh, q), eps))
                offset += count
                if state.qs[gi] is None:
                    state.qs[gi] = q.clone()
                else:
                    state.qs[gi].copy_(q)
        return results

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        """Options and every bucket's memories and ``Q``s (copies); with ``load_state_dict`` a resumed run
        continues bit-exactly. Loadable with ``torch.load(weights_only=True)`` for plain keys."""
        buckets = {}
        for key, state in self._buckets.items():
            buckets[key] = {
                "signature": state.signature,
                "memories": [None if t is None else t.clone() for t in state.memories],
                "qs": [None if t is None else t.clone() for t in state.qs],
            }
        return {"options": {name: getattr(self, name) for name in _STATE_OPTIONS}, "buckets": buckets}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the state with ``state`` (from ``state_dict``); ``ValueError`` if it was saved with
        different options (``start_iter`` may differ)."""
        options = state["options"]
        differ = {
            name: (options.get(name), getattr(self, name))
            for name in _STATE_OPTIONS
            if options.get(name) != getattr(self, name)
        }
        if differ:
            raise ValueError(f"PowerSGD state saved with other options (saved, current): {differ}")
        buckets = {}
        for key, saved in state["buckets"].items():
            if len(saved["memories"]) != len(saved["qs"]):
                raise ValueError(f"malformed PowerSGD state for bucket {key!r}")
            buckets[key] = _BucketState(
                tuple(saved["signature"]),
                [None if t is None else t.clone() for t in saved["memories"]],
                [None if t is None else t.clone() for t in saved["qs"]],
            )
        self._buckets = buckets


    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Horovod's stock optimizer compresses one gradient at a time: refused with a ``TypeError``."""
        raise TypeError("PowerSGD needs whole buckets: use hvdcomp.DistributedOptimizer or hvdcomp.ddp")
