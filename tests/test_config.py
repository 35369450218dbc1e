"""Config: KsanaLLM's YAML keys, leaf-name overrides, and errors that name the bad key."""

from __future__ import annotations

import pytest

from ksana.config import LEAF_PATHS, ConfigError, load_config


def test_yaml_then_leaf_overrides(tmp_path):
    path = tmp_path / "ksana.yaml"
    path.write_text(
        "setting:\n"
        "  global: {num_threads: 2}\n"
        "  batch_scheduler: {max_batch_size: 32, split_fuse_token_num: 256}\n"
        "  block_manager: {block_token_num: 32}\n"
        "model_spec:\n"
        "  base_model: {model_dir: demo, dtype: bfloat16}\n"
    )
    config = load_config(path, max_batch_size=8, model=None, dtype="float32")
    assert config.setting.batch_scheduler.max_batch_size == 8  # the override wins
    assert config.setting.batch_scheduler.split_fuse_token_num == 256
    assert config.setting.block_manager.block_token_num == 32
    assert config.setting.global_.num_threads == 2
    assert config.model_spec.base_model.model_dir == "demo"  # None overrides are ignored (unset CLI flags)
    assert config.model_spec.base_model.dtype == "float32"


def test_dotted_override_and_every_leaf_has_a_path():
    config = load_config(**{"setting.batch_scheduler.max_step_tokens": 128})
    assert config.setting.batch_scheduler.max_step_tokens == 128
    assert LEAF_PATHS["block_token_num"] == "setting.block_manager.block_token_num"
    assert LEAF_PATHS["model_dir"] == "model_spec.base_model.model_dir"
    assert LEAF_PATHS["tensor_para_size"] == "setting.global.tensor_para_size"


def test_async_scheduling_is_on_unless_the_yaml_or_the_flag_turns_it_off(tmp_path):
    import argparse

    from ksana.config_flags import add_config_flags, config_overrides

    assert load_config().setting.batch_scheduler.async_scheduling is True
    path = tmp_path / "ksana.yaml"
    path.write_text("setting:\n  batch_scheduler: {async_scheduling: false}\n")
    assert load_config(path).setting.batch_scheduler.async_scheduling is False
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    flags = config_overrides(parser.parse_args(["--no-async-scheduling"]))
    assert load_config(**flags).setting.batch_scheduler.async_scheduling is False
    unset = config_overrides(parser.parse_args([]))
    assert load_config(path, **unset).setting.batch_scheduler.async_scheduling is False  # an unset flag keeps the YAML


@pytest.mark.parametrize(
    ("yaml_text", "overrides", "message"),
    [
        ("setting:\n  batch_scheduler: {max_batch_sizes: 4}\n", {}, "'setting.batch_scheduler.max_batch_sizes'"),
        ("setting:\n  block_manager: {block_token_num: sixteen}\n", {}, "'setting.block_manager.block_token_num' must be int"),
        ("setting:\n  batch_scheduler: {enable_auto_prefix_cache: 1}\n", {}, "must be bool"),
        ("setting:\n  batch_scheduler: {async_scheduling: sometimes}\n", {},
         "'setting.batch_scheduler.async_scheduling' must be bool"),
        ("settings: {}\n", {}, "unknown config key 'settings'"),
        ("setting: [1, 2]\n", {}, "'setting' must be a mapping"),
        ("", {"block_tokens": 4}, "unknown config key 'block_tokens'"),
        ("", {"max_batch_size": True}, "must be int"),
        ("", {"max_batch_size": 0}, "'setting.batch_scheduler.max_batch_size' must be at least 1"),
        ("", {"dtype": "fp8"}, "'model_spec.base_model.dtype' must be one of"),
        ("", {"preempt_mode": 0}, "SWAP (0) is not supported"),
        ("", {"setting.batch_scheduler.nope": 1}, "unknown config key 'setting.batch_scheduler.nope'"),
    ],
)
def test_bad_keys_are_named(tmp_path, yaml_text, overrides, message):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError) as info:
        load_config(path, **overrides)
    assert message in str(info.value)


def test_unreadable_and_invalid_yaml(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("setting: {a: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
