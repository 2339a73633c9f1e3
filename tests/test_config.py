"""Typed configs: YAML, --set overrides, and errors that name the field."""

import pytest

from services.config import ConfigError, ServerConfig, Strict, load_config


class _Engine(Strict):
    block_size: int = 16
    dtype: str = "float32"


class _Service(Strict):
    server: ServerConfig = ServerConfig()
    engine: _Engine = _Engine()
    model: str


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: /m\nengine:\n  block_size: 32\nserver:\n  address: 127.0.0.1:5000\n")
    cfg = load_config(_Service, path, ["engine.dtype=bfloat16", "server.grace_s=2.5", "server.auth={tokens: {t: admin}}"])
    assert cfg.model == "/m" and cfg.engine.block_size == 32 and cfg.engine.dtype == "bfloat16"
    assert cfg.server.address == "127.0.0.1:5000" and cfg.server.grace_s == 2.5
    assert cfg.server.auth.tokens == {"t": "admin"}


def test_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"engine\.block_size: Input should be a valid integer"):
        load_config(_Service, None, ["model=x", "engine.block_size=big"])
    with pytest.raises(ConfigError, match=r"model: Field required"):
        load_config(_Service, None, [])
    with pytest.raises(ConfigError, match=r"server\.grace_s: Input should be greater than or equal to 0"):
        load_config(_Service, None, ["model=x", "server.grace_s=-1"])
    with pytest.raises(ConfigError, match=r"engine\.blocksize: Extra inputs are not permitted"):
        load_config(_Service, None, ["model=x", "engine.blocksize=3"])
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(_Service, None, ["model"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(_Service, bad)


def test_every_config_field_is_documented_or_obvious():
    undocumented = [name for name, f in ServerConfig.model_fields.items() if not f.description and name != "log_level"]
    assert undocumented == []


def test_the_engine_is_a_tagged_choice():
    """`engine.type` picks the engine's settings class; without it the native engine's (configs written before
    the choice existed keep their meaning); an unknown type or another engine's field names the field."""
    from rollout.engines.settings import NativeSettings, SglangSettings, VllmSettings
    from rollout.main import Config

    assert type(load_config(Config, None, ["model=m", "engine.max_num_seqs=8"]).engine) is NativeSettings
    vllm = load_config(Config, None, ["model=m", "engine={type: vllm, kv_cache_dtype: fp8}", "engine.seed=3"]).engine
    assert type(vllm) is VllmSettings and vllm.kv_cache_dtype == "fp8" and vllm.seed == 3
    assert type(load_config(Config, None, ["model=m", "engine.type=sglang"]).engine) is SglangSettings
    with pytest.raises(ConfigError, match=r"engine: Input tag 'tgi' found using _engine_type\(\) does not match"):
        load_config(Config, None, ["model=m", "engine.type=tgi"])
    with pytest.raises(ConfigError, match=r"engine\.vllm\.block_size: Extra inputs are not permitted"):
        load_config(Config, None, ["model=m", "engine={type: vllm, block_size: 16}"])


def test_kv_on_update_is_each_engines_and_vllm_refuses_keep():
    """engine.kv_on_update: keep by default for the native engine and SGLang, which also take recompute; the vLLM
    adapter's prefix-cache reset recomputes the requests in flight, so it is recompute only and says so when the
    config is loaded (docs/engine.md)."""
    from rollout.main import Config

    def engine(*settings: str):
        return load_config(Config, None, ["model=m", *settings]).engine

    assert engine().kv_on_update == engine("engine.type=sglang").kv_on_update == "keep"
    assert engine("engine.type=vllm").kv_on_update == "recompute"
    assert engine("engine.kv_on_update=recompute").kv_on_update == "recompute"
    assert engine("engine.type=sglang", "engine.kv_on_update=recompute").kv_on_update == "recompute"
    with pytest.raises(ConfigError, match=r"engine\.vllm\.kv_on_update: .*'keep' is not supported by the vLLM"):
        engine("engine={type: vllm, kv_on_update: keep}")
    with pytest.raises(ConfigError, match=r"engine\.native\.kv_on_update"):
        engine("engine.kv_on_update=later")
