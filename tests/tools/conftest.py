"""The tools' kernel builds at -O1 here: these tests check what the tools report, and -O1 compiles a build in a
third of -O3's time."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="package", autouse=True)
def quick_tool_builds():
    from tests.tools import load_tool

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(load_tool("_sources").EXTRA_FLAGS_ENV, "-O1")
        yield
