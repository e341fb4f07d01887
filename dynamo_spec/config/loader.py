"""Layer YAML file, environment and command-line overrides into Settings.

Order, highest first: command line > environment > YAML file > defaults.
Every value's origin is recorded ("cli", "env DYNAMO_SPEC_...", "file.yaml:12",
"default") so `dynamo-spec config` can say where each value came from, and a
validation error can name the field and the place that set it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, SecretStr, ValidationError
from pydantic_settings import EnvSettingsSource

from dynamo_spec.config import schedule
from dynamo_spec.config.settings import ENV_DELIMITER, ENV_PREFIX, Settings, did_you_mean

Path_ = tuple[str, ...]


class ConfigError(Exception):
    """A configuration problem, worded for the user (no traceback needed)."""


@dataclass(frozen=True)
class LoadedSettings:
    settings: Settings
    sources: dict[Path_, str]  # field path -> where its value came from
    notes: tuple[str, ...] = ()  # what loading changed, for the log (a schedule capped at a lowered k)

    def source_of(self, dotted: str) -> str:
        return _lookup(self.sources, tuple(dotted.split("."))) or "default"


def load_settings(
    config_file: str | Path | None,
    overrides: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
) -> LoadedSettings:
    layers: list[tuple[dict[str, Any], dict[Path_, str]]] = []  # lowest first
    if config_file is not None:
        layers.append(_read_yaml(Path(config_file)))
    layers.append(_read_env(os.environ if environ is None else environ))
    layers.append(_parse_overrides(overrides))

    merged: dict[str, Any] = {}
    sources: dict[Path_, str] = {}
    for data, origin in layers:
        _deep_merge(merged, data)
        for path in list(sources):  # a higher layer replaces what lies below it
            if any(path[: len(p)] == p or p[: len(path)] == path for p in origin):
                del sources[path]
        sources.update(origin)
    notes = [note] if (note := _cap_schedule_at_lowered_k(merged, sources)) else []
    try:
        settings = Settings(**merged)
    except ValidationError as exc:
        raise ConfigError(_explain(exc, sources, config_file)) from None
    return LoadedSettings(settings, sources, tuple(notes))


def effective_config(loaded: LoadedSettings) -> list[tuple[str, Any, str]]:
    """(dotted field, value, source) for every leaf of the effective settings."""
    rows: list[tuple[str, Any, str]] = []

    def walk(model: BaseModel, prefix: Path_) -> None:
        for name in type(model).model_fields:
            value = getattr(model, name)
            path = prefix + (name,)
            if isinstance(value, BaseModel):
                walk(value, path)
                continue
            if isinstance(value, SecretStr):
                value = "**********"
            rows.append((".".join(path), value, _lookup(loaded.sources, path) or "default"))

    walk(loaded.settings, ())
    return rows


def _rank(source: str | None) -> int:
    """How explicit a source is: the order of the layers (command line > environment > file > default)."""
    if source is None:
        return 0
    if source == "cli":
        return 3
    return 2 if source.startswith("env ") else 1


def _cap_schedule_at_lowered_k(merged: dict[str, Any], sources: dict[Path_, str]) -> str | None:
    """A k set above the schedule's layer (``--speculative.num_speculative_tokens 2`` over a file's
    schedule with k=4 entries) caps the schedule at that k: the user lowered k and expects the
    schedule to follow. A schedule set as explicitly as k that asks for more stays a preflight error.
    Returns the note to log, or None when nothing changed."""
    spec = merged.get("speculative")
    if not isinstance(spec, dict):
        return None
    k, value = spec.get("num_speculative_tokens"), spec.get("num_speculative_tokens_per_batch_size")
    if isinstance(k, str) and k.strip().isdigit():  # the environment's values are strings
        k = int(k)
    if not isinstance(k, int) or isinstance(k, bool) or value is None:
        return None
    k_source = sources.get(("speculative", "num_speculative_tokens"))
    field = tuple(schedule.FIELD.split("."))
    schedule_paths = [p for p in sources if p[: len(field)] == field]
    if _rank(k_source) <= max((_rank(sources[p]) for p in schedule_paths), default=0):
        return None
    lowered = schedule.capped(value, k)
    if lowered == value:
        return None
    spec["num_speculative_tokens_per_batch_size"] = lowered
    where = ", ".join(sorted({sources[p] for p in schedule_paths}))
    for p in schedule_paths:
        sources[p] += f" (capped at k={k} by {k_source})"
    return f"{schedule.FIELD} ({where}) capped at k={k}, the {schedule.K_FIELD} set by {k_source}: {json.dumps(lowered)}"


# --- the three sources -------------------------------------------------------


def _read_yaml(path: Path) -> tuple[dict[str, Any], dict[Path_, str]]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc.strerror}") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{where}: invalid YAML: {problem}") from None
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (server, engine, speculative, metrics)")
    data = resolve_relative_paths(data, path.parent.resolve())
    origin: dict[Path_, str] = {}
    _yaml_lines(node, (), path, origin)
    return data, origin


def _yaml_lines(node: yaml.Node, prefix: Path_, file: Path, out: dict[Path_, str]) -> None:
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            path = prefix + (str(key.value),)
            if isinstance(value, yaml.MappingNode) and value.value:
                _yaml_lines(value, path, file, out)
            else:
                out[path] = f"{file}:{key.start_mark.line + 1}"


def resolve_relative_paths(data: dict[str, Any], base: Path) -> dict[str, Any]:
    """Values starting with './' or '../' are paths relative to `base` (a YAML file's folder)."""

    def fix(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: fix(v) for k, v in value.items()}
        if isinstance(value, list):
            return [fix(v) for v in value]
        if isinstance(value, str) and value.startswith(("./", "../")):
            return os.path.normpath(base / value)
        return value

    return fix(data)


def _read_env(environ: Mapping[str, str]) -> tuple[dict[str, Any], dict[Path_, str]]:
    source = EnvSettingsSource(Settings, env_prefix=ENV_PREFIX, env_nested_delimiter=ENV_DELIMITER)
    source.env_vars = {k.lower(): v for k, v in environ.items()}  # read the mapping we were given
    data = source()
    origin = {
        path: "env " + ENV_PREFIX + ENV_DELIMITER.join(path).upper()
        for path in _leaf_paths(data)
    }
    unknown = sorted(  # DYNAMO_SPEC_<SECTION>__<FIELD> with a section that does not exist
        k for k in environ
        if k.upper().startswith(ENV_PREFIX) and ENV_DELIMITER in k
        and k.upper()[len(ENV_PREFIX):].split(ENV_DELIMITER)[0].lower() not in Settings.model_fields
    )
    if unknown:
        raise ConfigError(
            f"environment variable {unknown[0]}: unknown section"
            f"{did_you_mean(unknown[0][len(ENV_PREFIX):].split(ENV_DELIMITER)[0].lower(), Settings.model_fields)}"
            f" (use {ENV_PREFIX}<SECTION>{ENV_DELIMITER}<FIELD>)"
        )
    return data, origin


def _parse_overrides(args: Sequence[str]) -> tuple[dict[str, Any], dict[Path_, str]]:
    data: dict[str, Any] = {}
    origin: dict[Path_, str] = {}
    items = list(args)
    while items:
        flag = items.pop(0)
        if not flag.startswith("--") or "." not in flag:
            raise ConfigError(f"override '{flag}': expected --section.field VALUE, e.g. --server.port 9000")
        key, sep, raw = flag[2:].partition("=")
        if not sep:
            if not items:
                raise ConfigError(f"override '{flag}': missing value")
            raw = items.pop(0)
        path = tuple(key.replace("-", "_").split("."))
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        if not isinstance(value, (dict, list, bool, int, float, type(None))):
            value = raw  # keep strings (and YAML dates etc.) exactly as typed
        _set(data, path, value)
        origin[path] = "cli"
    return data, origin


# --- helpers -----------------------------------------------------------------


def _leaf_paths(data: Mapping[str, Any], prefix: Path_ = ()) -> list[Path_]:
    out: list[Path_] = []
    for key, value in data.items():
        if isinstance(value, Mapping) and value:
            out.extend(_leaf_paths(value, prefix + (key,)))
        else:
            out.append(prefix + (key,))
    return out


def _set(data: dict[str, Any], path: Path_, value: Any) -> None:
    for key in path[:-1]:
        data = data.setdefault(key, {})
        if not isinstance(data, dict):
            raise ConfigError(f"override --{'.'.join(path)}: '{key}' is not a section")
    data[path[-1]] = value


def _deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> None:
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _deep_merge(base[key], value)
        else:
            base[key] = dict(value) if isinstance(value, Mapping) else value


def _lookup(sources: Mapping[Path_, str], path: Path_) -> str | None:
    """Source of a value: its own, else those of the keys set inside it (a mapping), else its parent's."""
    if path in sources:
        return sources[path]
    inner = sorted({src for p, src in sources.items() if p[: len(path)] == path})
    if inner:
        return ", ".join(inner)
    for n in range(len(path) - 1, 0, -1):  # an item inside a value (e.g. a list) set as a whole
        if path[:n] in sources:
            return sources[path[:n]]
    return None


def _explain(exc: ValidationError, sources: dict[Path_, str], config_file: str | Path | None) -> str:
    lines = []
    for err in exc.errors():
        loc = tuple(str(p) for p in err["loc"] if not str(p).startswith("function-") and str(p) not in (*schedule.TAGS, "[key]"))
        message = err["msg"].removeprefix("Value error, ")
        if not loc and ": " in message:  # a cross-field check names its field first
            head, message = message.split(": ", 1)
            loc = tuple(head.split("."))
        field = ".".join(loc) or "settings"
        where = _lookup(sources, loc) or (str(config_file) if config_file else "defaults")
        if err["type"] == "extra_forbidden":
            parent = _model_at(loc[:-1])
            hint = did_you_mean(loc[-1], parent.model_fields) if parent else ""
            message = f"unknown key{hint}"
        elif err["type"] == "missing" and _lookup(sources, loc) is not None:
            message = "missing item"  # e.g. a [lo, hi, k] entry with two items
        elif err["type"] == "missing":
            where = str(config_file) if config_file else "no config file"
            message = "required but not set"
        lines.append(f"{where}: {field}: {message}")
    return "invalid configuration\n  " + "\n  ".join(lines)


def _model_at(path: Path_) -> type[BaseModel] | None:
    model: type[BaseModel] = Settings
    for key in path:
        field = model.model_fields.get(key)
        annotation = field.annotation if field else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model
