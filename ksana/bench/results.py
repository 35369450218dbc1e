"""How every benchmark writes its result JSON, so they all read the same way (``bench/results/*.json``).

Each report carries a ``"machine"`` block (``machine_info``): the CPU as ``lscpu`` names it, the instruction sets
the native kernels choose between, the core count, torch's version and the GPU if one is visible. Figures from
different machines differ by more than most changes do, so a result names the machine it came from, and
``bench/tables.py`` groups the results by it.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import orjson

# The instruction sets the CPU kernels pick between: AVX2 tiles, AVX-512 tiles, bfloat16 dot products, AMX tiles.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")

# Short names for the CPU kinds the benchmarks have run on, by (vendor, family, model) as ``lscpu`` reports them.
# Another CPU gets a name built from the same three (``cpu_kind``).
KNOWN_CPUS: dict[tuple[str, int, int], tuple[str, str]] = {
    ("AuthenticAMD", 23, 49): ("zen2", "Zen 2 EPYC"),
    ("AuthenticAMD", 25, 1): ("zen3", "Zen 3 EPYC"),
    ("AuthenticAMD", 25, 17): ("zen4", "Zen 4 EPYC"),
    ("GenuineIntel", 6, 167): ("amx", "AMX Xeon"),
    ("GenuineIntel", 6, 207): ("avx512", "AVX-512 Xeon"),
}


def parse_cpu_fields(text: str) -> dict[str, str]:
    """``Key: value`` lines (``lscpu``'s output, or one processor's block of ``/proc/cpuinfo``) as a dict; the
    first occurrence of a key wins."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    return fields


def cpu_from_fields(fields: dict[str, str]) -> dict[str, Any]:
    """The CPU's name, vendor, family, model and ISA flags from ``lscpu`` fields (or ``/proc/cpuinfo``'s names)."""

    def first(*keys: str) -> str | None:
        return next((fields[k] for k in keys if fields.get(k)), None)

    def number(*keys: str) -> int | None:
        value = first(*keys)
        return int(value) if value is not None and re.fullmatch(r"\d+", value) else None

    flags = set((first("Flags", "flags") or "").split())
    return {
        "cpu": first("Model name", "model name"),
        "vendor": first("Vendor ID", "vendor_id"),
        "cpu_family": number("CPU family", "cpu family"),
        "cpu_model": number("Model", "model"),
        "isa": {flag: flag in flags for flag in ISA_FLAGS} if flags else None,
        "cores": number("CPU(s)"),
    }


def cpu_kind(cpu: dict[str, Any]) -> tuple[str, str]:
    """(short name, label) of a CPU from ``cpu_from_fields``: a known kind's, else one built from its numbers."""
    key = (cpu.get("vendor"), cpu.get("cpu_family"), cpu.get("cpu_model"))
    if key in KNOWN_CPUS:
        return KNOWN_CPUS[key]
    vendor = {"AuthenticAMD": "amd", "GenuineIntel": "intel"}.get(cpu.get("vendor") or "", "cpu")
    family, model = cpu.get("cpu_family"), cpu.get("cpu_model")
    if family is None or model is None:
        return vendor, cpu.get("cpu") or "unknown CPU"
    return f"{vendor}_f{family}m{model}", f"{cpu.get('cpu') or vendor} family {family} model {model}"


def gpu_kind(name: str) -> str:
    """A GPU's short name: the last word of its device name, lowercase (``NVIDIA H200`` -> ``h200``)."""
    words = re.findall(r"[A-Za-z0-9]+", name)
    return words[-1].lower() if words else "gpu"


def _read_cpu_fields() -> dict[str, str]:
    try:
        done = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10,
                              env={**os.environ, "LC_ALL": "C"})
        if done.returncode == 0 and done.stdout:
            return parse_cpu_fields(done.stdout)
    except (OSError, subprocess.SubprocessError):
        pass
    try:  # no lscpu: the first processor's block of /proc/cpuinfo has the same facts under other names
        return parse_cpu_fields(Path("/proc/cpuinfo").read_text().split("\n\n")[0])
    except OSError:
        return {}


def machine_info() -> dict[str, Any]:
    """The machine a benchmark runs on: ``lscpu``'s model name, CPU family and model, the ISA flags the kernels
    choose by (``ISA_FLAGS``), the core count, torch's version and intra-op threads, the GPU if one is visible,
    and the machine's kind (``kind``, ``label``): the GPU's where there is one, else the CPU's."""
    import torch

    cpu = cpu_from_fields(_read_cpu_fields())
    if cpu["cores"] is None:
        cpu["cores"] = os.cpu_count()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    kind, label = (gpu_kind(gpu), gpu) if gpu else cpu_kind(cpu)
    return {"kind": kind, "label": label, **cpu, "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "gpu": gpu, "source": "lscpu"}


def default_out(folder: Path | str, name: str, *, quick: bool = False) -> Path:
    """Where a benchmark writes by default: ``<folder>/<name>_<machine kind>.json``, so each kind of machine keeps
    its own latest result; a ``--quick`` run writes ``<name>_quick.json`` and never replaces a full run's."""
    suffix = "quick" if quick else machine_info()["kind"]
    return Path(folder) / f"{name}_{suffix}.json"


def write_json(report: Any, out: Path | str, *, options: int = 0) -> Path:
    """``report`` as indented JSON at ``out`` (its folder made if missing), announced on stdout. A dict report
    without a ``"machine"`` key gets one (``machine_info``). ``options``: more orjson flags, for reports holding
    numpy values or non-string keys."""
    if isinstance(report, dict) and "machine" not in report:
        report = {**report, "machine": machine_info()}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2 | options))
    print(f"wrote {out}")
    return out
