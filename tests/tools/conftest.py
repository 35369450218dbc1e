"""The tools' kernel builds at -O1 here: these tests check what the tools report, and -O1 compiles a build in a
third of -O3's time."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="package", autouse=True)
def quick_tool_builds():
    from tests.tools import load_tool

    name = load_tool("_sources").EXTRA_FLAGS_ENV
    previous = os.environ.get(name)
    os.environ[name] = "-O1"
    yield
    if previous is None:
        del os.environ[name]
    else:
        os.environ[name] = previous
