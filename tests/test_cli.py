"""The ``ksana`` command as a user runs it: real processes, real exit codes."""

from __future__ import annotations

import json
import subprocess
import sys


def _ksana(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ksana.cli", *args], capture_output=True, text=True, timeout=300)


def test_demo_model_writes_a_loadable_directory(tmp_path):
    out = tmp_path / "demo"
    proc = _ksana("demo-model", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    assert (out / "tokenizer.json").exists() and (out / "model.safetensors").exists()
    proc = _ksana("generate", "--model", str(out), "--prompt", "hello there", "--max-tokens", "5")
    assert proc.returncode == 0, proc.stderr
    assert "tokens/s" in proc.stderr


def test_bad_config_key_is_a_message_not_a_traceback(tmp_path):
    config = tmp_path / "k.yaml"
    config.write_text("setting:\n  batch_scheduler:\n    max_batch_sise: 4\n")
    proc = _ksana("generate", "--model", "demo", "--config", str(config), "--prompt", "hi")
    assert proc.returncode == 2
    assert "unknown config key 'setting.batch_scheduler.max_batch_sise'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_model_directory_is_named(tmp_path):
    proc = _ksana("generate", "--model", str(tmp_path / "nowhere"), "--prompt", "hi")
    assert proc.returncode == 2
    assert "nowhere" in proc.stderr and "Traceback" not in proc.stderr
