"""The README's code runs as written, and its links resolve.

Every ```python block of README.md runs in one of these tests:

* the codec example (``Ternary`` and its simulator test) in this process; its codec is then checked to be
  unbiased, identical on every worker and resumable;
* the blocks that use Horovod on 2 Gloo workers (``tests/harness.py``'s ``run_function``), in order;
* the DDP block in a child process as a torch.distributed world of one (the variables torchrun sets);
* the Lightning block as a script, whose 2 CPU workers Lightning starts itself.
* the FSDP2 block under torchrun on 2 Gloo workers (FSDP reduces nothing in a world of one).

The snippets use ``model``, ``optimizer`` and ``batches`` as the user's own; the tests provide them with
``PREAMBLE`` (a tiny ``torch.nn.Linear`` model, SGD and a few random batches). A Horovod block that builds
an entry point (``DistributedOptimizer(`` or ``Birder(``) starts from a fresh preamble; any other Horovod
block (the checkpoint block) continues in the namespace of the last block that built
``hvdcomp.DistributedOptimizer``.

Every relative link in README.md and docs/*.md must name an existing file, and an anchor (``#...``) must
name a heading of that file.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

PREAMBLE = """\
import torch

torch.manual_seed(0)
model = torch.nn.Linear(16, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
batches = [(torch.randn(8, 16), torch.randn(8, 4)) for _ in range(3)]
"""


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def _kind(block: str) -> str:
    if "import lightning" in block:
        return "lightning"
    if "hvdcomp.ddp" in block and "register(" in block:
        return "ddp"
    if "hvdcomp.fsdp" in block and "register(" in block:
        return "fsdp"
    if "hvd." in block or "hvdcomp.init" in block or "horovod" in block:
        return "horovod"
    return "codec"


def _blocks(kind: str) -> list[str]:
    return [block for block in _python_blocks(README.read_text()) if _kind(block) == kind]


def test_every_python_block_is_run_by_a_test():
    blocks = _python_blocks(README.read_text())
    kinds = [_kind(block) for block in blocks]
    assert kinds.count("codec") == 2, "the codec example: Ternary and its simulator test"
    assert kinds.count("ddp") == kinds.count("fsdp") == kinds.count("lightning") == 1
    assert kinds.count("horovod") >= 3, "stock optimizer, DistributedOptimizer, Birder"


# --- the codec example --------------------------------------------------------------------------------


def _example_namespace():
    namespace = {}
    for block in _blocks("codec"):
        exec(compile(block, str(README), "exec"), namespace)  # noqa: S102 (our own README)
    return namespace


def test_readme_codec_example_runs_and_is_unbiased():
    namespace = _example_namespace()
    ternary, simulate = namespace["Ternary"], namespace["simulate"]
    world_size, numel, draws = 3, 8, 4000
    codecs = [ternary(seed=1) for _ in range(world_size)]
    for rank, codec in enumerate(codecs):
        codec.bind_rank(rank)
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(numel, generator=gen) for _ in range(world_size)]
    outputs = torch.stack([
        simulate([c.exchange(g, [numel], "b", step, world_size) for c, g in zip(codecs, grads)])[0]
        for step in range(draws)
    ])
    errors = (outputs - torch.stack(grads).mean(dim=0)).double()
    z = errors.mean(dim=0).abs() / (errors.std(dim=0) / draws**0.5)
    assert z.max() < 4.5  # unbiased

    states = [c.state_dict() for c in codecs]
    first = simulate([c.exchange(g, [numel], "b", 0, world_size) for c, g in zip(codecs, grads)])[0]
    for codec, state in zip(codecs, states):
        codec.load_state_dict(state)
    again = simulate([c.exchange(g, [numel], "b", 0, world_size) for c, g in zip(codecs, grads)])[0]
    assert torch.equal(first, again)  # the state holds everything a resumed run needs


# --- the Horovod blocks, on 2 Gloo workers ------------------------------------------------------------


def _run_horovod_blocks(blocks: list[str], workdir: str) -> list[list[float]]:
    """Each worker runs the blocks in order; returns, per block, the model's parameters after it."""
    import os

    import horovod.torch as hvd
    import torch

    os.chdir(workdir)
    namespace: dict = {}
    wrapped: dict = {}  # the namespace of the last block that built hvdcomp.DistributedOptimizer
    sums = []
    for number, block in enumerate(blocks):
        if "DistributedOptimizer(" in block or "Birder(" in block:
            namespace = {}
            exec(compile(PREAMBLE, "<preamble>", "exec"), namespace)  # noqa: S102
            if "hvdcomp.DistributedOptimizer(" in block:
                wrapped = namespace
        else:
            namespace = wrapped
        exec(compile(block, f"<README.md, Horovod block {number}>", "exec"), namespace)  # noqa: S102
        params = torch.cat([p.detach().flatten() for p in namespace["model"].parameters()])
        assert torch.isfinite(params).all()
        sums.append([float(params.sum()), float(hvd.size())])
    return sums


@pytest.mark.slow
def test_readme_horovod_blocks_run_on_two_workers(tmp_path):
    from tests.harness import run_function

    blocks = _blocks("horovod")
    results = run_function(_run_horovod_blocks, np=2, init="hvdcomp", timeout=300,
                           kwargs={"blocks": blocks, "workdir": str(tmp_path)})
    assert len(results) == 2
    assert results[0] == results[1]  # both workers hold the same model after every block
    assert all(size == 2.0 for _, size in results[0])
    assert sorted(p.name for p in tmp_path.glob("ckpt.rank*")) == ["ckpt.rank0", "ckpt.rank1"]


# --- the DDP block, as a world of one -----------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_readme_ddp_block_runs(tmp_path):
    (block,) = _blocks("ddp")
    script = PREAMBLE + block + "\nassert state.stats.steps == len(batches), state.stats\n"
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.slow
def test_readme_lightning_block_trains_identical_replicas_with_the_hook(tmp_path):
    """Lightning's 2 workers each run the block; both end with the same parameters, having sent QSGD 4's bytes
    (each worker's ``state.stats``) at every step."""
    pytest.importorskip("lightning")
    (block,) = _blocks("lightning")
    report = ("\ntotal = state.stats.total\n"
              "torch.save({'params': [p.detach() for p in model.parameters()], 'steps': state.stats.steps,\n"
              "            'sent': total.inter_node_bytes, 'dense': total.uncompressed_bytes},\n"
              "           f'result.{trainer.global_rank}.pt')\n")
    (tmp_path / "lightning_block.py").write_text(block + report)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "lightning_block.py"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    first, second = (torch.load(tmp_path / f"result.{rank}.pt") for rank in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first["params"], second["params"]))
    assert first["steps"] == second["steps"] == 2 * 64 // (2 * 8)  # every optimizer step went through the hook
    assert first["sent"] == second["sent"] > 0
    assert first["dense"] > 3 * first["sent"]  # 4-bit levels in int64 lanes, not float32


def test_readme_fsdp_block_runs_on_two_workers(tmp_path):
    (block,) = _blocks("fsdp")
    script = tmp_path / "fsdp_block.py"
    script.write_text(PREAMBLE + block + "\nassert state.stats.steps == len(batches), state.stats\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]


# --- links ----------------------------------------------------------------------------------------------


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    return {_anchor(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def _links(path: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("doc", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_relative_links_resolve(doc):
    broken = []
    for link in _links(doc):
        if re.match(r"^[a-z]+:", link):
            continue  # http:, https:, mailto:
        target, _, anchor = link.partition("#")
        path = (doc.parent / target).resolve() if target else doc
        if not path.exists():
            broken.append(link)
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(link)
    assert not broken, f"{doc.name}: broken links {broken}"
