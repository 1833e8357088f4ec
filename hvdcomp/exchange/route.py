"""A route left open, chosen by timing both on the job's own steps: Birder's flat or hierarchical route, or the
lanes or the two-stage exchange of ``hvdcomp.DistributedOptimizer``'s ``exchange="auto"``.

Bytes alone cannot choose. The hierarchical route sends fewer bytes between nodes, but first sums the
full-precision values inside each node and gathers them again, and what that costs depends on the node's
links and cores, which no byte count knows: on an emulated cluster of two nodes of two workers (1 Gbit/s
between nodes, loopback inside them, two cores), Birder's hierarchical route took twice the flat route's
time per step (docs/benchmarks.md#the-route-measured). The two-stage exchange likewise sends fewer bytes than
the lanes from four workers on, but runs two codec passes where the lanes run one, and whether the bytes pay
for them depends on the link and the cores (docs/benchmarks.md#the-exchange-measured).

So where the user left the route open and both routes can run, ``RouteTrial`` runs the first steps on the
first route (flat, lanes), then on the second (hierarchical, two-stage): one untimed step of each (first-use
costs), then ``rounds`` timed ones. Not by turns: over Horovod the hierarchical route's process sets, once
registered, slow every collective (Horovod coordinates each set at every cycle), so flat steps taken among
hierarchical ones would be timed slower than they run after a flat verdict removes the sets
(docs/benchmarks.md#the-route-measured). Then the verdict: every worker's seconds are reduced by MAX (a step
lasts as long as its slowest worker), so every worker holds the same numbers and takes the same route from then
on, the second one only where its median step is shorter.

Birder's trial needs no collective of its own: the door sends ``seconds()`` in a MAX it makes anyway. The
runner (``hvdcomp.exchange.runner``) times the steps of a codec's trial (``BucketCodec.trial``) itself and
reduces the seconds in one MAX of its own, once. A trial fits codecs and doors whose state does not depend on
the route (Birder's moments, the scale agreed ahead); memory kept per bucket shard, or the error one exchange's
rounding lost, would be left behind by the other route.
"""

from __future__ import annotations

from typing import Callable

import torch

from .protocol import Transport

TRIAL_ROUNDS = 3  # timed steps of each route


class RouteTrial:
    """The route of each step while trying both (see the module docstring), then the faster one.

    Per step: ``second`` says the step's route (False: the first, flat or lanes); if ``deciding``, the step first
    reduces ``seconds()`` by MAX over the workers and passes the result to ``decide`` (or ``ride`` and ``land``: in
    a MAX the door makes anyway); after the step, ``record(its seconds)``.
    ``choice`` is None until the verdict, then True (the second route) or False; given (a verdict saved with a
    checkpoint), there is no trial. ``release`` (Birder: ``Transport.release_hierarchy``) is called by a verdict for
    the first route, on every worker at the same point."""

    def __init__(self, rounds: int = TRIAL_ROUNDS, choice: bool | None = None,
                 release: Callable[[], None] | None = None) -> None:
        if rounds < 1:
            raise ValueError(f"a route trial needs at least one timed round, got {rounds}")
        self.rounds = rounds
        self.choice = choice
        self.release = release
        self.medians: tuple[float, float] | None = None  # the first, the second route's seconds (MAX over workers)
        self._steps = 0
        self._seconds: dict[bool, list[float]] = {False: [], True: []}

    @property
    def second(self) -> bool:
        """This step's route: the verdict once made, else the first for ``rounds + 1`` steps, then the second."""
        return self.choice if self.choice is not None else self._steps > self.rounds

    @property
    def deciding(self) -> bool:
        """Whether this step opens with the verdict (every trial step recorded, no verdict yet)."""
        return self.choice is None and self._steps == 2 * (self.rounds + 1)

    def record(self, seconds: float) -> None:
        """The seconds of the step just run on ``second`` (after the verdict: ignored)."""
        if self.choice is not None:
            return
        if self._steps % (self.rounds + 1):  # the first step of each route is not timed
            self._seconds[self.second].append(seconds)
        self._steps += 1

    def seconds(self) -> torch.Tensor:
        """float64 ``[2 rounds]``: this worker's timed steps, the first route's first (``deciding`` only)."""
        if not self.deciding:
            raise RuntimeError("the route trial has no verdict to reach at this step")
        return torch.tensor(self._seconds[False] + self._seconds[True], dtype=torch.float64)

    def ride(self, flags: torch.Tensor) -> torch.Tensor:
        """float64 ``flags`` that the door reduces by MAX anyway, with ``seconds()`` after them where ``deciding``."""
        return torch.cat([flags, self.seconds()]) if self.deciding else flags

    def land(self, reduced: torch.Tensor) -> torch.Tensor:
        """``ride``'s tensor reduced by MAX: the verdict taken from its seconds (``decide``), the flags returned."""
        if not self.deciding:
            return reduced
        self.decide(reduced[-2 * self.rounds:])
        return reduced[:-2 * self.rounds]

    def decide(self, slowest: torch.Tensor) -> bool:
        """Take the verdict from ``seconds()`` reduced by MAX over the workers; returns the route chosen."""
        if slowest.shape != (2 * self.rounds,):
            raise ValueError(f"the route trial's verdict needs {2 * self.rounds} seconds, got {tuple(slowest.shape)}")
        first, second = (float(part.median()) for part in slowest.double().split(self.rounds))
        self.medians = (first, second)
        self.choice = second < first
        if not self.choice and self.release is not None:
            self.release()
        return self.choice


def runs_hierarchy(transport: Transport) -> bool:
    """Whether ``transport`` runs node-local and cross-node collectives (``check_hierarchy`` does not raise)."""
    try:
        transport.check_hierarchy()
    except RuntimeError:
        return False
    return True
