"""Workers configured differently raise one clear error on every worker, never mix or hang; checkpoints of
another compressor are refused before anything changes; float64 gradients stay exact without compression.

Real Horovod workers (``tests/harness.py``); each launch has its own timeout, so a hang shows as a failure.
"""

import pytest
import torch

from tests.harness import run_function

pytestmark = pytest.mark.slow
TIMEOUT = 120


def _mismatch_worker(case):
    """Build ``hvdcomp.DistributedOptimizer`` with one setting different on rank 1, run one step; return what
    each rank saw: the error's type and message, or the gradients."""
    import horovod.torch as hvd

    import hvdcomp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 4))
    odd = hvd.rank() == 1
    params = list(model.parameters())
    kwargs = {"named_parameters": model.named_parameters(), "bucket_size_mb": 1e-3,
              "compression": hvdcomp.QSGDMaxNorm(8)}
    if case == "bits":
        kwargs["compression"] = hvdcomp.QSGDMaxNorm(4 if odd else 8)
    elif case == "compressor":
        kwargs["compression"] = hvd.Compression.fp16 if odd else hvdcomp.QSGDMaxNorm(8)
    elif case == "warmup":
        kwargs["warmup_steps"] = 1 if odd else 0
    elif case == "op":
        kwargs["op"] = hvd.Sum if odd else hvd.Average
    elif case == "order":  # the optimizer lists the parameters in another order on rank 1
        params = params[::-1] if odd else params
        kwargs["compression"] = None
    optimizer = hvdcomp.DistributedOptimizer(torch.optim.SGD(params, lr=0.0), **kwargs)
    x = torch.full((8, 64), float(hvd.rank() + 1))
    try:
        model(x).square().sum().backward()
        optimizer.step()
    except Exception as error:  # noqa: BLE001 (reported to the test)
        return {"error": type(error).__name__, "message": str(error)}
    return {"grads": [p.grad.clone() for p in model.parameters()]}


@pytest.mark.parametrize("case, field", [("bits", "compression"), ("compressor", "compression"),
                                         ("warmup", "warmup_steps"), ("op", "op")])
def test_workers_configured_differently_raise_on_every_worker(case, field):
    results = run_function(_mismatch_worker, np=2, kwargs={"case": case}, timeout=TIMEOUT)
    for rank, out in enumerate(results):
        assert out.get("error") == "ConfigurationMismatchError", (rank, out)
        assert "configured differently" in out["message"] and field in out["message"], (rank, out["message"])


def test_parameter_order_of_the_optimizer_does_not_misalign_buckets():
    results = run_function(_mismatch_worker, np=2, kwargs={"case": "order"}, timeout=TIMEOUT)
    # the exact mean of both workers' gradients, on both (rank r's input is r + 1 everywhere)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 4))
    expected = []
    for rank in range(2):
        model.zero_grad()
        model(torch.full((8, 64), float(rank + 1))).square().sum().backward()
        expected.append([p.grad.clone() for p in model.parameters()])
    mean = [(a + b) / 2 for a, b in zip(*expected)]
    for out in results:
        assert "grads" in out, out
        for got, want in zip(out["grads"], mean):
            torch.testing.assert_close(got, want)


def _foreign_state_worker():
    """Save one compressor's optimizer state, load it into optimizers of other compressors: every load must
    raise ValueError before the optimizer's own state (momentum) or exchange step changes."""
    import horovod.torch as hvd

    import hvdcomp

    def build(compression):
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 4)
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return model, hvdcomp.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                                   compression=compression)

    def train(model, optimizer, steps):
        for _ in range(steps):
            optimizer.zero_grad()
            model(torch.randn(8, 16)).square().sum().backward()
            optimizer.step()

    model, saved = build(hvdcomp.QSGDMaxNorm(4))
    train(model, saved, 2)
    state = saved.state_dict()
    out = {}
    for label, compression in {"fp16_ef": hvdcomp.FP16(error_feedback=True), "powersgd": hvdcomp.PowerSGD(),
                               "bits8": hvdcomp.QSGDMaxNorm(8), "none": None}.items():
        target_model, target = build(compression)
        train(target_model, target, 1)
        before = {k: v.clone() for k, v in target.state_dict()["state"][0].items()}
        step_before = target.state_dict()["hvdcomp"]["exchange_step"]
        try:
            target.load_state_dict(state)
            out[label] = "loaded"
        except ValueError as error:
            after = target.state_dict()
            unchanged = all(torch.equal(before[k], after["state"][0][k]) for k in before)
            out[label] = (str(error), unchanged and after["hvdcomp"]["exchange_step"] == step_before)
    bad = dict(state, hvdcomp=dict(state["hvdcomp"], version=99))
    try:
        build(hvdcomp.QSGDMaxNorm(4))[1].load_state_dict(bad)
        out["version"] = "loaded"
    except ValueError as error:
        out["version"] = str(error)
    hvd.barrier()
    return out


def test_foreign_state_is_refused_before_anything_changes():
    for out in run_function(_foreign_state_worker, np=2, timeout=TIMEOUT):
        for label in ("fp16_ef", "powersgd", "bits8", "none"):
            message, unchanged = out[label]
            assert "QSGDMaxNorm" in message or "AheadMaxNorm" in message, (label, message)
            assert "saved with compression" in message and unchanged, (label, message)
        assert "version" in out["version"], out["version"]


def _float64_worker(compression):
    import horovod.torch as hvd

    import hvdcomp

    values = torch.tensor([1 + 1e-12, 1e-50, 1e39, -3e300], dtype=torch.float64)
    weight = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    codec = None if compression == "none" else hvdcomp.QSGDMaxNorm(8, scale="exact")
    optimizer = hvdcomp.DistributedOptimizer(torch.optim.SGD([weight], lr=0.0), named_parameters=[("w", weight)],
                                             compression=codec)
    (weight * values).sum().backward()  # every worker's gradient is ``values``: their mean is ``values``
    optimizer.step()
    hvd.barrier()
    return weight.grad.clone()


def test_float64_gradients_stay_float64_without_compression():
    for grad in run_function(_float64_worker, np=2, kwargs={"compression": "none"}, timeout=TIMEOUT):
        assert grad.dtype == torch.float64
        assert torch.equal(grad, torch.tensor([1 + 1e-12, 1e-50, 1e39, -3e300], dtype=torch.float64))


def test_float64_gradients_beyond_float32_never_become_inf_when_quantized():
    for grad in run_function(_float64_worker, np=2, kwargs={"compression": "qsgd"}, timeout=TIMEOUT):
        assert grad.dtype == torch.float64 and torch.isfinite(grad).all(), grad
        assert grad[2] > 1e38 and grad[3] < -1e38, grad
