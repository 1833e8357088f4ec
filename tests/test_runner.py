"""The one runner (``hvdcomp.exchange.runner``) and exchange state (``hvdcomp.exchange.state``), in one process:
ordering by name and by call order, collective names, metering, write-back, agreement and checkpoints."""

import pytest
import torch

from hvdcomp.codec.quantize import MaxNormQuantizer
from hvdcomp.exchange import (
    FP16,
    AheadMaxNorm,
    ElementwiseCodec,
    MaxNormCodec,
    NoCompression,
    Op,
    Statistics,
    Transport,
)
from hvdcomp.exchange.plan import Delivery, plan_buckets, signature
from hvdcomp.exchange.protocol import last
from hvdcomp.exchange.runner import Runner, consecutive_span
from hvdcomp.exchange.state import ConfigurationMismatchError, ExchangeState


class _LoggingTransport(Transport):
    """Two identical workers: SUM doubles, MAX returns the tensor; starts and waits go into ``log``. ``done``
    says which started collectives ``poll`` reports complete (all when None)."""

    size, rank, local_size, local_rank, cross_size, cross_rank, equal_nodes = 2, 0, 2, 0, 1, 0, True
    sums_float16 = sums_bfloat16 = True

    def __init__(self, log, blocking=False, done=None, large=None):
        self.log, self.blocking, self.done, self.large_request_bytes = log, blocking, done, large
        self.seen = []  # MAX requests (the agreement)

    def start(self, op, tensor, name=None):
        self.log.append(("start", name))
        if op is Op.MAX:
            self.seen.append(tensor.clone())
        return name, tensor * self.size if op is not Op.MAX else tensor.clone()

    def poll(self, handle):
        return self.done is None or handle[0] in self.done

    def wait(self, handle):
        self.log.append(("wait", handle[0]))
        return handle[1]

    def collective(self, op, tensor):
        return self.wait(self.start(op, tensor))


def _two_rounds(index, log):
    """Logs its compute, sums twice, returns both results."""
    log.append(("compute", index))
    first = yield Op.SUM, torch.full((3,), float(index))
    log.append(("decode", index))
    second = yield Op.SUM, first + 1
    return first, second


def _run(log, transport):
    stats = Statistics()
    runner = Runner(transport, stats, "t")
    results = {}
    for index in range(3):
        runner.launch_exchange(index, f"x{index}", _two_rounds(index, log), lambda r, i=index: results.update({i: r}))
    runner.progress()
    runner.finish()
    return results, stats


def test_by_name_every_first_request_is_in_flight_before_any_wait_and_finish_blocks_on_the_lowest():
    log = []
    results, stats = _run(log, _LoggingTransport(log, done=set()))  # nothing completes early
    assert log[:6] == [("compute", 0), ("start", "t.x0.world0.sum"), ("compute", 1), ("start", "t.x1.world0.sum"),
                       ("compute", 2), ("start", "t.x2.world0.sum")]
    waits = [name for kind, name in log if kind == "wait"]
    assert waits == ["t.x0.world0.sum", "t.x0.world1.sum", "t.x1.world0.sum", "t.x1.world1.sum",
                     "t.x2.world0.sum", "t.x2.world1.sum"]  # the lowest still in flight, to its end
    for index in range(3):
        first, second = results[index]
        assert torch.equal(first, torch.full((3,), 2.0 * index)) and torch.equal(second, 2 * (first + 1))
    assert stats.steps == 1 and stats.last_step.inter_node_bytes == 6 * 12


def test_by_name_progress_advances_what_completed_without_blocking():
    log = []
    transport = _LoggingTransport(log, done={"t.x1.world0.sum"})
    runner = Runner(transport, Statistics(), "t")
    for index in range(2):
        runner.launch_exchange(index, f"x{index}", _two_rounds(index, log), lambda result: None)
    runner.progress()
    assert [entry for entry in log if entry[0] == "wait"] == [("wait", "t.x1.world0.sum")]
    assert log[-1] == ("start", "t.x1.world1.sum") and runner.in_flight


def test_exchanges_with_large_first_requests_are_open_two_at_a_time_the_others_start_in_launch_order():
    log = []
    transport = _LoggingTransport(log, done=set(), large=12)  # first requests of 3 float32: large; none completes early
    runner = Runner(transport, Statistics(), "t")
    results = {}
    for index in range(4):
        runner.launch_exchange(index, f"x{index}", _two_rounds(index, log), lambda r, i=index: results.update({i: r}))
    runner.progress()
    assert [name for kind, name in log if kind == "start"] == ["t.x0.world0.sum", "t.x1.world0.sum"]
    assert [index for kind, index in log if kind == "compute"] == [0, 1, 2, 3]  # encoded at launch, held to start
    runner.finish()
    starts = [name for kind, name in log if kind == "start"]
    assert starts == ["t.x0.world0.sum", "t.x1.world0.sum", "t.x0.world1.sum", "t.x2.world0.sum", "t.x1.world1.sum",
                      "t.x3.world0.sum", "t.x2.world1.sum", "t.x3.world1.sum"]  # a later round never waits its turn
    for index in range(4):
        first, second = results[index]
        assert torch.equal(first, torch.full((3,), 2.0 * index)) and torch.equal(second, 2 * (first + 1))


def _max_then_sum(index, log):
    """``_two_rounds`` with a MAX first."""
    log.append(("compute", index))
    first = yield Op.MAX, torch.full((3,), float(index))
    second = yield Op.SUM, first + 1
    return first, second


@pytest.mark.parametrize("blocking, large, rounds", [(False, 13, _two_rounds), (True, 1, _two_rounds),
                                                     (False, 1, _max_then_sum)],
                         ids=["small-requests", "by-call-order", "not-a-sum"])
def test_small_first_requests_others_than_sums_and_transports_that_pair_by_call_order_hold_nothing(blocking, large,
                                                                                                   rounds):
    log = []
    runner = Runner(_LoggingTransport(log, blocking=blocking, done=set(), large=large), Statistics(), "t")
    for index in range(4):  # first requests of 12 bytes each
        runner.launch_exchange(index, f"x{index}", rounds(index, log), lambda result: None)
    first_op = "max" if rounds is _max_then_sum else "sum"
    assert [name for kind, name in log if kind == "start"] == [f"t.x{i}.world0.{first_op}" for i in range(4)]
    runner.finish()
    assert len([kind for kind, _ in log if kind == "start"]) == 8


def test_a_dropped_step_forgets_its_open_and_held_exchanges():
    log = []
    runner = Runner(_LoggingTransport(log, done=set(), large=12), Statistics(), "t")
    for index in range(3):
        runner.launch_exchange(index, f"x{index}", _two_rounds(index, log), lambda result: None)
    runner.drop()
    log.clear()
    for index in range(2):
        runner.launch_exchange(index, f"y{index}", _two_rounds(index, log), lambda result: None)
    assert [name for kind, name in log if kind == "start"] == ["t.y0.world0.sum", "t.y1.world0.sum"]
    runner.finish()


def test_by_call_order_progress_advances_older_exchanges_one_round_and_finish_runs_them_in_order():
    log = []
    transport = _LoggingTransport(log, blocking=True)
    runner = Runner(transport, Statistics(), "t")
    runner.launch_exchange(0, "x0", _two_rounds(0, log), lambda result: None)
    runner.progress()  # nothing older than x0
    runner.launch_exchange(1, "x1", _two_rounds(1, log), lambda result: None)
    runner.progress()  # x0 one round, queued behind x1's first
    runner.finish()
    starts = [name for kind, name in log if kind == "start"]
    assert starts == ["t.x0.world0.sum", "t.x1.world0.sum", "t.x0.world1.sum", "t.x1.world1.sum"]


def _last_after(rounds, index, log):
    """Sums ``rounds`` times, the last one declared (``protocol.last``); logs its decode."""
    value = torch.full((3,), float(index))
    for round_ in range(rounds):
        value = yield (last(Op.SUM, value) if round_ == rounds - 1 else (Op.SUM, value))
    log.append(("decode", index))
    return value


def test_by_call_order_progress_never_waits_for_a_last_request_and_takes_it_once_completed():
    log = []
    transport = _LoggingTransport(log, blocking=True, done=set())
    runner = Runner(transport, Statistics(), "t")
    results = {}
    for index, rounds in enumerate((1, 2)):
        runner.launch_exchange(index, f"x{index}", _last_after(rounds, index, log),
                               lambda r, i=index: results.update({i: r}))
    runner.progress()  # nothing older
    runner.launch_exchange(2, "x2", _last_after(1, 2, log), lambda r: results.update({2: r}))
    runner.progress()  # x1 advances one round (it blocks: its first request is not its last); x0 is not waited for
    assert [entry for entry in log if entry[0] == "wait"] == [("wait", "t.x1.world0.sum")]
    transport.done = {"t.x0.world0.sum"}
    runner.progress()  # x0 completed: taken, decoded, delivered; x1's last and x2 are not waited for
    assert [entry for entry in log if entry[0] != "start"] == [("wait", "t.x1.world0.sum"), ("wait", "t.x0.world0.sum"),
                                                               ("decode", 0)]
    assert list(results) == [0]
    runner.finish()
    starts = [name for kind, name in log if kind == "start"]
    assert starts == ["t.x0.world0.sum", "t.x1.world0.sum", "t.x2.world0.sum", "t.x1.world1.sum"]
    assert torch.equal(results[1], torch.full((3,), 4.0)) and torch.equal(results[2], torch.full((3,), 4.0))


def test_an_exchange_that_asks_again_after_its_last_request_is_an_error():
    def liar():
        yield last(Op.SUM, torch.ones(2))
        yield Op.SUM, torch.ones(2)

    runner = Runner(_LoggingTransport([], blocking=True), Statistics(), "t")
    runner.launch_exchange(0, "liar", liar(), lambda result: None)
    with pytest.raises(RuntimeError, match="after declaring its last request"):
        runner.finish()


def test_a_delivery_plan_never_spans_two_deliveries_cut_by_ddps_rule():
    sizes = [1000, 300_000, 2, 500_000, 700_000, 5, 900_000, 100, 400_000]  # float32: 4 bytes each
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    names = {p: f"p{i}" for i, p in enumerate(params)}
    plan = plan_buckets(params, names, bucket_size_mb=2.0, delivery=Delivery(first_mb=1.0, rest_mb=3.0))
    deliveries, current, filled, limit = [], [], 0, 1.0 * 2**20  # DDP's rule, reverse order: close once full
    for p in reversed(params):
        current.append(names[p])
        filled += 4 * p.numel()
        if filled >= limit:
            deliveries.append(current)
            current, filled, limit = [], 0, 3.0 * 2**20
    deliveries.append(current)
    home = {name: i for i, names_ in enumerate(deliveries) for name in names_}
    assert [name for bucket in plan for name in bucket.names] == [names[p] for p in reversed(params)]
    assert all(len({home[name] for name in bucket.names}) == 1 for bucket in plan)
    assert all(4 * sum(bucket.sizes) <= 2 * 2**20 or len(bucket.params) == 1 for bucket in plan)
    assert len(plan) > len(deliveries)  # some delivery holds several codec buckets
    undelivered = plan_buckets(params, names, bucket_size_mb=2.0)
    assert any(len({home[name] for name in bucket.names}) > 1 for bucket in undelivered)  # what the cut prevents


def _state(codec, **settings):
    params = [torch.nn.Parameter(torch.zeros(5)), torch.nn.Parameter(torch.zeros(3))]
    state = ExchangeState(codec, "test", settings)
    state.plan = plan_buckets(params, {params[0]: "a", params[1]: "b"}, 25.0)
    return state, params


def test_launch_writes_each_mean_back_in_the_gradients_shape_and_counts_the_bytes():
    state, params = _state(NoCompression())
    log = []
    runner = Runner(_LoggingTransport(log), state.stats, "t", state)
    got = {}
    runner.launch(state.plan[0], [None, torch.ones(5)], lambda bucket, means, keep: got.update(means=means))
    runner.finish()
    first, second = got["means"]  # the plan holds them in reverse order: b, then a
    assert torch.equal(first, torch.zeros(3)) and torch.equal(second, torch.ones(5))
    assert state.step == 1 and state.stats.last_step.uncompressed_bytes == 32
    assert [name for kind, name in log if kind == "start"] == ["t.agree", "t.bucket0.world0.sum"]


@pytest.mark.parametrize("codec", [NoCompression(), FP16()], ids=["none", "fp16"])
def test_scratch_gradients_in_one_buffer_are_exchanged_there_and_get_the_mean_in_place(codec):
    state, params = _state(codec)
    buffer = torch.arange(8, dtype=torch.float32)  # as DDP's bucket: b's gradient (3), then a's (5)
    got = {}
    transport = _LoggingTransport([])
    codec.bind_transport(transport)
    runner = Runner(transport, state.stats, "t", state)
    runner.launch(state.plan[0], [buffer[:3], buffer[3:]], lambda bucket, means, keep: got.update(means=means),
                  scratch=True)
    runner.finish()
    assert torch.equal(buffer, torch.arange(8, dtype=torch.float32))  # the mean of two equal workers
    assert all(mean.data_ptr() == view.data_ptr() for mean, view in zip(got["means"], (buffer[:3], buffer[3:])))
    assert not state.plan[0]._flat  # the bucket's own flat buffer was never needed


def test_scratch_gradients_get_qsgd_with_the_scale_ahead_decoded_in_place():
    """``AheadMaxNorm`` takes ``out``: on its exact first exchange and the agreed ones after, the mean of scratch
    gradients lying in one buffer (DDP's bucket) is decoded there, equal to the mean of a copy's exchange."""
    codecs = [AheadMaxNorm(MaxNormCodec(MaxNormQuantizer((4,)))) for _ in range(2)]
    (state, _), (copied_state, _) = _state(codecs[0]), _state(codecs[1])
    transport = _LoggingTransport([])
    runners = [Runner(transport, s.stats, "t", s) for s in (state, copied_state)]
    for codec in codecs:
        codec.bind_transport(transport)
    got, want = {}, {}
    for step in range(3):
        buffer = torch.randn(8, generator=torch.Generator().manual_seed(step)) * (1 + step)  # growing: clipped ahead
        grads = [buffer[:3], buffer[3:]]
        runners[0].launch(state.plan[0], grads, lambda bucket, means, keep: got.update(means=means), scratch=True)
        runners[1].launch(copied_state.plan[0], [g.clone() for g in grads],
                          lambda bucket, means, keep: want.update(means=[m.clone() for m in means]))
        for runner in runners:
            runner.finish()
        assert all(mean.data_ptr() == view.data_ptr() for mean, view in zip(got["means"], grads)), step
        assert all(torch.equal(a, b) for a, b in zip(got["means"], want["means"])), step
    assert not state.plan[0]._flat


@pytest.mark.parametrize("codec, out_is_flat, want", [(NoCompression(), True, Op.SUM_IN_PLACE),
                                                      (NoCompression(), False, Op.SUM),
                                                      (FP16(), False, Op.SUM_IN_PLACE),
                                                      (FP16(error_feedback=True), False, Op.SUM)],
                         ids=["none-out-flat", "none", "fp16", "fp16-error-feedback"])
def test_a_codec_gives_its_request_up_to_be_summed_in_place_only_when_it_is_scratch(codec, out_is_flat, want):
    flat = torch.tensor([1.0, -2.0, 0.5])
    codec.bind_transport(_LoggingTransport([]))
    exchange = codec.exchange(flat, [3], "k", 0, 2, **({"out": flat} if out_is_flat else {}))
    op, request = next(exchange)
    assert op is want
    if op.consumes_tensor:  # the transport sums there, as TorchDistributedTransport does
        result = request.mul_(2)
    else:
        result = request * 2
    with pytest.raises(StopIteration) as done:
        exchange.send(result)
    assert torch.equal(done.value.value, torch.tensor([1.0, -2.0, 0.5]))
    assert (done.value.value.data_ptr() == flat.data_ptr()) == out_is_flat


class _Halves(ElementwiseCodec):
    """A codec written as README's example is (``exchange`` without ``out``): the mean of the flat sums."""

    def exchange(self, flat, segments, key, step, world_size):
        total = yield Op.SUM, flat
        return total / world_size

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def test_a_codec_without_out_runs_on_scratch_gradients_and_its_mean_is_delivered():
    state, _ = _state(_Halves())
    buffer = torch.arange(8, dtype=torch.float32)
    delivered = []
    runner = Runner(_LoggingTransport([]), state.stats, "t", state)
    runner.launch(state.plan[0], [buffer[:3], buffer[3:]], lambda bucket, means, keep: delivered.extend(means),
                  scratch=True)
    runner.finish()
    assert torch.equal(torch.cat(delivered), torch.arange(8, dtype=torch.float32))


@pytest.mark.parametrize("order, scratch", [((slice(5, 8), slice(0, 5)), True), ((slice(0, 3), slice(3, 8)), False)],
                         ids=["out-of-order", "not-scratch"])
def test_gradients_out_of_order_or_not_scratch_go_through_the_buckets_flat_buffer(order, scratch):
    buffer = torch.arange(8, dtype=torch.float32)
    grads = [buffer[part] for part in order]
    state, _ = _state(NoCompression())
    delivered = []
    runner = Runner(_LoggingTransport([]), state.stats, "t", state)
    runner.launch(state.plan[0], grads, lambda bucket, means, keep: delivered.extend(means), scratch=scratch)
    runner.finish()
    assert all(mean.data_ptr() != grad.data_ptr() for mean, grad in zip(delivered, grads))
    assert [torch.equal(mean, grad) for mean, grad in zip(delivered, grads)] == [True, True]


def test_consecutive_span_needs_one_buffer_in_order_of_one_dtype():
    buffer = torch.zeros(10)
    span = consecutive_span([buffer[2:4], buffer[4:9].view(5, 1)], torch.float32)
    assert span.data_ptr() == buffer[2:].data_ptr() and span.shape == (7,)
    assert consecutive_span([buffer[2:4], buffer[5:9]], torch.float32) is None  # a gap
    assert consecutive_span([buffer[4:6], buffer[2:4]], torch.float32) is None  # out of order
    assert consecutive_span([buffer[2:4], torch.zeros(3)], torch.float32) is None  # two buffers
    assert consecutive_span([buffer[2:4], None], torch.float32) is None
    assert consecutive_span([buffer[::2]], torch.float32) is None  # not contiguous
    assert consecutive_span([buffer[2:4]], torch.float16) is None


def test_agreement_names_every_setting_that_differs():
    state, _ = _state(NoCompression(), op="average")
    other, _ = _state(FP16(), op="sum")
    transport = _LoggingTransport([])
    other.agree(transport, "x")
    theirs = transport.seen[-1]
    mine = []

    class Mixed(_LoggingTransport):  # the maximum of this worker's request and the other worker's
        def start(self, op, tensor, name=None):
            mine.append(tensor)
            return name, torch.maximum(tensor, theirs)

    with pytest.raises(ConfigurationMismatchError, match="what differs: compression, op"):
        state.agree(Mixed([]), "x")
    assert not state.agreed


def test_a_checkpoint_of_another_codec_is_refused_before_anything_changes():
    saved, _ = _state(FP16(error_feedback=True))
    checkpoint = saved.state_dict(world_size=2)
    target, _ = _state(NoCompression())
    with pytest.raises(ValueError, match=r"saved with compression FP16\(True,\)"):
        target.check_state(checkpoint, world_size=2)
    with pytest.raises(ValueError, match="version"):
        target.check_state(dict(checkpoint, version=0), world_size=2)
    again, _ = _state(FP16(error_feedback=True))
    again.check_state(checkpoint, world_size=2)
    again.load_state_dict(dict(checkpoint, exchange_step=7), _LoggingTransport([]))
    assert again.step == 7 and not again.agreed


def test_plan_signature_names_tensors_not_positions():
    state, params = _state(NoCompression())
    assert signature(state.plan) == ((("b", 3, "torch.float32"), ("a", 5, "torch.float32")),)
