"""Horovod's private API behind one version gate (``hvdcomp.transport._compat``), and the range ``setup.py`` says."""

import re
from pathlib import Path

import pytest

from hvdcomp.transport import _compat

ROOT = Path(__file__).resolve().parent.parent


def test_the_horovod_range_is_checked_once_and_said_in_setup(monkeypatch):
    import horovod

    assert _compat.SUPPORTED_HOROVOD == ">=0.28.1,<0.29"
    assert f'"horovod{_compat.SUPPORTED_HOROVOD}"' in (ROOT / "setup.py").read_text()
    assert re.search(r'-e "\.\[[a-z,]*horovod', (ROOT / "Makefile").read_text())
    assert "horovod" not in re.search(r"install_requires=\[(.*)\]", (ROOT / "setup.py").read_text()).group(1)
    _compat.check_horovod.cache_clear()
    try:
        _compat.check_horovod()  # the installed one (a local build label is allowed)
        _compat.check_horovod.cache_clear()
        monkeypatch.setattr(horovod, "__version__", "0.29.0")
        with pytest.raises(RuntimeError, match=r"Horovod >=0\.28\.1,<0\.29, but Horovod 0\.29\.0 is installed"):
            _compat.check_horovod()
    finally:
        monkeypatch.undo()
        _compat.check_horovod.cache_clear()


def test_horovods_compression_objects_are_recognised_only_once_loaded():
    from horovod.torch.compression import Compression

    assert _compat.horovod_compressions() == (Compression.none, Compression.fp16)
