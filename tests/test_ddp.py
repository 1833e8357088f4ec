"""hvdcomp.ddp on real torch.distributed Gloo workers: the DDP hook against DDP's own all-reduce, every codec,
exact resume across DDP's bucket rebuild, no_sync, hierarchical on emulated nodes, Birder on the torch transport."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.ddp_launch import run_ddp

TINY_BUCKETS_MB = 0.0005  # after DDP's first step, a bucket per tensor or two: many hooks per step


def _net() -> nn.Module:
    generator = torch.Generator().manual_seed(0)
    net = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 3))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    return net


class _WithUnused(nn.Module):
    """``_net`` beside a layer that no forward uses (for ``find_unused_parameters=True``)."""

    def __init__(self) -> None:
        super().__init__()
        self.net, self.unused = _net(), nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _batch(step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * dist.get_rank() + 10 * step + micro)
    return torch.randn(16, 12, generator=generator), torch.randint(0, 3, (16,), generator=generator)


def _loss(model: nn.Module, step: int, micro: int = 0) -> torch.Tensor:
    x, y = _batch(step, micro)
    return nn.functional.cross_entropy(model(x), y)


def _flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def _compressions() -> dict[str, object]:
    import hvdcomp

    return {
        "none": hvdcomp.NoCompression(),
        "fp16": hvdcomp.FP16(error_feedback=True),
        "qsgd": hvdcomp.QSGDMaxNorm(8),
        "qsgd-rotated": hvdcomp.QSGDMaxNorm(4, rotate=True),
        "qsgd-multiscale": hvdcomp.QSGDMaxNormMultiScale((4, 8)),
        "randk": hvdcomp.GlobalRandKMaxNorm(ratio=0.3, bits=8),
        "randk-multiscale": hvdcomp.GlobalRandKMaxNormMultiScale(ratio=0.3, bits=(4, 8)),
        "powersgd": hvdcomp.PowerSGD(rank=1),
    }


class _Run:
    """A DDP model (with the hook if ``compression`` is given), its SGD, and their step."""

    def __init__(self, compression: object = "default", bucket_cap_mb: float = TINY_BUCKETS_MB,
                 hierarchical: bool | None = None, bucket_size_mb: float | None = None, unused: bool = False) -> None:
        import hvdcomp.ddp

        self.model = DDP(_WithUnused() if unused else _net(), bucket_cap_mb=bucket_cap_mb,
                         find_unused_parameters=unused)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.2, momentum=0.9)
        self.state = None
        if compression != "default":
            self.state = hvdcomp.ddp.register(self.model, compression, hierarchical=hierarchical,
                                                 bucket_size_mb=bucket_size_mb)

    def backward(self, step: int, accumulate: int = 1) -> None:
        self.optimizer.zero_grad()
        for micro in range(accumulate - 1):
            with self.model.no_sync():
                _loss(self.model, step, micro).backward()
        _loss(self.model, step, accumulate - 1).backward()

    def train(self, steps: range) -> torch.Tensor:
        for step in steps:
            self.backward(step)
            self.optimizer.step()
        return _flat(self.model)

    def checkpoint(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "hook": self.state.state_dict()}

    def restore(self, checkpoint: dict) -> None:
        self.model.load_state_dict(checkpoint["model"])
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        self.state.load_state_dict(checkpoint["hook"])


def _grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in model.parameters()])


def _two_workers() -> dict:
    import hvdcomp
    import hvdcomp.ddp

    out: dict = {}
    # NoCompression equals DDP's own all-reduce, also with no_sync accumulation (DDP calls no hook there), and
    # with find_unused_parameters and a parameter that no forward uses
    differences = []
    for unused in (False, True):
        ours, theirs = _Run(hvdcomp.NoCompression(), unused=unused), _Run(unused=unused)
        for step in range(3):
            for run in (ours, theirs):
                run.backward(step, accumulate=1 + step % 2)
            differences.append(float((_grads(ours.model) - _grads(theirs.model)).abs().max()))
            for run in (ours, theirs):
                run.optimizer.step()
        if not unused:
            out["none_stats"] = (ours.state.stats.steps, ours.state.stats.total.inter_node_bytes,
                                 ours.state.stats.total.uncompressed_bytes)
            out["numel"] = sum(p.numel() for p in ours.model.parameters())
    out["none_vs_ddp"] = max(differences)

    # every codec: identical replicas, training loss falls; results do not depend on DDP's bucketing (one
    # bucket per tensor or so against one bucket for all, the same codec buckets)
    out["codecs"] = {}
    for name, compression in _compressions().items():
        run = _Run(compression, bucket_size_mb=TINY_BUCKETS_MB)
        before = _loss(run.model, 99).item()
        params = run.train(range(4))
        one_bucket = _Run(_compressions()[name], bucket_cap_mb=25, bucket_size_mb=TINY_BUCKETS_MB)
        other = one_bucket.train(range(4))
        out["ddp_buckets"] = [len(r.model._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(", "))
                              for r in (run, one_bucket)]
        out["codecs"][name] = (params, before, _loss(run.model, 99).item(), torch.equal(params, other),
                               run.state.stats.total.inter_node_bytes / run.state.stats.steps)

    # exchange="auto" through the hook: the runner times both exchanges and every worker keeps the same one
    from hvdcomp.codec.quantize import MaxNormQuantizer
    from hvdcomp.exchange import MaxNormCodec, TwoStageMaxNorm
    from hvdcomp.exchange.two_stage import EXCHANGE_TRIAL_ROUNDS

    auto = _Run(TwoStageMaxNorm(MaxNormCodec(MaxNormQuantizer((6,))), "auto", scale="ahead"))
    params = auto.train(range(2 * (EXCHANGE_TRIAL_ROUNDS + 1) + 2))
    out["auto"] = (auto.state.codec.trial.choice, auto.state.codec.trial.medians, params)

    # resume: 2 steps, checkpoint, a fresh DDP model (one bucket again at its first step) + load, 2 steps
    out["resume"] = {}
    for name in ("randk", "qsgd-multiscale", "powersgd", "fp16"):
        unbroken = _Run(_compressions()[name]).train(range(4))
        first = _Run(_compressions()[name])
        first.train(range(2))
        second = _Run(_compressions()[name])
        second.restore(first.checkpoint())
        out["resume"][name] = torch.equal(unbroken, second.train(range(2, 4)))

    out["aligned"] = _codec_buckets_inside_ddps()

    # clear errors, on every worker
    errors = []
    mismatched = _Run(hvdcomp.QSGDMaxNorm(8 if dist.get_rank() == 0 else 4))
    try:
        mismatched.backward(0)
    except RuntimeError as error:
        errors.append(str(error))
    for call in (lambda: hvdcomp.ddp.register(nn.Linear(2, 2), None),
                 lambda: hvdcomp.ddp.register(DDP(_net()), "zip"),
                 lambda: hvdcomp.ddp.register(DDP(_net()), None, hierarchical="yes")):
        try:
            call()
        except (TypeError, ValueError) as error:
            errors.append(f"{type(error).__name__}: {error}")
    out["errors"] = errors

    out["outputs"] = _named_outputs_reused()

    # Birder over the torch.distributed transport; then in chunks of 124 elements, their sums in flight together
    from hvdcomp.exchange import onebit

    for label in ("birder", "birder_chunked"):
        if label == "birder_chunked":
            onebit.WORLD_CHUNK_ELEMENTS = 100
        net, birder = _birder_steps(3)
        out[label] = (_flat(net), birder.route, birder.stats.total.inter_node_bytes)
    return out


def _codec_buckets_inside_ddps() -> tuple[bool, int, int]:
    """A model of 42 MB under DDP's default caps (a first bucket of 1 MiB, then 25 MiB) and codec buckets of
    16 MiB through ``hook()``: once DDP has rebuilt its buckets, does every codec bucket lie in one of them (so
    its exchange starts in that bucket's hook)? Also how many codec buckets and DDP buckets there were."""
    import hvdcomp
    import hvdcomp.ddp

    generator = torch.Generator().manual_seed(1)
    layers = [nn.Linear(1024, 1024) for _ in range(10)]
    model = DDP(nn.Sequential(*layers))
    for p in model.parameters():
        p.data.normal_(0, 0.01, generator=generator)
    state, hook = hvdcomp.ddp.hook(hvdcomp.FP16(), bucket_size_mb=16)
    seen: list[set[int]] = []

    def spy(hook_state, bucket):
        seen.append({id(p) for p in bucket.parameters()})
        return hook(hook_state, bucket)

    model.register_comm_hook(state, spy)
    for _ in range(3):
        seen.clear()
        model(torch.ones(2, 1024)).square().sum().backward()
    inside = all(any({id(p) for p in codec_bucket.params} <= ddp_bucket for ddp_bucket in seen)
                 for codec_bucket in state._state.plan)
    return inside, len(state._state.plan), len(seen)


def _named_outputs_reused():
    """Whether a named sum and all-to-all write into the same output again once nothing holds the last one (the
    transport holds its last 4 finished works: 4 other collectives in between), and a held result is never written
    (a new output instead), with the sums right each time; a SUM never writes its request's tensor, a SUM_IN_PLACE
    sums in it."""
    from hvdcomp.exchange import Op

    transport = _torch_transport()
    rank, size = dist.get_rank(), dist.get_world_size()
    data = torch.arange(4.0) + rank
    want = sum(torch.arange(4.0) + r for r in range(size))
    first = transport.wait(transport.start(Op.SUM, data, "bucket.sum"))
    first_ptr, first_ok = first.data_ptr(), torch.equal(first, want)
    del first

    def others():
        for index in range(4):
            transport.wait(transport.start(Op.MAX, data, f"other{index}"))

    others()
    again = transport.wait(transport.start(Op.SUM, data, "bucket.sum"))
    others()
    held = transport.wait(transport.start(Op.SUM, data * 2, "bucket.sum"))
    parts = []
    for _ in range(2):
        parts.append(transport.wait(transport.start(Op.ALLTOALL, data, "bucket.parts")).data_ptr())
        others()
    scratch = torch.arange(4.0) + rank
    summed_there = transport.wait(transport.start(Op.SUM_IN_PLACE, scratch, "bucket.in_place"))
    return {"reused": again.data_ptr() == first_ptr, "held_kept": torch.equal(again, want),
            "fresh_for_held": held.data_ptr() != again.data_ptr() and torch.equal(held, 2 * want),
            "sums": first_ok, "all_to_all_reused": parts[0] == parts[1],
            "request_unwritten": torch.equal(data, torch.arange(4.0) + rank),
            "summed_in_place": summed_there.data_ptr() == scratch.data_ptr() and torch.equal(scratch, want)}


def _torch_transport():
    import hvdcomp.ddp

    return hvdcomp.ddp.TorchDistributedTransport()


def _birder_steps(steps):
    """``_net()`` trained ``steps`` steps by Birder over the torch.distributed transport: (net, optimizer)."""
    import hvdcomp

    net = _net()
    birder = hvdcomp.Birder(net.parameters(), lr=0.01, transport=hvdcomp.ddp.TorchDistributedTransport(),
                            hierarchical=True)
    for step in range(steps):
        birder.zero_grad()
        _loss(net, step).backward()
        birder.step()
    return net, birder


@pytest.mark.slow
def test_ddp_hook_on_two_gloo_workers():
    results = run_ddp(_two_workers, np=2)
    for out in results:
        assert out["outputs"] == {"reused": True, "held_kept": True, "fresh_for_held": True, "sums": True,
                                  "all_to_all_reused": True, "request_unwritten": True,
                                  "summed_in_place": True}, out["outputs"]
        assert out["none_vs_ddp"] <= 1e-6
        steps, sent, uncompressed = out["none_stats"]
        assert steps == 3 and sent == uncompressed == 3 * 4 * out["numel"]  # fp32, once per synchronizing step
        assert all(out["resume"].values()), out["resume"]
        assert len(out["errors"]) == 4, out["errors"]
        assert "configured differently (what differs: compression" in out["errors"][0]
        assert "DistributedDataParallel" in out["errors"][1] and "not supported" in out["errors"][2]
        assert "hierarchical must be True or False" in out["errors"][3]
        assert out["ddp_buckets"][0] >= 2 and out["ddp_buckets"][1] == 1  # the precondition of the bucketing check
        inside, codec_buckets, ddp_buckets = out["aligned"]
        assert inside and ddp_buckets >= 3 and codec_buckets > ddp_buckets, out["aligned"]
    fp32_bytes = 4 * results[0]["numel"]
    for name, (params, before, after, bucketing_invariant, bytes_per_step) in results[0]["codecs"].items():
        assert torch.equal(params, results[1]["codecs"][name][0]), name  # identical replicas
        assert torch.isfinite(params).all() and after < before, (name, before, after)
        assert bucketing_invariant, name
        assert bytes_per_step < fp32_bytes or name == "none", (name, bytes_per_step)
    choice, medians, params = results[0]["auto"]
    assert choice is not None and all(out["auto"][:2] == (choice, medians) for out in results)
    assert torch.equal(params, results[1]["auto"][2]) and torch.isfinite(params).all()
    birder_params, route, sent = results[0]["birder"]
    assert torch.equal(birder_params, results[1]["birder"][0]) and route == "world:sum" and sent > 0
    assert all(out["birder_chunked"][1:] == (route, sent) and torch.equal(out["birder_chunked"][0], birder_params)
               for out in results)  # three chunks: the same parameters and bytes as one sum


def _emulated_nodes() -> dict:
    import hvdcomp
    import hvdcomp.ddp

    out: dict = {}
    ours, theirs = _Run(hvdcomp.NoCompression(), hierarchical=True), _Run()
    for run in (ours, theirs):
        run.backward(0)
    out["none_vs_ddp"] = float((_grads(ours.model) - _grads(theirs.model)).abs().max())
    for name in ("qsgd", "powersgd"):
        stats = []
        for hierarchical in (True, False):
            run = _Run(_compressions()[name], hierarchical=hierarchical)
            params = run.train(range(2))
            total = run.state.stats.total
            stats.append((total.intra_node_bytes, total.inter_node_bytes))
        out[name] = (params, *stats)
    net, birder = _birder_steps(2)
    out["birder"] = (_flat(net), birder.route)
    from hvdcomp.exchange.protocol import Op

    transport, rank = hvdcomp.ddp.TorchDistributedTransport(), dist.get_rank()
    out["alltoall"] = transport.collective(Op.ALLTOALL, torch.arange(4, dtype=torch.uint8) + 4 * rank)
    out["cross_alltoall"] = transport.collective(Op.CROSS_ALLTOALL, torch.arange(2) + 10 * rank)
    return out


@pytest.mark.slow
def test_ddp_hook_hierarchical_on_two_emulated_nodes_of_two():
    results = run_ddp(_emulated_nodes, np=4, local_size=2)
    for out in results:
        assert out["none_vs_ddp"] <= 1e-6
        for name in ("qsgd", "powersgd"):
            params, (intra, inter), (flat_intra, flat_inter) = out[name]
            assert torch.equal(params, results[0][name][0]), name
            assert intra > 0 and flat_intra == 0 and 0 < inter < flat_inter, (name, intra, inter, flat_inter)
        assert torch.equal(out["birder"][0], results[0]["birder"][0]) and out["birder"][1].startswith("hierarchical")
    for rank, out in enumerate(results):  # part j of every sender's tensor reaches member j, by sender
        assert out["alltoall"].tolist() == [rank, 4 + rank, 8 + rank, 12 + rank]
        cross_rank, peers = rank // 2, (rank % 2, rank % 2 + 2)  # nodes {0, 1} and {2, 3}
        assert out["cross_alltoall"].tolist() == [10 * peer + cross_rank for peer in peers]


def _one_worker_without_horovod() -> list[str]:
    sys.modules["horovod"] = sys.modules["mpi4py"] = None  # importing either now fails
    import hvdcomp.ddp
    from hvdcomp import FP16, NoCompression, PowerSGD
    from hvdcomp.codec import MaxNormQuantizer
    from hvdcomp.exchange import MaxNormCodec

    full_rank = PowerSGD(rank=16, min_compression_rate=0)  # compresses every matrix, exactly
    for codec in (NoCompression(), FP16(), full_rank, MaxNormCodec(MaxNormQuantizer((16,)))):
        model = DDP(_net())
        state = hvdcomp.ddp.register(model, codec)
        _loss(model, 0).backward()
        reference = _net()
        _loss(reference, 0).backward()
        assert torch.allclose(_grads(model), _grads(reference), atol=1e-4, rtol=1e-3), codec
        assert state.stats.steps == 1
    return sorted(name for name, module in sys.modules.items() if name.startswith("horovod") and module is not None)


def test_import_needs_no_horovod_and_one_worker_runs_every_codec():
    assert run_ddp(_one_worker_without_horovod, np=1) == [[]]


def test_bucket_exchange_routes_both_codec_kinds():
    from hvdcomp.exchange import NoCompression, Placement, PowerSGD, simulate
    from hvdcomp.exchange.hierarchy import bucket_exchange

    generator = torch.Generator().manual_seed(0)
    # local rank 0 owns the first matrix and the vector, local rank 1 the second matrix: both run two rounds
    # (the simulator's lockstep needs that; real transports do not)
    grads = [[torch.randn(6, 5, generator=generator), torch.randn(5, 6, generator=generator),
              torch.randn(7, generator=generator)] for _ in range(4)]
    mean = [torch.stack([g[i] for g in grads]).mean(0) for i in range(3)]
    for hierarchical in (False, True):
        flats = [torch.cat([x.reshape(-1) for x in g]) for g in grads]
        results = simulate([bucket_exchange(NoCompression(), flat, g, "b", 0, Placement(rank, 4, 2), hierarchical)
                            for rank, (flat, g) in enumerate(zip(flats, grads))], local_size=2)
        for result in results:
            assert torch.allclose(result, torch.cat([m.reshape(-1) for m in mean]), atol=1e-6)
        codecs = [PowerSGD(rank=5, min_compression_rate=0) for _ in range(4)]  # full rank: exact up to rounding
        results = simulate([bucket_exchange(codec, torch.zeros(0), g, "b", 0, Placement(rank, 4, 2), hierarchical)
                            for rank, (codec, g) in enumerate(zip(codecs, grads))], local_size=2)
        for result in results:
            assert all(torch.allclose(r, m, atol=1e-5) for r, m in zip(result, mean)), hierarchical




@pytest.mark.parametrize("name, args, default_mb", [("FP16", (), 25.0), ("BF16", (), 25.0), ("QSGDMaxNorm", (4,), 8.0),
                                                    ("QSGDMaxNormMultiScale", ((4, 8),), 25.0), (None, (), 25.0)])
def test_default_codec_buckets_are_the_codecs_bucket_mb_else_ddps(name, args, default_mb):
    """The codec's ``bucket_mb`` where it has one and splits deliveries, else DDP's 25 MiB (``FP16`` and ``BF16``:
    DDP's own buckets, though ``hvdcomp.DistributedOptimizer`` takes their 8 MiB); ``bucket_size_mb`` wins."""
    import hvdcomp
    import hvdcomp.ddp
    from hvdcomp.exchange.plan import Delivery

    def make() -> object:
        return None if name is None else getattr(hvdcomp, name)(*args)

    assert hvdcomp.ddp.hook(make())[0]._bucket_size_mb == default_mb
    assert hvdcomp.ddp.hook(make(), bucket_size_mb=3.0)[0]._bucket_size_mb == 3.0
    given_cap = hvdcomp.ddp.hook(make(), bucket_cap_mb=10.0)[0]  # the model's cap: default buckets and DDP's cuts
    assert given_cap._bucket_size_mb == (10.0 if default_mb == 25.0 else default_mb)
    assert given_cap._delivery == Delivery(10.0, 10.0) and hvdcomp.ddp.hook(make())[0]._delivery == Delivery(1.0, 25.0)
    assert hvdcomp.ddp.hook(make(), bucket_cap_mb=25.0)[0]._delivery == Delivery(1.0, 25.0)  # as register reads it
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        hvdcomp.ddp.hook(make(), bucket_cap_mb=0)
