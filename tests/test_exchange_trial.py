"""``exchange="auto"``: ``hvdcomp.DistributedOptimizer`` runs the lanes, then the two-stage exchange, on its first
steps, times each step from one ``finish`` to the next (the runner), reduces the seconds by MAX in one collective,
and keeps the faster; the verdict is saved and resumed. Equal workers and a clock that the collectives advance."""

from types import SimpleNamespace

import pytest
import torch

import hvdcomp
from hvdcomp.codec.quantize import MaxNormQuantizer
from hvdcomp.exchange import MaxNormCodec, Op, Reduction, TwoStageMaxNorm
from hvdcomp.exchange import runner as runner_module
from hvdcomp.exchange.two_stage import EXCHANGE_TRIAL_ROUNDS as TRIAL_ROUNDS
from tests.fakes import EchoTransport

TRIAL_STEPS = 2 * (TRIAL_ROUNDS + 1)


class _EqualWorkers(EchoTransport):
    """Rank 0 of ``size`` workers that all send what it sends (an all-gather repeats it, an all-to-all brings
    its part 0 from each), whose clock each collective advances by ``seconds[its reduction]``. ``log`` holds
    (op, name)."""

    def __init__(self, size, clock, seconds):
        super().__init__(size)
        self.clock, self.seconds, self.log = clock, seconds, []

    def collective(self, op, tensor):
        if op.reduction is Reduction.ALLGATHER:
            return torch.cat([tensor] * self.size)
        if op.reduction is Reduction.ALLTOALL:
            return torch.cat([tensor.chunk(self.size)[0]] * self.size)
        return super().collective(op, tensor)

    def start(self, op, tensor, name=None):
        self.log.append((op, name))
        self.clock.now += self.seconds.get(op.reduction, 0.0)
        return self.collective(op, tensor)


@pytest.fixture
def clock(monkeypatch):
    """The runner's clock: ``clock.now`` seconds, advanced by the transport (and 0.1 s per step by ``_steps``)."""
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(runner_module, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    return clock


def _optimizer(transport, compression=None, exchange="auto", warmup_steps=0):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 4))
    sgd = torch.optim.SGD(model.parameters(), lr=0.01)
    compression = hvdcomp.QSGDMaxNorm(4) if compression is None else compression
    return model, hvdcomp.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), transport=transport,
                                               compression=compression, exchange=exchange, warmup_steps=warmup_steps)


def _steps(model, optimizer, transport, count):
    """Run ``count`` steps; per step, whether it ran the two-stage exchange (an all-to-all) and its trial ops."""
    routes, trials = [], []
    for _ in range(count):
        transport.log.clear()
        transport.clock.now += 0.1
        optimizer.zero_grad()
        model(torch.randn(8, 64)).square().mean().backward()
        optimizer.step()
        routes.append(any(op is Op.ALLTOALL for op, _ in transport.log))
        trials.append([(op, name) for op, name in transport.log if name.endswith(".trial")])
    return routes, trials


@pytest.mark.parametrize("faster_two_stage", [False, True])
def test_auto_tries_the_lanes_then_the_two_stage_exchange_and_keeps_the_faster(clock, faster_two_stage):
    seconds = {Reduction.SUM: 1.0, Reduction.ALLTOALL: 0.5 if faster_two_stage else 2.0}
    transport = _EqualWorkers(4, clock, seconds)
    model, optimizer = _optimizer(transport)
    trial = optimizer.exchange_trial
    routes, trials = _steps(model, optimizer, transport, TRIAL_STEPS + 3)
    assert routes == [False] * (TRIAL_ROUNDS + 1) + [True] * (TRIAL_ROUNDS + 1) + [faster_two_stage] * 3
    # one MAX of the timed steps, at the end of the last trial step, then none
    assert [len(t) for t in trials] == [0] * (TRIAL_STEPS - 1) + [1] + [0] * 3
    assert trials[TRIAL_STEPS - 1][0][0] is Op.MAX
    assert trial.choice is faster_two_stage
    # a lanes step: 0.1 s plus its sum; a two-stage step: 0.1 s plus its all-to-all (the MAXes are free)
    assert trial.medians == pytest.approx((1.1, 0.1 + seconds[Reduction.ALLTOALL]))


def test_the_verdict_is_saved_with_the_state_and_a_trial_cut_short_starts_again(clock):
    transport = _EqualWorkers(4, clock, {Reduction.SUM: 1.0, Reduction.ALLTOALL: 0.5})
    model, optimizer = _optimizer(transport)
    _steps(model, optimizer, transport, TRIAL_ROUNDS + 2)
    midway = optimizer.state_dict()
    _steps(model, optimizer, transport, TRIAL_ROUNDS)
    decided = optimizer.state_dict()
    assert midway["hvdcomp"]["codec"]["exchange_verdict"] is None and decided["hvdcomp"]["codec"]["exchange_verdict"]
    optimizer.close()

    model, resumed = _optimizer(transport)
    resumed.load_state_dict(decided)
    assert _steps(model, resumed, transport, 2) == ([True, True], [[], []])
    resumed.load_state_dict(midway)  # the trial starts over, from the lanes
    routes, trials = _steps(model, resumed, transport, TRIAL_STEPS)
    assert routes == [False] * (TRIAL_ROUNDS + 1) + [True] * (TRIAL_ROUNDS + 1) and len(trials[-1]) == 1
    bad = resumed.state_dict()
    bad["hvdcomp"]["codec"]["exchange_verdict"] = "two_stage"
    with pytest.raises(ValueError, match="exchange verdict"):
        resumed.load_state_dict(bad)
    resumed.close()


def test_warm_up_steps_are_not_tried(clock):
    transport = _EqualWorkers(4, clock, {Reduction.SUM: 1.0, Reduction.ALLTOALL: 0.5})
    model, optimizer = _optimizer(transport, warmup_steps=2)
    routes, trials = _steps(model, optimizer, transport, 2 + TRIAL_STEPS)
    assert routes == [False] * (2 + TRIAL_ROUNDS + 1) + [True] * (TRIAL_ROUNDS + 1)
    assert [len(t) for t in trials] == [0] * (2 + TRIAL_STEPS - 1) + [1]
    assert optimizer.exchange_trial.medians == pytest.approx((1.1, 0.6))


@pytest.mark.parametrize("exchange", ["lanes", "two_stage", "auto"])
def test_the_means_are_kept_without_a_copy_on_either_exchange(clock, exchange):
    """One bucket: every gradient is a view of the exchange's one result, on the lanes as on the two-stage exchange
    (``TwoStageMaxNorm.reuses_result``); with a selector (random-k) the lanes' result is the codec's buffer, copied."""
    transport = _EqualWorkers(4, clock, {Reduction.SUM: 1.0})
    model, optimizer = _optimizer(transport, exchange=exchange)
    routes, _ = _steps(model, optimizer, transport, TRIAL_STEPS)
    assert set(routes) == ({False, True} if exchange == "auto" else {exchange == "two_stage"})
    assert len({p.grad.untyped_storage().data_ptr() for p in model.parameters()}) == 1
    assert not TwoStageMaxNorm(MaxNormCodec(MaxNormQuantizer((4,))), exchange).reuses_result
    random_k = hvdcomp.GlobalRandKMaxNorm(ratio=0.5).max_norm
    assert TwoStageMaxNorm(random_k, "lanes" if exchange == "two_stage" else exchange).reuses_result


@pytest.mark.parametrize("case", ["lanes", "two_stage", "error_feedback", "one_worker"])
def test_no_trial_where_the_exchange_is_fixed_or_alone(clock, case):
    transport = _EqualWorkers(1 if case == "one_worker" else 4, clock, {})
    compression = TwoStageMaxNorm(MaxNormCodec(MaxNormQuantizer((4,))), "auto", error_feedback=True) if (
        case == "error_feedback") else None
    model, optimizer = _optimizer(transport, compression, "auto" if case in ("error_feedback", "one_worker") else case)
    routes, trials = _steps(model, optimizer, transport, TRIAL_STEPS + 1)
    assert not any(trials) and set(routes) == {case == "two_stage"}
    if case == "one_worker":
        assert optimizer.exchange_trial.choice is None
    else:
        assert optimizer.exchange_trial is None
