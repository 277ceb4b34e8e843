"""Categorify: categorical values (and multi-hot lists of them) to contiguous int32 codes.

Reserved codes: 0 = missing, 1 = out of vocabulary (unseen at fit, rarer than ``freq_threshold``,
or beyond ``max_vocab_size``), 2.. = the vocabulary by descending frequency, ties broken by the
value (ascending, UTF-8 byte order), so the same data always gives the same codes. The embedding table of a column
therefore has ``len(vocabulary) + 2`` rows. Vocabularies are saved as parquet (value, count).

Multi-hot columns (lists of values) share the same scheme per element; a missing list becomes an
empty list and a missing element becomes 0.

On cuDF the values are counted and looked up by 64-bit keys of their text, each checked against the
text (:mod:`pipeline.etl.ops.keyed`): the counts of all columns of a partition come from one sort, the
codes from a binary search of the vocabulary's sorted keys, with the same vocabularies and codes as on
pandas, where string columns are read as Arrow dictionaries and only their distinct values are worked on.

A pandas partition's column is looked up with Arrow's ``index_in``, which hashes the vocabulary at each call.
The serving path (``transform_many``: a request's columns, or a small frame's) instead keeps one index of all the
operator's vocabularies between calls (:mod:`pipeline.etl.ops.text_lookup`: 64-bit keys of each value's column and
bytes, built on first use) and finds every value of all its columns in one pass, straight from the request's
fixed-width bytes where they come so.

Example::

    ["C1", "C2"] >> Categorify(freq_threshold=3, max_vocab_size=100_000)
"""

from __future__ import annotations

import threading
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.etl.blocks import BlockColumns, ColumnBytes, ColumnRows, ColumnSlices
from pipeline.etl.column_schema import CATEGORICAL
from pipeline.etl.frames import (
    as_arrow_lists,
    as_arrow_strings,
    cudf_map_lists,
    cudf_strings,
    empty_series,
    is_cudf,
    list_lengths,
    lists_from_flat,
    longest_list,
    looks_multihot,
)
from pipeline.etl.ops.base import Operator
from pipeline.etl.ops.keyed import KeyTable, count_columns, key_table, look_up_codes, merge_columns
from pipeline.etl.ops.text_lookup import TextWords, VocabularyIndex

NULL_INDEX = 0
OOV_INDEX = 1
RESERVED = 2
_SINGLE_REDUCTION_PARTITIONS = 64
_INDEXED_VALUES = 1 << 20
"""``transform_many`` finds up to this many values (rows times columns) in one pass of the index; more (a large
frame's) go column by column through Arrow's ``index_in``, whose memory is one column's."""


class Categorify(Operator):
    """Map each value to its vocabulary code (see the module docstring for the reserved codes).

    ``freq_threshold``: values seen fewer times at fit go to OOV (0 or 1 keeps all).
    ``max_vocab_size``: keep only the most frequent values (0 keeps all).
    ``split_out``: partitions of the value counts while reducing; ``None`` lets the size decide
    (one tree reduction up to 64 input partitions, a shuffle over several partitions beyond, so no
    single worker holds all counts before the threshold is applied; on cuDF always one tree: a GPU
    holds large vocabularies).
    """

    stateful = True
    output_tags = frozenset({CATEGORICAL})
    output_dtype = "int32"

    def __init__(self, freq_threshold: int = 0, max_vocab_size: int = 0, split_out: int | None = None):
        if freq_threshold < 0 or max_vocab_size < 0:
            raise ValueError("Categorify: freq_threshold and max_vocab_size must be >= 0")
        self.freq_threshold = int(freq_threshold)
        self.max_vocab_size = int(max_vocab_size)
        self.split_out = split_out
        self.vocabularies: dict[str, pa.Array] = {}
        self.vocabulary_ids: dict[str, str] = {}
        """A new id each time a column's vocabulary is set; copies of the operator (Dask's tasks) share it, so a
        worker keeps what it builds from a vocabulary (its GPU key table) for the tasks after (:func:`_key_table`)."""
        self.counts: dict[str, np.ndarray] = {}
        self.multihot: dict[str, bool] = {}
        self.max_lengths: dict[str, int] = {}

    def values_ending_in_zero_byte(self) -> dict[str, list[str]]:
        """The vocabulary's values that end in a zero byte, by column: a served request's text tensor pads values
        with zero bytes, so it cannot carry them (the client refuses them)."""
        self._require_fitted()
        found = {}
        for name, vocab in self.vocabularies.items():
            ending = pc.fill_null(pc.ends_with(vocab, "\x00"), False)
            if pc.any(ending).as_py():
                found[name] = vocab.filter(ending).to_pylist()
        return found

    def cardinality(self, column: str) -> int:
        """Embedding table size of ``column``: vocabulary plus the reserved codes."""
        self._require_fitted()
        return len(self.vocabularies[column]) + RESERVED

    def column_properties(self, name: str) -> dict:
        multihot = self.multihot[name]
        return {"cardinality": self.cardinality(name), "is_list": multihot,
                "max_length": self.max_lengths[name] if multihot else 0}

    def fit(self, ddf: Any) -> Any:
        multihot = {name: looks_multihot(ddf[name]) for name in ddf.columns}
        gpu = is_cudf(ddf._meta)
        # cuDF: one tree unless split_out is given (a shuffle of cuDF partitions depends on the
        # shuffle method Dask picks, p2p or tasks).
        split_out = self.split_out or (1 if gpu or ddf.npartitions <= _SINGLE_REDUCTION_PARTITIONS else True)
        if split_out == 1:
            return _tree_counts(ddf, multihot)
        # Dask's value_counts with a shuffle (cuDF: of cuDF strings, on the GPU).
        strings = empty_series(ddf._meta, "str")
        stats = {}
        for name in ddf.columns:
            column = ddf[name]
            if multihot[name]:
                values = column.map_partitions(_flat_strings, meta=strings)
                longest = column.map_partitions(longest_list, meta=empty_series(ddf._meta, "int64")).max()
                stats[name] = {"counts": values.value_counts(sort=False, split_out=split_out), "max_length": longest}
            else:
                values = column.map_partitions(_plain_strings, meta=strings)
                stats[name] = {"counts": values.value_counts(sort=False, split_out=split_out)}
        return stats

    def fit_finalize(self, stats: Any) -> None:
        for name, stat in stats.items():
            counts = stat["counts"]
            if isinstance(counts, pa.Table):
                table = counts
            else:
                counts = counts.to_pandas() if is_cudf(counts) else counts
                values = as_arrow_strings(pd.Series(counts.index, name=name))
                table = pa.table({"value": values, "count": pa.array(counts.to_numpy(dtype="int64"))})
            self._keep(name, table)
            self.multihot[name] = "max_length" in stat
            if self.multihot[name]:
                self.max_lengths[name] = int(stat["max_length"]) if pd.notna(stat["max_length"]) else 0
        self._fitted = True

    def _keep(self, name: str, table: pa.Table) -> None:
        table = table.filter(pc.is_valid(table["value"]))
        if table.num_rows and pc.count_distinct(table["value"]).as_py() != table.num_rows:
            table = table.group_by("value").aggregate([("count", "sum")]).rename_columns(["value", "count"])
        if self.freq_threshold > 1:
            table = table.filter(pc.greater_equal(table["count"], self.freq_threshold))
        order = pc.sort_indices(table, sort_keys=[("count", "descending"), ("value", "ascending")])
        table = table.take(order)
        if self.max_vocab_size:
            table = table.slice(0, self.max_vocab_size)
        self._set_vocabulary(name, table)

    def _set_vocabulary(self, name: str, table: pa.Table) -> None:
        self.vocabularies[name] = table["value"].combine_chunks().cast(pa.string())
        self.vocabulary_ids[name] = uuid.uuid4().hex
        self.counts[name] = table["count"].to_numpy()
        self.__dict__.pop("_index", None)

    def transform_column(self, name: str, values: Any) -> Any:
        self._require_fitted()
        vocab = self.vocabularies[name]
        if is_cudf(values):
            return _encode_cudf(values, vocab, self.multihot[name], self.vocabulary_ids[name])
        if self.multihot[name]:
            return _encode_lists(values, vocab, name)
        return _encode(as_arrow_strings(values, keep_dictionary=True, name=name), vocab)

    def transform_many(self, columns: Mapping[str, Any]) -> Mapping[str, Any]:
        """The codes of several columns of the same rows, what :meth:`transform_column` gives each, all their values
        found in one pass of the operator's :class:`~pipeline.etl.ops.text_lookup.VocabularyIndex` (up to
        :data:`_INDEXED_VALUES` values; more, as from a large frame, go column by column through Arrow's
        ``index_in``). Blocks stay blocks (:meth:`_block`)."""
        self._require_fitted()
        if isinstance(columns, BlockColumns):  # each block as it is (text and lists apart)
            return BlockColumns([self.transform_many(block) for block in columns.blocks])
        if isinstance(columns, ColumnSlices):
            found = self._block(columns)
            if found is not None:
                return found
        elif not columns or is_cudf(next(iter(columns.values()))):  # the columns of one frame: one library
            return super().transform_many(columns)
        names = list(columns)
        rows = len(next(iter(columns.values())))
        if rows * len(names) > _INDEXED_VALUES:
            return super().transform_many(columns)
        codes, strings = {}, {}
        for name in names:
            if self.multihot[name]:
                lists = as_arrow_lists(columns[name], name)
                flat = pc.list_flatten(lists)
                flat = self._indexed([name], TextWords.of_arrow(flat), len(flat))
                codes[name] = lists_from_flat(flat, list_lengths(lists), getattr(columns[name], "index", None))
                continue
            values = as_arrow_strings(columns[name], keep_dictionary=True, name=name)
            if pa.types.is_dictionary(values.type):
                codes[name] = _encode(values, self.vocabularies[name], lambda dictionary, name=name: self._indexed(
                    [name], TextWords.of_arrow(dictionary), len(dictionary)))
            else:
                strings[name] = values
        if strings:
            kinds = {values.type for values in strings.values()}
            values = pa.concat_arrays([v if len(kinds) == 1 else v.cast(pa.large_string()) for v in strings.values()])
            found = self._indexed(list(strings), TextWords.of_arrow(values), rows).reshape(len(strings), rows)
            codes.update(zip(strings, found))
        return {name: codes[name] for name in names}

    def _block(self, block: ColumnSlices) -> Mapping[str, Any] | None:
        """The codes of a block in one pass: of text columns (Arrow strings, or a request's fixed-width bytes,
        :class:`~pipeline.etl.blocks.ColumnBytes`) as the rows of one matrix (:class:`~pipeline.etl.blocks.ColumnRows`),
        of multi-hot columns as one Arrow array of lists; None for any other block, or one too large."""
        names, rows = list(block), block.rows
        if rows * len(names) > _INDEXED_VALUES:
            return None
        multihot = [self.multihot[name] for name in names]
        if not any(multihot) and (isinstance(block, ColumnBytes) or pa.types.is_string(block.array.type)):
            text = (TextWords.of_fixed_width(block.fixed_width) if isinstance(block, ColumnBytes)
                    else TextWords.of_arrow(block.array))
            return ColumnRows(names, self._indexed(names, text, rows).reshape(len(names), rows))
        kind = block.array.type
        if pa.types.is_list(kind) and pa.types.is_string(kind.value_type) and all(multihot):
            lengths = list_lengths(block.array)
            each = lengths.reshape(len(names), rows).sum(axis=1)
            codes = self._indexed(names, TextWords.of_arrow(pc.list_flatten(block.array)), each)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            return ColumnSlices(names, pa.ListArray.from_arrays(pa.array(offsets), pa.array(codes)), rows)
        return None

    def index(self) -> VocabularyIndex:
        """The index of all the operator's vocabularies: built on first use, dropped whenever a vocabulary is set."""
        self._require_fitted()
        index = self.__dict__.get("_index")
        if index is None:
            index = self._index = VocabularyIndex(self.vocabularies)
        return index

    def _indexed(self, names: list[str], values: TextWords, each: Any) -> np.ndarray:
        """int32 codes of ``values``, those of the columns ``names`` one after the other: ``each[k]`` values of the
        k-th column (one number: as many of each)."""
        return self.index().positions(values, names, each, RESERVED, OOV_INDEX, NULL_INDEX).astype(np.int32)

    def __getstate__(self) -> dict:
        """Without the index (:meth:`_indexed`): a copy sent to a Dask worker builds its own when it needs one."""
        return {key: value for key, value in self.__dict__.items() if key != "_index"}

    def get_params(self) -> dict:
        return {"freq_threshold": self.freq_threshold, "max_vocab_size": self.max_vocab_size, "split_out": self.split_out}

    def get_state(self) -> dict:
        return {
            "columns": {
                name: {
                    "file": _vocab_file(index, name),
                    "size": len(vocab),
                    "multihot": self.multihot[name],
                    "max_length": self.max_lengths.get(name, 0),
                }
                for index, (name, vocab) in enumerate(self.vocabularies.items())
            }
        }

    def save_artifacts(self, directory: Path) -> None:
        for index, (name, vocab) in enumerate(self.vocabularies.items()):
            path = directory / _vocab_file(index, name)
            path.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(pa.table({"value": vocab, "count": pa.array(self.counts[name])}), path)

    def set_state(self, state: dict, directory: Path) -> None:
        for name, info in state["columns"].items():
            table = pq.read_table(directory / info["file"])
            if table.num_rows != info["size"]:
                raise ValueError(f"vocabulary of {name}: expected {info['size']} values, the file has {table.num_rows}")
            self._set_vocabulary(name, table)
            self.multihot[name] = info["multihot"]
            if info["multihot"]:
                self.max_lengths[name] = info["max_length"]
        self._fitted = True


def _encode(values: pa.Array, vocab: pa.Array,
            indexed: Callable[[pa.Array], np.ndarray] | None = None) -> np.ndarray:
    """int32 codes of a string (or dictionary of strings) array: found by ``indexed`` (the operator's index) where
    given, else by Arrow's ``index_in`` (which hashes the vocabulary at each call: the way of a large partition)."""
    if pa.types.is_dictionary(values.type):
        per_value = _encode(values.dictionary, vocab, indexed)
        indices = values.indices
        codes = per_value[pc.fill_null(indices, 0).to_numpy(zero_copy_only=False)] if len(per_value) else np.zeros(len(values), np.int32)
        if indices.null_count:
            codes[indices.is_null().to_numpy(zero_copy_only=False)] = NULL_INDEX
        return codes
    if indexed is not None:
        return indexed(values)
    # Finished in numpy: fewer Arrow calls, which dominate on a few rows.
    codes = pc.fill_null(pc.index_in(values, value_set=vocab), -1).to_numpy(zero_copy_only=False) + RESERVED
    codes[codes < RESERVED] = OOV_INDEX
    if values.null_count:
        codes[values.is_null().to_numpy(zero_copy_only=False)] = NULL_INDEX
    return codes.astype(np.int32, copy=False)


def _encode_lists(values: Any, vocab: pa.Array, name: str | None = None) -> pd.Series:
    """Codes of a multi-hot pandas column (Series or array), as a Series of list<int32> cells."""
    lists = as_arrow_lists(values, name)
    return lists_from_flat(_encode(pc.list_flatten(lists), vocab), list_lengths(lists), getattr(values, "index", None))


def _encode_cudf(series: Any, vocab: pa.Array, multihot: bool, vocab_id: str) -> Any:
    """The cuDF path: codes from the vocabulary's sorted 64-bit keys on the GPU (:func:`_keyed_codes`; ``vocab_id``:
    the operator's id of the vocabulary, under which a worker keeps its key table).

    The values become the same text as on pandas (:func:`cudf_strings`). Multi-hot lists: their
    leaves are coded the same way and put back into lists of the same lengths on the GPU, a missing
    list becoming an empty one (as on pandas); a column whose missing lists still hold values (libcudf
    builds none) goes through host memory and the pandas code.
    """
    import cudf

    if not multihot:
        return cudf.Series(_keyed_codes(cudf_strings(series), vocab, vocab_id), index=series.index, name=series.name)
    return cudf_map_lists(series, lambda leaves: _keyed_codes(cudf_strings(leaves), vocab, vocab_id),
                          lambda host: _encode_lists(host, vocab))


def _keyed_codes(strings: Any, vocab: pa.Array, vocab_id: str) -> Any:
    """int32 codes of a Series of strings (cuDF or pandas) found through the vocabulary's keys
    (:func:`keyed.look_up_codes`), as an array of the Series' library; a vocabulary holding two values of one
    key is looked up by its strings instead. No rows (Dask's metadata, an empty partition) need no key table: Dask's
    client would otherwise build every vocabulary's on its own GPU before each transform's first task."""
    if not len(strings):
        if is_cudf(strings):
            import cupy

            return cupy.zeros(0, dtype=cupy.int32)
        return np.zeros(0, dtype=np.int32)
    table = _key_table(vocab, strings, vocab_id)
    if not table.exact:
        return _codes_by_strings(strings, vocab)
    return look_up_codes(table, strings, RESERVED, OOV_INDEX, NULL_INDEX)


def _codes_by_strings(strings: Any, vocab: pa.Array) -> Any:
    """int32 codes of a Series of strings through the strings themselves: on cuDF a hash join of the values
    with the vocabulary ``(value, code)``, the codes scattered by row number (a join does not keep the row
    order, and a scatter costs less than a sort); on pandas :func:`_encode`."""
    if not is_cudf(strings):
        return _encode(as_arrow_strings(strings), vocab)
    import cudf
    import cupy

    values = strings.reset_index(drop=True)
    rows = cudf.DataFrame({"value": values, "row": cupy.arange(len(values), dtype="int32")})
    found = rows.merge(_gpu_vocabulary(vocab, values.dtype), on="value", how="inner")
    codes = cupy.full(len(values), OOV_INDEX, dtype="int32")
    codes[found["row"].values] = found["code"].values
    codes[values.isna().values] = NULL_INDEX
    return codes


def _per_vocabulary(cache: dict, vocab: pa.Array, build: Callable[[], Any], variant: Any = None) -> Any:
    """``build()`` for ``vocab`` (and ``variant``), made on first use and kept in ``cache`` while
    ``vocab`` lives: a worker holds the fitted operator, so every partition after the first reuses it."""
    key = (id(vocab), variant)
    value = cache.get(key)
    if value is None:
        value = cache[key] = build()
        weakref.finalize(vocab, cache.pop, key, None)
    return value


_GPU_VOCABULARIES: dict[tuple, Any] = {}


def _gpu_vocabulary(vocab: pa.Array, dtype: Any) -> Any:
    """The cuDF frame ``(value, code)`` of a vocabulary, its values of the strings' ``dtype``, on the GPU."""
    import cudf
    import cupy

    return _per_vocabulary(_GPU_VOCABULARIES, vocab, lambda: cudf.DataFrame({
        "value": cudf.Series.from_arrow(vocab.cast(pa.string())).astype(dtype),
        "code": cupy.arange(RESERVED, RESERVED + len(vocab), dtype="int32"),
    }), variant=str(dtype))


class _KeyTablesById:
    """Key tables by vocabulary id (:attr:`Categorify.vocabulary_ids`), the most recently used kept while all of them
    take at most ``budget`` bytes (one is always kept). A Dask task gets its own copy of the operator, vocabularies
    included, so a table kept with the copy (as :func:`_per_vocabulary` keeps it) would be built again for every
    partition and every split: hashing and sorting each vocabulary and checking its keys, a few calls and
    synchronisations a column for each task."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.tables: OrderedDict[tuple, KeyTable] = OrderedDict()
        self.held = 0
        self._lock = threading.Lock()  # a worker of several threads (etl.gpu_threads) codes partitions at once

    def get(self, key: tuple, build: Callable[[], KeyTable]) -> KeyTable:
        with self._lock:
            table = self.tables.get(key)
            if table is not None:
                self.tables.move_to_end(key)
                return table
        table = build()
        with self._lock:
            if key not in self.tables:
                self.tables[key] = table
                self.held += _table_bytes(table)
            while self.held > self.budget and len(self.tables) > 1:
                _, gone = self.tables.popitem(last=False)
                self.held -= _table_bytes(gone)
        return table


def _table_bytes(table: KeyTable) -> int:
    return int(table.keys.nbytes + table.checks.nbytes + table.positions.nbytes)


KEY_TABLE_BYTES = 2 << 30
"""What a process keeps of vocabularies' key tables between tasks (24 bytes a value: 2 GiB hold about 90M values);
beyond it the least recently used are built again when next needed."""

_KEY_TABLES_BY_ID = _KeyTablesById(KEY_TABLE_BYTES)


def _key_table(vocab: pa.Array, like: Any, vocab_id: str) -> KeyTable:
    """The :class:`~pipeline.etl.ops.keyed.KeyTable` of a vocabulary in the library (and string dtype) of
    the Series ``like``: on the GPU for cuDF, built on first use and kept under the vocabulary's id
    (:class:`_KeyTablesById`)."""
    return _KEY_TABLES_BY_ID.get((vocab_id, type(like).__module__, str(like.dtype)),
                                 lambda: key_table(_vocabulary_series(vocab, like)))


def _vocabulary_series(vocab: pa.Array, like: Any) -> Any:
    """A vocabulary as a Series of strings of the library (and string dtype) of the Series ``like``."""
    if is_cudf(like):
        import cudf

        return cudf.Series.from_arrow(vocab.cast(pa.string())).astype(like.dtype)
    return pd.Series(pd.arrays.ArrowExtensionArray(vocab.cast(pa.string())))


def _tree_counts(ddf: Any, multihot: dict[str, bool], split_every: int = 8) -> dict:
    """Value counts of every column in one pass per partition, merged by a tree.

    Each partition is read once for all columns and counted (Arrow on pandas partitions, by key on
    the GPU). On pandas each column then has its own tree of merges, so that different columns' vocabularies
    end on different workers; on the GPU (one worker a GPU) each merge takes all columns in one sort
    (:func:`~pipeline.etl.ops.keyed.merge_columns`), a task where pandas has one a column. The root of each
    tree is an Arrow table (cuDF counts leave the GPU there, all columns in one copy).
    Selecting columns with ``ddf[name]`` instead would read every partition once per column.
    """
    from dask import delayed

    names = list(ddf.columns)
    chunks = [delayed(_count_partition, pure=True)(part, names, multihot) for part in ddf.to_delayed()]
    if not chunks:
        return {name: {"counts": _counts_table(pa.array([], pa.string()))} for name in names}
    if is_cudf(ddf._meta):
        level = chunks
        while len(level) > 1:
            level = [delayed(_merge_partitions, pure=True)(*level[i : i + split_every])
                     for i in range(0, len(level), split_every)]
        root = delayed(_all_counts_to_arrow, pure=True)(level[0])
        return {name: root[name] for name in names}
    stats = {}
    for name in names:
        level = [chunk[name] for chunk in chunks]
        while len(level) > 1:
            level = [delayed(_merge_counts, pure=True)(*level[i : i + split_every]) for i in range(0, len(level), split_every)]
        stats[name] = level[0]
    return stats


def _count_partition(df: Any, names: list[str], multihot: dict[str, bool]) -> dict:
    if is_cudf(df):
        return _count_partition_keyed(df, names, multihot)
    out = {}
    for name in names:
        if multihot[name]:
            lists = as_arrow_lists(df[name])
            out[name] = {"counts": _counts_table(pc.list_flatten(lists)), "max_length": int(list_lengths(lists).max(initial=0))}
        else:
            out[name] = {"counts": _counts_table(as_arrow_strings(df[name], keep_dictionary=True))}
    return out


def _count_partition_keyed(df: Any, names: list[str], multihot: dict[str, bool]) -> dict:
    """Counts of the values' text (what the pandas path counts, :func:`_plain_strings`), multi-hot leaves
    too, of every column in one :class:`~pipeline.etl.ops.keyed.ColumnCounts` (one sort of all columns' keys,
    :func:`keyed.count_columns`), with the longest list of each multi-hot column: the cuDF path, which runs on
    pandas frames too."""
    strings = [(_flat_strings if multihot[name] else _plain_strings)(df[name]) for name in names]
    return {"names": names, "counts": count_columns(strings),
            "max_length": {name: int(longest_list(df[name]).iloc[0]) for name in names if multihot[name]}}


def _counts_table(values: pa.Array) -> pa.Table:
    counted = pc.value_counts(values)
    table = pa.table({"value": counted.field("values").cast(pa.string()), "count": counted.field("counts").cast(pa.int64())})
    return table.filter(pc.is_valid(table["value"]))


def _merge_counts(*parts: dict) -> dict:
    """One column's Arrow counts of several partitions merged (the pandas path)."""
    # combine_chunks copies into fresh buffers: tables that travelled between workers may be unaligned for Acero.
    table = pa.concat_tables([p["counts"] for p in parts]).combine_chunks()
    merged = {"counts": table.group_by("value").aggregate([("count", "sum")]).rename_columns(["value", "count"])}
    if "max_length" in parts[0]:
        merged["max_length"] = max(p["max_length"] for p in parts)
    return merged


def _merge_partitions(*parts: dict) -> dict:
    """The counts of :func:`_count_partition_keyed` of several partitions merged, all columns in one sort."""
    return {"names": parts[0]["names"], "counts": merge_columns([part["counts"] for part in parts]),
            "max_length": {name: max(part["max_length"][name] for part in parts) for name in parts[0]["max_length"]}}


def _all_counts_to_arrow(stats: dict) -> dict:
    """Each column's statistics (:meth:`Categorify.fit_finalize`) from :func:`_count_partition_keyed`'s (merged): the
    counts leave the GPU here, all columns in one copy, each an Arrow table ``(value: string, count: int64)``."""
    counts = stats["counts"]
    frame = counts.frame[["value", "count"]]
    table = frame.to_arrow(preserve_index=False) if is_cudf(frame) else pa.Table.from_pandas(frame, preserve_index=False)
    table = pa.table({"value": table["value"].cast(pa.string()), "count": table["count"].cast(pa.int64())})
    out = {}
    for name, start, end in zip(stats["names"], counts.bounds, counts.bounds[1:]):
        out[name] = {"counts": table.slice(start, end - start)}
        if name in stats["max_length"]:
            out[name]["max_length"] = stats["max_length"][name]
    return out


def _vocab_file(index: int, name: str) -> str:
    """The vocabulary file of the op's ``index``-th column: numbered, so that any column name (of any
    length, with any characters) gives a file name; the name's start follows, for a reader of the folder."""
    return f"categories/{index:05d}-{quote(name, safe='')[:100]}.parquet"


def _plain_strings(series: Any) -> Any:
    if is_cudf(series):
        return cudf_strings(series)
    strings = as_arrow_strings(series)
    return pd.Series(pd.arrays.ArrowExtensionArray(strings.cast(pa.string())), name=series.name)


def _flat_strings(series: Any) -> Any:
    if is_cudf(series):
        return cudf_strings(series.list.leaves).rename(series.name)
    flat = pc.list_flatten(as_arrow_lists(series))
    return pd.Series(pd.arrays.ArrowExtensionArray(flat.cast(pa.string())), name=series.name)
