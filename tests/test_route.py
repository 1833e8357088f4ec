"""``RouteTrial``: the schedule of a route left open, and the one verdict every worker reaches."""

import pytest
import torch

from hvdcomp.exchange.route import TRIAL_ROUNDS, RouteTrial


def _try(trial, seconds_of):
    """Run ``trial``'s steps until its verdict is due; ``seconds_of(second)`` times each. Returns the routes."""
    routes = []
    while not trial.deciding:
        routes.append(trial.second)
        trial.record(seconds_of(trial.second))
    return routes


def test_flat_steps_then_hierarchical_ones_then_the_verdict_is_due():
    trial = RouteTrial()
    assert _try(trial, lambda second: 1.0) == [False] * (TRIAL_ROUNDS + 1) + [True] * (TRIAL_ROUNDS + 1)
    assert trial.choice is None and trial.deciding and trial.seconds().shape == (2 * TRIAL_ROUNDS,)


def test_untimed_first_steps_and_the_median_decides():
    trial = RouteTrial(rounds=3)
    seconds = iter([100.0, 1.0, 9.0, 1.0, 100.0, 5.0, 2.0, 2.0])  # flat 1 9 1, hierarchical 5 2 2
    _try(trial, lambda second: next(seconds))
    assert trial.seconds().tolist() == [1.0, 9.0, 1.0, 5.0, 2.0, 2.0]
    assert trial.decide(trial.seconds()) is False  # the means (3.67 against 3.0) would pick hierarchical
    assert trial.medians == (1.0, 2.0) and trial.choice is False and not trial.deciding
    trial.record(0.001)  # after the verdict: ignored
    assert trial.second is False and not trial.deciding


def test_every_worker_takes_the_verdict_of_the_slowest():
    """Ranks 0 and 1 alone would keep flat, rank 2 alone hierarchical; the MAX of their seconds decides for all."""
    def seconds_of(rank):
        return lambda second: (1.0 if second else 4.0) if rank == 2 else (3.0 if second else 2.0)

    workers = [RouteTrial(rounds=2) for _ in range(3)]
    for rank, trial in enumerate(workers):
        _try(trial, seconds_of(rank))
    slowest = torch.stack([trial.seconds() for trial in workers]).amax(dim=0)
    assert [trial.decide(slowest) for trial in workers] == [True] * 3
    assert all(trial.second and trial.medians == (4.0, 3.0) for trial in workers)
    alone = RouteTrial(rounds=2)
    _try(alone, seconds_of(0))
    assert alone.decide(alone.seconds()) is False


def test_bad_use_is_refused():
    with pytest.raises(ValueError, match="at least one timed round"):
        RouteTrial(rounds=0)
    trial = RouteTrial(rounds=1)
    with pytest.raises(RuntimeError, match="no verdict to reach"):
        trial.seconds()
    _try(trial, lambda second: 1.0)
    with pytest.raises(ValueError, match="needs 2 seconds"):
        trial.decide(torch.zeros(3))
