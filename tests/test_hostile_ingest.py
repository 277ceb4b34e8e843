"""Hostile ingest files through the real data stage: no traceback, every bad line counted with its number.

Cases (the count is in docs/HOSTILE_INPUT.md, "Ingest files"): a stray carriage return inside a
line (Criteo plain and gzip, CSV), ``\\r\\n`` line ends, ``\\r``-only line ends (Criteo, CSV),
lines over the length limit (Criteo, CSV, a header), a truncated gzip, a file named ``.gz`` that is
not gzip, integers at and beyond the int64 range (typed and text paths), integers above 2^53
through the ETL, quotes left open (CSV, TSV), infinite numbers (typed and text paths), bad times
(CSV, parquet) and time settings that cannot work.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.data.readers import MAX_LINE_BYTES
from pipeline.errors import BadInputError
from pipeline.stages import data as data_stage
from pipeline.stages.config import load_config

ROOT = Path(__file__).resolve().parents[1]
TABLE = ["data.source=table", "data.label=clicked", "data.continuous=price", "data.categorical=user"]


def _criteo_line(i: int) -> str:
    ints = [str(i * 13 + k) if (i + k) % 4 else "" for k in range(13)]
    cats = [f"{(i * 31 + k) % 997:08x}" for k in range(26)]
    return "\t".join([str(i % 2), *ints, *cats])


def _criteo(n: int = 60) -> list[str]:
    return [_criteo_line(i) for i in range(1, n + 1)]


def _table(n: int = 60) -> list[str]:
    return ["clicked,price,user"] + [f"{i % 2},{i * 1.5},u{i % 7}" for i in range(1, n + 1)]


def _ingest(tmp_path: Path, path: Path, *overrides: str) -> dict:
    """Run the data stage (a table for files named rows.*, else Criteo); return ``raw/ingest_report.json``."""
    source = list(TABLE) if path.name.startswith("rows") else ["data.source=criteo"]
    cfg = load_config(None, [f"workdir={tmp_path / 'work'}", "data.chunk_rows=16", *source,
                             f"data.path={path}", *overrides])
    data_stage.run(cfg)
    return json.loads((cfg.paths.raw / "ingest_report.json").read_text())


def _failed_report(tmp_path: Path, path: Path, *overrides: str) -> tuple[str, dict]:
    with pytest.raises(BadInputError) as err:
        _ingest(tmp_path, path, *overrides)
    found = list((tmp_path / "work").glob("*/raw/ingest_report.json"))
    return str(err.value), (json.loads(found[0].read_text()) if found else None)


def _raw_rows(tmp_path: Path) -> pa.Table:
    parts = sorted((tmp_path / "work").glob("*/raw/*/part-*.parquet"))
    return pa.concat_tables([pq.read_table(p) for p in parts])


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


@pytest.mark.parametrize("name", ["day.tsv", "day.tsv.gz"])
def test_a_stray_carriage_return_is_one_counted_line_and_numbers_stay_right(tmp_path, name):
    lines = _criteo()
    lines[3] = lines[3].replace("\t", "\t\r", 5)  # splits a field of line 4
    lines[7] = "\t".join(["1", "abc"] + lines[7].split("\t")[2:])  # line 8: a non-number after it
    path = _write(tmp_path / name, ("\r\n".join(lines) + "\r\n").encode())
    report = _ingest(tmp_path, path, "data.on_bad_lines=skip")
    assert (report["rows_read"], report["rows_kept"]) == (60, 58)
    assert report["bad"] == {"carriage_return": 1, "not_a_number": 1}
    assert [e["line"] for e in report["examples"]] == [4, 8]
    assert report["examples"][0]["reason"].startswith("a carriage return (\\r) inside the line at byte 2;")
    assert report["examples"][1]["reason"] == "I1: 'abc' is not an integer"
    table = _raw_rows(tmp_path)
    assert table.num_rows == 58 and not any("\r" in (v or "") for v in table.column("C26").to_pylist())

    message, report = _failed_report(tmp_path, path)
    assert f"{path.name} line 4: a carriage return" in message and "data.on_bad_lines=skip" in message
    assert report["status"] == "failed" and report["bad"]["carriage_return"] == 1


def test_a_stray_carriage_return_in_a_csv_line(tmp_path):
    lines = _table()
    lines[5] = "1,2.5\r,u3"  # line 6 of the file
    path = _write(tmp_path / "rows.csv", ("\n".join(lines) + "\n").encode())
    report = _ingest(tmp_path, path, "data.on_bad_lines=skip")
    assert report["bad"] == {"carriage_return": 1} and report["examples"][0]["line"] == 6
    assert (report["rows_read"], report["rows_kept"]) == (60, 59)


@pytest.mark.parametrize("name", ["day.tsv", "rows.csv", "rows.csv.gz"])
def test_carriage_return_only_line_ends_are_line_ends(tmp_path, name):
    lines = _criteo(300) if name.startswith("day") else _table(300)
    bad = 41 if name.startswith("day") else 42  # the file's line 42 (header included) / 41
    fields = lines[bad - 1].split("\t" if name.startswith("day") else ",")
    fields[1] = "oops"
    lines[bad - 1] = ("\t" if name.startswith("day") else ",").join(fields)
    path = _write(tmp_path / name, ("\r".join(lines) + "\r").encode())
    report = _ingest(tmp_path, path, "data.on_bad_lines=skip")
    assert (report["rows_read"], report["rows_kept"], report["bad_rows"]) == (300, 299, 1)
    assert report["examples"][0]["line"] == bad and "'oops'" in report["examples"][0]["reason"]


@pytest.mark.parametrize("name", ["day.tsv", "rows.csv"])
def test_over_long_lines_are_counted_not_fatal(tmp_path, name):
    criteo = name.startswith("day")
    lines = _criteo(400) if criteo else _table(400)
    sep = "\t" if criteo else ","
    lines[5] += "x" * (MAX_LINE_BYTES + 1)              # over by one byte
    lines[20] += "y" * (9 << 20)                         # much longer than a read block
    lines[30] += "z" * (MAX_LINE_BYTES - len(lines[30]) - 1)  # at the limit: read whole
    lines[99] = sep.join(["1"] * 2)                      # a short line after them keeps its number
    path = _write(tmp_path / name, ("\n".join(lines) + "\n").encode())
    report = _ingest(tmp_path, path, "data.on_bad_lines=skip")
    assert report["bad"] == {"line_too_long": 2, "wrong_field_count": 1}
    assert [e["line"] for e in report["examples"]] == [6, 21, 100]
    assert f"longer than {MAX_LINE_BYTES} bytes" in report["examples"][0]["reason"]
    assert (report["rows_read"], report["rows_kept"]) == (400, 397)
    column = "C26" if criteo else "user"
    assert max(len(v) for v in _raw_rows(tmp_path).column(column).to_pylist()) > MAX_LINE_BYTES - 400

    message, report = _failed_report(tmp_path, path)
    assert f"{name} line 6: the line is longer than" in message
    assert report["files"][0]["stopped_at_line"] >= 6


def test_an_over_long_header_is_one_clear_error(tmp_path):
    path = _write(tmp_path / "rows.csv", ("clicked,price,user" + "," * (MAX_LINE_BYTES + 5) + "\n1,2,a\n").encode())
    message, _ = _failed_report(tmp_path, path, "data.on_bad_lines=skip")
    assert "rows.csv" in message and "header line" in message and "longer than" in message


def _damaged_gz(tmp_path: Path, kind: str) -> Path:
    data = ("\n".join(_criteo(20_000)) + "\n").encode()
    path = tmp_path / "day.tsv.gz"
    if kind == "truncated":
        packed = gzip.compress(data)
        path.write_bytes(packed[: len(packed) * 3 // 5])
    else:
        path.write_bytes(data)  # plain text named .gz
    return path


@pytest.mark.parametrize("kind", ["truncated", "not gzip"])
@pytest.mark.parametrize("mode", ["error", "skip"])
def test_a_damaged_gzip_is_one_error_naming_the_file(tmp_path, kind, mode):
    path = _damaged_gz(tmp_path, kind)
    message, report = _failed_report(tmp_path, path, f"data.on_bad_lines={mode}")
    assert str(path) in message and "\n" not in message
    assert ("ends early" if kind == "truncated" else "not valid gzip") in message
    assert report["status"] == "failed" and report["rows_written"] == {"train": 0, "valid": 0, "test": 0}
    assert report["files"][0]["error"] == message
    rows = report["files"][0]["rows_read"]
    assert (rows > 0) if kind == "truncated" else (rows == 0)
    if kind == "truncated":
        assert f"after line {rows}" in message
    assert not list((tmp_path / "work").glob("*/raw/meta.json"))
    assert not list((tmp_path / "work").glob("*/raw/*/*.parquet"))


def test_a_damaged_gzip_among_several_files_names_that_file(tmp_path):
    folder = tmp_path / "days"
    folder.mkdir()
    _write(folder / "day_0.tsv.gz", ("\n".join(_criteo(50)) + "\n").encode())
    (folder / "day_1.tsv.gz").write_bytes(b"not gzip at all\n")
    message, report = _failed_report(tmp_path, folder)
    assert str(folder / "day_1.tsv.gz") in message
    assert [f["rows_read"] for f in report["files"]] == [50, 0]


def test_the_cli_prints_one_error_line_for_a_damaged_gzip(tmp_path):
    path = _damaged_gz(tmp_path, "truncated")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "pipeline", "data", f"workdir={tmp_path / 'work'}",
                           "data.source=criteo", f"data.path={path}"], check=False, cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(path) in errors[0] and "Traceback" not in done.stderr


INT64_MAX, INT64_MIN = 2**63 - 1, -(2**63)
FITS = [INT64_MAX, INT64_MIN, 1234567890123456789, 2**53 + 1, -(2**53) - 1, 7]
DOES_NOT_FIT = ["9223372036854775808", "-9223372036854775809", "12345678901234567890", "1" * 400]


@pytest.mark.parametrize("with_text_path", [False, True])
def test_every_int64_is_accepted_and_nothing_beyond(tmp_path, with_text_path):
    lines = _criteo(40)

    def with_i1(line: str, value) -> str:
        fields = line.split("\t")
        fields[1] = str(value)
        return "\t".join(fields)

    for k, value in enumerate(FITS):
        lines[k] = with_i1(lines[k], value)
    if with_text_path:  # a value that does not parse sends the block to the checked text path
        for k, value in enumerate(DOES_NOT_FIT):
            lines[10 + k] = with_i1(lines[10 + k], value)
    path = _write(tmp_path / "day.tsv", ("\n".join(lines) + "\n").encode())
    report = _ingest(tmp_path, path, "data.on_bad_lines=skip", "data.chunk_rows=100")
    if with_text_path:
        assert report["bad"] == {"out_of_range": 4}
        assert [e["line"] for e in report["examples"]] == [11, 12, 13, 14]
        assert "outside the 64-bit integer range" in report["examples"][0]["reason"]
    else:
        assert report["bad"] == {}
    values = set(_raw_rows(tmp_path).column("I1").to_pylist())
    assert set(FITS) <= values


def test_the_etl_accepts_every_integer_ingest_accepts(tmp_path):
    from pipeline.stages import etl as etl_stage

    lines = _criteo(400)
    for k, value in enumerate([INT64_MAX, 2**53 + 1, INT64_MIN, 10**17 + 3] * 50):
        fields = lines[k * 2].split("\t")
        fields[1 + k % 13] = str(value)
        lines[k * 2] = "\t".join(fields)
    path = _write(tmp_path / "day.tsv", ("\n".join(lines) + "\n").encode())
    cfg = load_config(None, [f"workdir={tmp_path / 'work'}", "device=cpu", "etl.cluster=threads",
                             "data.source=criteo", f"data.path={path}", "data.valid_fraction=0.2",
                             "data.test_fraction=0.2"])
    etl_stage.run(cfg)
    train = pa.concat_tables([pq.read_table(p) for p in sorted((cfg.paths.processed / "train").glob("*.parquet"))])
    assert train.num_rows > 100
    for name in [f"I{i}" for i in range(1, 14)]:
        values = train.column(name).to_numpy(zero_copy_only=False)
        assert values.dtype.kind == "f" and pa.compute.all(pa.compute.is_finite(train.column(name))).as_py()


@pytest.mark.parametrize("name", ["rows.csv", "rows.tsv"])
def test_a_quote_left_open_is_one_counted_line(tmp_path, name):
    sep = "," if name.endswith(".csv") else "\t"
    lines = [line.replace(",", sep) for line in _table(60)]
    lines[5] = sep.join(["1", "2", '"abc'])            # line 6: the quote runs on into line 7
    lines[10] = sep.join(["1", "2", '"a'])             # lines 11-12: a quoted line end
    lines[11] = 'b"'
    lines[60] = sep.join(["0", "3", '"last'])          # the last line
    path = _write(tmp_path / name, ("\n".join(lines) + "\n").encode())
    report = _ingest(tmp_path, path, "data.on_bad_lines=skip")
    assert report["bad"] == {"open_quote": 3, "wrong_field_count": 1}
    assert [(e["line"], e["reason"]) for e in report["examples"]] == [
        (6, "a quoted value does not end on its line"), (11, "a quoted value does not end on its line"),
        (12, "expected 3 fields, found 1"), (61, "a quoted value does not end on its line")]
    assert (report["rows_read"], report["rows_kept"]) == (60, 56)
    assert not any("\n" in v for v in _raw_rows(tmp_path).column("user").to_pylist())


@pytest.mark.parametrize("with_text_path", [False, True])
def test_infinite_numbers_are_counted_not_kept(tmp_path, with_text_path):
    lines = _table(60)
    for line, value in zip((3, 4, 5, 6), ("inf", "-Infinity", "1e400", "1" * 400)):
        lines[line - 1] = f"1,{value},u1"
    if with_text_path:
        lines[9] = "1,oops,u1"
    path = _write(tmp_path / "rows.csv", ("\n".join(lines) + "\n").encode())
    report = _ingest(tmp_path, path, "data.on_bad_lines=skip")
    assert report["bad"] == {"out_of_range": 4, **({"not_a_number": 1} if with_text_path else {})}
    assert [e["line"] for e in report["examples"]][:4] == [3, 4, 5, 6]
    assert all(e["reason"].endswith("is not a finite number") for e in report["examples"][:4])
    prices = _raw_rows(tmp_path).column("price").to_numpy(zero_copy_only=False)
    assert len(prices) == 60 - len(report["examples"]) and all(abs(p) < 1e300 for p in prices)


BAD_TIMES = {3: ("", "ts: the time is missing"), 5: ("yesterday", "ts: 'yesterday' is not a time"),
             8: ("2024-13-01", "ts: '2024-13-01' is not a time"), 9: ("12.5", "ts: '12.5' is not a time")}
TIMED = [*TABLE, "data.time_column=ts"]


@pytest.mark.parametrize("name", ["rows.csv", "rows.parquet"])
def test_bad_times_are_counted_lines_with_their_numbers(tmp_path, name):
    times = [f"2024-02-{1 + i:02d}T08:00:00" for i in range(20)]
    for line, (value, _) in BAD_TIMES.items():
        times[line - 2] = value
    path = tmp_path / name
    if name.endswith(".parquet"):  # row numbers count from 1 there, without a header line
        times = [None if t == "" else t for t in [times[0], *times]]
        pq.write_table(pa.table({"clicked": [i % 2 for i in range(21)], "price": [1.5 * i for i in range(21)],
                                 "user": [f"u{i}" for i in range(21)], "ts": times}), path)
    else:
        path.write_text("clicked,price,user,ts\n" + "".join(f"{i % 2},{1.5 * i},u{i},{t}\n" for i, t in enumerate(times)))
    report = _ingest(tmp_path, path, *TIMED[len(TABLE):], "data.on_bad_lines=skip")
    assert report["bad"] == {"bad_time": 4} and report["rows_kept"] == report["rows_read"] - 4
    assert [(e["line"], BAD_TIMES[e["line"]][1] in e["reason"]) for e in report["examples"]] == [
        (line, True) for line in sorted(BAD_TIMES)]
    message, failed = _failed_report(tmp_path / "strict", path, *TIMED[len(TABLE):])
    assert f"{name} line 3: ts: the time is missing" in message and failed["status"] == "failed"


@pytest.mark.parametrize("rows, setting, message", [
    ([f"1,1.0,u,{'2024-01-02' if i % 2 else 1_700_000_000 + i}" for i in range(10)], "data.time_column=ts",
     r"data.time_column=ts: the column holds integers \(.*rows.csv line 2\) and dates \(.*rows.csv line 3\)"),
    ([f"{i % 2},1.0,u,2024-01-01" for i in range(10)], "data.time_column=ts",
     "data.time_column=ts: the first test time is 2024-01-01, the earliest of the rows, so no row is left"),
    ([f"{i % 2},1.0,u,{'2024-01-01' if i < 70 else '2024-01-02'}" for i in range(100)], "data.time_column=ts",
     (r"data.time_column=ts: no row is left for validation: the data.valid_fraction=0.1 of the rows before the "
      r"first test time, 2024-01-02, share that time")),
    ([f"1,1.0,u,{i}" for i in range(10)], "data.time_column=when", r"declared column\(s\) \['when'\] not found"),
    ([f"1,1.0,u,{i}" for i in range(10)], "data.time_column=clicked", "data.time_column='clicked' names the label"),
    ([f"1,1.0,u,{i}" for i in range(10)], "data.ignore=[ts]",
     "data.time_column='ts' names a column data.ignore drops"),
])
def test_time_settings_that_cannot_work_are_one_clear_error(tmp_path, rows, setting, message):
    path = tmp_path / "rows.csv"
    path.write_text("clicked,price,user,ts\n" + "\n".join(rows) + "\n")
    with pytest.raises(BadInputError, match=message):
        _ingest(tmp_path, path, "data.time_column=ts", setting)
    assert not list((tmp_path / "work").glob("*/raw/meta.json"))


def test_a_time_column_needs_a_table(tmp_path):
    from pipeline.stages.config import ConfigError

    with pytest.raises(ConfigError, match="data.time_column needs data.source=table"):
        load_config(None, ["data.source=criteo", "data.path=day.tsv", "data.time_column=ts"])


def test_a_folder_of_subfolders_names_them_and_the_glob_that_reads_them(tmp_path):
    """A Hive-partitioned folder (``day=1/part-0.parquet``) said only that the folder had no files."""
    from pipeline.data.input_files import input_files

    (tmp_path / "hive" / "day=1").mkdir(parents=True)
    pq.write_table(pa.table({"y": [0, 1]}), tmp_path / "hive" / "day=1" / "part-0.parquet")
    data = load_config(None, ["data.source=table", f"data.path={tmp_path / 'hive'}"]).data
    with pytest.raises(BadInputError, match=r"subfolders \(day=1\) are not read: .*hive/\*/\*\.parquet"):
        input_files(data)
    glob_data = load_config(None, ["data.source=table", f"data.path={tmp_path / 'hive'}/*/*.parquet"]).data
    assert [p.name for p, _ in input_files(glob_data)] == ["part-0.parquet"]


def test_the_index_pandas_writes_to_parquet_is_not_a_column_to_declare(tmp_path):
    """``df[mask].to_parquet()`` writes the frame's index as ``__index_level_0__``: it was refused as a column with
    no role."""

    frame = pd.DataFrame({"y": [0, 1, 0, 1, 1, 0] * 50, "x": range(300), "c": list("abcabc") * 50})
    frame[frame.x % 3 > 0].to_parquet(tmp_path / "filtered.parquet")
    assert "__index_level_0__" in pq.read_schema(tmp_path / "filtered.parquet").names
    cfg = load_config(None, [f"workdir={tmp_path / 'work'}", "data.source=table", "progress=off",
                             f"data.path={tmp_path / 'filtered.parquet'}", "data.label=y", "data.continuous=[x]",
                             "data.categorical=[c]"])
    raw = data_stage.ensure_raw(cfg)
    assert sum(raw.rows.values()) == 200


def test_a_decimal_continuous_column_is_read_as_its_numbers_and_served_as_them(tmp_path):
    """Databases and Spark export prices as parquet decimals: they were refused as not numeric."""
    import decimal

    from export.repository import raw_columns
    from pipeline.data.raw_folder import RawDataset

    prices = [decimal.Decimal(f"{v}.{v % 100:02d}") for v in range(300)]  # 3.03: not 3.0300000000000002
    table = pa.table({"y": [i % 2 for i in range(300)], "price": pa.array(prices, pa.decimal128(10, 2)),
                      "c": [f"k{i % 7}" for i in range(300)]})
    pq.write_table(table, tmp_path / "prices.parquet")
    cfg = load_config(None, [f"workdir={tmp_path / 'work'}", "data.source=table", "progress=off",
                             f"data.path={tmp_path / 'prices.parquet'}", "data.label=y", "data.continuous=[price]",
                             "data.categorical=[c]"])
    raw = data_stage.ensure_raw(cfg)
    read = pa.concat_tables(pq.read_table(f) for split in raw.splits.values() for f in split)
    assert read.schema.field("price").type == pa.float64()
    assert sorted(read.column("price").to_pylist()) == sorted(float(p) for p in prices)
    layout = raw_columns(RawDataset.load(cfg.paths.raw), cfg.data.list_separator).layout
    for rows in (table.drop_columns(["y"]).to_pandas(),  # a client's frame of Decimal objects, or of Arrow decimals
                 table.drop_columns(["y"]).to_pandas(types_mapper=pd.ArrowDtype)):
        assert layout.tensors(rows)["FLOATS"].ravel().tolist() == [float(p) for p in prices]


def test_a_yes_no_column_given_as_continuous_is_told_where_it_belongs(tmp_path, capsys):
    """pandas writes a bool column as True / False: declared continuous, every row was 'not a number', and the
    advice was to skip them all."""
    (tmp_path / "flags.csv").write_text("y,flag,c\n1,True,a\n0,False,b\n")
    cfg = load_config(None, [f"workdir={tmp_path / 'work'}", "data.source=table", "progress=off",
                             f"data.path={tmp_path / 'flags.csv'}", "data.label=y", "data.continuous=[flag]",
                             "data.categorical=[c]"])
    with pytest.raises(BadInputError, match=r"'True' is not a number \(a yes / no column: name it in data.categorical"):
        data_stage.ensure_raw(cfg)


@pytest.mark.parametrize("settings", [["data.path=events.parquet"], ["data.path=events.parquet", "data.label=clicked"],
                                      ["data.categorical=[user]"], ["data.test_path=late.csv"]])
def test_table_settings_without_a_table_source_are_one_clear_error(settings):
    """`data.path=events.parquet data.label=clicked` without `data.source=table` trained on the built-in synthetic rows
    and said nothing of the file it was given."""
    from pipeline.stages.config import ConfigError

    with pytest.raises(ConfigError, match=r"data.source=synthetic \(the default\) makes rows of its own: add "
                                          r"data.source=table"):
        load_config(None, settings)
    assert load_config(None, ["data.source=table", "data.path=events.parquet", *settings]).data.source == "table"


@pytest.mark.parametrize("reader", ["arrow", "vectorized"])
@pytest.mark.parametrize("value", ["2024-03-01 12:30:00", "2024-03-01T12:30:00Z", "2024-03-01", "03/01/2024", "12:30"])
def test_dates_in_a_continuous_column_are_told_where_they_belong(tmp_path, reader, value):
    """A column of dates named continuous: every row was 'not a number', and the advice was to skip them all."""
    path = tmp_path / "rows.csv"
    path.write_text("y,ts,c\n" + "".join(f"{i % 2},{value},u{i}\n" for i in range(40)))
    message, _ = _failed_report(tmp_path, path, f"data.reader={reader}", "data.label=y", "data.continuous=[ts]",
                                "data.categorical=[c]")
    if value[0].isdigit() and value[2] in "/:":  # a form data.time_column does not read: it is told so
        assert "is not a number (a date or time, written otherwise than ISO 8601 (YYYY-MM-DD, YYYY-MM-DD HH:MM:SS), " \
               "the form data.time_column reads: rewrite it so to order the splits by it with data.time_column=ts" \
               in message
    else:
        assert "is not a number (a date or time: order the splits by it with data.time_column=ts, drop it with " \
               "data.ignore=[ts]" in message
    assert message.count("a date or time") == 1, "said once, not for every example"
    assert "Every row read was malformed: check the column roles" in message and "on_bad_lines=skip" not in message


@pytest.mark.parametrize("reader", ["arrow", "vectorized"])
@pytest.mark.parametrize("header", ["y, price, n, c", "y,price,n,c"])
def test_a_table_written_with_spaces_after_its_commas_is_told_so(tmp_path, reader, header):
    """A CSV written by hand or by a tool with ', ' between its values: its header's names were 'not found' (the
    file's ' price' shown beside 'price'), its numbers and labels 'not a number' with the advice to check the roles."""
    path = tmp_path / "rows.csv"
    path.write_text(header + "\n" + "".join(f"{i % 2}, {i / 7:.3f}, {i}, u{i}\n" for i in range(40)))
    message, _ = _failed_report(tmp_path, path, f"data.reader={reader}", "data.label=y", "data.continuous=[price,n]",
                                "data.categorical=[c]")
    if " " in header:
        assert "its names [' price', ' n', ' c'] have spaces around them" in message
    else:
        assert "price: not a number: ' 0.000', spaces around it (as in a file written with ', ' between its values: " \
               "write it without spaces around the separators, or as parquet)" in message
        assert message.count("as in a file written with") == 1, "said once, not for every example"
        assert "Fix the input as said" in message and "check the column roles" not in message


def test_a_label_or_integer_with_spaces_around_it_is_told_so_and_other_words_are_not():
    from pipeline.data.text_format import SPACED, value_problem

    said = (f"y: expected 0 or 1, found ' 1', {SPACED} (as in a file written with ', ' between its values: write it "
            "without spaces around the separators, or as parquet)")
    assert value_problem("y", "label", " 1") == ("bad_label", said)
    assert SPACED in value_problem("n", "int", "12 ")[1] and SPACED in value_problem("x", "float", " -1.5e3")[1]
    assert SPACED not in value_problem("y", "label", " 2")[1] and SPACED not in value_problem("n", "int", " u1")[1]


def test_a_few_bad_rows_are_still_offered_the_skip():
    from pipeline.data.ingest import _failure_message

    report = {"files": [{}], "bad_rows": 2, "rows_read": 100, "bad": {"not_a_number": 2},
              "examples": [{"file": "a.csv", "line": 3, "reason": "x: 'q' is not a number", "excerpt": "1,q"}]}
    assert "set data.on_bad_lines=skip" in _failure_message(report, Path("raw/ingest_report.json"))


def test_a_timestamp_parquet_column_named_continuous_is_told_where_it_belongs(tmp_path):
    pq.write_table(pa.table({"y": [0, 1], "ts": pa.array([1, 2], pa.timestamp("us")), "c": ["a", "b"]}),
                   tmp_path / "events.parquet")
    cfg = load_config(None, [f"workdir={tmp_path / 'work'}", "data.source=table", "progress=off",
                             f"data.path={tmp_path / 'events.parquet'}", "data.label=y", "data.continuous=[ts]",
                             "data.categorical=[c]"])
    with pytest.raises(BadInputError, match=r"column 'ts' \(data.continuous\) should be a numeric column, found "
                                            r"timestamp\[us\] \(a date or time: order the splits by it with "
                                            r"data.time_column=ts"):
        data_stage.ensure_raw(cfg)


def _ingest_labels(tmp_path, reader: str, suffix: str, labels: list):
    """Ingest 40 rows whose label column ``y`` repeats ``labels`` from a CSV or parquet file; the settings and the
    refusal it must end in."""
    frame = pd.DataFrame({"y": labels * 20, "c": [f"u{i}" for i in range(40)]})
    path = tmp_path / f"rows.{suffix}"
    frame.to_csv(path, index=False) if suffix == "csv" else frame.to_parquet(path, index=False)
    cfg = load_config(None, [f"workdir={tmp_path / 'work'}", "data.source=table", "progress=off", f"data.reader={reader}",
                             f"data.path={path}", "data.label=y", "data.categorical=[c]"])
    with pytest.raises(BadInputError) as err:
        data_stage.ensure_raw(cfg)
    return cfg, str(err.value)


@pytest.mark.parametrize("reader, suffix", [("arrow", "csv"), ("vectorized", "csv"), ("arrow", "parquet")])
def test_labels_of_minus_one_and_one_are_told_to_be_written_as_zero_and_one(tmp_path, reader, suffix):
    """-1 / 1 labels (LibSVM's): the advice was to skip the malformed rows, which would have kept the positives
    alone."""
    _, err = _ingest_labels(tmp_path, reader, suffix, [-1, 1])
    assert "found '-1' (labels of -1 and 1: write the negatives as 0" in err
    assert "on_bad_lines=skip" not in err and err.count("labels of -1") == 1


@pytest.mark.parametrize("reader, suffix", [("arrow", "csv"), ("vectorized", "csv"), ("arrow", "parquet")])
@pytest.mark.parametrize("labels, advice", [
    (["yes", "no"], "found 'yes' (a label of words: write the positive outcome as 1 and the other as 0"),
    ([3, 0], "found '3' (a label is one row's outcome: a count of clicks or a rate is none"),
    (["NULL", "1"], "data.on_bad_lines=skip"),  # rows without their label: no advice of words, and skipping is offered
])
def test_labels_of_words_or_counts_are_told_what_a_label_is(tmp_path, reader, suffix, labels, advice):
    """A label of yes / no, or a count of clicks: the error said "expected 0 or 1" and then to check the roles, and
    pointed at ingest_report.json without saying where it is."""
    cfg, err = _ingest_labels(tmp_path, reader, suffix, labels)
    assert advice in err and err.count("(a label") <= 1
    assert f"details in {cfg.paths.raw / 'ingest_report.json'}" in err


def test_a_list_column_pandas_wrote_to_a_csv_is_malformed_not_one_item_a_row(tmp_path):
    """pandas writes a list cell as its text, "['drama', 'kids']": read as one item, every row's list was a value of its
    own, and the model learned nothing from the column, without a word."""
    pd.DataFrame({"y": [0, 1] * 10, "genres": [["drama", "kids"], ["action"]] * 10}).to_csv(tmp_path / "rows.csv",
                                                                                           index=False)
    cfg = load_config(None, [f"workdir={tmp_path / 'work'}", "data.source=table", "progress=off",
                             f"data.path={tmp_path / 'rows.csv'}", "data.label=y", "data.multihot=[genres]"])
    with pytest.raises(BadInputError, match=r"\{'list_as_text': 20\}.*genres: \"\['drama', 'kids'\]\" is a list "
                                            r"written as its text \(as pandas writes a list to a CSV: join its items"):
        data_stage.ensure_raw(cfg)



@pytest.mark.parametrize("reader", ["arrow", "vectorized"])
def test_integer_times_written_with_a_zero_fraction_split_by_time(tmp_path, reader):
    """pandas writes an integer column widened by a missing value as ``1704067200.0``: every row was a bad time."""
    times = [f"{1_704_067_200 + 60 * i}.0" if i != 3 else "" for i in range(40)]
    path = tmp_path / "rows.csv"
    path.write_text("clicked,price,user,ts\n" + "".join(f"{i % 2},{1.5 * i},u{i % 3},{t}\n" for i, t in enumerate(times)))
    report = _ingest(tmp_path, path, "data.time_column=ts", f"data.reader={reader}", "data.on_bad_lines=skip")
    assert report["bad"] == {"bad_time": 1} and report["rows_kept"] == 39
    meta = json.loads(next((tmp_path / "work").glob("*/raw/meta.json")).read_text())
    assert meta["time_cuts"]["test"] == 1_704_067_200 + 60 * 36


@pytest.mark.parametrize("reader", ["arrow", "vectorized"])
def test_a_time_the_keys_cannot_hold_or_a_form_they_do_not_read_says_why(tmp_path, reader):
    times = [f"2024-02-{1 + i:02d}T08:00:00" for i in range(20)]
    times[4], times[6], times[8] = "9999-12-31T00:00:00", "01/02/2024 10:00", "2024-01-01 00:00:00 UTC"
    path = tmp_path / "rows.csv"
    path.write_text("clicked,price,user,ts\n" + "".join(f"{i % 2},{1.5 * i},u{i},{t}\n" for i, t in enumerate(times)))
    report = _ingest(tmp_path, path, "data.time_column=ts", f"data.reader={reader}", "data.on_bad_lines=skip")
    reasons = {e["line"]: e["reason"] for e in report["examples"]}
    assert "outside the years 1678 to 2261" in reasons[6] and "placeholder" in reasons[6]
    assert "write it in ISO 8601" in reasons[8] and "write it in ISO 8601" in reasons[10]


def test_the_time_column_named_continuous_is_told_to_leave_data_continuous(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("clicked,price,user,ts\n" + "".join(f"{i % 2},{1.5 * i},u{i},2024-02-{1 + i:02d}\n"
                                                         for i in range(20)))
    message, _ = _failed_report(tmp_path, path, "data.time_column=ts", "data.continuous=[price,ts]")
    assert "data.time_column=ts orders the splits by it, but as a feature it is no number: take ts out of " \
           "data.continuous" in message
    parquet = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"clicked": [0, 1], "price": [1.0, 2.0], "user": ["a", "b"],
                             "ts": pa.array([1, 2], pa.timestamp("s"))}), parquet)
    with pytest.raises(BadInputError, match="take ts out of data.continuous"):
        _ingest(tmp_path / "p", parquet, "data.time_column=ts", "data.continuous=[price,ts]")


def test_a_duration_column_is_told_to_become_seconds(tmp_path):
    from pipeline.data.role_hint import propose_roles

    table = pa.table({"clicked": [0, 1], "price": [1.0, 2.0], "user": ["a", "b"],
                      "stay": pa.array([5, 7], pa.duration("s"))})
    pq.write_table(table, tmp_path / "rows.parquet")
    for roles in (["data.continuous=[price,stay]"], ["data.time_column=stay"]):
        with pytest.raises(BadInputError, match=r"column 'stay' .* found duration\[s\] \(a duration: write it as a "
                                                r"number, such as seconds"):
            _ingest(tmp_path / roles[0][5:9], tmp_path / "rows.parquet", *roles)
    assert propose_roles(table, "clicked", "|")["time_column"] == ""


def test_files_and_folders_named_otherwise_than_plain(tmp_path):
    """A name with brackets was taken for a glob; an upper-case .GZ was not decompressed; one file as both valid
    and test split was accepted; a Delta Lake folder was read with the files its later versions replaced."""
    from pipeline.data.input_files import input_files

    rows = "\n".join(_table()) + "\n"
    bracketed = tmp_path / "rows[2024].csv"
    bracketed.write_text(rows)
    assert _ingest(tmp_path / "a", bracketed)["rows_kept"] == 60
    upper = tmp_path / "rows.csv.GZ"
    upper.write_bytes(gzip.compress(rows.encode()))
    assert _ingest(tmp_path / "b", upper)["rows_kept"] == 60
    same = load_config(None, [*TABLE, f"data.path={bracketed}", f"data.valid_path={upper}", f"data.test_path={upper}"])
    with pytest.raises(BadInputError, match="data.valid_path and data.test_path both name"):
        input_files(same.data)
    delta = tmp_path / "delta"
    (delta / "_delta_log").mkdir(parents=True)
    (delta / "part-0.parquet").write_bytes(b"")
    with pytest.raises(BadInputError, match=r"is a Delta Lake table \(_delta_log/\).*write one version of it out"):
        input_files(load_config(None, [*TABLE, f"data.path={delta}"]).data)
    hive = tmp_path / "hive" / "rows=1"
    hive.mkdir(parents=True)
    (hive / "rows.csv").write_text(rows)
    with pytest.raises(BadInputError, match=r"hive/\*/\*\.csv'"):
        input_files(load_config(None, [*TABLE, f"data.path={hive.parent}"]).data)
    (hive / "README.md").write_text("the data\n")
    with pytest.raises(BadInputError, match=r"README.md: expected a .csv.*name only those with a glob"):
        _ingest(tmp_path / "c", hive)


def test_values_holding_quoted_line_breaks_are_told_to_lose_them_or_come_as_parquet(tmp_path):
    """A CSV whose text values hold line breaks inside quotes (valid CSV that this line-based reader does not read):
    every row is malformed, and the message says why, not to check the column roles."""
    rows = tmp_path / "rows.csv"
    rows.write_text("\n".join(_table()[:1] + [f'{i % 2},{i}.5,"Zoë\nsaid {i}"' for i in range(40)]) + "\n")
    message, report = _failed_report(tmp_path / "w", rows)
    assert report["bad"]["open_quote"] > 0
    assert "A quoted value that holds a line break is not read" in message and "or as parquet" in message
    assert "check the column roles" not in message and "on_bad_lines=skip" not in message


def test_text_in_another_encoding_is_told_to_be_saved_as_utf8(tmp_path):
    utf16 = tmp_path / "rows.csv"
    utf16.write_bytes("\n".join(_table()).encode("utf-16"))
    with pytest.raises(BadInputError, match=r"header line is not valid UTF-8 .*UTF-16 text .*save it as UTF-8"):
        _ingest(tmp_path, utf16)
    latin = tmp_path / "rows_latin.csv"
    latin.write_bytes(("\n".join(_table()[:1] + [f"{i % 2},{i}.5,{'Zoë' if i % 3 else 'Bob'}" for i in range(30)])
                       + "\n").encode("latin-1"))
    message, _ = _failed_report(tmp_path / "l", latin)
    assert "save it as UTF-8" in message and "on_bad_lines=skip" not in message


def test_the_default_label_missing_is_named_as_the_setting(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("y,price,user\n1,2.0,u\n")
    with pytest.raises(BadInputError, match=r"\['label'\] not found \(data.label=label names the column of 0 / 1"):
        _ingest(tmp_path, path, "data.label=label")


def test_ids_typed_as_integers_in_one_file_and_floats_in_another_are_noted(tmp_path, capsys):
    """pandas widens an integer column with a blank to floats: one day's file held 7, another's 7.0, and each id
    became two categories without a word."""
    folder = tmp_path / "days"
    folder.mkdir()
    day = pd.DataFrame({"clicked": [i % 2 for i in range(40)], "price": [i / 2 for i in range(40)],
                        "user": [i % 3 for i in range(40)]})
    day.to_parquet(folder / "day1.parquet", index=False)
    widened = day.assign(user=day["user"].astype(float))
    widened.loc[0, "user"] = None
    widened.to_parquet(folder / "day2.parquet", index=False)
    cfg = load_config(None, [f"workdir={tmp_path / 'work'}", *TABLE, f"data.path={folder}", "progress=off"])
    data_stage.run(cfg)
    note = ("[data] note: column 'user' holds integers in day1.parquet and floats in day2.parquet (pandas widens an "
            "integer column with a missing value): 7 and 7.0 become two categories")
    assert note in capsys.readouterr().out
    report = json.loads((cfg.paths.raw / "ingest_report.json").read_text())
    assert len(report["notes"]) == 1


@pytest.mark.parametrize("name", ["day_0.gz", "day_1.bz2", "day_2", "rows.csv.bz2"])
def test_criteo_days_named_as_criteo_names_them_and_bz2_files_are_read(tmp_path, name):
    """`day_0.gz` was refused after the whole ingest (a table's suffix was asked of a Criteo file), and any `.bz2`
    input was a traceback (Arrow names the codec bz2)."""
    import bz2

    lines = (_table() if name.startswith("rows") else _criteo())
    data = ("\n".join(lines) + "\n").encode()
    path = tmp_path / name
    path.write_bytes(gzip.compress(data) if name.endswith(".gz") else bz2.compress(data) if name.endswith(".bz2")
                     else data)
    report = _ingest(tmp_path, path)
    assert report["rows_kept"] == 60 and report["bad_rows"] == 0
