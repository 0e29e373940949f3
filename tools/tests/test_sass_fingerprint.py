"""tools/sass_fingerprint.py on the CPU: it finds a cuobjdump where PATH has none."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import sass_fingerprint  # noqa: E402


def test_cuobjdump_found_without_path(monkeypatch):
    monkeypatch.setenv("PATH", "")
    try:
        exe = sass_fingerprint._cuobjdump()
    except SystemExit as e:  # neither a toolkit nor triton's copy here: the error names where it looked
        assert "cuobjdump" in str(e)
        pytest.skip("no cuobjdump on this machine")
    assert os.path.basename(exe) == "cuobjdump" and os.access(exe, os.X_OK)
