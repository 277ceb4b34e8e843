"""Column conversions for the ETL operators, dispatched on the frame library (pandas or cuDF).

A column is a pandas Series, a pandas or numpy array (the in-memory serving path hands operators
arrays), or a cuDF Series. pandas columns go through numpy and pyarrow, which work the same on
pandas 2.2 / numpy 1.26 (the serving environment) and pandas 3 / numpy 2; cuDF columns stay on the
GPU and use the cuDF API. cuDF is never imported here: a cuDF object is recognised by its module name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from pipeline.errors import BadInputError

_IS_CUDF: dict[type, bool] = {}


def is_cudf(obj: Any) -> bool:
    """Whether ``obj`` is a cuDF object (its type's module is cuDF's), remembered per type."""
    kind = type(obj)
    found = _IS_CUDF.get(kind)
    if found is None:
        found = _IS_CUDF[kind] = kind.__module__.split(".")[0] == "cudf"
    return found


def array_module(array: Any) -> Any:
    """The array library of an array: ``cupy`` for a CuPy array (cuDF columns' values), else ``numpy``."""
    if type(array).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    return np


def frame_like(like: Any, columns: Mapping[str, Any]) -> Any:
    """A DataFrame of the same library (and index) as ``like`` from named columns (any mapping of them, such as the
    rows of one matrix that an operator's ``transform_many`` gives). A pandas frame holds the columns as they are:
    pandas would otherwise copy all columns of a dtype into one 2-d block (about a third of a partition's transform,
    an operator's output at a time); with copy-on-write, no pandas method writes into them."""
    if is_cudf(like):
        return cudf_frame(columns, like.index)
    return pd.DataFrame(dict(columns), index=like.index, copy=False)


def cudf_frame(columns: dict[str, Any], index: Any = None) -> Any:
    """A cuDF DataFrame of equally long columns (Series or arrays) side by side, on ``index``
    (default: 0..n-1).

    The columns are put together by position: ``cudf.DataFrame(series, index=index)`` would align
    every Series with ``index`` (a join per column, even when the Series already has that index,
    and an error when it holds repeated labels).
    """
    import cudf

    if not columns:
        return cudf.DataFrame(index=index)
    nan_free = nan_free_arrays(columns)
    frame = cudf.DataFrame({name: cudf.Series(column, nan_as_null=False) if nan_free.get(name)
                            else column.reset_index(drop=True) if hasattr(column, "reset_index") else column
                            for name, column in columns.items()})
    if index is not None:
        frame.index = index
    return frame


def nan_free_arrays(columns: Mapping[str, Any]) -> dict[str, bool]:
    """Which of the columns are CuPy float arrays without NaN, found for all of them with one copy to the host.

    cuDF makes a float array's NaN nulls, and looks for them in each array with a reduction and a copy to the host
    of its own: a wait for the GPU a column, which, with workers sharing a GPU, waits for the other workers' kernels
    too. An array found without NaN is taken as it is."""
    arrays = {name: column for name, column in columns.items()
              if array_module(column) is not np and column.dtype.kind == "f"}
    if not arrays:
        return {}
    import cupy

    found = cupy.stack([cupy.isnan(array).any() for array in arrays.values()]).get()
    return {name: not bool(nan) for name, nan in zip(arrays, found)}


def empty_series(like: Any, dtype: str) -> Any:
    """An empty Series of ``dtype`` from the library of ``like`` (Dask metadata)."""
    if is_cudf(like):
        import cudf

        return cudf.Series([], dtype=dtype)
    return pd.Series([], dtype=pd.ArrowDtype(pa.string()) if dtype == "str" else dtype)


def as_float64(values: Any, name: str | None = None) -> Any:
    """Numbers as float64 with NaN for missing (numpy array for pandas, float Series for cuDF).

    cuDF tells null from NaN, pandas-through-numpy does not: on cuDF every NaN becomes null, so
    ``fillna`` and the Dask reductions treat both as missing, as the pandas path does. Float
    arrays and arrow-backed numbers are converted without building a Series.
    """
    if isinstance(values, np.ndarray) and values.dtype.kind == "f":
        return values.astype(np.float64, copy=False)
    if is_cudf(values):
        return values.astype("float64").nans_to_nulls()
    dtype = values.dtype
    if isinstance(dtype, pd.ArrowDtype) and (pa.types.is_integer(dtype.pyarrow_dtype)
                                             or pa.types.is_floating(dtype.pyarrow_dtype)):
        try:
            return as_arrow(values).cast(pa.float64(), safe=False).to_numpy(zero_copy_only=False)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            pass  # the general path below says what is wrong
    series = values if isinstance(values, pd.Series) else pd.Series(values, name=name, copy=False)
    if isinstance(series.dtype, np.dtype) and series.dtype.kind == "f":
        return series.to_numpy(dtype="float64")
    try:
        if hasattr(series.array, "__arrow_array__"):
            return pa.array(series.array).cast(pa.float64(), safe=False).to_numpy(zero_copy_only=False)
        return series.to_numpy(dtype="float64", na_value=np.nan)
    except (TypeError, ValueError, pa.ArrowInvalid, pa.ArrowNotImplementedError) as err:
        raise BadInputError(f"column {series.name!r}: expected numbers, found dtype {series.dtype} ({err})") from err


def cudf_float_rows(columns: list[Any]) -> Any:
    """Equally long cuDF numeric Series (or CuPy arrays) as one CuPy float64 matrix ``[column, row]``, NaN for a missing value
    (the values of a float column with nulls hold NaN there), as :func:`as_float64` reads each.

    Series are put one after the other first (one libcudf call), then cast and their nulls filled once for all: a cast
    and a fill a column each cost more on the host (each looks at the column's nulls) than the GPU's work here."""
    import cupy

    if columns and all(is_cudf(values) for values in columns):
        import cudf

        same = len({str(values.dtype) for values in columns}) == 1
        whole = cudf.concat(columns if same else [values.astype("float64") for values in columns], ignore_index=True)
        rows = whole.astype("float64").values.reshape(len(columns), len(columns[0]))
        return rows.copy() if len(columns) == 1 else rows  # one column may come back as its own memory
    rows = cupy.empty((len(columns), len(columns[0]) if columns else 0), dtype=cupy.float64)
    for i, values in enumerate(columns):
        values = values.astype("float64")
        rows[i] = values if array_module(values) is cupy else values.values
    return rows


def float_rows(df: Any, names: list[str]) -> Any:
    """The columns ``names`` of a frame as one float64 matrix ``[column, row]``, NaN for a missing value: CuPy for
    cuDF (:func:`cudf_float_rows`), numpy for pandas (:func:`as_float64` of each)."""
    if is_cudf(df):
        return cudf_float_rows([df[name] for name in names])
    if not names:
        return np.zeros((0, len(df)), dtype=np.float64)
    return np.stack([as_float64(df[name], name) for name in names])


def as_arrow(values: Any, name: str | None = None) -> pa.Array:
    """A pandas Series or array as one contiguous pyarrow array (strings, numbers or lists)."""
    if isinstance(values, pd.Series):
        name, array = values.name, values.array
    else:
        array = values
    if hasattr(array, "__arrow_array__"):
        arrow = pa.array(array)
    elif (isinstance(array.dtype, np.dtype) or isinstance(array, pd.arrays.NumpyExtensionArray)) and (
            np.asarray(array).dtype != object):  # a Series' numpy values come wrapped in a NumpyExtensionArray
        arrow = pa.array(np.asarray(array), from_pandas=True)
    else:
        try:
            arrow = pa.array(np.asarray(array, dtype=object), from_pandas=True)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as err:
            raise BadInputError(f"column {name!r}: cannot read its values ({err})") from err
    if isinstance(arrow, pa.ChunkedArray):
        arrow = arrow.combine_chunks()
    return arrow


def as_arrow_strings(series: Any, keep_dictionary: bool = False, name: str | None = None) -> pa.Array:
    """A pandas Series (or array) of categorical values as a pyarrow string array (numbers become their text).

    With ``keep_dictionary``, a dictionary-encoded column stays one (with string values), so the
    caller can work on its few distinct values instead of every row.
    """
    name = series.name if isinstance(series, pd.Series) else name
    arrow = as_arrow(series, name)
    if pa.types.is_null(arrow.type):
        return arrow.cast(pa.string())
    if pa.types.is_string(arrow.type) or pa.types.is_large_string(arrow.type):
        return arrow
    if pa.types.is_dictionary(arrow.type):
        values = as_arrow_strings(pd.arrays.ArrowExtensionArray(arrow.dictionary), name=name)
        if keep_dictionary:
            return pa.DictionaryArray.from_arrays(arrow.indices, values)
        return values.take(arrow.indices)
    if pa.types.is_integer(arrow.type) or pa.types.is_boolean(arrow.type):
        return arrow.cast(pa.string())
    if pa.types.is_floating(arrow.type):
        return integral_floats(arrow, name).cast(pa.string())
    raise BadInputError(f"column {name!r}: expected strings or integers, found {arrow.type}")


def as_arrow_lists(series: Any, name: str | None = None) -> pa.Array:
    """A pandas Series (or array) of list cells as a pyarrow list<string> array."""
    name = series.name if isinstance(series, pd.Series) else name
    arrow = as_arrow(series, name)
    if pa.types.is_null(arrow.type):
        return arrow.cast(pa.list_(pa.string()))
    if not (pa.types.is_list(arrow.type) or pa.types.is_large_list(arrow.type)):
        raise BadInputError(f"column {name!r}: expected lists (multi-hot), found {arrow.type}")
    if not (pa.types.is_string(arrow.type.value_type) or pa.types.is_large_string(arrow.type.value_type)):
        values = arrow.flatten()
        values = integral_floats(values, name) if pa.types.is_floating(values.type) else values
        arrow = pa.ListArray.from_arrays(_list_offsets(arrow), values.cast(pa.string()), mask=arrow.is_null())
    return arrow


def list_lengths(lists: pa.Array) -> np.ndarray:
    """Length of each list cell; a missing cell counts as empty."""
    import pyarrow.compute as pc

    return pc.fill_null(pc.list_value_length(lists), 0).to_numpy(zero_copy_only=False).astype(np.int64)


def _list_offsets(lists: pa.Array) -> pa.Array:
    return pa.array(np.concatenate([[0], np.cumsum(list_lengths(lists))]).astype(np.int32))


def lists_from_flat(values: np.ndarray, lengths: np.ndarray, index: Any = None) -> pd.Series:
    """A pandas Series of list cells (arrow-backed) from flat int32 or int64 values and per-row lengths."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    arrow = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=pa.from_numpy_dtype(values.dtype)))
    return pd.Series(pd.arrays.ArrowExtensionArray(arrow), index=index)


def integral_floats(arrow: pa.Array, name: str) -> pa.Array:
    """Floats that hold whole numbers (integers that pandas widened to make room for NaN) as int64."""
    values = arrow.to_numpy(zero_copy_only=False)
    present = values[~np.isnan(values)]
    if not np.all(np.abs(present) < 2.0**63):
        raise BadInputError(f"column {name!r}: expected strings or integers, found {present[np.abs(present) >= 2.0**63][0]} "
                            "(whole numbers in a float column are read as int64 ids)")
    if not np.all(present == np.round(present)):
        raise BadInputError(f"column {name!r}: expected strings or integers, found fractional numbers")
    return arrow.cast(pa.int64())


def looks_multihot(column: Any) -> bool:
    """Whether a Dask column holds lists (arrow list dtype, cuDF list dtype, or Python lists)."""
    dtype = column.dtype
    # cuDF 26 reports a list column as cudf.ListDtype or as pd.ArrowDtype(list<...>), depending on
    # how the column was made: both count.
    if isinstance(dtype, pd.ArrowDtype):
        return pa.types.is_list(dtype.pyarrow_dtype) or pa.types.is_large_list(dtype.pyarrow_dtype)
    if type(dtype).__name__ == "ListDtype":
        return True
    if is_cudf(getattr(column, "_meta", column)):
        return False  # cuDF strings have dtype object: never sample them
    if dtype == object:
        sample = column.head(50, npartitions=-1, compute=True).dropna()
        return len(sample) > 0 and isinstance(sample.iloc[0], (list, tuple, np.ndarray))
    return False


def longest_list(series: pd.Series) -> pd.Series:
    """The length of the longest list of one partition, as a one-row Series (for a Dask max)."""
    if is_cudf(series):
        return cudf_longest_list(series)
    lengths = list_lengths(as_arrow_lists(series))
    return pd.Series([int(lengths.max(initial=0))], dtype="int64")


def cudf_strings(series: Any) -> Any:
    """A cuDF Series of categorical values as cuDF strings, the same text the pandas path makes.

    Strings stay; integers become their decimal text; floats must hold whole numbers (integers
    widened to make room for nulls) and become the text of the integer; nulls stay null.
    """
    dtype = series.dtype
    if type(dtype).__name__ == "CategoricalDtype":
        series = series.astype(series.cat.categories.dtype)
        dtype = series.dtype
    kind = getattr(dtype, "kind", "O")
    if kind in "OSU" or str(dtype) in ("str", "string"):
        return series  # cuDF has one string type (object or str dtype): already text
    if kind == "b":
        return series.astype("str").str.lower()
    if kind in "iu":
        return series.astype("str")
    if kind == "f":
        return cudf_integral(series).astype("str")
    raise BadInputError(f"column {series.name!r}: expected strings or integers, found {dtype}")


def cudf_integral(series: Any) -> Any:
    """A cuDF Series of integers (int64, nulls kept) from integers or whole-number floats."""
    kind = series.dtype.kind
    if kind in "iu":
        return series.astype("int64")
    series = series.nans_to_nulls()
    present = series.dropna()
    if len(present) and bool((present != present.round()).any()):
        raise BadInputError(f"column {series.name!r}: expected strings or integers, found fractional numbers")
    return series.astype("int64")


def cudf_to_pandas(series: Any) -> pd.Series:
    """A cuDF Series as an arrow-backed pandas Series (lists stay lists), for the pandas code path."""
    arrow = series.to_arrow()
    if isinstance(arrow, pa.ChunkedArray):
        arrow = arrow.combine_chunks()
    return pd.Series(pd.arrays.ArrowExtensionArray(arrow), name=series.name)


def cudf_from_pandas(values: Any, like: Any) -> Any:
    """A pandas Series or numpy array back as a cuDF Series on ``like``'s index (through Arrow)."""
    import cudf

    arrow = as_arrow(values) if isinstance(values, pd.Series) else pa.array(values)
    out = cudf.Series.from_arrow(arrow)
    out.index = like.index
    out.name = like.name
    return out


def cudf_lists_from_flat(values: Any, lengths: Any, index: Any = None, name: Any = None) -> Any:
    """A cuDF Series of list cells from flat values and per-row lengths (CuPy arrays), no cell missing:
    what :func:`lists_from_flat` is on pandas, built on the GPU.

    cuDF has no public constructor of a list column from offsets; pylibcudf (libcudf's Python API, which
    cuDF is built on) has: a LIST column whose children are the int32 offsets and the values, each a
    column over a CuPy array (``Column.from_array`` keeps a reference to it).
    """
    import cudf
    import cupy
    import pylibcudf as plc

    offsets = cupy.zeros(len(lengths) + 1, dtype=cupy.int32)
    offsets[1:] = cupy.cumsum(lengths, dtype=cupy.int64)
    children = [plc.Column.from_array(offsets), plc.Column.from_array(cupy.ascontiguousarray(values))]
    column = plc.Column(plc.DataType(plc.TypeId.LIST), len(lengths), None, None, 0, 0, children)
    return cudf.Series.from_pylibcudf(column, {"name": name, "index": index})


def cudf_map_lists(series: Any, of_leaves: Callable[[Any], Any], on_host: Callable[[pd.Series], Any]) -> Any:
    """A cuDF column of lists mapped value by value on the GPU: ``of_leaves`` (a cuDF Series of every list's values
    -> a CuPy array of theirs), put back into lists of the same lengths, a missing list becoming an empty one (as on
    pandas). A column whose missing lists still hold values (libcudf builds none) goes through host memory:
    ``on_host`` (the pandas code, on the column as :func:`cudf_to_pandas` gives it)."""
    lengths = series.list.len().fillna(0).astype("int32")
    leaves = series.list.leaves
    if len(series) and int(lengths.sum()) != len(leaves):
        return cudf_from_pandas(on_host(cudf_to_pandas(series)), series)
    return cudf_lists_from_flat(of_leaves(leaves), lengths.values, series.index, series.name)


def cudf_longest_list(series: Any) -> Any:
    """The length of the longest list of one cuDF partition, as a one-row cuDF Series (for a Dask max)."""
    import cudf

    longest = series.list.len().max() if len(series) else None
    longest = 0 if longest is None or pd.isna(longest) else int(longest)
    return cudf.Series([longest], dtype="int64")


def column_reader(df: pd.DataFrame) -> Callable[[Any], Any]:
    """``name -> the column's array``, without building a Series per column where pandas allows it.

    ``DataFrame._get_column_array`` (pandas 2.2 to 3) skips building a Series, which ``df[name]``
    does; ``df[name]`` stays the way when it is missing or names repeat.
    """
    get = getattr(df, "_get_column_array", None)
    if get is None or not df.columns.is_unique:
        return lambda name: df[name]
    positions = {name: i for i, name in enumerate(df.columns)}
    return lambda name: get(positions[name])
