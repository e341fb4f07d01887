"""Config layering (CLI > env > YAML > default), provenance, and every error path."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from dynamo_spec.config.loader import ConfigError, effective_config, load_settings

pytestmark = pytest.mark.unit

BASE = {
    "engine": {"model": "/models/target", "kv_cache_memory_bytes": "256MiB"},
    "speculative": {"model": "/models/draft", "num_speculative_tokens": 2},
}


def test_precedence_cli_over_env_over_yaml_over_default(write_config):
    path = write_config(BASE)
    env = {"DYNAMO_SPEC_SPECULATIVE__NUM_SPECULATIVE_TOKENS": "4", "DYNAMO_SPEC_SERVER__PORT": "7000"}
    loaded = load_settings(path, ["--server.port", "9000"], env)
    s = loaded.settings
    assert s.server.port == 9000 and loaded.source_of("server.port") == "cli"
    assert s.speculative.num_speculative_tokens == 4
    assert loaded.source_of("speculative.num_speculative_tokens") == "env DYNAMO_SPEC_SPECULATIVE__NUM_SPECULATIVE_TOKENS"
    assert s.engine.model == "/models/target" and loaded.source_of("engine.model") == f"{path}:2"
    assert s.server.host == "0.0.0.0" and loaded.source_of("server.host") == "default"
    assert s.engine.kv_cache_memory_bytes == 256 * 2**20


def test_env_alone_overrides_yaml(write_config):
    loaded = load_settings(write_config(BASE), [], {"DYNAMO_SPEC_SPECULATIVE__NUM_SPECULATIVE_TOKENS": "5"})
    assert loaded.settings.speculative.num_speculative_tokens == 5


def test_cli_values_are_typed(write_config):
    loaded = load_settings(write_config(BASE), [
        "--speculative.aux_hidden_state_layer_ids=[1, 2, 3]", "--engine.enforce_eager", "true",
        "--engine.extra.block_size", "32", "--server.served_model_name", "2024-01-01",
    ], {})
    s = loaded.settings
    assert s.speculative.aux_hidden_state_layer_ids == [1, 2, 3]
    assert s.engine.enforce_eager is True
    assert s.engine.extra == {"block_size": 32}
    assert s.server.served_model_name == "2024-01-01"  # stays a string


def test_effective_config_lists_every_field_with_its_source(write_config):
    rows = {f: (v, src) for f, v, src in effective_config(load_settings(write_config(BASE), [], {}))}
    assert rows["speculative.num_speculative_tokens"][0] == 2
    assert rows["metrics.window_seconds"] == (60.0, "default")
    assert set(f.split(".")[0] for f in rows) == {"server", "engine", "speculative", "limits", "metrics", "sampling", "learning"}


def test_secret_is_hidden(write_config):
    rows = {f: v for f, v, _ in effective_config(load_settings(write_config(BASE), ["--server.api_key", "s3cret"], {}))}
    assert rows["server.api_key"] == "**********"


def test_relative_paths_resolve_against_the_yaml_file(tmp_path):
    (tmp_path / "configs").mkdir()
    path = tmp_path / "configs" / "c.yaml"
    path.write_text("engine:\n  model: ../models/t\n  kv_cache_memory_bytes: 1GiB\nspeculative:\n  model: ./d\n")
    s = load_settings(path, [], {}).settings
    assert s.engine.model == str(tmp_path / "models" / "t")
    assert s.speculative.model == str(tmp_path / "configs" / "d")


@pytest.mark.parametrize(
    "yaml_text, overrides, env, expected",
    [
        ("engine: [unclosed\n", [], {}, "invalid YAML"),
        ("- just a list\n", [], {}, "top level must be a mapping"),
        ("engine:\n  modle: x\n", [], {}, "engine.modle: unknown key; did you mean 'model'?"),
        ("engine:\n  model: x\n  max_model_len: lots\n", [], {}, ":3: engine.max_model_len: Input should be a valid integer"),
        ("engine:\n  model: x\n", ["--speculative.num_speculative_tokens", "0"], {}, "cli: speculative.num_speculative_tokens: Input should be greater than or equal to 1"),
        ("engine:\n  model: x\n", [], {"DYNAMO_SPEC_SERVER__PORT": "70000"}, "env DYNAMO_SPEC_SERVER__PORT: server.port: Input should be less than or equal to 65535"),
        ("engine:\n  model: x\nspeculative:\n  method: eagel3\n  model: d\n", [], {}, "unknown method 'eagel3'; did you mean 'eagle3'?"),
        ("engine:\n  model: x\n  extra:\n    blok_size: 16\n", [], {}, "'blok_size' is not a vLLM option; did you mean 'block_size'?"),
        ("engine:\n  model: x\n  extra:\n    dtype: half\n", [], {}, "set engine.dtype instead of engine.extra.dtype"),
        ("engine:\n  model: x\nspeculative:\n  extra:\n    num_speculatve_tokens: 2\n", [], {}, "did you mean 'num_speculative_tokens'?"),
        ("engine:\n  model: x\nspeculative:\n  method: eagle3\n", [], {}, "method 'eagle3' needs a draft checkpoint: set speculative.model"),
        ("server:\n  port: 1\n", [], {}, "engine: required but not set"),
        ("engine:\n  model: x\n", [], {"DYNAMO_SPEC_SERVR__PORT": "1"}, "DYNAMO_SPEC_SERVR__PORT: unknown section; did you mean 'server'?"),
        ("engine:\n  model: x\n", ["--port", "1"], {}, "expected --section.field VALUE"),
        ("engine:\n  model: x\n", ["--server.port"], {}, "missing value"),
    ],
)
def test_config_errors_name_the_field_and_the_source(tmp_path, yaml_text, overrides, env, expected):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError) as err:
        load_settings(path, overrides, env)
    assert expected in str(err.value)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_settings(tmp_path / "nope.yaml", [], {})


def test_cli_reports_config_error_in_one_line_without_traceback(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("engine:\n  model: x\n  max_model_len: lots\n")
    result = subprocess.run([sys.executable, "-m", "dynamo_spec", "config", "--config", str(path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert f"{path}:3: engine.max_model_len: Input should be a valid integer" in result.stderr


def test_cli_config_prints_sources(tmp_path, write_config):
    path = write_config(BASE)
    result = subprocess.run(
        [sys.executable, "-m", "dynamo_spec", "config", "--config", str(path), "--server.port", "9001"],
        capture_output=True, text=True, timeout=120,
        env={**__import__("os").environ, "DYNAMO_SPEC_ENGINE__SEED": "7"},
    )
    assert result.returncode == 0, result.stderr
    lines = {line.split()[0]: line.split() for line in result.stdout.splitlines()}
    assert lines["server.port"][1:] == ["9001", "cli"]
    assert lines["engine.seed"][1:] == ["7", "env", "DYNAMO_SPEC_ENGINE__SEED"]
    assert lines["speculative.num_speculative_tokens"][1:] == ["2", f"{path}:6"]
    assert lines["server.host"][1:] == ["0.0.0.0", "default"]
    # the runner and scheduling vLLM will pick on this host (dynamo_spec/engine/paths.py)
    assert "engine path: the V1 model runner with synchronous scheduling (predicted for this host)" in result.stdout


def test_frontend_options_are_checked_and_reach_vllm_serving_args():
    from dynamo_spec.config.settings import Settings
    from dynamo_spec.engine.args import vllm_serving_args

    settings = Settings(engine={"model": "m"}, speculative={"enabled": False},
                        server={"served_model_name": "served",
                                "frontend": {"tool_call_parser": "hermes", "enable_auto_tool_choice": True}})
    args = vllm_serving_args(settings)
    assert (args.tool_call_parser, args.enable_auto_tool_choice, args.served_model_name) == ("hermes", True, ["served"])
    for frontend, message in [({"tool_cal_parser": "x"}, "did you mean 'tool_call_parser'?"),
                              ({"port": 1}, "set server.port instead of server.frontend.port"),
                              ({"max_num_seqs": 2}, "is an engine argument: set engine.max_num_seqs"),
                              ({"block_size": 16}, "set engine.extra.block_size")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            Settings(engine={"model": "m"}, speculative={"enabled": False}, server={"frontend": frontend})


TENANTS_BASE = "engine:\n  model: x\nspeculative:\n  model: d\n"


def test_tenant_defaults_are_typed_and_keyed_by_the_tenant_header(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(TENANTS_BASE + "  tenants:\n    batch:\n      max_draft_tokens: 0\n    chat: {}\n"
                    "metrics:\n  tenant_header: X-Tenant\n")
    s = load_settings(path, [], {"DYNAMO_SPEC_SPECULATIVE__TENANTS__BULK__MAX_DRAFT_TOKENS": "1"}).settings
    assert {name: t.max_draft_tokens for name, t in s.speculative.tenants.items()} == \
        {"batch": 0, "chat": None, "bulk": 1}


@pytest.mark.parametrize("tenants, metrics, expected", [
    ("    batch:\n      max_draft_tokens: -1\n", "  tenant_header: X-Tenant\n",
     "speculative.tenants.batch.max_draft_tokens: Input should be greater than or equal to 0"),
    ("    batch:\n      max_draft_tokens: two\n", "  tenant_header: X-Tenant\n",
     "speculative.tenants.batch.max_draft_tokens: Input should be a valid integer"),
    ("    batch:\n      max_draft_tokns: 0\n", "  tenant_header: X-Tenant\n",
     ":7: speculative.tenants.batch.max_draft_tokns: unknown key"),
    ("    batch:\n      max_draft_tokens: 0\n", "  max_tenants: 5\n", "set metrics.tenant_header"),
], ids=["negative", "not-an-int", "unknown-key", "no-tenant-header"])
def test_bad_tenant_defaults_name_the_field(tmp_path, tenants, metrics, expected):
    path = tmp_path / "tenants.yaml"
    path.write_text(TENANTS_BASE + "  tenants:\n" + tenants + "metrics:\n" + metrics)
    with pytest.raises(ConfigError) as err:
        load_settings(path, [], {})
    assert expected in str(err.value)


def test_the_snapshot_of_vllms_option_names_is_the_installed_vllms():
    """Settings check names against config/vllm_names.json without importing vLLM; it must be what the
    installed vLLM says (after an upgrade: python -m dynamo_spec.config.vllm_names)."""
    import json

    from dynamo_spec.config import vllm_names

    snapshot = json.loads(vllm_names.SNAPSHOT.read_text())
    assert snapshot == vllm_names.live()
    assert vllm_names.names() == snapshot


def test_check_does_not_import_vllm(tmp_path, write_config):
    """`dynamo-spec check` answers in about a second: neither vLLM nor torch is imported for it."""
    path = write_config(BASE)
    script = ("import sys; from dynamo_spec.cli import main; rc = main(['check', '--config', sys.argv[1]]); "
              "print(sorted({m.split('.')[0] for m in sys.modules} & {'vllm', 'torch'}))")
    result = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout + result.stderr


@pytest.mark.parametrize("breakers", [[""], ["ok", ""], ["x"] * 65])
def test_dry_sequence_breakers_a_request_could_not_send_are_refused_at_load(breakers):
    """Issue 65: `check` passed [""], which the request path then refused for every request."""
    from dynamo_spec.config.settings import Settings

    with pytest.raises(ValueError, match="sampling.dry.sequence_breakers"):
        Settings(engine={"model": "m"}, sampling={"dry": {"multiplier": 1.0, "sequence_breakers": breakers}})
