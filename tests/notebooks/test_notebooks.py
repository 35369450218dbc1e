"""Every notebook in ``notebooks/`` runs top to bottom on small inputs (nbclient, a real Jupyter kernel), and each
shows its plots; the notebooks are committed without outputs."""

from __future__ import annotations

from pathlib import Path

import nbformat
import orjson
import pytest
from nbclient import NotebookClient

from tests.simulator.fits import linear_fit
from tests.simulator.test_fit import _perf_result

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def _run(name: str, env: dict[str, str], monkeypatch) -> nbformat.NotebookNode:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    notebook = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}},
                   ).execute()
    return notebook


def _images(notebook) -> int:
    return sum(1 for cell in notebook.cells if cell.cell_type == "code" for out in cell.get("outputs", [])
               if "image/png" in out.get("data", {}))


@pytest.mark.parametrize("name", ["fit_latency_model", "validate_simulator", "capacity_planning"])
def test_notebooks_are_committed_without_outputs(name):
    notebook = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    nbformat.validate(notebook)
    assert all(not cell.get("outputs") and cell.get("execution_count") is None
               for cell in notebook.cells if cell.cell_type == "code")


def test_fit_latency_model_runs_on_a_profile(tmp_path, monkeypatch):
    from ksana.simulator.sweep import sweep_batches

    path = tmp_path / "perf.json"
    path.write_bytes(orjson.dumps(_perf_result(sweep_batches(16, 1024, 128, 512), noise=0.05)))
    notebook = _run("fit_latency_model", {"KSANA_PERF_RESULTS": str(path)}, monkeypatch)
    assert _images(notebook) >= 2
    text = "".join(out.get("text", "") for cell in notebook.cells for out in cell.get("outputs", []))
    assert "worker (DistServe)" in text and "held out" in text


def test_validate_simulator_runs_on_a_validation(tmp_path, monkeypatch):
    from ksana.simulator.validate import compare

    def summary(scale):
        requests = [{"success": True, "ttft": 0.1 * scale * i, "tpot": 0.02 * scale, "e2el": 0.5 * scale * i}
                    for i in range(1, 21)]
        keys = {"median_ttft_ms": 1000 * scale, "p90_ttft_ms": 1800 * scale, "median_tpot_ms": 20 * scale,
                "p90_tpot_ms": 25 * scale, "median_itl_ms": 20 * scale, "median_e2el_ms": 5000 * scale,
                "output_throughput": 100 / scale}
        return {**keys, "requests": requests}

    measured, simulated, at_speed = summary(1.0), summary(1.05), summary(1.01)
    run = {"metrics": compare(measured, simulated), "trace": "t.jsonl", "settings": {}, "measured": measured,
           "simulated": simulated}
    older, timed = tmp_path / "validation_older.json", tmp_path / "validation_timed.json"
    older.write_bytes(orjson.dumps(run))
    speed = {"prefill": {"times_s": [0.0, 0.5, 1.0], "factors": [1.0, 1.4, 1.2]}, "decode": None}
    timed.write_bytes(orjson.dumps({**run, "served_speed": speed,
                                    "metrics_with_served_speed": compare(measured, at_speed)}))
    notebook = _run("validate_simulator", {"KSANA_VALIDATIONS": str(older)}, monkeypatch)
    assert _images(notebook) == 1  # the distributions; a validation without its run's speed has no speed plot
    notebook = _run("validate_simulator", {"KSANA_VALIDATIONS": f"{older}:{timed}"}, monkeypatch)
    assert _images(notebook) == 2
    text = "".join(out.get("text", "") for cell in notebook.cells for out in cell.get("outputs", []))
    assert "validation_timed: simulated at the run's own speed" in text
    assert "validation_older: simulated at" not in text


def test_capacity_planning_runs_on_the_demo_model(tmp_path, monkeypatch):
    from ksana.simulator.simulate import prepare

    linear_fit({}).save(tmp_path / "blank.json")
    shape = prepare("demo", None, {}, tmp_path / "blank.json").shape
    identity = {key: getattr(shape, key) for key in ("model_type", "hidden_size", "num_layers", "num_heads",
                                                     "num_kv_heads", "head_dim", "intermediate_size", "vocab_size")}
    fit = linear_fit(identity | {"dtype": "float32", "device_type": "cpu"}, decode_row_ms=0.5).save(
        tmp_path / "fit.json")
    env = {"KSANA_FIT": str(fit), "KSANA_MODEL": "demo", "KSANA_RATES": "2,8", "KSANA_BATCH_SIZES": "2,8",
           "KSANA_CHUNKS": "0", "KSANA_REQUESTS": "20", "KSANA_SLO": "ttft:500,tpot:50"}
    notebook = _run("capacity_planning", env, monkeypatch)
    assert _images(notebook) == 3
    text = "".join(out.get("text", "") for cell in notebook.cells for out in cell.get("outputs", []))
    assert "best max_batch_size=" in text
    # Speculation at the default acceptance: at the lower rate, where few requests run, each decodes faster.
    lines = [line for line in text.splitlines() if "TPOT p50" in line]
    assert len(lines) == 2
    off, on = (float(ms) for ms in lines[0].split("TPOT p50 ")[1].split(" ms")[0].split(" -> "))
    assert on < off
