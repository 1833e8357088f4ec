"""The architecture as tests: layer purity, dependencies pointing downward, the declared contracts,
one statistics type, and the public names."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hvdcomp
from hvdcomp.exchange import (
    FP16,
    AheadMaxNorm,
    BucketCodec,
    ElementwiseCodec,
    MaxNormCodec,
    NoCompression,
    Op,
    Placement,
    PowerSGD,
    Reduction,
    Scope,
    Statistics,
    TensorCodec,
    Traffic,
    Transport,
    drive,
    drive_together,
)
from hvdcomp.exchange.protocol import single
from hvdcomp.exchange.stats import counted
from tests.fakes import EchoTransport

PACKAGE = Path(hvdcomp.__file__).parent
LAYERS = ("codec", "exchange", "transport", "integrations")  # bottom to top
PUBLIC = ("ConfigurationMismatchError", "QSGDMaxNorm", "QSGDMaxNormMultiScale", "GlobalRandKMaxNorm",
          "GlobalRandKMaxNormMultiScale",
          "MaxNormCompressor", "DistributedOptimizer", "Birder", "PowerSGD", "FP16", "NoCompression", "MPITransport",
          "BF16", "HorovodTransport", "TorchDistributedTransport", "CarrierMismatchError")


def _imports(path):
    """(layer or external top-level name) of every import in a module of the package."""
    tree = ast.parse(path.read_text())
    parts = path.relative_to(PACKAGE).with_suffix("").parts  # e.g. ("exchange", "stats")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                yield node.module
            else:
                base = list(parts[:-1])[: len(parts) - node.level]
                yield ".".join(["hvdcomp", *base, *([node.module] if node.module else [])])


@pytest.mark.parametrize("layer", LAYERS)
def test_dependencies_point_downward(layer):
    allowed = {f"hvdcomp.{name}" for name in LAYERS[: LAYERS.index(layer) + 1]}
    pure = LAYERS.index(layer) <= LAYERS.index("exchange")
    for path in sorted((PACKAGE / layer).glob("*.py")):
        for name in _imports(path):
            if name.startswith("hvdcomp."):
                target = ".".join(name.split(".")[:2])
                assert target in allowed, f"{path.name} ({layer}) imports {name}, a layer above it"
            elif pure:
                assert name.split(".")[0] not in ("horovod", "mpi4py"), f"{path.name} ({layer}) imports {name}"


def _without_horovod(code):
    """Run ``code`` (which prints ``ok``) in a process where Horovod and mpi4py cannot be imported."""
    prefix = "import sys; sys.modules['horovod'] = sys.modules['mpi4py'] = None; "
    done = subprocess.run([sys.executable, "-c", prefix + code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_codec_and_exchange_import_without_horovod_or_mpi4py():
    _without_horovod("import hvdcomp.codec, hvdcomp.exchange, torch; "
                     "from hvdcomp.exchange import MaxNormCodec, simulate; from hvdcomp.codec import MaxNormQuantizer; "
                     "codecs = [MaxNormCodec(MaxNormQuantizer((4,))) for _ in range(2)]; "
                     "[c.bind_rank(r) for r, c in enumerate(codecs)]; "
                     "out = simulate([c.exchange(torch.ones(5), [5], 0, 0, 2) for c in codecs]); "
                     "assert torch.equal(out[0], torch.ones(5)); print('ok')")


def test_public_codecs_and_the_ddp_door_need_no_horovod():
    _without_horovod("import hvdcomp, hvdcomp.ddp, torch; hvdcomp.QSGDMaxNorm(8); "
                     "codecs = [hvdcomp.QSGDMaxNorm(8), hvdcomp.QSGDMaxNormMultiScale((4, 8), chunk_size=64, seed=1), "
                     "hvdcomp.GlobalRandKMaxNorm(k=3, error_feedback=False), "
                     "hvdcomp.GlobalRandKMaxNormMultiScale(ratio=0.5), "
                     "hvdcomp.QSGDMaxNorm(4, scale='exact', warmup_steps=2, min_compress_numel=0)]; "
                     "assert [hvdcomp.ddp.resolve_codec(c) for c in codecs] == [c.inner for c in codecs]; "
                     "assert codecs[-1].warmup_steps == 2 and codecs[0].warmup_steps == 0; "
                     "half = hvdcomp.FP16(); sent = half.compress(torch.ones(2)); "
                     "assert half.decompress(*sent).dtype == torch.float32; "
                     "print('ok')")


def test_no_module_over_400_lines():
    sizes = {p.relative_to(PACKAGE): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert max(sizes.values()) <= 400, sizes


def test_public_names_keep_working():
    for name in PUBLIC:
        assert getattr(hvdcomp, name).__name__ == name
    assert set(PUBLIC) <= set(hvdcomp.__all__) and set(hvdcomp.__all__) <= set(dir(hvdcomp))
    with pytest.raises(AttributeError):
        hvdcomp.NoSuchThing  # noqa: B018


def test_codecs_declare_the_contract():
    for codec in (NoCompression(), FP16(), FP16(error_feedback=True), hvdcomp.BF16(), hvdcomp.BF16(error_feedback=True),
                  MaxNormCodec(hvdcomp.MaxNormQuantizer((8,)))):
        assert isinstance(codec, ElementwiseCodec) and isinstance(codec, BucketCodec)
    assert isinstance(PowerSGD(), TensorCodec)
    for public in (hvdcomp.QSGDMaxNorm(4), hvdcomp.QSGDMaxNorm(4, scale="exact"), hvdcomp.QSGDMaxNormMultiScale(),
                   hvdcomp.GlobalRandKMaxNorm(k=3), hvdcomp.GlobalRandKMaxNormMultiScale(k=3)):
        assert isinstance(public, ElementwiseCodec) and isinstance(public.max_norm, MaxNormCodec)
        assert public.inner is public.max_norm or isinstance(public.inner, AheadMaxNorm)

    class Incomplete(ElementwiseCodec):  # no state_dict: refused at construction, not found missing later
        def exchange(self, flat, segments, key, step, world_size):
            return (yield Op.SUM, flat)

    with pytest.raises(TypeError, match="state_dict"):
        Incomplete()


def test_transports_implement_the_protocol():
    for cls in (hvdcomp.HorovodTransport, hvdcomp.MPITransport, hvdcomp.TorchDistributedTransport):
        missing = [name for name in ("size", "rank", "local_size", "local_rank", "cross_size", "cross_rank",
                                     "equal_nodes", "blocking", "start", "poll", "wait", "collective")
                   if not hasattr(cls, name)]
        assert not missing, (cls, missing)


def test_typed_ops():
    assert Op.PAYLOAD.carries_payload and Op.PAYLOAD.reduction is Reduction.SUM and Op.PAYLOAD.scope is Scope.WORLD
    assert ([op.across_nodes() for op in (Op.SUM, Op.MAX, Op.PAYLOAD, Op.ALLGATHER, Op.ALLGATHER_EQUAL, Op.ALLTOALL)]
            == [Op.CROSS_SUM, Op.CROSS_MAX, Op.CROSS_SUM, Op.CROSS_ALLGATHER, Op.CROSS_ALLGATHER_EQUAL,
                Op.CROSS_ALLTOALL])
    for op in (Op.LOCAL_SUM, Op.CROSS_MAX, Op.LOCAL_ALLGATHER):
        with pytest.raises(ValueError, match="hierarchical"):
            op.across_nodes()


def test_drive_runs_to_the_end_or_stops_at_an_op():
    transport = EchoTransport()
    assert isinstance(transport, Transport)
    codec = MaxNormCodec(hvdcomp.MaxNormQuantizer((8,)))
    codec.bind_rank(0)
    x = torch.linspace(-1, 1, 9)
    assert torch.allclose(drive(codec.exchange(x, [9], "k", 0, 3), transport), x, atol=1 / 255)
    assert transport.ops == [Op.MAX, Op.PAYLOAD]
    exchange = codec.exchange(x, [9], "k", 1, 3)
    words = drive(exchange, transport, until=Op.PAYLOAD)
    assert words.dtype == torch.int64 and transport.ops[-1] is Op.MAX
    with pytest.raises(StopIteration):
        exchange.send(words * 3)
    with pytest.raises(RuntimeError, match="without requesting"):
        drive(NoCompression().exchange(x, [9], "k", 0, 3), transport, until=Op.PAYLOAD)


def test_drive_together_batches_each_round_into_one_collective():
    xs = [torch.linspace(-1, 1, 9), torch.linspace(0, 3, 4).view(2, 2), torch.zeros(0), torch.tensor(0.5)]
    codecs = [MaxNormCodec(hvdcomp.MaxNormQuantizer((3, 8))) for _ in range(2)]  # multi-scale: MAX, SUM, PAYLOAD
    for codec in codecs:
        codec.bind_rank(0)
    together, alone = EchoTransport(), EchoTransport()
    batched = [codecs[0].exchange(x.reshape(-1), [x.numel()], i, 0, 3) for i, x in enumerate(xs)]
    words = drive_together(batched, together, until=Op.PAYLOAD)
    assert together.ops == [Op.MAX, Op.SUM]  # one collective per round for all four exchanges
    separate = [codecs[1].exchange(x.reshape(-1), [x.numel()], i, 0, 3) for i, x in enumerate(xs)]
    expected = [drive(exchange, alone, until=Op.PAYLOAD) for exchange in separate]
    assert alone.ops == [Op.MAX, Op.SUM] * len(xs)
    for exchange, other, got, want, x in zip(batched, separate, words, expected, xs):
        assert torch.equal(got, want)
        results = []
        for ex in (exchange, other):
            with pytest.raises(StopIteration) as done:
                ex.send(got * 3)
            results.append(done.value.value)
        assert torch.equal(results[0], results[1])
        assert torch.allclose(results[0], x.reshape(-1), atol=float(x.abs().amax()) / 7 + 1e-6 if x.numel() else 0.0)
    assert drive_together([], together, until=Op.PAYLOAD) == []


def test_drive_together_refuses_what_it_cannot_batch():
    transport = EchoTransport()
    one = torch.ones(2)
    with pytest.raises(RuntimeError, match="different ops"):
        drive_together([single(Op.MAX, one), single(Op.SUM, one)], transport, until=Op.PAYLOAD)
    with pytest.raises(RuntimeError, match="without requesting"):
        drive_together([single(Op.SUM, one), single(Op.SUM, one)], transport, until=Op.PAYLOAD)
    with pytest.raises(ValueError, match="dtypes"):
        drive_together([single(Op.SUM, one), single(Op.SUM, one.double())], transport, until=Op.PAYLOAD)
    with pytest.raises(ValueError, match="ALLGATHER"):
        drive_together([single(Op.LOCAL_ALLGATHER, one)], transport, until=Op.PAYLOAD)
    assert transport.ops == [Op.SUM]  # only the two float32 SUMs that then finished too early


def test_traffic_counts_by_scope_and_counted_times_the_codec():
    topology = Placement(rank=1, size=4, local_size=2)
    traffic = Traffic()
    traffic.count(Op.LOCAL_SUM, torch.zeros(10), topology)
    traffic.count(Op.CROSS_ALLGATHER, torch.zeros(10, dtype=torch.uint8), topology)
    traffic.count(Op.MAX, torch.zeros(2), topology, control=True)
    assert (traffic.intra_node_bytes, traffic.inter_node_bytes, traffic.control_bytes) == (40, 10, 8)
    assert traffic.intra_node_wire_bytes == 40.0 and traffic.inter_node_wire_bytes == 10.0  # rings of 2
    assert traffic.sent_bytes == 58

    counted_traffic = Traffic()
    exchange = counted(NoCompression().exchange(torch.ones(6), [6], 0, 0, 2), counted_traffic, Placement(0, 2, 2))
    op, tensor = next(exchange)
    with pytest.raises(StopIteration) as done:
        exchange.send(tensor * 2)
    assert torch.equal(done.value.value, torch.ones(6))
    assert counted_traffic.inter_node_bytes == 24 and counted_traffic.inter_node_wire_bytes == 24.0
    assert min(counted_traffic.compress_s, counted_traffic.communicate_s, counted_traffic.decompress_s) >= 0


def test_one_statistics_type_for_every_entry_point():
    birder = hvdcomp.Birder([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    assert type(birder.stats) is Statistics and type(hvdcomp.QSGDMaxNorm(4).stats) is Statistics
    code = ("import horovod.torch as hvd, torch, hvdcomp; hvd.init(); "
            "p = torch.nn.Parameter(torch.zeros(3)); "
            "opt = hvdcomp.DistributedOptimizer(torch.optim.SGD([p], lr=0.1)); "
            "print(type(opt.stats).__module__, type(opt.stats).__name__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["hvdcomp.exchange.stats", "Statistics"], done.stderr
