"""The public codecs outside Horovod's optimizer: ``resolve_codec``, Horovod's compressor contract on ``FP16``,
``NoCompression`` and ``PowerSGD``, and checkpoint validation of the max-norm codecs (single process)."""

import copy
import re

import pytest
import torch

import hvdcomp
from hvdcomp.exchange import FP16, AheadMaxNorm, NoCompression, PowerSGD, TwoStageMaxNorm, simulate
from hvdcomp.integrations.resolve import resolve_codec


def test_resolve_codec_maps_every_compression_argument():
    assert type(resolve_codec(None)) is NoCompression
    powersgd = PowerSGD()
    assert resolve_codec(powersgd) is powersgd
    ahead, exact = hvdcomp.QSGDMaxNorm(8), hvdcomp.QSGDMaxNorm(8, scale="exact")
    assert isinstance(resolve_codec(ahead), AheadMaxNorm) and resolve_codec(ahead) is ahead.inner
    assert resolve_codec(exact) is exact.max_norm
    for exchange in ("two_stage", "auto"):
        two_stage = resolve_codec(exact, exchange, workers_per_node=2)
        assert isinstance(two_stage, TwoStageMaxNorm) and two_stage.inner is exact.max_norm
        assert two_stage.mode == exchange and two_stage.workers_per_node == 2 and two_stage.ahead is None
        kept = resolve_codec(ahead, exchange)  # the scale agreed ahead is never dropped silently
        assert isinstance(kept, TwoStageMaxNorm) and kept.inner is ahead.max_norm and kept.ahead is not None
    multiscale = hvdcomp.QSGDMaxNormMultiScale((4, 8))
    assert isinstance(resolve_codec(multiscale, "auto"), TwoStageMaxNorm)
    with pytest.raises(ValueError, match="two_stage"):
        resolve_codec(powersgd, "two_stage")
    with pytest.raises(ValueError, match="exchange must be"):
        resolve_codec(None, "ring")
    with pytest.raises(TypeError, match="not supported"):
        resolve_codec("fp16")


def test_resolve_codec_recognises_horovods_compression_objects():
    from horovod.torch.compression import Compression

    assert type(resolve_codec(Compression.none)) is NoCompression
    assert type(resolve_codec(Compression.fp16)) is FP16


def test_fp16_and_no_compression_compress_as_horovods():
    grad = torch.randn(3, 4, dtype=torch.float64)
    sent, ctx = FP16().compress(grad)
    assert sent.dtype == torch.float16 and ctx == torch.float64
    back = FP16().decompress(sent, ctx)
    assert back.dtype == torch.float64 and torch.equal(back, grad.half().double())
    counts = torch.arange(5)
    assert FP16().decompress(*FP16().compress(counts)) is counts  # not floating point: as it is
    sent, ctx = NoCompression().compress(grad)
    assert sent is grad and NoCompression().decompress(sent, ctx) is grad
    with pytest.raises(TypeError, match="whole buckets"):
        FP16(error_feedback=True).compress(grad)
    with pytest.raises(TypeError, match="PowerSGD needs whole buckets"):
        PowerSGD().compress(grad)


def _exchanged(codec, steps=2, numel=100):
    """``codec`` after ``steps`` exchanges of one gradient of ``numel`` elements (one worker): for the scale agreed
    ahead, a scale agreed for key ``"w"``, and an excess kept from clipping."""
    codec.bind_rank(0)
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        grad = torch.randn(numel, generator=gen) * 2.0**step
        simulate([codec.exchange(grad, [numel], "w", step, 1)])
    return codec


def _same(a, b):
    return repr(a) == repr(b)


def test_a_state_loads_into_its_own_configuration():
    saved = _exchanged(hvdcomp.QSGDMaxNorm(8)).state_dict()
    assert saved["version"] == 1 and saved["inner"]["agreed"]["excess"]
    fresh = hvdcomp.QSGDMaxNorm(8)
    fresh.load_state_dict(copy.deepcopy(saved))
    assert _same(fresh.state_dict(), saved)


@pytest.mark.parametrize("other", [
    lambda: hvdcomp.QSGDMaxNorm(4),
    lambda: hvdcomp.QSGDMaxNorm(8, chunk_size=16),
    lambda: hvdcomp.QSGDMaxNorm(8, scale="exact"),
    lambda: hvdcomp.QSGDMaxNormMultiScale((4, 8)),
    lambda: hvdcomp.GlobalRandKMaxNorm(k=10, bits=8),
], ids=["bits", "chunk_size", "scale", "type", "selector"])
def test_a_state_of_another_configuration_is_refused_before_anything_changes(other):
    saved = _exchanged(hvdcomp.QSGDMaxNorm(8)).state_dict()
    target = _exchanged(other(), steps=1)
    before = target.state_dict()
    with pytest.raises(ValueError, match=re.escape("cannot load the state of QSGDMaxNorm(bits=(8,)")) as refused:
        target.load_state_dict(saved)
    assert f"into {type(target).__name__}(" in str(refused.value)
    assert _same(target.state_dict(), before)


def test_error_feedback_and_selector_are_part_of_the_configuration():
    saved = _exchanged(hvdcomp.GlobalRandKMaxNorm(k=10)).state_dict()
    for other in (hvdcomp.GlobalRandKMaxNorm(k=10, error_feedback=False), hvdcomp.GlobalRandKMaxNorm(k=11)):
        with pytest.raises(ValueError, match="configured differently"):
            other.load_state_dict(saved)
    hvdcomp.GlobalRandKMaxNorm(k=10).load_state_dict(saved)


@pytest.mark.parametrize("damage", ["nan", "inf", "groups", "version", "keys", "excess"])
def test_a_damaged_state_is_refused_before_anything_changes(damage):
    saved = _exchanged(hvdcomp.QSGDMaxNorm(8)).state_dict()
    numel, size, scales = saved["inner"]["agreed"]["scales"]["w"]
    if damage in ("nan", "inf"):
        scales[0] = float(damage)
    elif damage == "groups":  # three scales where the stock path's gradient of 100 elements has one group
        saved["inner"]["agreed"]["scales"]["w"] = (numel, size, torch.zeros(4))
    elif damage == "version":
        del saved["version"]
    elif damage == "keys":
        saved["inner"]["agreed"]["generators"] = {}
    else:
        indices, values = saved["inner"]["agreed"]["excess"]["w"]
        saved["inner"]["agreed"]["excess"]["w"] = (indices, values[:-1])
    target = _exchanged(hvdcomp.QSGDMaxNorm(8), steps=1)
    before = target.state_dict()
    with pytest.raises(ValueError, match="cannot load the state of"):
        target.load_state_dict(saved)
    assert _same(target.state_dict(), before)
