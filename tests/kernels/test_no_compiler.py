"""The engine without a C compiler: the CPU native kernels cannot build, so it warns once and runs the torch
reference ops, and greedy decoding gives the tokens the native kernels give.

Each run is a fresh process (``load_library`` caches its answer per process); the one without a compiler gets an
empty kernel cache, so no earlier build is reused. The demo model is built once, here, and read by both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ksana.builtin import resolve_model_dir
from ksana.kernels.cpu.build import find_cxx_compiler

GENERATE = """
import json, sys
from ksana import LLM, SamplingParams
llm = LLM(model=sys.argv[1], block_token_num=8, max_batch_size=4)
params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
outputs = llm.generate([[5, 9, 13, 2, 40], [7, 7, 1], [300, 12, 12, 12, 9, 4, 81]], params, use_tqdm=False)
print(json.dumps({"ops": llm.engine.model.ops.name, "tokens": [o.outputs[0].token_ids for o in outputs]}))
"""


def _generate(model_dir: Path, env: dict[str, str]) -> tuple[dict, str]:
    """``GENERATE`` in a fresh Python under ``env``: its report and its stderr."""
    done = subprocess.run([sys.executable, "-c", GENERATE, str(model_dir)], env=env, capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_without_a_compiler_the_engine_warns_and_gives_the_native_paths_tokens(tmp_path) -> None:
    if find_cxx_compiler() is None:
        pytest.skip("no C++ compiler here: there is no native path to compare the fallback with")
    model_dir = resolve_model_dir("demo")
    env = {k: v for k, v in os.environ.items() if k not in ("CXX", "KSANA_CPU_KERNELS")}
    no_tools = tmp_path / "bin"  # the only folder on PATH, and empty: no cc, c++, gcc or clang to find
    no_tools.mkdir()
    bare = env | {"PATH": str(no_tools), "KSANA_CACHE_DIR": str(tmp_path / "cache")}
    fallback, fallback_log = _generate(model_dir, bare)
    assert fallback["ops"] == "torch"
    assert fallback_log.count("no C++ compiler found") == 1, fallback_log
    assert not list((tmp_path / "cache").glob("cpu-kernels-*"))  # nothing was built

    native, native_log = _generate(model_dir, env)  # the suite's own kernel cache: built once, reused
    assert native["ops"] == "cpu-native"
    assert "no C++ compiler found" not in native_log
    assert fallback["tokens"] == native["tokens"]
    assert all(len(tokens) == 12 for tokens in native["tokens"])
