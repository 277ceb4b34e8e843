"""Workflow: fit an operator graph on a Dask DataFrame, transform data, save and load it.

``fit`` computes the statistics of every stateful operator with Dask reductions, in phases (an
operator whose input comes out of another stateful operator waits for it, unless only a FillMissing and
element-wise operators lie between them, as under Normalize, and an operator that
needs a second pass, such as FillMissing's exact median of many distinct values, takes the next
phase too); the operators of one phase are computed together. ``transform`` maps partitions, and also takes
a plain pandas DataFrame: this is the serving entry point (raw request rows in, model features out;
unseen values -> OOV, missing -> the null code or the fill value)::

    workflow = Workflow.load("data/synthetic/workflow")
    features = workflow.transform(pandas_rows)      # a pandas DataFrame
    arrays = workflow.transform_columns(columns)    # the same, column name -> array, without DataFrames

A saved workflow is ``workflow.json`` (graph, operator parameters and statistics, a format
version) plus parquet vocabularies under ``ops/<node>/``; nothing is pickled, and loading checks
the version.

Example::

    cats = ["C1", "C2"] >> Categorify(freq_threshold=2)
    conts = ["I1"] >> FillMissing() >> Clip(min_value=0) >> LogOp() >> Normalize()
    workflow = Workflow(cats + conts + (["label"] >> Cast("float32")))
    train = workflow.fit_transform("raw/train")      # a Dask DataFrame, computed when written
    workflow.save("workflow/")
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from pipeline.errors import BadInputError, UserError
from pipeline.etl.blocks import BlockColumns
from pipeline.etl.column_schema import ColumnSchema
from pipeline.etl.frame_library import FRAME_LIBRARIES, read_parquet
from pipeline.etl.frames import as_arrow_lists, column_reader, frame_like, is_cudf
from pipeline.etl.graph import ColumnsLike, Node
from pipeline.etl.ops.base import REGISTRY, Operator
from pipeline.etl.progress import compute

WORKFLOW_FORMAT = "pipeline.etl.Workflow"
WORKFLOW_VERSION = 1


class WorkflowVersionError(UserError):
    """A saved workflow this code cannot use: another format version, or a corrupt or incomplete folder."""


class Workflow:
    """An operator graph, its fitted statistics, and the library it reads parquet with.

    The library (``"pandas"`` or ``"cudf"``) matters only when the workflow reads files itself;
    in-memory frames are transformed with their own library.
    """

    def __init__(self, output: ColumnsLike, library: str = "pandas"):
        if library not in FRAME_LIBRARIES:
            raise ValueError(f"library: expected one of {FRAME_LIBRARIES}, got {library!r}")
        self.output = Node.of(output)
        self.library = library
        self._nodes = list(self.output.walk())
        _refuse_shared_operators(self._nodes)
        self._inputs = self.output.raw_columns()

    @property
    def input_columns(self) -> list[str]:
        """The raw columns the workflow reads."""
        return list(self._inputs)

    @property
    def output_columns(self) -> list[str]:
        return list(self.output.output_columns)

    @property
    def fitted(self) -> bool:
        return all(n.op.fitted for n in self._nodes if n.op)

    @property
    def nodes(self) -> list[Node]:
        """The graph's nodes, each after its parents (the last: the output)."""
        return list(self._nodes)

    def operators(self) -> list[tuple[Operator, list[str]]]:
        """Each operator with the input columns it works on, in graph order."""
        return [(n.op, n.input_columns) for n in self._nodes if n.op]

    def output_schema(self, inputs: list[ColumnSchema]) -> list[ColumnSchema]:
        """The output columns' schema (tags, dtype, cardinality, ...) from the raw columns' ``inputs``.

        Each operator derives its outputs' schema from its inputs' and its fitted statistics, so
        the workflow must be fitted. ``pipeline.etl.column_schema.to_schema`` makes ``schema.json`` of it.
        """
        self._require_fitted()
        given = {c.name: c for c in inputs}
        missing = [c for c in self.input_columns if c not in given]
        if missing:
            raise ValueError(f"output_schema: the input schema lacks the columns {missing}")
        results: dict[int, list[ColumnSchema]] = {}
        for node in self._nodes:
            if node.is_selection:
                results[id(node)] = [given[name] for name in node.output_columns]
                continue
            by_name = {c.name: c for parent in node.parents for c in results[id(parent)]}
            columns = [by_name[name] for name in node.input_columns]
            results[id(node)] = node.op.compute_output_schema(columns) if node.op else columns
        return results[id(self.output)]

    def fit(self, data: Any, progress: str | bool = "off") -> Workflow:
        """Compute every operator's statistics from ``data`` (Dask or pandas DataFrame, or parquet path).

        Runs on the current Dask scheduler (a ``distributed.Client`` if one is active); ``progress`` is a
        mode of :mod:`pipeline.progress`.
        """
        if isinstance(data, pd.DataFrame):
            self._check_columns(data.columns, "the data to fit")
        ddf = self._as_dask(data)
        self._check_columns(ddf.columns, "the data to fit")
        pending = [n for n in self._nodes if n.op and n.op.stateful]
        for node in pending:
            node.op.start_fit()
        waiting: list[tuple[Node, Node, list[Operator], Any]] = []  # fitted before their fill: node, fill, chain, stats
        while pending:
            ready = [n for n in pending if all(a.op.fitted for a in n.walk() if a.op and a is not n)]
            early = [(n, *below) for n in pending if n not in ready and (below := _fill_below(n)) and below[0] in ready]
            lazy = [n.op.fit(self._lazy_input(ddf, n)) for n in ready]
            lazy += [n.op.fit_before_fill(self._lazy_input(ddf, fill), chain) for n, fill, chain in early]
            computed = _compute_by_kind(lazy, progress)
            for node, stats in zip(ready, computed):
                node.op.fit_finalize(stats)
            waiting += [(n, fill, chain, stats) for (n, fill, chain), stats in zip(early, computed[len(ready):])]
            for node, fill, chain, stats in [w for w in waiting if w[1].op.fitted]:
                node.op.fit_finalize_after_fill(stats, _filled(fill, chain))
            waiting = [w for w in waiting if not w[0].op.fitted]
            pending = [n for n in pending if not n.op.fitted and all(n is not w[0] for w in waiting)]
        return self

    def transform(self, data: Any) -> Any:
        """Transform a pandas DataFrame (returns pandas) or a Dask DataFrame / parquet path (returns Dask)."""
        self._require_fitted()
        if isinstance(data, pd.DataFrame):
            self._check_columns(data.columns, "the rows to transform")
            return _evaluate_pandas(data, self._nodes)
        if type(data).__module__.split(".")[0] == "cudf":
            self._check_columns(data.columns, "the rows to transform")
            return self.transform_partition(data, self.output)
        from dask import delayed

        ddf = self._as_dask(data)
        self._check_columns(ddf.columns, "the data to transform")
        ddf = ddf[self.input_columns]
        meta = self.transform_partition(ddf._meta, self.output)
        # One graph key holds the graph and its statistics: each worker receives it once, not once per task.
        graph = delayed(self.output, pure=False)
        return ddf.map_partitions(self.transform_partition, graph, meta=meta, enforce_metadata=False)

    def transform_columns(self, columns: Mapping[str, Any]) -> dict[str, Any]:
        """The serving path without a DataFrame: raw columns as arrays in, output columns as arrays out.

        ``columns`` maps each input column to an array of the same rows (numpy, or a pandas extension
        array such as ``pd.arrays.ArrowExtensionArray``: what a column of the frame would hold). The
        result is what :meth:`transform` gives for the frame of those columns, column by column, as
        numpy or extension arrays; a column passed through unchanged is the input array itself.
        ``columns`` given as :class:`~pipeline.etl.blocks.BlockColumns` (a request's columns kind by kind)
        stay in their blocks through the operators that compute many columns at once, and the result is a
        ``BlockColumns`` too (the same columns, by name).
        """
        self._require_fitted()
        self._check_columns(columns, "the columns to transform")
        if isinstance(columns, BlockColumns):
            values = _evaluate_columns(columns.select, columns.rows, self._nodes, blocks=True)
            return values if isinstance(values, BlockColumns) else BlockColumns([values])
        rows = len(next(iter(columns.values()))) if columns else 0
        values = _evaluate_columns(lambda names: {name: columns[name] for name in names}, rows, self._nodes)
        return {name: _values(column) for name, column in values.items()}

    def fit_transform(self, data: Any) -> Any:
        ddf = self._as_dask(data) if not isinstance(data, pd.DataFrame) else data
        return self.fit(ddf).transform(ddf)

    def _as_dask(self, data: Any) -> Any:
        import dask.dataframe as dd

        if isinstance(data, (str, Path, list)):
            return read_parquet(data, None, self.library)
        if isinstance(data, pd.DataFrame):
            return dd.from_pandas(_lists_as_arrow(data), npartitions=1)
        if hasattr(data, "map_partitions") and hasattr(data, "npartitions"):
            made_text = [name for name in _lists_made_text(data) if name in self._inputs]
            if made_text:
                raise BadInputError(
                    f"the Dask frame's column(s) {made_text} hold lists in the pandas frame it was made from, which "
                    "dask.dataframe.from_pandas turned into text (Dask's dataframe.convert-string): pass the pandas "
                    "frame itself, or make the Dask frame under dask.config.set({'dataframe.convert-string': False})")
            return data
        raise TypeError(f"expected a Dask or pandas DataFrame or a parquet path, got {type(data).__name__}")

    def _check_columns(self, columns: Any, what: str) -> None:
        names = list(columns)
        repeated = sorted({c for c in self._inputs if names.count(c) > 1})
        if repeated:
            raise BadInputError(f"{what}: the column(s) {repeated} appear more than once (columns {names}), so which one "
                                "holds the data is unclear: give each column its own name")
        present = set(columns)
        missing = [c for c in self._inputs if c not in present]
        if missing:
            raise BadInputError(
                f"{what}: expected the columns {self.input_columns}; missing {missing}; found {list(columns)}"
            )

    def _require_fitted(self) -> None:
        unfitted = [repr(n.op) for n in self._nodes if n.op and not n.op.fitted]
        if unfitted:
            raise RuntimeError(f"the workflow is not fitted ({', '.join(unfitted)}): call fit first")

    def _lazy_input(self, ddf: Any, node: Node) -> Any:
        if all(p.is_selection for p in node.parents):
            return ddf[node.input_columns]
        inputs = Node(node.parents)
        source = ddf[inputs.raw_columns()]
        meta = self.transform_partition(source._meta, inputs)
        return source.map_partitions(self.transform_partition, inputs, meta=meta, enforce_metadata=False)

    @staticmethod
    def transform_partition(df: Any, output: Node) -> Any:
        """Run the graph up to ``output`` on one partition (pandas or cuDF): what every Dask task runs.

        A cuDF partition's columns go through the graph as blocks (:func:`_evaluate_columns`): a chain of
        numeric operators passes one CuPy matrix along, and the frame is built once, at the end.
        """
        if is_cudf(df):
            values = _evaluate_columns(lambda names: {name: df[name] for name in names}, df.index,
                                       list(output.walk()), blocks=True, like=df)
            return frame_like(df, {name: values[name] for name in output.output_columns})
        results: dict[int, Any] = {}
        for node in output.walk():
            if node.is_selection:
                results[id(node)] = df[node.output_columns]
                continue
            if len(node.parents) == 1:
                frame = results[id(node.parents[0])]
            else:
                columns = {}
                for parent in node.parents:
                    frame = results[id(parent)]
                    for name in parent.output_columns:
                        columns[name] = frame[name]
                frame = frame_like(df, columns)
            results[id(node)] = node.op.transform(frame) if node.op else frame
        return results[id(output)]

    def save(self, path: str | Path) -> Path:
        """Write the fitted workflow to the folder ``path``: a new folder, an empty one, or one that holds a saved
        workflow, which is replaced (only once the new one is whole). Any other folder or file is refused."""
        self._require_fitted()
        path = _save_target(Path(path))
        ids = {id(n): i for i, n in enumerate(self._nodes)}
        nodes = []
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
        try:
            for i, node in enumerate(self._nodes):
                entry: dict[str, Any] = {"id": i, "parents": [ids[id(p)] for p in node.parents]}
                if node.is_selection:
                    entry["columns"] = node.output_columns
                elif node.op is not None:
                    directory = f"ops/{i}"
                    entry["op"] = {
                        "type": type(node.op).__name__,
                        "params": node.op.get_params(),
                        "state": node.op.get_state(),
                        "dir": directory,
                    }
                    node.op.save_artifacts(staging / directory)
                nodes.append(entry)
            record = {
                "format": WORKFLOW_FORMAT,
                "version": WORKFLOW_VERSION,
                "backend": self.library,
                "input_columns": self.input_columns,
                "output_columns": self.output_columns,
                "output": ids[id(self.output)],
                "nodes": nodes,
            }
            (staging / "workflow.json").write_text(json.dumps(record, indent=1, default=_json_value) + "\n")
            replaced = staging.with_name(staging.name + ".replaced")
            if path.exists():
                path.rename(replaced)
            staging.rename(path)
            shutil.rmtree(replaced, ignore_errors=True)
        finally:
            if staging.exists():
                shutil.rmtree(staging)
        return path

    @staticmethod
    def fingerprint(path: str | Path) -> str:
        """The sha256 of a saved workflow's files (their names and bytes): what tells the workflow that wrote an
        ETL output from one fitted again later, whatever columns and sizes they share."""
        path = Path(path)
        digest = hashlib.sha256()
        for file in sorted(p for p in path.rglob("*") if p.is_file()):
            digest.update(str(file.relative_to(path)).encode() + b"\0")
            with open(file, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
        return digest.hexdigest()

    @classmethod
    def load(cls, path: str | Path, library: str = "pandas") -> Workflow:
        """Read a workflow saved by :meth:`save` (on any library), to read files with ``library``.

        A record of another version, or a corrupt or incomplete folder (unparsable JSON, missing
        keys, a broken graph, a missing vocabulary file) raises :class:`WorkflowVersionError` naming it.
        """
        path = Path(path)
        record_path = path / "workflow.json"
        if not record_path.is_file():
            raise FileNotFoundError(f"no saved workflow at {path} (expected {record_path}): run the ETL first")
        again = "rerun the ETL to write it again"
        try:
            record = json.loads(record_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as err:
            raise WorkflowVersionError(f"{record_path} is not a readable workflow record ({err}); {again}") from None
        if not isinstance(record, dict):
            raise WorkflowVersionError(f"{record_path}: expected a JSON object, found {type(record).__name__}; {again}")
        if record.get("format") != WORKFLOW_FORMAT or record.get("version") != WORKFLOW_VERSION:
            raise WorkflowVersionError(
                f"{record_path}: expected {WORKFLOW_FORMAT} version {WORKFLOW_VERSION}, found "
                f"{record.get('format')} version {record.get('version')}; {again}"
            )
        missing = [k for k in ("input_columns", "output_columns", "output", "nodes") if k not in record]
        if missing:
            raise WorkflowVersionError(f"{record_path} is incomplete: it lacks {', '.join(missing)}; {again}")
        try:
            workflow = cls(_graph_of(record, path), library=library)
        except WorkflowVersionError:
            raise
        except (LookupError, TypeError, ValueError, AttributeError, OSError) as err:
            reason = (str(err).splitlines() or [""])[0]
            raise WorkflowVersionError(
                f"{record_path} or its files under {path} are corrupt or incomplete "
                f"({type(err).__name__}: {reason}); {again}") from None
        for key in ("input_columns", "output_columns"):
            if list(getattr(workflow, key)) != record[key]:
                raise WorkflowVersionError(f"{record_path}: the graph gives other {key.replace('_', ' ')} than the "
                                           f"record lists ({_short(getattr(workflow, key))}); {again}")
        try:  # no rows through every operator: a fitted state that lacks a column, or holds no number, fails here
            workflow.transform(pd.DataFrame({c: pd.Series([], dtype=object) for c in workflow.input_columns}))
        except (LookupError, TypeError, ValueError, AttributeError) as err:
            reason = (str(err).splitlines() or [""])[0]
            raise WorkflowVersionError(f"{record_path}: its operators' fitted state does not cover their columns "
                                       f"({type(err).__name__}: {reason}); {again}") from None
        return workflow

    def __repr__(self) -> str:
        lines = [f"  {_short(cols)} >> {op!r}" for op, cols in self.operators()]
        return "Workflow(\n" + "\n".join(lines) + f"\n) -> {_short(self.output_columns)}"


def _graph_of(record: dict, path: Path) -> Node:
    """The output node of a saved record's graph, each operator with its parameters and fitted state."""
    built: dict[int, Node] = {}
    for entry in record["nodes"]:
        parents = [built[i] for i in entry["parents"]]
        if "columns" in entry:
            built[entry["id"]] = Node(columns=entry["columns"])
        elif "op" in entry:
            spec = entry["op"]
            if spec["type"] not in REGISTRY:
                raise WorkflowVersionError(f"{path / 'workflow.json'}: unknown operator {spec['type']!r}")
            op = REGISTRY[spec["type"]](**spec["params"])
            op.set_state(spec["state"], path / spec["dir"])
            built[entry["id"]] = Node(parents, op=op)
        else:
            built[entry["id"]] = Node(parents)
    return built[record["output"]]


def _evaluate_pandas(df: pd.DataFrame, nodes: list[Node]) -> pd.DataFrame:
    """Run the graph on an in-memory pandas frame, column by column (the serving path).

    Same result as :meth:`Workflow.transform_partition` (the partition path), without a DataFrame per node:
    each column travels as an array (:func:`_evaluate_columns`), and one frame is built at the end.
    """
    # A copy, as the partition path gives: without copy-on-write (pandas 2), a column passed
    # through would otherwise share its memory with the caller's frame.
    read = column_reader(df)
    return _frame(_evaluate_columns(lambda names: {name: read(name) for name in names}, df.index, nodes), df.index,
                  copy=True)


def _evaluate_columns(select: Callable[[list[str]], Mapping[str, Any]], index: pd.Index | int, nodes: list[Node],
                      blocks: bool = False, like: Any = None) -> Mapping[str, Any]:
    """The output columns of the graph, from ``select(names)``, the raw columns ``names`` as arrays by name.

    A column-by-column operator gets all its input arrays at once (``transform_many``, which runs
    ``transform_column`` on each unless the operator computes them together); any other operator gets
    a frame of its input columns (on ``index``; on 0..n-1 where it is a number of rows) and its own
    ``transform``. With ``blocks``, the columns of a node with one parent are that parent's columns as they are,
    and a union keeps its parents' blocks side by side (:class:`~pipeline.etl.blocks.BlockColumns`). With ``like``
    (a cuDF frame), an operator that takes a frame gets one of ``like``'s library and index.
    """
    results: dict[int, Mapping[str, Any]] = {}
    for node in nodes:
        if node.is_selection:
            results[id(node)] = select(node.output_columns)
            continue
        if blocks and len(node.parents) == 1:
            inputs = results[id(node.parents[0])]
        elif blocks and node.op is None:
            inputs = BlockColumns([results[id(parent)] for parent in node.parents])
        else:
            inputs = {}
            for parent in node.parents:
                columns = results[id(parent)]
                for name in parent.output_columns:
                    inputs[name] = columns[name]
        if like is not None and node.op is not None and not node.op.takes_rows and not isinstance(inputs, dict):
            inputs = _as_series(like, inputs)
        if node.op is None:
            results[id(node)] = inputs
        elif node.op.columnwise:
            results[id(node)] = node.op.transform_many(inputs)
        else:
            out = node.op.transform(_frame(inputs, index) if like is None else frame_like(like, inputs))
            results[id(node)] = {name: _values(out[name]) for name in out.columns}
    return results[id(nodes[-1])]


def _as_series(like: Any, columns: Mapping[str, Any]) -> dict[str, Any]:
    """Columns of blocks (rows of a CuPy matrix among them) as Series of the cuDF frame ``like``, for an operator
    that takes Series only."""
    frame = frame_like(like, columns)
    return {name: frame[name] for name in frame.columns}


def _frame(columns: Mapping[str, Any], index: pd.Index | int, copy: bool = False) -> pd.DataFrame:
    index = index if isinstance(index, pd.Index) else pd.RangeIndex(index)
    return pd.DataFrame({name: _values(v) for name, v in columns.items()}, index=index, copy=copy)


def _values(column: Any) -> Any:
    """The array behind a Series (numpy for numpy dtypes, else the extension array); arrays as they are."""
    if isinstance(column, pd.Series):
        return column.array if isinstance(column.dtype, pd.api.extensions.ExtensionDtype) else column.to_numpy()
    return column


def _lists_as_arrow(df: pd.DataFrame) -> pd.DataFrame:
    """Object columns of lists as arrow list columns, which Dask keeps as lists (it turns objects into text)."""
    converted = {name: pd.Series(pd.arrays.ArrowExtensionArray(as_arrow_lists(df[name])), index=df.index)
                 for name in df.columns if _holds_lists(df[name])}
    return df.assign(**converted) if converted else df


def _lists_made_text(ddf: Any) -> list[str]:
    """The columns of the pandas frames a Dask frame was made from (``dd.from_pandas``, with Dask's
    ``dataframe.convert-string`` on) that hold lists: Dask turns them into text like ``"[1, 2]"``, and a multi-hot
    column then became one category a row, silently. Read from the Dask expression; none where its form differs."""
    names: list[str] = []
    for node in getattr(getattr(ddf, "expr", None), "walk", list)():
        if type(node).__name__ != "FromPandas":
            continue
        try:
            original, converts = node.frame._data, node.operand("pyarrow_strings_enabled")
        except (AttributeError, KeyError, ValueError):
            continue
        if converts and isinstance(original, pd.DataFrame):
            names += [name for name in original.columns if _holds_lists(original[name])]
    return names


def _holds_lists(column: Any) -> bool:
    if not isinstance(column, pd.Series) or column.dtype != object:  # a name given twice selects a frame
        return False
    sample = column.dropna()
    return bool(len(sample)) and isinstance(sample.iloc[0], (list, tuple, np.ndarray))


def _fill_below(node: Node) -> tuple[Node, list[Operator]] | None:
    """Where ``node``'s operator can be fitted in the same phase as a ``FillMissing`` below it: that fill's node and
    the element-wise operators between them (in order), when ``node`` takes the fill's columns through them alone
    (as ``FillMissing >> Clip >> LogOp >> Normalize``); else None.

    A statistic of values that pass through element-wise operators after a fill is the statistic of the present
    values plus what the fill's value, through the same operators, adds for each missing one: it needs the fill's
    value only at the end (:meth:`~pipeline.etl.ops.continuous.Normalize.fit_before_fill`), so the data is not read
    again in a phase of its own."""
    if not hasattr(node.op, "fit_before_fill") or len(node.parents) != 1:
        return None
    chain, below = [], node.parents[0]
    while below.op is not None and getattr(below.op, "elementwise", False) and len(below.parents) == 1:
        chain.append(below.op)
        below = below.parents[0]
    if not hasattr(below.op, "fill_of") or len(below.parents) != 1 or below.input_columns != node.input_columns:
        return None
    return below, chain[::-1]


def _filled(fill: Node, chain: list[Operator]) -> dict[str, float]:
    """What a missing value of each of ``fill``'s columns becomes: filled, then through ``chain``."""
    names = fill.input_columns
    rows = np.array([[fill.op.fill_of(name)] for name in names], dtype=np.float64)
    for op in chain:
        rows = op.transform_rows(names, rows)
    return {name: float(rows[k, 0]) for k, name in enumerate(names)}


def _compute_by_kind(lazy: list, progress: str | bool) -> list:
    """Compute statistics built from Dask DataFrame expressions and from ``dask.delayed`` separately.

    Dask warns (and materializes the expressions) when both kinds are computed together.
    """
    from dask.delayed import Delayed

    def is_delayed(value: Any) -> bool:
        if isinstance(value, dict):
            return any(is_delayed(v) for v in value.values())
        return isinstance(value, Delayed)

    lazy = [_on_host(value) for value in lazy]
    results: list = [None] * len(lazy)
    for delayed_kind in (False, True):
        picked = [i for i, value in enumerate(lazy) if is_delayed(value) == delayed_kind]
        if picked:
            values = compute(*[lazy[i] for i in picked], desc="fit statistics", progress=progress)
            for i, value in zip(picked, values):
                results[i] = value
    return results


def _on_host(value: Any) -> Any:
    """Statistics as pandas objects, converted where they are computed (on the workers).

    cuDF results travelling to the client would need the workers' cuDF spill manager there too
    (a LocalCUDACluster spills cuDF buffers); the statistics are small, so they come back as pandas.
    """
    if isinstance(value, dict):
        return {k: _on_host(v) for k, v in value.items()}
    meta = getattr(value, "_meta", None)
    if meta is not None and is_cudf(meta) and hasattr(value, "to_backend"):
        return value.to_backend("pandas")
    return value


def _short(columns: list[str]) -> str:
    return str(columns) if len(columns) <= 4 else f"[{columns[0]}, {columns[1]}, ... {columns[-1]}] ({len(columns)})"


def _save_target(path: Path) -> Path:
    """``path`` made absolute, once it is known that saving there replaces nothing but a saved workflow."""
    path = path.expanduser().absolute()
    if path.exists():
        holds_workflow = (path / "workflow.json").is_file()
        if not path.is_dir() or not (holds_workflow or not any(path.iterdir())):
            what = "a file" if not path.is_dir() else "a folder that does not hold a saved workflow (no workflow.json)"
            raise BadInputError(f"{path} is {what}; saving a workflow replaces its folder: name a new folder, an empty "
                                "one or one of a saved workflow")
        if Path.cwd().resolve().is_relative_to(path.resolve()):
            raise BadInputError(f"{path} is the current folder or holds it; a saved workflow replaces its folder: name "
                                "a folder below it")
    return path


def _json_value(value: Any) -> Any:
    """An operator's parameter or statistic given as a numpy value (``np.int64(3)``, ``np.float32``, a dtype) as the
    JSON value it stands for."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (np.dtype, type)):
        try:
            return np.dtype(value).name
        except TypeError:
            pass
    raise TypeError(f"a workflow's operators keep JSON values; found {value!r} ({type(value).__name__})")


def _refuse_shared_operators(nodes: list[Node]) -> None:
    """One operator object on two nodes would keep the statistics of only one of them (each node's fit sets them)."""
    seen: dict[int, Node] = {}
    for node in nodes:
        if node.op is not None:
            first = seen.setdefault(id(node.op), node)
            if first is not node:
                name = type(node.op).__name__
                raise ValueError(f"one {name} object works on two parts of the graph ({first.input_columns} and "
                                 f"{node.input_columns}): give each its own {name}(...), or apply it once to both "
                                 "column lists joined")
