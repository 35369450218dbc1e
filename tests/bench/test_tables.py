"""``bench/tables.py``: the README's results tables are generated from ``bench/results/*.json`` and kept current."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from tests.bench import REPO, load_bench


@pytest.fixture(scope="module")
def tables():
    return load_bench("tables")


MACHINE = {"kind": "testcpu", "label": "Test CPU", "cpu": "Test EPYC", "vendor": "AuthenticAMD", "cpu_family": 25,
           "cpu_model": 1, "isa": {"avx2": True, "avx512f": False, "avx512_bf16": False, "amx_bf16": None},
           "cores": 2, "torch": "2.0", "gpu": None, "source": "lscpu"}


def throughput(float32: float, bfloat16: float) -> dict:
    def side(ratio: float) -> dict:
        return {"ratio": ratio, "ksana_output_tok_s": 100.0 * ratio, "hf_output_tok_s": 100.0,
                "hf_baseline": "batch 32"}

    return {"time": "2030-01-02T03:04:05+0000", "float32": side(float32), "bfloat16": side(bfloat16),
            "machine": MACHINE}


def write(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(report))


def test_the_readme_matches_the_committed_results(tables):
    assert tables.main(["--check"]) == 0


def test_every_cited_result_is_named_for_its_machine(tables):
    results = [path for path in sorted((REPO / "bench" / "results").glob("*.json"))
               if tables.benchmark_of(path) is not None and not path.stem.endswith("_quick")]
    assert results
    for path in results:
        machine = orjson.loads(path.read_bytes())["machine"]
        assert machine["kind"] and machine["label"] and machine["torch"], path.name
        assert path.stem.endswith("_" + machine["kind"]), path.name


def test_a_stale_readme_fails_the_check_until_rewritten(tables, tmp_path, capsys):
    readme, results = tmp_path / "README.md", tmp_path / "results"
    readme.write_text(f"# guide\n\n{tables.BEGIN}\nold table\n{tables.END}\n\nafter\n")
    write(results / "throughput_testcpu.json", throughput(4.0, 1.5))
    write(results / "throughput_quick.json", throughput(0.1, 0.1))  # a --quick run: never cited
    args = ["--readme", str(readme), "--results", str(results)]
    assert tables.main([*args, "--check"]) == 1 and "stale" in capsys.readouterr().err
    assert tables.main(args) == 0
    assert tables.main([*args, "--check"]) == 0
    text = readme.read_text()
    assert text.startswith("# guide\n") and text.endswith(f"{tables.END}\n\nafter\n") and "old table" not in text
    assert "### Test CPU (`testcpu`)" in text
    assert "`lscpu`: Test EPYC, family 25 model 1; AVX2 (no AVX-512, no AVX512_BF16) (AMX not recorded)" in text
    rows = [line for line in text.splitlines() if "`throughput_testcpu.json` (2030-01-02)" in line]
    assert len(rows) == 2 and "throughput_quick" not in text
    float32, bfloat16 = rows
    assert "**4.00x** (400.0 / 100.0 tok/s) | >= 3x | yes" in float32
    assert "**1.50x** (150.0 / 100.0 tok/s) | >= 2x | **no**" in bfloat16  # under the bfloat16 target


def test_a_result_without_a_machine_is_refused(tables, tmp_path):
    report = throughput(4.0, 3.0)
    del report["machine"]
    write(tmp_path / "throughput_x.json", report)
    with pytest.raises(SystemExit, match="no \"machine\" block"):
        tables.render(tmp_path)


def test_the_longest_benchmark_name_claims_a_file(tables):
    assert tables.benchmark_of(Path("serving_vs_offline_zen4.json")) == "serving_vs_offline"
    assert tables.benchmark_of(Path("tp_avx512.json")) == "tp"
    assert tables.benchmark_of(Path("decode_ab_zen4.json")) is None


def test_a_repeated_validation_names_its_furthest_measured_run(tables):
    spread = {"ttft_p50_ms": 0.05, "ttft_p90_ms": 0.34, "output_throughput_tok_s": 0.02}
    assert tables.spread_text({"repeats": 5, "measured_spread": spread}) == (
        "; a run's own measurement lay up to 34.0% from the runs' median (TTFT p90)")
    assert tables.spread_text({"repeats": 1, "measured_spread": spread}) == ""
    assert tables.spread_text({"repeats": 3}) == ""
