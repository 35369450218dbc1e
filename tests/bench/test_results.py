"""``ksana.bench.results``: the machine block every benchmark's JSON carries, and where a run writes by default."""

from __future__ import annotations

from pathlib import Path

import orjson

from ksana.bench import results

LSCPU = """Architecture:                            x86_64
CPU(s):                                  8
Vendor ID:                               AuthenticAMD
Model name:                              AMD EPYC 9R14
CPU family:                              25
Model:                                   17
Flags:                                   fpu sse avx avx2 avx512f avx512_bf16 avx512vl
"""


def test_lscpu_fields_give_the_cpu_its_numbers_and_isa_flags():
    cpu = results.cpu_from_fields(results.parse_cpu_fields(LSCPU))
    assert cpu == {"cpu": "AMD EPYC 9R14", "vendor": "AuthenticAMD", "cpu_family": 25, "cpu_model": 17,
                   "isa": {"avx2": True, "avx512f": True, "avx512_bf16": True, "amx_bf16": False}, "cores": 8}
    assert results.cpu_kind(cpu) == results.KNOWN_CPUS[("AuthenticAMD", 25, 17)]


def test_proc_cpuinfo_names_give_the_same_fields():
    cpuinfo = "vendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 143\nmodel name\t: Intel Xeon\nflags\t\t: avx2 amx_bf16\n"
    cpu = results.cpu_from_fields(results.parse_cpu_fields(cpuinfo))
    assert (cpu["vendor"], cpu["cpu_family"], cpu["cpu_model"], cpu["cpu"]) == ("GenuineIntel", 6, 143, "Intel Xeon")
    assert cpu["isa"] == {"avx2": True, "avx512f": False, "avx512_bf16": False, "amx_bf16": True}
    # Not a known kind: the short name is built from the vendor, family and model.
    assert results.cpu_kind(cpu) == ("intel_f6m143", "Intel Xeon family 6 model 143")


def test_gpu_kind_is_the_device_names_last_word():
    assert results.gpu_kind("NVIDIA H200") == "h200"
    assert results.gpu_kind("NVIDIA GeForce RTX 4090") == "4090"


def test_machine_info_describes_this_machine():
    import torch

    machine = results.machine_info()
    assert machine["torch"] == torch.__version__ and machine["torch_threads"] == torch.get_num_threads()
    assert machine["cores"] >= 1 and machine["kind"] and machine["label"]
    if machine["isa"] is not None:
        assert set(machine["isa"]) == set(results.ISA_FLAGS)


def test_a_quick_run_never_writes_a_full_runs_file(tmp_path: Path):
    full, quick = results.default_out(tmp_path, "throughput"), results.default_out(tmp_path, "throughput", quick=True)
    assert quick == tmp_path / "throughput_quick.json"
    assert full == tmp_path / f"throughput_{results.machine_info()['kind']}.json" != quick


def test_write_json_adds_the_machine_and_keeps_one_given(tmp_path: Path):
    added = orjson.loads(results.write_json({"figure": 1.5}, tmp_path / "a" / "x.json").read_bytes())
    assert added["figure"] == 1.5 and added["machine"]["kind"] == results.machine_info()["kind"]
    kept = orjson.loads(results.write_json({"machine": {"kind": "zen4"}}, tmp_path / "y.json").read_bytes())
    assert kept["machine"] == {"kind": "zen4"}
