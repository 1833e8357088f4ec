"""bfloat16 and float16 models through every codec on real workers: ``hvdcomp.DistributedOptimizer`` over Horovod
Gloo (and MPI), the DDP hook over torchrun's Gloo; ``BF16``/``FP16`` against torch's own bf16/fp16 hooks; and
``hvdcomp.ddp.hook``'s ``(state, hook)`` against ``register``. One launch per door, every case inside it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.ddp_launch import run_ddp
from tests.harness import run_function

CODECS = ["none", "fp16", "bf16", "qsgd", "multiscale", "randk", "randk-multiscale", "powersgd"]
DTYPES = [torch.bfloat16, torch.float16]
STEPS = 3
TINY_MB = 0.0005  # DDP buckets of a tensor or two; codec buckets likewise


def _compression(name):
    import hvdcomp

    return {
        "none": lambda: hvdcomp.NoCompression(),
        "fp16": lambda: hvdcomp.FP16(error_feedback=True),
        "bf16": lambda: hvdcomp.BF16(error_feedback=True),
        "qsgd": lambda: hvdcomp.QSGDMaxNorm(8),
        "multiscale": lambda: hvdcomp.QSGDMaxNormMultiScale((4, 8)),
        "randk": lambda: hvdcomp.GlobalRandKMaxNorm(ratio=0.5, bits=8),
        "randk-multiscale": lambda: hvdcomp.GlobalRandKMaxNormMultiScale(ratio=0.5, bits=(4, 8)),
        "powersgd": lambda: hvdcomp.PowerSGD(rank=1, min_compression_rate=1.0),
    }[name]()


def _net(dtype):
    generator = torch.Generator().manual_seed(0)
    net = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    return net.to(dtype)


def _loss(model, rank, step):
    generator = torch.Generator().manual_seed(100 * rank + step)
    x, y = torch.randn(16, 12, generator=generator), torch.randn(16, 3, generator=generator)
    return nn.functional.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y)


def _local_grads(dtype, rank):
    """This worker's own first-step gradients of ``_net(dtype)`` (before any exchange)."""
    net = _net(dtype)
    _loss(net, rank, 0).backward()
    return [p.grad.clone() for p in net.parameters()]


def _train(model, step_fn, rank):
    """``STEPS`` steps of ``model``; returns the first step's means (each parameter's gradient after the step)."""
    first = None
    for step in range(STEPS):
        step_fn(_loss(model, rank, step))
        if first is None:
            first = [p.grad.clone() for p in model.parameters()]
    return first


def _cases():
    return [(dtype, name) for dtype in DTYPES for name in CODECS] + [(torch.float32, "bf16")]


def _record(model, means, stats):
    return {"params": [p.detach().clone() for p in model.parameters()], "means": means,
            "dtypes": {str(p.dtype) for p in model.parameters()} | {str(p.grad.dtype) for p in model.parameters()},
            "sent": stats.total.inter_node_bytes, "dense": stats.total.uncompressed_bytes}


def _optimizer_worker(over_mpi):
    import horovod.torch as hvd

    import hvdcomp

    transport = hvdcomp.MPITransport() if over_mpi else None
    out = {}
    for dtype, name in _cases():
        model = _net(dtype)
        optimizer = hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                 named_parameters=model.named_parameters(),
                                                 compression=_compression(name), bucket_size_mb=TINY_MB,
                                                 transport=transport)

        def step(loss, optimizer=optimizer):
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        means = _train(model, step, hvd.rank())
        out[(dtype, name)] = dict(_record(model, means, optimizer.stats), local=_local_grads(dtype, hvd.rank()))
    if not over_mpi:  # Horovod moves bfloat16 as int16 words (in pieces when large) and refuses to reduce it
        from hvdcomp.exchange import Op

        horovod = hvdcomp.HorovodTransport()
        mine = torch.arange(2 * 300_000, dtype=torch.float32).mul_(hvd.rank() + 1).bfloat16()  # pieces of 512 KiB
        out["alltoall"] = horovod.collective(Op.ALLTOALL, mine)
        out["allgather"] = horovod.collective(Op.ALLGATHER_EQUAL, mine[:7])
        try:
            horovod.collective(Op.SUM, mine)
        except TypeError as error:
            out["sum"] = str(error)
    return out


def _ddp_worker():
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hvdcomp
    import hvdcomp.ddp

    rank = dist.get_rank()

    def sgd_step(model):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(loss):
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        return step

    out = {}
    for dtype, name in _cases():
        model = DDP(_net(dtype), bucket_cap_mb=TINY_MB)
        state = hvdcomp.ddp.register(model, _compression(name))
        means = _train(model, sgd_step(model), rank)
        out[(dtype, name)] = dict(_record(model, means, state.stats), local=_local_grads(dtype, rank))

    # BF16 and FP16 send what torch's bf16 and fp16 hooks send: at W = 2 the same means, bit for bit
    out["torch_hooks"] = {}
    for name, torch_hook in (("bf16", default_hooks.bf16_compress_hook), ("fp16", default_hooks.fp16_compress_hook)):
        runs = []
        for ours in (True, False):
            model = DDP(_net(torch.float32))
            if ours:
                hvdcomp.ddp.register(model, hvdcomp.BF16() if name == "bf16" else hvdcomp.FP16())
            else:
                model.register_comm_hook(dist.group.WORLD, torch_hook)
            runs.append(_train(model, sgd_step(model), rank))
        out["torch_hooks"][name] = all(torch.equal(a, b) for a, b in zip(*runs))

    # hook(): torch's (state, hook) convention gives register()'s results (DDP's first step in several buckets); a
    # state loaded before the first call is applied when it binds, so a resumed run continues exactly
    def with_hook(load=None):
        model = DDP(_net(torch.float32), bucket_cap_mb=TINY_MB)
        state, hook = hvdcomp.ddp.hook(hvdcomp.QSGDMaxNorm(4), bucket_size_mb=TINY_MB)
        if load is not None:
            state.load_state_dict(load)
        model.register_comm_hook(state, hook)
        return model, state

    registered = DDP(_net(torch.float32), bucket_cap_mb=TINY_MB)
    register_state = hvdcomp.ddp.register(registered, hvdcomp.QSGDMaxNorm(4), bucket_size_mb=TINY_MB)
    step_registered = sgd_step(registered)
    hooked, hook_state = with_hook()
    step_hooked = sgd_step(hooked)
    for step in range(2 * STEPS):
        step_registered(_loss(registered, rank, step))
        step_hooked(_loss(hooked, rank, step))
        if step == STEPS - 1:
            saved = {"model": copy.deepcopy(hooked.state_dict()), "hook": hook_state.state_dict()}
    resumed, resumed_state = with_hook(load=saved["hook"])
    resumed.load_state_dict(saved["model"])
    step_resumed = sgd_step(resumed)
    for step in range(STEPS, 2 * STEPS):
        step_resumed(_loss(resumed, rank, step))
    out["hook"] = {name: [p.detach().clone() for p in m.parameters()]
                   for name, m in (("register", registered), ("hook", hooked), ("resumed", resumed))}
    out["hook_stats"] = (register_state.stats.total.inter_node_bytes, hook_state.stats.total.inter_node_bytes,
                         hook_state.stats.steps, resumed_state.step)
    return out


def _exact_means(results, dtype, name):
    """The first step's exact means, where the codec's rounding is known: the float32 mean (none), the float32 sum of
    the gradients rounded to the codec's 16-bit dtype, rounded to it once (fp16 of float16 gradients, bf16 of bf16
    and float32 ones); else None.
    At W = 2 the division by W rounds nothing."""
    half = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(name)
    if name != "none" and not (half == dtype or (half is torch.bfloat16 and dtype is torch.float32)):
        return None
    locals_ = [r[(dtype, name)]["local"] for r in results]
    sent = [[g.float() if half is None else g.to(half).float() for g in worker] for worker in locals_]
    sums = [sum(worker[i] for worker in sent) for i in range(len(sent[0]))]
    return [(s if half is None else s.to(half).float()).div(len(results)).to(dtype) for s in sums]


def _check(results):
    for dtype, name in _cases():
        first, second = (r[(dtype, name)] for r in results)
        assert all(torch.equal(a, b) for a, b in zip(first["params"], second["params"])), (dtype, name)
        assert all(bool(torch.isfinite(p).all()) for p in first["params"]), (dtype, name)
        assert first["dtypes"] == {str(dtype)}, (dtype, name, first["dtypes"])  # parameters and means alike
        assert 0 < first["sent"] and first["dense"] > 0, (dtype, name)
        exact, exact_of = _exact_means(results, dtype, name), first["local"]
        if exact is not None:
            assert all(torch.equal(a, b) for a, b in zip(first["means"], exact)), (dtype, name)
        else:  # within the codec's error of the mean of the 16-bit gradients
            scale = max(float(g.abs().max()) for r in results for g in r[(dtype, name)]["local"])
            mean = [sum(r[(dtype, name)]["local"][i].double() for r in results) / 2 for i in range(len(exact_of))]
            error = max(float((a.double() - b).abs().max()) for a, b in zip(first["means"], mean))
            assert error <= (1.0 if name in ("randk", "randk-multiscale", "powersgd") else 0.15) * scale, (dtype, name)
    for dtype in DTYPES:  # 16 bits an element: half of the float32 sum's bytes (the all-to-all pads odd buckets)
        sent = {name: results[0][(dtype, name)]["sent"] for name in ("none", "fp16", "bf16")}
        assert all(0.45 * sent["none"] <= sent[name] <= 0.56 * sent["none"] for name in ("fp16", "bf16")), sent


@pytest.mark.slow
def test_16_bit_models_through_every_codec_in_the_optimizer_over_horovod_gloo():
    results = run_function(_optimizer_worker, np=2, kwargs={"over_mpi": False}, timeout=300)
    _check(results)
    sent = [torch.arange(2 * 300_000, dtype=torch.float32).mul_(rank + 1).bfloat16() for rank in range(2)]
    for rank, out in enumerate(results):
        assert out["alltoall"].dtype == torch.bfloat16
        assert torch.equal(out["alltoall"], torch.cat([s.view(2, -1)[rank] for s in sent]))
        assert torch.equal(out["allgather"], torch.cat([s[:7] for s in sent]))
        assert "Horovod has no bfloat16 reductions" in out["sum"]


@pytest.mark.slow
@pytest.mark.mpi
def test_16_bit_models_through_every_codec_in_the_optimizer_over_mpi():
    _check(run_function(_optimizer_worker, np=2, launcher="mpi", kwargs={"over_mpi": True}, timeout=300))


@pytest.mark.slow
def test_16_bit_models_through_every_codec_in_the_ddp_hook_and_torchs_hook_convention():
    results = run_ddp(_ddp_worker, np=2, timeout=300)
    _check(results)
    for out in results:
        assert out["torch_hooks"] == {"bf16": True, "fp16": True}
        runs = out["hook"]
        assert all(torch.equal(a, b) for a, b in zip(runs["register"], runs["hook"]))
        assert all(torch.equal(a, b) for a, b in zip(runs["hook"], runs["resumed"]))
        register_sent, hook_sent, hook_steps, resumed_step = out["hook_stats"]
        assert register_sent == hook_sent > 0 and hook_steps == 2 * STEPS and resumed_step == 2 * STEPS
    assert all(torch.equal(a, b) for a, b in zip(results[0]["hook"]["hook"], results[1]["hook"]["hook"]))
