"""benchmarks/cluster.py: its pure parts (rates, scheme names, options, records, table) and, as root with
``ip``, a real ``--quick`` run on an emulated cluster plus clean-up when it is terminated."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import cluster  # noqa: E402
import cluster_report  # noqa: E402
import cluster_worker  # noqa: E402
from cluster_netns import PREFIX, our_namespaces, parse_rate, why_unavailable  # noqa: E402
from cluster_schemes import (  # noqa: E402
    DEFAULT,
    FSDP_DEFAULT,
    FSDP_HIERARCHICAL_DEFAULT,
    HIERARCHICAL_DEFAULT,
    QUICK,
    Scheme,
    default_schemes,
    parse_scheme,
)


def test_parse_rate():
    assert parse_rate("1gbit") == 10**9
    assert parse_rate("2.5Gbit") == 2_500_000_000
    assert parse_rate("100mbit") == 10**8
    for bad in ("1gb", "fast", "0gbit", "-1mbit", ""):
        with pytest.raises(ValueError, match="rate"):
            parse_rate(bad)


def test_scheme_names():
    for name in DEFAULT + HIERARCHICAL_DEFAULT + QUICK:
        assert parse_scheme(name).name == name
    assert parse_scheme("hvdcomp:qsgd4:hier") == Scheme("hvdcomp", "qsgd4", True)
    assert parse_scheme("stock:qsgd8").qsgd_bits == 8
    assert parse_scheme("local:sgd") == Scheme("local", "sgd") and not parse_scheme("local:sgd").torch_distributed
    assert parse_scheme("hvdcomp:birder").qsgd_bits is None
    for variant in ("none", "fp16", "bf16", "qsgd2", "qsgd8", "multiscale48", "randk1", "powersgd1", "birder"):
        for name in (f"hvdcomp-ddp:{variant}", f"hvdcomp-ddp:{variant}:hier"):
            assert parse_scheme(name).name == name and parse_scheme(name).torch_distributed
    assert parse_scheme("hvdcomp-ddp:qsgd4:hier") == Scheme("hvdcomp-ddp", "qsgd4", True)
    assert parse_scheme("ddp:fp16").torch_distributed and not parse_scheme("hvdcomp:qsgd4").torch_distributed
    assert {"hvdcomp-ddp:fp16", "hvdcomp-ddp:qsgd4", "hvdcomp-ddp:powersgd1"} <= set(DEFAULT)
    assert {"ddp:bf16", "hvdcomp:bf16", "hvdcomp-ddp:bf16"} <= set(DEFAULT)  # Horovod has no bfloat16
    assert "hvdcomp-ddp:birder" not in DEFAULT and [n for n in QUICK if n.startswith("hvdcomp-ddp:")]
    two_stage = parse_scheme("hvdcomp:qsgd8:hier:two_stage")
    assert two_stage == Scheme("hvdcomp", "qsgd8", True, "two_stage") and two_stage.exchange == "two_stage"
    for name in ("hvdcomp:qsgd4:auto_exchange", "hvdcomp:birder:auto:auto_exchange"):  # the exchange left open
        assert parse_scheme(name).exchange == "auto" and parse_scheme(name).name == name
    assert parse_scheme("hvdcomp:birder:two_stage").name == "hvdcomp:birder:two_stage"
    for name in ("hvdcomp:birder:auto", "hvdcomp-ddp:birder:auto", "hvdcomp:birder:auto:two_stage"):
        scheme = parse_scheme(name)  # the route left open: Birder's default
        assert scheme.name == name and scheme.hierarchical is None and scheme.node_sets
    assert parse_scheme("hvdcomp:birder:hier").node_sets and not parse_scheme("hvdcomp:birder").node_sets
    assert parse_scheme("hvdcomp:qsgd8").exchange == "lanes"
    for name in (*FSDP_DEFAULT, *FSDP_HIERARCHICAL_DEFAULT, "fsdp:fp32:hsdp", "hvdcomp-fsdp:randk1"):
        assert parse_scheme(name).name == name and parse_scheme(name).torch_distributed
    assert parse_scheme("hvdcomp-fsdp:qsgd4:hsdp") == Scheme("hvdcomp-fsdp", "qsgd4", hsdp=True)
    assert {"fsdp:fp32", "fsdp:bf16", "hvdcomp-fsdp:qsgd4"} <= set(FSDP_DEFAULT)
    for bad in ("horovod:qsgd4", "horovod:bf16", "hvdcomp:qsgd17", "ddp:fp16:hier", "hvdcomp:none:flat", "hvdcomp",
                "mpi:fp32", "local:fp32", "local:sgd:hier", "hvdcomp-ddp:fp32", "hvdcomp-ddp:qsgd0",
                "hvdcomp-ddp:none:flat", "hvdcomp_ddp:none",
                "hvdcomp:fp16:two_stage", "hvdcomp-ddp:qsgd4:two_stage", "hvdcomp:qsgd4:two_stage:hier",
                "stock:qsgd4:two_stage", "hvdcomp:qsgd4:hier:hier", "hvdcomp-fsdp:powersgd1", "fsdp:fp16",
                "hvdcomp-ddp:qsgd4:hsdp", "hvdcomp-fsdp:qsgd4:hier", "fsdp:fp32:hsdp:two_stage", "hvdcomp:qsgd4:auto",
                "hvdcomp:birder:hier:auto", "hvdcomp:birder:auto:hier", "ddp:fp32:auto", "hvdcomp-fsdp:none:auto",
                "hvdcomp:qsgd4:two_stage:auto_exchange", "hvdcomp:qsgd4:auto_exchange:two_stage",
                "hvdcomp:fp16:auto_exchange", "hvdcomp-ddp:qsgd4:auto_exchange"):
        with pytest.raises(ValueError, match="scheme"):
            parse_scheme(bad)
    assert default_schemes(1) == list(DEFAULT + FSDP_DEFAULT)
    assert default_schemes(2) == list(DEFAULT + FSDP_DEFAULT + HIERARCHICAL_DEFAULT + FSDP_HIERARCHICAL_DEFAULT)


def test_options(capsys):
    quick = cluster.parse_args(["--quick"])
    assert (quick.nodes, quick.workers_per_node, quick.model, quick.rate_list) == (2, 1, "quick", [("1gbit", 10**9)])
    assert quick.scheme_list == list(QUICK)
    full = cluster.parse_args(["--nodes", "4", "--workers-per-node", "2", "--rates", "1gbit,10gbit",
                               "--schemes", "horovod:fp32,hvdcomp:qsgd4:hier", "--threads", "2"])
    assert full.model == "resnet50" and full.threads == 2 and full.warmup == 3
    assert [rate for _, rate in full.rate_list] == [10**9, 10**10]
    assert full.scheme_list == ["horovod:fp32", "hvdcomp:qsgd4:hier"]
    ddp = cluster.parse_args(["--quick", "--schemes", " hvdcomp-ddp:randk1,hvdcomp-ddp:birder:hier"])
    assert ddp.scheme_list == ["hvdcomp-ddp:randk1", "hvdcomp-ddp:birder:hier"]
    for bad in (["--rates", "1gb"], ["--schemes", "hvdcomp:zip"], ["--nodes", "1"], ["--reps", "0"]):
        with pytest.raises(SystemExit):
            cluster.parse_args(bad)
    assert "rate '1gb'" in capsys.readouterr().err


def test_torch_distributed_env():
    """DDP workers get torchrun's variables: ranks node by node, each node's local rank and size."""
    args = SimpleNamespace(workers_per_node=2)
    env = cluster._ddp_env(SimpleNamespace(nodes=3), args, node=1, local=1)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("3", "6", "1", "2")


def test_hvdcomp_ddp_codecs_match_the_hvdcomp_schemes():
    """hvdcomp-ddp:X builds (without Horovod) the bucket codec that hvdcomp:X's compressor carries."""
    from hvdcomp.ddp import resolve_codec

    for variant in ("none", "fp16", "bf16", "qsgd4", "multiscale48", "randk1", "powersgd1"):
        bits = parse_scheme(f"hvdcomp-ddp:{variant}").qsgd_bits
        ours = resolve_codec(cluster_worker._hvdcomp_ddp_codec(variant, bits))
        theirs = resolve_codec(cluster_worker._hvdcomp_compression(variant, bits))
        assert type(ours) is type(theirs), variant
        assert getattr(ours, "config", tuple)() == getattr(theirs, "config", tuple)(), variant
        assert getattr(ours, "seed", None) == getattr(theirs, "seed", None), variant


def one_step(seconds: float, payload_bits: int | None) -> dict:
    """One rank's result of one step without hvdcomp's statistics."""
    return {"step_s": [seconds], "main_cpu_s": [seconds / 2], "process_cpu_s": [seconds], "traffic": [None],
            "payload_bits": payload_bits, "elements": 200}


def test_records_and_table():
    base = {"scheme": "hvdcomp:qsgd4", "nodes": 2, "workers_per_node": 1, "rate": "1gbit", "rate_bps": 10**9,
            "model": "quick", "reps": 3, "warmup": 1, "threads": 1}
    traffic = [{"inter_node_bytes": 100, "compress_s": c, "communicate_s": 0.5, "decompress_s": 0.1} for c in (1, 2, 3)]
    ranks = [{"step_s": [1.0, 4.0, 2.0], "main_cpu_s": [0.5, 1.0, 0.7], "process_cpu_s": [1.0, 2.0, 3.0],
              "traffic": traffic, "payload_bits": None, "elements": 200},
             {"step_s": [3.0, 1.0, 2.5], "main_cpu_s": [0.7, 1.0, 0.9], "process_cpu_s": [2.0, 2.0, 2.0],
              "traffic": traffic, "payload_bits": None, "elements": 200}]
    record = cluster_report.summarize(base, ranks)
    assert record["step_s"] == [3.0, 4.0, 2.5]  # the slowest worker's time of each step
    assert (record["median_s"], record["min_s"]) == (3.0, 2.5)
    assert (record["main_cpu_s"], record["process_cpu_s"]) == (0.8, 2.0)  # medians over steps of the ranks' means
    assert record["bits_per_element"] == 4.0 and record["compress_s"] == 2
    fp32 = cluster_report.summarize({**base, "scheme": "horovod:fp32"}, [one_step(6.0, 32)])
    assert fp32["bits_per_element"] == 32 and fp32["compress_s"] is None
    hang = cluster_report.failed({**base, "scheme": "ddp:powersgd1"}, "hang", "no progress for 9 s")
    lines = cluster_report.table([fp32, record, hang]).splitlines()
    assert lines[0].startswith("| scheme | bits/element between nodes | median s | min s |")
    assert lines[0].endswith("| vs horovod:fp32 | vs best 16-bit peer (none ran) | vs local:sgd (no exchange) |")
    assert len({line.count("|") for line in lines}) == 1  # every row has every column
    assert lines[3] == ("| hvdcomp:qsgd4 | 4.00 | 3.000 | 2.500 | 0.800 / 2.000 | 2.000 | 0.500 | 0.100 | 10500000.00 "
                        "| ×2.00 | – | – |")
    assert record["codec_ns_per_element"] == pytest.approx(1e9 * 2.1 / 200)  # (compress + decompress) / element
    assert "hang: no progress for 9 s" in lines[4]

    # the best 16-bit peer: the fastest of horovod:fp16, ddp:fp16 and ddp:bf16 in the same run
    def peer(scheme, seconds):
        return cluster_report.summarize({**base, "scheme": scheme}, [one_step(seconds, 16)])

    peers = [peer("horovod:fp16", 5.0), peer("ddp:bf16", 4.5), peer("ddp:fp16", 4.8), peer("hvdcomp:bf16", 1.0)]
    floor = cluster_report.summarize({**base, "scheme": "local:sgd"}, [one_step(1.5, None)])
    lines = cluster_report.table([fp32, *peers, record, floor]).splitlines()
    assert lines[0].endswith("| vs horovod:fp32 | vs best 16-bit peer (ddp:bf16) | vs local:sgd (no exchange) |")
    assert lines[-2].endswith("| ×2.00 | ×1.50 | ×0.50 |") and lines[4].endswith("| ×1.33 | ×1.00 | ×0.33 |")
    assert lines[-1].startswith("| local:sgd | – | 1.500 |") and lines[-1].endswith("| ×4.00 | ×3.00 | ×1.00 |")
    assert cluster_report.best_16_bit_peer({"hvdcomp:bf16": 1.0, "ddp:fp16": 3.0}) == "ddp:fp16"


needs_cluster = pytest.mark.skipif(why_unavailable() is not None, reason=f"cluster benchmark: {why_unavailable()}")


@pytest.mark.slow
@needs_cluster
def test_quick_run(tmp_path):
    """``--quick --json``: every scheme reported (timed, or an explicit hang/error), baselines timed,
    QSGD sending fewer bits than fp32 over Horovod and over DDP (hvdcomp.ddp's hook), and none of the run's
    namespaces or hosts files left behind."""
    out = tmp_path / "quick.json"
    bench = subprocess.Popen([sys.executable, str(BENCHMARKS / "cluster.py"), "--quick", "--json", str(out)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = bench.communicate(timeout=900)
    assert bench.returncode == 0, stdout + stderr
    records = {r["scheme"]: r for r in json.loads(out.read_text())}
    assert sorted(records) == sorted(QUICK)
    for name, r in records.items():
        assert (r["nodes"], r["workers_per_node"], r["rate"]) == (2, 1, "1gbit")
        if r["status"] == "ok":
            assert 0 < r["min_s"] <= r["median_s"] and len(r["step_s"]) == 3, name
            assert 0 < r["main_cpu_s"] <= r["process_cpu_s"], name  # the stepping thread's share of the worker's
        else:
            assert r["status"] in ("hang", "error") and r["detail"] and r["median_s"] is None, name
    for timed in ("horovod:fp32", "hvdcomp:none", "hvdcomp:qsgd4", "hvdcomp-ddp:qsgd4", "local:sgd"):
        assert records[timed]["status"] == "ok", records[timed]
    assert records["hvdcomp:qsgd4"]["bits_per_element"] < 8 < 32 == records["horovod:fp32"]["bits_per_element"]
    assert records["hvdcomp-ddp:qsgd4"]["bits_per_element"] < 8 and records["hvdcomp-ddp:qsgd4"]["compress_s"] > 0
    assert records["local:sgd"]["bits_per_element"] is None and records["local:sgd"]["compress_s"] is None
    assert "| hvdcomp:qsgd4 |" in stdout
    mine = f"{PREFIX}{bench.pid}-"
    assert not [name for name in our_namespaces() if name.startswith(mine)]
    assert not list(Path("/etc/netns").glob(f"{mine}*"))


@pytest.mark.slow
@needs_cluster
def test_terminated_run_removes_its_namespaces():
    """SIGTERM while the cluster is up: the benchmark exits and deletes every namespace it made."""
    bench = subprocess.Popen([sys.executable, str(BENCHMARKS / "cluster.py"), "--quick", "--schemes", "hvdcomp:none"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    mine = f"{PREFIX}{bench.pid}-"
    deadline = time.time() + 60
    while not any(name.startswith(mine) for name in our_namespaces()) and bench.poll() is None:
        assert time.time() < deadline, "the benchmark built no namespace within 60 s"
        time.sleep(0.2)
    bench.send_signal(signal.SIGTERM)
    assert bench.wait(timeout=60) == 128 + signal.SIGTERM, bench.stderr.read()
    assert not [name for name in our_namespaces() if name.startswith(mine)]
    assert not list(Path("/etc/netns").glob(f"{mine}*"))
