"""Reading parquet for the ETL: row-group partitions, dictionary-encoded strings, clear errors."""

from __future__ import annotations

import numpy as np
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



def test_a_later_file_without_a_column_is_named_before_any_task(files):
    """Only the first file's columns were checked: a later file without one failed inside a task with a bare
    KeyError naming no file."""
    from pipeline.etl.frame_library import gpu_pieces

    table, folder = files
    later = folder / "part-00002.parquet"
    pq.write_table(table.drop_columns(["I"]), later)
    for columns in (None, ["C", "I"]):
        with pytest.raises(BadInputError, match=rf"{later}: expected the columns .*; missing \['I'\]"):
            read_parquet(folder, columns, "pandas")
    with pytest.raises(BadInputError, match=r"missing \['I'\]"):
        gpu_pieces(sorted(folder.glob("*.parquet")), ["C", "I"])
    assert len(read_parquet(folder, ["C", "M"], "pandas").compute()) == 640


def test_gpu_partitions_divide_among_the_workers():
    from pipeline.etl.frame_library import piece_count

    gib = 1 << 30
    assert piece_count(20 * 64 << 20, slots=2) == 2  # 1.25 GiB: one a worker
    assert piece_count(20 * 64 << 20, slots=8) == 8
    assert piece_count(int(9.4 * gib), slots=2) == 10  # 9 of 1 GiB would leave a worker idle for a round
    assert piece_count(100 << 20, slots=4) == 3  # at least 32 MiB a piece, fewer than the slots
    assert piece_count(200 << 20, slots=4) == 4  # 50 MiB a slot
    assert piece_count(int(3.4 * gib), slots=2) == 4  # 3 of 1 GiB, up to a multiple of the slots
    assert piece_count(40 * gib, slots=2) == 40  # at most 1 GiB a piece, a multiple of the slots
    assert piece_count(10 << 20, slots=2) == 1  # at least 32 MiB a piece: small data stays one piece
    assert piece_count(100 << 20, slots=1) == 1


def test_gpu_partitions_are_one_a_thread_of_the_workers(tmp_path):
    """`etl.gpu_threads=2` promises a partition read or written while another is computed; the pieces were one a
    worker, so under 1 GiB a worker its second thread had nothing to do."""
    from distributed import Client, LocalCluster

    from pipeline.etl.frame_library import gpu_pieces

    path = tmp_path / "part.parquet"
    values = np.random.default_rng(0).integers(0, 2**62, 13_000_000)
    pq.write_table(pa.table({"x": values}), path, row_group_size=1_000_000, use_dictionary=False)  # 99 MiB
    for threads in (1, 2):
        with LocalCluster(n_workers=1, threads_per_worker=threads, processes=False, dashboard_address=None) as cluster, \
                Client(cluster):
            assert len(gpu_pieces([path], ["x"])) == threads
    assert len(gpu_pieces([path], ["x"])) == 1  # no cluster: this process


def test_row_groups_split_in_order_into_pieces_of_about_equal_rows():
    from pipeline.etl.frame_library import split_row_groups

    groups = [(f"f{i}", g, 250) for i in range(8) for g in range(2)] + [("last", 0, 100), ("last", 1, 20)]
    pieces = split_row_groups(groups, 4)
    assert len(pieces) == 4
    flat = [(path, g) for piece in pieces for path, indices in piece for g in indices]
    assert flat == [(path, g) for path, g, _ in groups]  # every row group once, in order
    rows = {(path, g): n for path, g, n in groups}
    sizes = [sum(rows[(path, g)] for path, indices in piece for g in indices) for piece in pieces]
    assert sum(sizes) == 4120 and max(sizes) - min(sizes) <= 500  # within a row group or two of 1030
    assert pieces[0][:2] == [("f0", [0, 1]), ("f1", [0, 1])]  # a piece spans files, a file's groups together
    assert split_row_groups(groups[:3], 8) == [[("f0", [0])], [("f0", [1])], [("f1", [0])]]  # no empty piece
    assert split_row_groups([("empty", 0, 0), ("empty", 1, 0)], 2) == [[("empty", [0, 1])]]


def test_cudf_reader_pieces_cover_every_row_group_once(files):
    from pipeline.etl.frame_library import gpu_pieces

    _, folder = files
    paths = sorted(folder.glob("*.parquet"))
    assert gpu_pieces(paths, ["C", "I"]) == [[(str(paths[0]), [0, 1, 2]), (str(paths[1]), [0])]]


def test_a_file_s_footer_is_read_once_until_the_file_changes(tmp_path):
    """The fit and the transform of a split plan their partitions from the same files: each footer is read once, and
    read again when its file is written anew."""
    from pipeline.etl.frame_library import _read_footer, gpu_pieces

    path = tmp_path / "part-0.parquet"
    pq.write_table(pa.table({"C": [str(i) for i in range(30)], "I": list(range(30))}), path, row_group_size=30)
    assert gpu_pieces([path], ["C", "I"]) == [[(str(path), [0])]]
    reads = _read_footer.cache_info().misses
    assert gpu_pieces([path], ["C", "I"]) == [[(str(path), [0])]]
    assert _read_footer.cache_info().misses == reads
    pq.write_table(pa.table({"C": [str(i) for i in range(90)], "I": list(range(90))}), path, row_group_size=30)
    assert gpu_pieces([path], ["C", "I"]) == [[(str(path), [0, 1, 2])]]


@pytest.mark.parametrize("library", ["pandas", "cudf"])
def test_a_column_of_numbers_in_one_file_and_text_in_another_is_refused_naming_both(tmp_path, library):
    """HashBucket hashes 7 as a number's bytes and "7" as text: one id was two buckets, silently. A column without
    values in a file (Arrow's null type) fits either."""
    n = 40
    pq.write_table(pa.table({"C": pa.array(range(n)), "I": pa.array(range(n))}), tmp_path / "part-0.parquet")
    pq.write_table(pa.table({"C": pa.array([None] * n, pa.null()), "I": pa.array(range(n))}), tmp_path / "part-1.parquet")
    pq.write_table(pa.table({"C": pa.array([str(i) for i in range(n)]), "I": pa.array(range(n))}),
                   tmp_path / "part-2.parquet")
    if library == "pandas":
        read = lambda files: read_parquet(files, ["C", "I"], "pandas")
    else:  # the cuDF reader's partitions, cut before cuDF is imported
        from pipeline.etl.frame_library import gpu_pieces

        read = lambda files: gpu_pieces(files, ["C", "I"])
    files = sorted(tmp_path.glob("*.parquet"))
    read(files[:2])  # numbers, then no value at all: read
    with pytest.raises(BadInputError) as refused:
        read(files)
    message = str(refused.value)
    assert "part-2.parquet" in message and "part-0.parquet" in message and "'C'" in message and "string" in message
