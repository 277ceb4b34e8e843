"""The import rules of docs/ARCHITECTURE.md, checked on the source: layers only point down, no
package reaches the stage runners, and no private name crosses a package boundary.

Every import statement counts, also one inside a function (a lazy import is still a dependency);
a ``"module:attr"`` string in a registry is not an import, which is how the CLI reaches the
benchmarks and the embedding collection its compute backends.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# docs/ARCHITECTURE.md, "Layers": a package may import its own modules and those of lower layers.
LAYERS: dict[str, int] = {
    "core": 0,
    "data": 1, "kernels": 1, "loader": 1,
    "etl": 2, "modules": 2,
    "distributed": 3,
    "train": 4,
    "export": 5,
    "stages": 6,
    "bench": 7,
    "main": 8,
}
CORE = {"pipeline", "pipeline.errors", "pipeline.schema", "pipeline.device", "pipeline.sparse", "pipeline.files",
        "pipeline.parquet",
        "pipeline.registry", "pipeline.progress"}


def package_of(module: str) -> str | None:
    """The package (a key of LAYERS) a module of ours belongs to; None for a module not of ours."""
    parts = module.split(".")
    if parts[0] == "export":
        return "export"
    if parts[0] != "pipeline":
        return None
    if module in CORE:
        return "core"
    if module == "pipeline.__main__":
        return "main"
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else f"unknown:{module}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files() -> list[Path]:
    return sorted(p for top in ("pipeline", "export") for p in (ROOT / top).rglob("*.py"))


@dataclass(frozen=True)
class Import:
    source: str           # the importing module
    target: str           # the imported module
    names: tuple[str, ...]  # names taken from it (``from target import names``)
    line: int


def imports_of(path: Path) -> list[Import]:
    """Every import in a file, relative ones resolved, with the private attributes read off modules
    imported from another package (``categorify._encode``) counted as names taken."""
    source = module_name(path)
    package = source if path.name == "__init__.py" else source.rpartition(".")[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[Import] = []
    module_aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(source, alias.name, (), node.lineno))
                module_aliases[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = tuple(a.name for a in node.names)
            found.append(Import(source, target, names, node.lineno))
            for alias in node.names:
                # ``from pipeline.etl.ops import categorify`` binds a module: remember it.
                module_aliases[alias.asname or alias.name] = f"{target}.{alias.name}"
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in module_aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.append(Import(source, module_aliases[node.value.id], (node.attr,), node.lineno))
    return found


def all_imports() -> list[Import]:
    return [imp for path in source_files() for imp in imports_of(path)]


def test_every_module_belongs_to_a_layer():
    unknown = sorted({package_of(module_name(p)) for p in source_files()} - set(LAYERS))
    assert not unknown, f"modules outside every layer of docs/ARCHITECTURE.md: {unknown}"


def test_imports_only_point_down():
    wrong = []
    for imp in all_imports():
        src, dst = package_of(imp.source), package_of(imp.target)
        if dst is None or src == dst or src not in LAYERS:
            continue
        if dst not in LAYERS or LAYERS[dst] >= LAYERS[src]:
            wrong.append(f"{imp.source}:{imp.line} ({src}, layer {LAYERS.get(src)}) imports {imp.target} "
                         f"({dst}, layer {LAYERS.get(dst)})")
    assert not wrong, "imports that do not point to a lower layer:\n" + "\n".join(wrong)


def test_no_private_name_crosses_a_package():
    wrong = []
    for imp in all_imports():
        src, dst = package_of(imp.source), package_of(imp.target)
        if dst is None or src == dst:
            continue
        private = [n for n in imp.names if n.startswith("_") and not n.startswith("__")]
        private_module = [p for p in imp.target.split(".") if p.startswith("_") and not p.startswith("__")]
        if private or private_module:
            wrong.append(f"{imp.source}:{imp.line} takes {', '.join(private) or imp.target} from {imp.target}")
    assert not wrong, "private names used from another package:\n" + "\n".join(wrong)


@pytest.mark.parametrize("text, expected", [
    ("from pipeline.stages.config import PipelineConfig", ("pipeline.stages.config", "PipelineConfig")),
    ("from ..modules import embedding", ("pipeline.modules", "embedding")),
])
def test_the_checker_reads_imports(tmp_path, monkeypatch, text, expected):
    """The checker itself: an absolute and a relative import are both seen, with their names."""
    folder = tmp_path / "pipeline" / "train"
    folder.mkdir(parents=True)
    (folder / "x.py").write_text(text + "\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    (imp, *_) = imports_of(folder / "x.py")
    assert (imp.target, imp.names[0]) == expected
    assert package_of(imp.source) == "train"


def test_the_checker_sees_an_upward_import(tmp_path, monkeypatch):
    """A lower layer importing a higher one (modules -> train) is reported."""
    folder = tmp_path / "pipeline" / "modules"
    folder.mkdir(parents=True)
    (folder / "x.py").write_text("def f():\n    from pipeline.train import loop\n    return loop._private\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    imps = imports_of(folder / "x.py")
    assert any(LAYERS[package_of(i.target)] > LAYERS[package_of(i.source)] for i in imps)
    assert any(i.names == ("_private",) for i in imps)
