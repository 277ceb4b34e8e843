"""Settings: dataclasses filled from a YAML file and ``key=value`` overrides.

Every library package owns its section (``pipeline/<package>/config.py``, ``export/config.py``);
this module composes them into :class:`PipelineConfig` and knows how to fill it.

Example::

    cfg = load_config("my.yaml", ["data.rows=2000000", "train.epochs=2"])
    cfg.paths.processed   # data/synthetic/processed

A field's ``metadata["help"]`` is what ``python -m pipeline --help`` prints.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from export.config import ExportConfig, ServeConfig
from pipeline.data.config import DataConfig
from pipeline.distributed.config import DistributedConfig
from pipeline.etl.config import EtlConfig
from pipeline.train.config import TrainConfig


class ConfigError(ValueError):
    """A setting that does not exist or has a value of the wrong type."""


@dataclass
class Paths:
    """Where each stage reads and writes, all under ``<workdir>/<dataset>``."""

    root: Path

    @property
    def raw(self) -> Path:
        return self.root / "raw"

    @property
    def processed(self) -> Path:
        return self.root / "processed"

    @property
    def schema(self) -> Path:
        return self.processed / "schema.json"

    @property
    def workflow(self) -> Path:
        return self.root / "workflow"

    @property
    def oracle(self) -> Path:
        return self.raw / "oracle.json"

    @property
    def train(self) -> Path:
        return self.root / "train"

    @property
    def export(self) -> Path:
        return self.root / "export"


@dataclass
class PipelineConfig:
    """The whole pipeline's settings."""

    workdir: str = field(default="data", metadata={"help": "folder for datasets and every stage's output"})
    device: str = field(
        default="auto",
        metadata={"help": "cpu | cuda | auto (auto picks cuda only when a GPU is really usable, and says so)"},
    )
    seed: int = field(default=0, metadata={"help": "seed for everything random (data, shuffling, weights)"})
    data: DataConfig = field(default_factory=DataConfig)
    etl: EtlConfig = field(default_factory=EtlConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda", "auto"):
            raise ConfigError(f"device: expected cpu, cuda or auto, got {self.device!r}")

    @property
    def paths(self) -> Paths:
        return Paths(Path(self.workdir) / self.data.dataset_name)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> PipelineConfig:
    """Build the settings: defaults, then the YAML file, then ``key=value`` overrides."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path}: expected a mapping at the top, got {type(loaded).__name__}")
        tree = loaded
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected key=value, e.g. data.rows=2000000")
        node = tree
        *parents, leaf = key.strip().split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part} is not a section")
        node[leaf] = yaml.safe_load(raw) if raw.strip() else None
    return _build(PipelineConfig, tree, "")


def _build(cls: type, tree: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(tree) - set(known))
    if unknown:
        raise ConfigError(
            f"unknown setting {prefix}{unknown[0]}; known in {prefix.rstrip('.') or 'the top level'}: "
            + ", ".join(sorted(known))
        )
    kwargs = {}
    for name, value in tree.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                raise ConfigError(f"{prefix}{name} is a section: give it as a mapping or use {prefix}{name}.KEY=VALUE")
            kwargs[name] = _build(hint, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, hint, f"{prefix}{name}")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{prefix.rstrip('.') or 'settings'}: {err}") from err


def _coerce(value: Any, hint: Any, name: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, name)
            except ConfigError:
                pass
        raise ConfigError(f"{name}: expected {hint}, got {value!r}")
    if origin in (list, tuple):
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name}: expected a list, got {value!r}")
        inner = args[0] if args else Any
        return [_coerce(v, inner, name) for v in value]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{name}: expected a mapping, got {value!r}")
        kt, vt = args or (Any, Any)
        return {_coerce(k, kt, name): _coerce(v, vt, name) for k, v in value.items()}
    if hint is Any:
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if hint is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(hint, type) and not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise ConfigError(f"{name}: expected {getattr(hint, '__name__', hint)}, got {value!r}")
    return value


def describe(cls: type = PipelineConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, default, help) for every setting, in declaration order, for ``--help``."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            rows.extend(describe(hint, f"{prefix}{f.name}."))
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        else:
            default = "(required)"
        rows.append((f"{prefix}{f.name}", repr(default), f.metadata.get("help", "")))
    return rows


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain-data view of a config, for saving next to outputs."""
    return dataclasses.asdict(cfg)
