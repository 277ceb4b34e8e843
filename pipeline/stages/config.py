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
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from export.config import ExportConfig, ServeConfig
from pipeline.data.config import DataConfig
from pipeline.distributed.config import DistributedConfig
from pipeline.errors import check_range
from pipeline.etl.config import EtlConfig
from pipeline.progress import MODES as PROGRESS_MODES
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
        """The training runs: one folder each, and ``latest``, the newest finished (:mod:`pipeline.train.runs`)."""
        return self.root / "train"

    @property
    def export(self) -> Path:
        return self.root / "export"

    @property
    def serve_log(self) -> Path:
        return self.root / "serve" / "tritonserver.log"


@dataclass
class PipelineConfig:
    """The whole pipeline's settings."""

    workdir: str = field(default="data", metadata={"help": "folder for datasets and every stage's output"})
    device: str = field(
        default="auto",
        metadata={"help": "cpu | cuda | auto (auto picks cuda only when a GPU is really usable, and says so)"},
    )
    seed: int = field(default=0, metadata={"help": "seed for everything random (data, shuffling, weights)"})
    progress: str = field(default="auto", metadata={
        "help": "auto | bar | plain | off: progress of every stage (auto: a bar on a terminal, else a plain "
                "line at most every 5 s, as a log file wants)"})
    data: DataConfig = field(default_factory=DataConfig)
    etl: EtlConfig = field(default_factory=EtlConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda", "auto"):
            raise ConfigError(f"device: expected cpu, cuda or auto, got {self.device!r}")
        if self.progress not in PROGRESS_MODES:
            raise ConfigError(f"progress: expected one of {', '.join(PROGRESS_MODES)}, got {self.progress!r}")
        if not self.workdir:
            raise ConfigError("workdir: expected a folder, got an empty text")
        try:
            check_range("seed", self.seed, 0, 2**32 - 1)
        except ValueError as err:
            raise ConfigError(str(err)) from None

    @property
    def paths(self) -> Paths:
        return Paths(Path(self.workdir).expanduser() / self.data.dataset_name)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> PipelineConfig:
    """Build the settings: defaults, then the YAML file, then ``key=value`` overrides.

    Values are read by the type of their setting, not by YAML's guesses: a text setting keeps the
    text as written (``data.name=0123`` stays ``"0123"``), a float takes ``1e-5``, ``1E5`` and
    ``.5``, an integer is decimal. Lists take ``a,b`` or ``[a, b]``, mappings ``{k: v}``.
    """
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist" if not path.exists()
                              else f"config file {path} is not a file")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"config file {path} cannot be read as UTF-8 text ({err})") from None
        loaded = _tree(_compose(text, f"config file {path}"), f"config file {path}")
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path}: expected a mapping (sections data:, train:, ...) at the top, "
                              f"got a {_kind(loaded)}")
        tree = loaded
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r}: expected key=value, e.g. data.rows=2000000")
        node = tree
        *parents, leaf = key.strip().split(".")
        for depth, part in enumerate(parents):
            given = node.get(part)
            child = {} if given is None or _is_null(given) else _parsed(given)
            if not isinstance(child, dict):
                section = ".".join(parents[: depth + 1])
                if isinstance(given, yaml.Node):
                    raise ConfigError(f"config file {path}, line {given.start_mark.line + 1}: {section} is a section: "
                                      f"give it as a mapping of its settings, or leave it empty")
                raise ConfigError(f"override {item!r}: {section} is not a section")
            node[part] = child
            node = child
        node[leaf] = _Text(raw, f"override {item!r}")
    return _build(PipelineConfig, tree, "")


@dataclass(frozen=True)
class _Text:
    """A value as typed on the command line, parsed only once the setting's type is known."""

    text: str
    where: str


def _compose(text: str, where: str) -> yaml.Node | None:
    """The YAML node tree of ``text`` (nothing converted yet); a syntax error names where, line and column."""
    try:
        return yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
        at = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{where}{at}: not valid YAML: {problem}") from None


_PLAIN_TAGS = {f"tag:yaml.org,2002:{t}" for t in ("str", "int", "float", "bool", "null", "seq", "map", "timestamp")}


def _tree(node: yaml.Node | None, where: str) -> Any:
    """Mappings as dicts of nodes (so overrides can be merged in); scalars and sequences stay nodes."""
    if node is not None and node.tag not in _PLAIN_TAGS:
        raise ConfigError(f"{where}, line {node.start_mark.line + 1}, column {node.start_mark.column + 1}: "
                          f"the tag {node.tag!r} is not allowed in settings")
    if isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _tree(item, where)
    if not isinstance(node, yaml.MappingNode):
        return node
    out: dict[str, Any] = {}
    for key, value in node.value:
        if not isinstance(key, yaml.ScalarNode):
            raise ConfigError(f"{where}, line {key.start_mark.line + 1}: a key must be a plain name")
        if key.value in out:
            raise ConfigError(f"{where}, line {key.start_mark.line + 1}: {key.value} is given twice")
        out[key.value] = _tree(value, where)
    return out


def _kind(value: Any) -> str:
    if isinstance(value, dict):
        return "mapping"
    return "list" if isinstance(value, yaml.SequenceNode) else "single value"


def _parsed(value: Any) -> Any:
    """A command-line text as YAML nodes (for settings that are lists, mappings or sections)."""
    if isinstance(value, _Text):
        return _tree(_compose(value.text, value.where), value.where)
    return value


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
            value = {} if _is_null(value) else _parsed(value)
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
        message = str(err)
        section = prefix.rstrip(".")
        if section and message.startswith(prefix):
            raise ConfigError(message) from None
        raise ConfigError(f"{section or 'settings'}: {message}") from None


_TRUE = ("true", "yes", "on")
_FALSE = ("false", "no", "off")
_SPECIAL_FLOATS = {".nan": math.nan, ".inf": math.inf, "+.inf": math.inf, "-.inf": -math.inf}


def _scalar_text(value: Any, name: str, expected: str) -> str:
    if isinstance(value, _Text):
        return value.text
    if isinstance(value, yaml.ScalarNode):
        return value.value
    raise ConfigError(f"{name}: expected {expected}, got a {_kind(value)}")


def _is_null(value: Any) -> bool:
    if isinstance(value, _Text):
        return value.text.strip().lower() in ("", "null", "~")
    return isinstance(value, yaml.ScalarNode) and value.tag == "tag:yaml.org,2002:null" and not value.style


def _coerce(value: Any, hint: Any, name: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and _is_null(value):
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, name)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{name}: expected {hint}")
    if origin in (list, tuple):
        inner = args[0] if args else Any
        if isinstance(value, _Text) and not value.text.strip().startswith("["):
            return [_coerce(_Text(v.strip(), value.where), inner, name) for v in value.text.split(",") if v.strip()]
        value = _parsed(value)
        if isinstance(value, yaml.ScalarNode) and not value.style:
            return [_coerce(_Text(v.strip(), name), inner, name) for v in value.value.split(",") if v.strip()]
        if not isinstance(value, yaml.SequenceNode):
            raise ConfigError(f"{name}: expected a list (a,b or [a, b]), got a {_kind(value)}")
        return [_coerce(v, inner, name) for v in value.value]
    if origin is dict:
        value = _parsed(value)
        if not isinstance(value, dict):
            raise ConfigError(f"{name}: expected a mapping ({{key: value}}), got a {_kind(value)}")
        kt, vt = args or (Any, Any)
        glued = [k for k, v in value.items() if ":" in k and _is_null(v)]
        if glued:
            key, item = glued[0].split(":", 1)
            raise ConfigError(f"{name}: {{{glued[0]}}} is read as a key with no value: write {{{key}: {item}}} (a space "
                              "after the colon)")
        return {_coerce(_Text(k, name), kt, f"{name}.{k}"): _coerce(v, vt, f"{name}.{k}") for k, v in value.items()}
    if hint is str:
        return _scalar_text(value, name, "a text")
    text = _scalar_text(value, name, getattr(hint, "__name__", str(hint))).strip()
    if hint is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ConfigError(f"{name}: expected true or false, got {text!r}")
    if hint is int:
        try:
            return int(text, 10)
        except ValueError:
            pass
        number = _float(text)
        if number is not None and math.isfinite(number) and number.is_integer():
            return int(number)
        raise ConfigError(f"{name}: expected int (a decimal integer), got {text!r}")
    if hint is float:
        number = _float(text)
        if number is None:
            raise ConfigError(f"{name}: expected float (a number such as 0.01, 1e-5 or .5), got {text!r}")
        return number
    raise ConfigError(f"{name}: settings of type {hint} cannot be read")


def _float(text: str) -> float | None:
    special = _SPECIAL_FLOATS.get(text.lower())
    if special is not None:
        return special
    try:
        return float(text)
    except ValueError:
        return None


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
