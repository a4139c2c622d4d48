"""Fixtures shared by the Python tests."""
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tool():
    """The attn_tool harness (tests/tools/attn_tool.c) that runs one attention
    kind on inputs from a file."""
    bdir = os.environ.get("STILL_BUILD_DIR")
    exe = Path(bdir) / "attn_tool" if bdir else ROOT / "build" / "attn_tool"
    if bdir:
        assert exe.exists(), f"{exe} missing (build the project first)"
    elif not exe.exists():
        pytest.skip("attn_tool not built (set STILL_BUILD_DIR)")
    return exe
