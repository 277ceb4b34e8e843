"""Reading parquet for the ETL: row-group partitions, dictionary-encoded strings, clear errors."""

from __future__ import annotations

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.errors import BadInputError
from pipeline.etl.frame_library import read_parquet


@pytest.fixture()
def files(tmp_path):
    table = pa.table({"C": pa.array([f"v{i % 7}" if i % 5 else None for i in range(300)]), "I": pa.array(range(300)),
                      "M": pa.array([[f"t{i % 3}"] for i in range(300)])})
    pq.write_table(table, tmp_path / "part-00000.parquet", row_group_size=100)
    pq.write_table(table.slice(0, 40), tmp_path / "part-00001.parquet")
    return table, tmp_path


def test_partitions_are_row_groups_and_strings_are_dictionaries(files):
    table, folder = files
    ddf = read_parquet(folder, None, "pandas", partition_rows=150)
    assert ddf.npartitions == 3  # row groups [0, 1] and [2] of the first file, then the second file
    df = ddf.compute()
    assert len(df) == 340
    assert isinstance(df["C"].dtype, pd.ArrowDtype) and pa.types.is_dictionary(df["C"].dtype.pyarrow_dtype)
    assert str(ddf._meta["C"].dtype) == str(df["C"].dtype)
    assert df["C"].iloc[:300].astype(object).where(df["C"].iloc[:300].notna(), None).tolist() == table["C"].to_pylist()
    assert list(df["M"].iloc[:3].tolist()[1]) == ["t1"]


def test_column_projection_reads_only_what_is_asked(files):
    _, folder = files
    ddf = read_parquet(folder, ["I", "C"], "pandas")
    assert list(ddf.columns) == ["I", "C"]
    assert list(ddf[["I"]].partitions[0].compute().columns) == ["I"]


def test_reading_errors(files, tmp_path):
    _, folder = files
    with pytest.raises(BadInputError, match=r"missing \['nope'\]"):
        read_parquet(folder, ["C", "nope"], "pandas")
    with pytest.raises(BadInputError, match="no parquet files at"):
        read_parquet(tmp_path / "empty-*", None, "pandas")

