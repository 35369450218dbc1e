"""Installed from a wheel, Ksana adds only ``ksana`` to ``site-packages`` and runs beside Hugging Face's ``kernels``.

The design's top-level folders (``events/``, ``kernels/``, ``perf/``, ``simulator/``) install as ``ksana.*``: a
top-level ``kernels`` would shadow Hugging Face's kernel hub, which ``transformers`` imports. The suite's
environment has both the newest ``transformers`` and ``kernels`` (the ``dev`` extra, no upper pin); this test
installs the project as a user would, into a folder of its own, and runs a model from there in a fresh process
started outside the checkout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import distribution
from pathlib import Path

import pytest

from ksana.kernels.cpu.build import cxx_sources
from tests.model_factory import hf_greedy_generate, load_hf_model, make_checkpoint, random_prompts

REPO = Path(__file__).resolve().parents[2]

RUN_MODEL = """
import json, sys
import kernels, ksana, transformers
from ksana import LLM, SamplingParams
from ksana.bench import serve
from ksana.kernels.dispatch import get_ops
model_dir, prompt = sys.argv[1], json.loads(sys.argv[2])
llm = LLM(model=model_dir, dtype="float32", num_device_blocks=32)
out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
print(json.dumps({"tokens": out[0].outputs[0].token_ids, "ksana": ksana.__file__, "kernels": kernels.__file__,
                  "hub_kernels": hasattr(kernels, "get_kernel"), "load_generator": serve.__file__}))
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The project built as a wheel and installed, without its dependencies, into a folder of its own."""
    source, target = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("site")
    # A copy of what the wheel is built from, so that the build's own folders stay out of the checkout.
    skip_top = {".git", ".venv", "build", "bench", "tests", "tools", "notebooks"}

    def ignore(folder: str, names: list[str]) -> set[str]:
        top = Path(folder) == REPO
        return {n for n in names if (top and n in skip_top) or n == "__pycache__" or n.endswith(".egg-info")}

    shutil.copytree(REPO, source, dirs_exist_ok=True, ignore=ignore)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(target), str(source)], check=True, timeout=600)
    return target


def test_the_wheel_adds_only_ksana_to_site_packages(installed):
    top_level = {path.name for path in installed.iterdir() if not path.name.endswith(".dist-info")}
    assert top_level - {"bin"} == {"ksana"}
    package = installed / "ksana"
    sources = {"ksana": REPO / "ksana", "ksana/events": REPO / "events", "ksana/kernels": REPO / "kernels",
               "ksana/perf": REPO / "perf", "ksana/simulator": REPO / "simulator"}
    for name, source in sources.items():
        for init in source.rglob("__init__.py"):
            module = Path(name) / init.relative_to(source)
            assert (installed / module).is_file(), f"{module} is missing from the wheel"
    for name in ("registration.cpp", *(path.name for path in cxx_sources()), "vec.h", "parallel.h"):
        assert (package / "kernels" / "cpu" / name).is_file()  # built on first use on the CPU
    assert (package / "perf" / "schema" / "perf_result.schema.json").is_file()


def test_transformers_imports_the_hub_kernels_package():
    """What the check below stands on: Hugging Face's ``kernels`` is installed, and ``transformers``' integration
    of it imports (it fails when another top-level ``kernels`` answers)."""
    assert any(str(file) == "kernels/__init__.py" for file in distribution("kernels").files)
    import transformers.integrations.hub_kernels  # noqa: F401


def test_the_installed_wheel_runs_a_model_beside_hub_kernels(installed, tmp_path):
    model_dir = make_checkpoint(tmp_path / "model", "llama")
    prompt = random_prompts([11], seed=3)[0]
    env = {**os.environ, "PYTHONPATH": str(installed), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", RUN_MODEL, str(model_dir), json.dumps(prompt)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(report["ksana"]).is_relative_to(installed)
    assert Path(report["load_generator"]).is_relative_to(installed)  # `ksana bench serve` works from a wheel
    assert not Path(report["kernels"]).is_relative_to(installed) and report["hub_kernels"]
    expected = hf_greedy_generate(load_hf_model(model_dir), prompt, 8)
    assert report["tokens"] == expected
