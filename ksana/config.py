"""Engine configuration: KsanaLLM's YAML keys (``setting.*`` / ``model_spec.*``) with leaf-name overrides.

One YAML file describes a deployment; ``LLM(...)`` keyword arguments and CLI flags override single keys by their
leaf names (``max_batch_size=8`` sets ``setting.batch_scheduler.max_batch_size``). Unknown or ill-typed keys are
errors that name the key, because a silently ignored typo is the worst kind of misconfiguration.
"""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any

import attrs
import yaml


class ConfigError(ValueError):
    """A configuration key is unknown, ill-typed or out of range; the message names the key."""


@attrs.define(kw_only=True)
class GlobalSetting:
    tensor_para_size: int = 1
    device: str = "auto"  # auto | cpu | cuda | npu
    num_threads: int = 0  # torch intra-op threads; 0 keeps torch's default


# ``bench/speculative.py --batches 1,4,8,16`` on smollm2: prompt lookup's verify steps pay at batch 1 and 4 (1.3x
# to 2.7x the output rate), break even at 8 and cost more than they save at 16 (0.8x).
SPEC_MAX_BATCH_SIZE = 4


@attrs.define(kw_only=True)
class BatchSchedulerSetting:
    max_batch_size: int = 64
    # vLLM's CPU server default too. A burst's requests get their first token when the step holding their prompt
    # ends, so smaller prefill steps bring the median first token sooner at the same throughput: ``bench/vs_vllm.py``
    # burst (64 x 256 tokens, float32), TTFT p50 13.6-13.9 s at 2048 against 15.9-17.5 s at 4096.
    max_step_tokens: int = 2048
    max_token_len: int = 0  # 0: the model's maximum; always clipped to it
    # Chunked prefill: a prompt that does not fit the step's remaining budget runs its first part now (at most this
    # many tokens a step; 0: prompts run whole). Whole prompts leave up to a prompt's length of the budget unused
    # every step of a burst: ``bench/vs_vllm.py`` burst (64 x 256 tokens, float32, AVX-512 Xeon), steps of 1,792
    # prefill tokens and TTFT p50 10.7-13.6 s whole, steps of about 2,040 and TTFT p50 7.6 s chunked.
    split_fuse_token_num: int = 2048
    enable_auto_prefix_cache: bool = False
    # Plan step N+1 while step N runs (vLLM's async scheduling): the worker starts the next step without waiting
    # for the scheduler, whose work runs beside the forward pass. Only while requests wait (see SchedulerActor).
    async_scheduling: bool = True
    preempt_mode: int = 1  # 1 = RECOMPUTE (the only mode on this engine; 0 = SWAP is rejected)
    waiting_timeout_in_ms: int = 600_000
    max_waiting_queue_len: int = 1200
    # Speculative decoding (one drafter at a time; async scheduling is off while it is on): draft tokens per step
    # from the model's MTP modules (KsanaLLM's key) or from prompt lookup, which matches the last
    # ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens earlier in the sequence and drafts what followed.
    mtp_step_num: int = 0
    ngram_step_num: int = 0
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # Drafts only while at most this many requests run (0: at any batch size). A verify row runs through the general
    # forward, not the fused one-token decode: its extra positions are nearly free at small batches and cost more
    # than they save at large ones (``bench/speculative.py --batches 1,4,8,16``).
    spec_max_batch_size: int = SPEC_MAX_BATCH_SIZE

    @property
    def num_speculative_tokens(self) -> int:
        """Draft tokens per request per step (0: speculative decoding is off)."""
        return self.mtp_step_num or self.ngram_step_num

    @property
    def plans_ahead(self) -> bool:
        """Whether a step is planned while the one before it runs: speculation needs each step's accepted
        tokens before it can draft the next, so it turns async scheduling off."""
        return self.async_scheduling and not self.num_speculative_tokens


@attrs.define(kw_only=True)
class BlockManagerSetting:
    block_token_num: int = 16
    reserved_device_memory_ratio: float = 0.01
    # Fraction of the memory left after loading the weights that the KV pool takes.
    block_device_memory_ratio: float = 0.2
    num_device_blocks: int = 0  # > 0: exactly this many KV blocks, overriding the ratio
    # Prefix cache on a sliding-window model: blocks of the SWA layers' pool (0: as many as the FA pool).
    num_swa_blocks: int = 0
    # Remote cache loading: a directory shared by engines ("" = off); needs enable_auto_prefix_cache.
    remote_cache_dir: str = ""


@attrs.define(kw_only=True)
class TokenizationSetting:
    add_special_tokens: bool = True
    skip_special_tokens: bool = True


@attrs.define(kw_only=True)
class ConnectorSetting:
    """Prefill/decode disaggregation (KsanaLLM's ``setting.connector``): this node's role in a pair, the router
    it registers with, and how long a decode node waits for a prompt's K/V."""

    group_role: str = "none"  # none | prefill | decode
    router_addr: str = ""  # http://host:port of ``ksana router``
    inference_addr: str = ""  # host:port the router reaches this node at ("": the served address)
    cluster_name: str = "default_cluster"
    heartbeat_interval_ms: int = 5000
    # A decode node ends a request whose K/V has not come after this long, and drops received K/V no request
    # claims after this long.
    connector_waiting_sec: int = 30


@attrs.define(kw_only=True)
class Setting:
    global_: GlobalSetting = attrs.field(factory=GlobalSetting, alias="global_")
    batch_scheduler: BatchSchedulerSetting = attrs.field(factory=BatchSchedulerSetting)
    block_manager: BlockManagerSetting = attrs.field(factory=BlockManagerSetting)
    tokenization: TokenizationSetting = attrs.field(factory=TokenizationSetting)
    connector: ConnectorSetting = attrs.field(factory=ConnectorSetting)


@attrs.define(kw_only=True)
class BaseModelSpec:
    model_dir: str = "smollm2"  # a Hugging Face directory, or a built-in name: smollm2 | demo
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16


@attrs.define(kw_only=True)
class ModelSpec:
    base_model: BaseModelSpec = attrs.field(factory=BaseModelSpec)


@attrs.define(kw_only=True)
class KsanaConfig:
    setting: Setting = attrs.field(factory=Setting)
    model_spec: ModelSpec = attrs.field(factory=ModelSpec)

    @property
    def scheduler(self) -> BatchSchedulerSetting:
        return self.setting.batch_scheduler

    @property
    def block_manager(self) -> BlockManagerSetting:
        return self.setting.block_manager


# YAML spells the section "global"; Python cannot, so the attribute is "global_".
_YAML_TO_ATTR = {"global": "global_"}
_ATTR_TO_YAML = {v: k for k, v in _YAML_TO_ATTR.items()}
_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DEVICES = ("auto", "cpu", "cuda", "npu")
_ROLES = ("none", "prefill", "decode")


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and attrs.has(tp)


def _leaf_paths(cls: type, prefix: str = "") -> dict[str, str]:
    """Map every leaf name to its dotted YAML path (leaf names are unique across the schema)."""
    paths: dict[str, str] = {}
    hints = typing.get_type_hints(cls)
    for field in attrs.fields(cls):
        key = _ATTR_TO_YAML.get(field.name, field.name)
        path = f"{prefix}{key}"
        if _is_section(hints[field.name]):
            paths.update(_leaf_paths(hints[field.name], path + "."))
        else:
            assert key not in paths, f"leaf name {key} is ambiguous"
            paths[key] = path
    return paths


LEAF_PATHS: dict[str, str] = _leaf_paths(KsanaConfig)
ALIASES = {"model": "model_dir"}


def _coerce(value: Any, tp: Any, path: str) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, (str, Path)):
            return str(value)
    elif isinstance(tp, types.UnionType):
        raise AssertionError("union config fields are not supported")
    name = getattr(tp, "__name__", str(tp))
    raise ConfigError(f"config key '{path}' must be {name}, got {type(value).__name__} {value!r}")


def _build(cls: type, data: Any, prefix: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config key '{prefix.rstrip('.') or '<root>'}' must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {_ATTR_TO_YAML.get(f.name, f.name): f.name for f in attrs.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(f"unknown config key '{path}'")
        attr = names[key]
        tp = hints[attr]
        kwargs[attr] = _build(tp, value, path + ".") if _is_section(tp) else _coerce(value, tp, path)
    return cls(**kwargs)


def _set_path(config: KsanaConfig, path: str, value: Any) -> None:
    *sections, leaf = path.split(".")
    target: Any = config
    for section in sections:
        target = getattr(target, _YAML_TO_ATTR.get(section, section))
    tp = typing.get_type_hints(type(target))[leaf]
    setattr(target, leaf, _coerce(value, tp, path))


def _validate(config: KsanaConfig) -> KsanaConfig:
    s, b, m = config.setting.batch_scheduler, config.setting.block_manager, config.model_spec.base_model
    g, c = config.setting.global_, config.setting.connector
    checks = [
        (c.group_role in _ROLES, "setting.connector.group_role", f"must be one of {', '.join(_ROLES)}"),
        (c.group_role == "none" or c.router_addr, "setting.connector.router_addr",
         "is needed when setting.connector.group_role is prefill or decode"),
        (c.heartbeat_interval_ms >= 1, "setting.connector.heartbeat_interval_ms", "must be positive"),
        (c.connector_waiting_sec >= 1, "setting.connector.connector_waiting_sec", "must be positive"),
        (b.block_token_num >= 1, "setting.block_manager.block_token_num", "must be at least 1"),
        (0 < b.block_device_memory_ratio <= 1, "setting.block_manager.block_device_memory_ratio", "must be in (0, 1]"),
        (0 <= b.reserved_device_memory_ratio < 1, "setting.block_manager.reserved_device_memory_ratio", "must be in [0, 1)"),
        (b.num_device_blocks >= 0, "setting.block_manager.num_device_blocks", "must be non-negative"),
        (b.num_swa_blocks >= 0, "setting.block_manager.num_swa_blocks", "must be non-negative"),
        (not b.remote_cache_dir or s.enable_auto_prefix_cache, "setting.block_manager.remote_cache_dir",
         "needs setting.batch_scheduler.enable_auto_prefix_cache"),
        (s.max_batch_size >= 1, "setting.batch_scheduler.max_batch_size", "must be at least 1"),
        (s.max_step_tokens >= 1, "setting.batch_scheduler.max_step_tokens", "must be at least 1"),
        (s.max_token_len >= 0, "setting.batch_scheduler.max_token_len", "must be non-negative"),
        (s.split_fuse_token_num >= 0, "setting.batch_scheduler.split_fuse_token_num", "must be non-negative"),
        (s.preempt_mode == 1, "setting.batch_scheduler.preempt_mode",
         "must be 1 (RECOMPUTE); SWAP (0) is not supported by this engine"),
        (s.waiting_timeout_in_ms >= 1, "setting.batch_scheduler.waiting_timeout_in_ms", "must be positive"),
        (s.max_waiting_queue_len >= 1, "setting.batch_scheduler.max_waiting_queue_len", "must be at least 1"),
        (s.mtp_step_num >= 0, "setting.batch_scheduler.mtp_step_num", "must be non-negative"),
        (s.ngram_step_num >= 0, "setting.batch_scheduler.ngram_step_num", "must be non-negative"),
        (not (s.mtp_step_num and s.ngram_step_num), "setting.batch_scheduler.ngram_step_num",
         "cannot be set together with setting.batch_scheduler.mtp_step_num (one drafter at a time)"),
        (s.prompt_lookup_min >= 1, "setting.batch_scheduler.prompt_lookup_min", "must be at least 1"),
        (s.spec_max_batch_size >= 0, "setting.batch_scheduler.spec_max_batch_size", "must be non-negative"),
        (s.prompt_lookup_max >= s.prompt_lookup_min, "setting.batch_scheduler.prompt_lookup_max",
         "must be at least setting.batch_scheduler.prompt_lookup_min"),
        (g.tensor_para_size >= 1, "setting.global.tensor_para_size", "must be at least 1"),
        (g.num_threads >= 0, "setting.global.num_threads", "must be non-negative"),
        (g.device in _DEVICES, "setting.global.device", f"must be one of {', '.join(_DEVICES)}"),
        (m.dtype in _DTYPES, "model_spec.base_model.dtype", f"must be one of {', '.join(_DTYPES)}"),
    ]
    for ok, path, message in checks:
        if not ok:
            raise ConfigError(f"config key '{path}' {message}")
    return config


def load_config(path: str | Path | None = None, **overrides: Any) -> KsanaConfig:
    """Read the YAML (if any), then apply leaf-name overrides; ``None`` overrides are ignored (unset CLI flags)."""
    data: Any = {}
    if path is not None:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    config = _build(KsanaConfig, data, "")
    for name, value in overrides.items():
        if value is None:
            continue
        leaf = ALIASES.get(name, name)
        if leaf in LEAF_PATHS:
            _set_path(config, LEAF_PATHS[leaf], value)
        elif "." in name:
            if name not in LEAF_PATHS.values():
                raise ConfigError(f"unknown config key '{name}'")
            _set_path(config, name, value)
        else:
            raise ConfigError(f"unknown config key '{name}' (known keys: {', '.join(sorted(LEAF_PATHS))})")
    return _validate(config)
