"""The demo model: loads with transformers, real tokenizer and chat template, identical on every build, cached."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from ksana.builtin import BUILTIN_MODELS, demo_model_dir, resolve_model_dir, write_demo_model
from ksana.builtin.cache_dir import build_cached
from ksana.builtin.demo import CORPUS

TEXT = "The capital of France is Paris. 12345 héllo\n\tworld! <|im_start|>user\nhi<|im_end|>"


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("demo") / "qwen2")


def test_loads_with_transformers(qwen2_dir):
    tokenizer = AutoTokenizer.from_pretrained(qwen2_dir)
    model = AutoModelForCausalLM.from_pretrained(qwen2_dir)
    config = model.config
    assert config.model_type == "qwen2"
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (64, 2, 128)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.max_position_embeddings == 2048
    assert config.tie_word_embeddings is False
    assert len(tokenizer) >= 1000
    assert len(tokenizer) == config.vocab_size == model.get_input_embeddings().weight.shape[0]
    assert model.lm_head.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert config.eos_token_id == 2 and model.generation_config.eos_token_id == 2


def test_tokenizer_is_byte_level_and_transformers_agrees_with_tokenizers(qwen2_dir):
    # transformers 5 rebuilds a qwen2 model's tokenizer as Qwen2Tokenizer; the ids must not change on the way.
    raw = Tokenizer.from_file(str(qwen2_dir / "tokenizer.json"))
    tokenizer = AutoTokenizer.from_pretrained(qwen2_dir)
    for text in (TEXT, CORPUS, "日本語 and emoji 🙂 are bytes too"):
        ids = tokenizer(text).input_ids
        assert ids == raw.encode(text).ids
        assert tokenizer.decode(ids) == text
    assert tokenizer("<|im_start|>user<|im_end|>").input_ids[0] == 1
    assert len(tokenizer("the capital of France").input_ids) < len("the capital of France") // 2


def test_chat_template_renders(qwen2_dir):
    tokenizer = AutoTokenizer.from_pretrained(qwen2_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert (
        text
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert ids[0] == 1 and ids.count(2) == 2 and ids == tokenizer(text).input_ids


def test_greedy_output_is_varied(qwen2_dir):
    tokenizer = AutoTokenizer.from_pretrained(qwen2_dir)
    model = AutoModelForCausalLM.from_pretrained(qwen2_dir)
    outputs = []
    for prompt in ("Hello world", "What is the capital of France?"):
        inputs = tokenizer(prompt, return_tensors="pt")
        out = model.generate(**inputs, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
        new = out[0, inputs.input_ids.shape[1] :].tolist()
        assert len(set(new)) >= 12, new  # random weights must not collapse onto one repeated token
        outputs.append(new)
    assert outputs[0] != outputs[1]


def test_two_builds_are_identical(qwen2_dir, tmp_path):
    # The second build runs in a fresh interpreter, so per-process hash seeds cannot hide behind one process.
    other = tmp_path / "again"
    code = "import sys; from ksana.builtin import write_demo_model; write_demo_model(sys.argv[1])"
    subprocess.run(
        [sys.executable, "-c", code, str(other)], check=True, env={**os.environ, "PYTHONHASHSEED": "7"}
    )
    for name in ("model.safetensors", "tokenizer.json", "config.json", "generation_config.json"):
        assert (qwen2_dir / name).read_bytes() == (other / name).read_bytes(), name
    first, second = AutoTokenizer.from_pretrained(qwen2_dir), AutoTokenizer.from_pretrained(other)
    assert first(TEXT).input_ids == second(TEXT).input_ids
    state_1 = AutoModelForCausalLM.from_pretrained(qwen2_dir).state_dict()
    state_2 = AutoModelForCausalLM.from_pretrained(other).state_dict()
    assert state_1.keys() == state_2.keys()
    assert all(torch.equal(state_1[k], state_2[k]) for k in state_1)


def test_llama_family(tmp_path):
    model_dir = write_demo_model(tmp_path / "llama", family="llama")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.config.model_type == "llama"
    assert model.config.tie_word_embeddings is True
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert len(tokenizer) == model.config.vocab_size >= 1000
    assert (
        tokenizer(TEXT).input_ids == Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(TEXT).ids
    )
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(**inputs, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert len(set(out[0, inputs["input_ids"].shape[1] :].tolist())) >= 8


def test_unknown_family_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="gpt2"):
        write_demo_model(tmp_path / "x", family="gpt2")


def test_demo_model_dir_is_built_once_in_the_cache_root(monkeypatch, tmp_path):
    monkeypatch.setenv("KSANA_CACHE_DIR", str(tmp_path / "cache"))
    first = demo_model_dir()
    assert first.parent == tmp_path / "cache" and (first / "config.json").is_file()
    mtime = first.stat().st_mtime_ns
    assert demo_model_dir() == first and first.stat().st_mtime_ns == mtime
    assert resolve_model_dir("demo") == first
    assert [p.name for p in first.parent.iterdir() if p.is_dir()] == [first.name]  # no temp dir left behind
    assert AutoTokenizer.from_pretrained(first).eos_token_id == 2


def test_a_failed_build_leaves_nothing_and_the_next_call_builds(monkeypatch, tmp_path):
    monkeypatch.setenv("KSANA_CACHE_DIR", str(tmp_path))

    def failing(out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        build_cached("thing", failing)
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]
    built = build_cached("thing", lambda out: (out / "config.json").write_text('{"ok": 1}'))
    assert (built / "config.json").read_text() == '{"ok": 1}'


def _flock_waiters() -> int:
    return sum("->" in line and "FLOCK" in line for line in Path("/proc/locks").read_text().splitlines())


def test_racing_builders_build_once(monkeypatch, tmp_path):
    monkeypatch.setenv("KSANA_CACHE_DIR", str(tmp_path))
    calls: list[str] = []
    entered, release = threading.Event(), threading.Event()

    def build(out: Path) -> None:
        calls.append(threading.current_thread().name)
        if len(calls) == 1:
            entered.set()
            assert release.wait(timeout=30)
        (out / "config.json").write_text(threading.current_thread().name)

    results: dict[str, Path] = {}

    def run() -> None:
        results[threading.current_thread().name] = build_cached("raced", build)

    first = threading.Thread(target=run, name="first")
    first.start()
    assert entered.wait(timeout=30)
    waiters_before = _flock_waiters()
    second = threading.Thread(target=run, name="second")
    second.start()
    try:
        while _flock_waiters() == waiters_before:  # until the second builder is blocked on the lock file
            assert second.is_alive(), "second builder did not wait for the first"
    finally:
        release.set()
    first.join(timeout=30)
    second.join(timeout=30)
    assert calls == ["first"]
    assert results["first"] == results["second"] == tmp_path / "raced"
    assert (tmp_path / "raced" / "config.json").read_text() == "first"


def test_resolve_model_dir(tmp_path):
    assert BUILTIN_MODELS == ("smollm2", "demo")
    missing = tmp_path / "nowhere"
    with pytest.raises(ValueError, match="does not exist") as error:
        resolve_model_dir(missing)
    assert str(missing) in str(error.value) and "config.json" in str(error.value)
    assert "smollm2" in str(error.value) and "demo" in str(error.value)

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no config.json") as error:
        resolve_model_dir(str(empty))
    assert str(empty) in str(error.value)

    a_file = tmp_path / "weights.bin"
    a_file.write_bytes(b"")
    with pytest.raises(ValueError, match="not a directory"):
        resolve_model_dir(a_file)

    (empty / "config.json").write_text("{}")
    assert resolve_model_dir(str(empty)) == empty.resolve()
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model_dir(Path("demo-does-not-exist"))
