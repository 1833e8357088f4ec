"""The README's "Implementing a codec" example runs as written, and its codec works in our optimizer's
simulation: unbiased, identical on every worker, resumable."""

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parent.parent / "README.md"


def _example_namespace():
    text = README.read_text()
    section = text[text.index("### Implementing a codec"):]
    section = section[: section.index("\n## ")]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 2, "the section shows the codec and its simulator test"
    namespace = {}
    for block in blocks:
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
