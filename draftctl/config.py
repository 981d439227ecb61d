"""Job configs: dataclasses that load from YAML, take flag overrides, and save next to outputs."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, TypeVar

import yaml

from draftctl.errors import DraftctlError

T = TypeVar("T")


class ConfigError(DraftctlError):
    """A config file or value that does not fit the job."""


def read_settings(path: str | Path | None = None,
                  overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The settings the YAML file at ``path`` (if any) states, then ``overrides`` not None."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping of keys to values")
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return data


def config_from(cls: type[T], settings: dict[str, Any]) -> T:
    """``cls`` built from ``settings``, refusing keys it does not have."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ConfigError(f"unknown config key(s) {', '.join(unknown)} for {cls.__name__}; "
                          f"known: {', '.join(sorted(known))}")
    return cls(**settings)


def load_config(cls: type[T], path: str | Path | None = None,
                overrides: dict[str, Any] | None = None) -> T:
    """``cls`` built from the YAML file at ``path`` (if any), then ``overrides`` not None."""
    return config_from(cls, read_settings(path, overrides))


def save_config(config: Any, path: str | Path) -> None:
    """Write the resolved config as YAML."""
    Path(path).write_text(yaml.safe_dump(dataclasses.asdict(config), sort_keys=False),
                          encoding="utf-8")
