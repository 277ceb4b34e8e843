"""The vectorized reader of CSV / TSV tables (numpy here, CuPy on a GPU) against the Arrow path of ``read_table``: the
same tables (labels, numbers to the bit, categories, lists), line numbers and report, for every kind of value and
malformed line, across blocks, for random mutations of valid lines, and through the data stage. A block that quotes
otherwise than whole values is the Arrow path's; every other block must be parsed with array operations only."""

from __future__ import annotations

import json
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.data import readers
from pipeline.data.readers import MAX_LINE_BYTES, FileReport, Roles, read_table
from pipeline.data.vectorized_text import text_layout
from pipeline.stages.config import load_config
from pipeline.stages.data import ensure_raw
from tests.test_data_vectorized_text import assert_same_reads, assert_same_whole_or_in_pieces, mutated_line

XPS = [pytest.param("numpy"), pytest.param("cupy", marks=pytest.mark.gpu)]
ROLES = Roles("clicked", ["price", "score"], ["user", "city"], ["tags"], ["note"], "")
HEADER = ["note", "user", "price", "clicked", "tags", "score", "city"]  # any order; note is dropped

NUMBERS_KEPT = ["", "0", "-0", "1.5", "-2.25", "+3", "1.", ".5", "+.5", "007.50", "1e5", "1E-5", "-1.5e+10", "5.e3",
                "0.1", "0.30000000000000004", "9007199254740993", "123456789012345678901234567890", "1e-400",
                "0e99999999", "1.7976931348623157e308", "4.9e-324", "2.2250738585072011e-308", "1e22", "1e23",
                "12345678901234567e-5", "3.14159265358979323846264338327950288", "1e0000022", "-0.0e-0",
                "90071992547409.93", "1234567890123456789e-10", "0.12345678901234567", "9999999999999999999.5",
                "NA", "NULL", "null", "nan", "-nan", "NaN", "NAN", "<NA>", "#N/A", "None", "n/a", "N/A", "-1.#IND"]
NUMBERS_BAD = ["abc", "1.2.3", "1e", "e5", "--1", "+-1", "1e+-5", " 1", "1 ", "0x10", "inf", "-Infinity", "1e400",
               "-1e309", "Nan", "nAn", "1_0", "\u0663", "1e5.0", ".", "-", "+", "1d5", "NA ", "\ufeff1", "1-", "1e5e3"]
LABELS_KEPT = ["0", "1", "1.0", "0.", "1.000", "true", "FALSE", "True", "fAlSe"]
LABELS_BAD = ["2", "", "01", "-0", " 1", "yes", "tru", "truee", "1e0", "falsee"]
STRINGS = ["é", "a b", "NA", "", "x|y", "0x1", "\ufeff", "€😀", "1.5", " "]
LISTS = ["a|b", "", "|", "a||b|", "é|€", "single", "||", "a b|c", "NA", "x|", "[a", "a]", "]", "a[b]", "[", " [a]"]
LISTS_AS_TEXT = ["[]", "['a' 'b']", "[1|2]", "[[x]]"]  # lists written as their text: malformed
QUOTED = [("user", '"a, b"'), ("user", '""'), ("city", '","'), ("note", '"n, 1"'), ("price", '"1.5"'),
          ("price", '"NA"'), ("score", '"oops"'), ("clicked", '"1"'), ("clicked", '"2"'), ("tags", '"x|y, z"'),
          ("user", '"é"'), ("price", '""')]


def _fields(i: int) -> dict[str, str]:
    return {"note": f"n{i}", "user": f"u{i * 7919 % 1000}" if i % 6 else "", "price": f"{(i * 37) % 1000 / 8}",
            "clicked": str(i % 2), "tags": "|".join(f"t{(i + k) % 11}" for k in range(i % 4)),
            "score": f"{i * 1e-3:.6g}" if i % 5 else "", "city": f"c{i % 13}"}


def _line(i: int, delimiter: str, **values: str) -> bytes:
    fields = {**_fields(i), **values}
    return delimiter.join(fields[name] for name in HEADER).encode()


def _hostile_lines(delimiter: str) -> list[bytes]:
    lines, i = [], 1
    d = delimiter

    def add(line: bytes) -> None:
        nonlocal i
        lines.append(line)
        i += 1

    for k, value in enumerate(NUMBERS_KEPT + NUMBERS_BAD):
        add(_line(i, d, **{("price", "score")[k % 2]: value}))
    for value in LABELS_KEPT + LABELS_BAD:
        add(_line(i, d, clicked=value))
    for k, value in enumerate(STRINGS):
        add(_line(i, d, **{("user", "city", "note")[k % 3]: value}))
    for value in LISTS + LISTS_AS_TEXT:
        add(_line(i, d, tags=value))
    add(_line(i, d, tags='"[a, b]"'.replace(",", d)))  # quoted, as pandas writes a list's text
    for column, value in QUOTED:  # values wrapped whole in quotes, the delimiter inside some
        add(_line(i, d, **{column: value.replace(",", d)}))
    add(_line(i, d, price="x", score="y", clicked="7"))          # the label is checked first, then price
    add(_line(i, d, score="oops") + b"\r")                       # \r\n line end, a bad value
    add(_line(i, d, user="ab\rcd"))                              # a stray \r
    add(_line(i, d)[:5] + b"\xff" + _line(i, d)[5:])              # broken UTF-8
    add(_line(i, d) + b"\xc3")
    add(b"")                                                     # empty lines
    add(b"\r")
    add(d.join(["1"] * 6).encode())                              # wrong field counts
    add(_line(i, d) + d.encode() + b"extra")
    add(b"garbage")
    add(_line(i, d, note="y" * (MAX_LINE_BYTES + 1)))            # over the length limit
    add(_line(i, d, clicked="7") + b"\xff")                      # broken UTF-8 is found before the label
    for _ in range(30):
        add(_line(i, d) + (b"\r" if i % 3 == 0 else b""))
    return lines


def _write(path, lines: list[bytes], end: bytes = b"\n"):
    delimiter = "," if path.suffix == ".csv" else "\t"
    path.write_bytes(b"\xef\xbb\xbf" + delimiter.join(HEADER).encode() + end + end.join(lines) + end)
    return path


def _read(path, xp, chunk_rows: int, stop: bool) -> tuple[list[tuple[pa.Table, np.ndarray]], FileReport]:
    report = FileReport(str(path))
    return list(read_table(path, ROLES, chunk_rows, report, stop, "|", xp)), report


def _assert_same(path, xp_name: str, monkeypatch, chunk_rows: int = 64, stop: bool = False,
                 arrow_blocks: int | None = 0) -> FileReport:
    """Read ``path`` both ways; assert the same blocks, line numbers and report, and that the vectorized read left
    ``arrow_blocks`` blocks to the Arrow path (None: any); return the report."""
    want_blocks, want = _read(path, None, chunk_rows, stop)
    by_arrow = []
    parse = readers._parse_block
    monkeypatch.setattr(readers, "_parse_block", lambda *a, **k: by_arrow.append(1) or parse(*a, **k))
    got_blocks, got = _read(path, pytest.importorskip(xp_name), chunk_rows, stop)
    monkeypatch.setattr(readers, "_parse_block", parse)
    assert arrow_blocks is None or len(by_arrow) == arrow_blocks
    assert_same_reads(got_blocks, got, want_blocks, want, floats=("price", "score"))
    return want


@pytest.mark.parametrize("xp", XPS)
@pytest.mark.parametrize("stop", [False, True])
@pytest.mark.parametrize("name", ["rows.csv", "rows.tsv"])
def test_values_and_malformed_lines_of_every_kind_give_the_arrow_paths_report(tmp_path, monkeypatch, xp, stop, name):
    path = _write(tmp_path / name, _hostile_lines("," if name.endswith(".csv") else "\t"))
    report = _assert_same(path, xp, monkeypatch, stop=stop)
    if not stop:
        assert set(report.bad) == {"wrong_field_count", "line_too_long", "carriage_return", "invalid_utf8",
                                   "bad_label", "not_a_number", "out_of_range", "list_as_text"}
        assert report.bad["list_as_text"] == len(LISTS_AS_TEXT) + 1
        assert report.bad["bad_label"] == len(LABELS_BAD) + 2
        assert report.bad["out_of_range"] == 4  # inf, -Infinity, 1e400, -1e309
        quoted_kept = len(QUOTED) - 2  # "oops" and "2" are malformed
        assert report.rows_kept == len(NUMBERS_KEPT) + len(LABELS_KEPT) + len(STRINGS) + len(LISTS) + quoted_kept + 30
    else:
        assert report.stopped_at_line is not None and report.rows_kept == 0


@pytest.mark.parametrize("xp", XPS)
@pytest.mark.parametrize("quoted", ['"a ""quoted"" one"', '"open', 'in"side', '"a"b', ' "a"', '"a" ', '"a"",b"'])
def test_a_csv_block_quoted_otherwise_than_whole_values_is_the_arrow_paths_and_the_others_are_not(
        tmp_path, monkeypatch, xp, quoted):
    lines = [_line(i, ",", user=f'"u{i}, {i % 7}"' if i % 3 == 0 else f"u{i}") for i in range(1, 20_001)]  # 4 blocks
    lines[10] = _line(11, ",", user=quoted)
    lines[15_000] = _line(15_001, ",", score="oops")
    report = _assert_same(_write(tmp_path / "rows.csv", lines), xp, monkeypatch, arrow_blocks=1)
    assert report.bad_rows >= 1 and report.rows_kept >= 19_997


@pytest.mark.parametrize("xp", XPS)
@pytest.mark.parametrize("stop", [False, True])
def test_a_file_of_many_blocks_with_bad_lines_near_their_edges(tmp_path, monkeypatch, xp, stop):
    lines = [_line(i, "\t") for i in range(1, 30_001)]  # blocks of 1 MiB
    rng = random.Random(5)
    for k in rng.sample(range(len(lines)), 40):
        column = rng.choice(["price", "score", "clicked"])
        pool = LABELS_BAD if column == "clicked" else NUMBERS_BAD + NUMBERS_KEPT
        lines[k] = _line(k + 1, "\t", **{column: rng.choice(pool)})
    for k in range(3000, len(lines), 4100):
        lines[k:k + 30] = [b"\t".join([b"1"] * 5)] * 30
    path = _write(tmp_path / "rows.tsv", lines)
    report = _assert_same(path, xp, monkeypatch, stop=stop)
    assert report.rows_read == (len(lines) if not stop else report.stopped_at_line - 1)


@pytest.mark.parametrize("xp", XPS)
@pytest.mark.parametrize("ends", ["\n", "\r\n"])
def test_line_ends(tmp_path, monkeypatch, xp, ends):
    lines = [_line(i, ",") for i in range(1, 300)]
    lines[40] = _line(41, ",", price="oops")
    report = _assert_same(_write(tmp_path / "rows.csv", lines, ends.encode()), xp, monkeypatch)
    assert (report.rows_read, report.rows_kept, report.bad) == (299, 298, {"not_a_number": 1})


MUTATIONS = [b"0", b"1", b"9", b"-", b"+", b"x", b"e", b"E", b".", b" ", b"\t", b",", b"|", b"\r", b"\n", b"\x80", b'"',
             b"\xc3", b"\xa9", b"\xff", b"\xef\xbb\xbf", b"", b"\r\n", b"00", b"NA", b"nan", b"inf", b"true"]


def _mutated(rng: random.Random, line: bytes, delimiter: bytes, quotes: bool) -> bytes:
    """``line`` changed 1 to 3 times; with ``quotes`` a change may put a quote anywhere, else only around a value."""

    def field_replaced(rng: random.Random, line: bytes) -> bytes:  # the label and the numbers more often
        fields = line.split(delimiter)
        column = rng.randrange(len(fields)) if rng.random() < 0.3 else rng.choice([2, 3, 5])
        if column < len(fields):
            values = LABELS_KEPT + LABELS_BAD if column == 3 else NUMBERS_KEPT + NUMBERS_BAD + STRINGS + LISTS
            fields[column] = rng.choice(values).encode()
        return delimiter.join(fields)

    line = mutated_line(rng, line, MUTATIONS if quotes else [m for m in MUTATIONS if m != b'"'], field_replaced)
    if rng.random() < 0.3 and not any(c in line for c in (b'"', b"\r", b"\n")):  # a value quoted whole
        fields = line.split(delimiter)
        column = rng.randrange(len(fields))
        fields[column] = b'"' + fields[column] + b'"'
        line = delimiter.join(fields)
    return line


@pytest.mark.parametrize("xp", XPS)
@pytest.mark.parametrize("seed", range(10))
def test_random_mutations_of_valid_lines(tmp_path, monkeypatch, xp, seed):
    rng = random.Random(seed)
    name = "rows.tsv" if seed % 2 else "rows.csv"
    delimiter = b"\t" if seed % 2 else b","
    quotes = seed % 3 == 0  # a quote anywhere: the block is the Arrow path's
    lines = [_mutated(rng, _line(i, delimiter.decode()), delimiter, quotes) if rng.random() < 0.4
             else _line(i, delimiter.decode()) for i in range(1, 401)]
    path = _write(tmp_path / name, lines, b"\r\n" if seed % 4 == 3 else b"\n")
    report = _assert_same(path, xp, monkeypatch, arrow_blocks=None if quotes else 0)
    assert report.bad_rows > 20
    _assert_same(path, xp, monkeypatch, stop=True, arrow_blocks=None if quotes else 0)


@pytest.mark.parametrize("xp", XPS)
def test_a_block_is_parsed_the_same_whole_or_in_pieces(xp):
    array_module = pytest.importorskip(xp)
    layout = text_layout(HEADER, readers._kinds(ROLES, integer_continuous=False), "\t", True, "|")
    lines = _hostile_lines("\t")[:-20] + [_line(i, "\t") for i in range(200)]
    lines = [line for line in lines if len(line) < MAX_LINE_BYTES]
    assert_same_whole_or_in_pieces(array_module, layout, lines)


def test_a_long_list_separator_leaves_the_file_to_the_arrow_path():
    kinds = readers._kinds(ROLES, integer_continuous=False)
    assert text_layout(HEADER, kinds, ",", True, "|") is not None
    assert text_layout(HEADER, kinds, ",", True, "||") is None


TIMES_KEPT = ["2024-01-05", "2024-01-05T10:00:00", "2024-01-05 10:00:00.5", "2024-01-05T10:00:00Z",
              "2024-01-05T10:00:00+02:00", '"2024-02-29"']
TIMES_BAD = ["", "yesterday", "2024-02-30", "2024-13-01", "1.5", '"soon"', "2024-01-05T25:00"]


@pytest.mark.parametrize("xp", XPS)
@pytest.mark.parametrize("form", ["dated", "integer"])
@pytest.mark.parametrize("feature", [False, True])
def test_a_time_column_gives_the_arrow_paths_keys_forms_and_bad_times(tmp_path, monkeypatch, xp, form, feature):
    """The rows' time keys (the last column), the forms of time met and each row whose time is none, as the Arrow
    path gives them, with the time column read for the split only or also a feature (a category)."""
    roles = Roles("clicked", ["price"], ["user"] + (["day"] if feature else []), [], [], "day")
    kept = TIMES_KEPT if form == "dated" else ["1700000000", "-5", "0", '"42"', "9223372036854775807"]
    bad = TIMES_BAD + (["2024-01-05"] if form == "integer" else ["99999999999999999999"])
    values = [kept[i % len(kept)] for i in range(300)]
    for k, value in enumerate(bad):
        values[7 + 31 * k] = value
    lines = [f"{i % 2},{i * 0.25},u{i % 7},{value}".encode() for i, value in enumerate(values)]
    lines[100] = b"2,1.0,u1," + values[100].encode()  # a bad label: counted as that, not for its time
    lines[101] = b"1,2.0,u1"                          # too few fields
    path = tmp_path / "rows.csv"
    path.write_bytes(b"clicked,price,user,day\n" + b"\n".join(lines) + b"\n")
    want, got = FileReport(str(path)), FileReport(str(path))
    want_tables = list(read_table(path, roles, 64, want))
    keys_want, report_want = readers.read_times(path, roles, 64)
    monkeypatch.setattr(readers, "_parse_block", None)  # every block through the vectorized parse
    got_tables = list(read_table(path, roles, 64, got, xp=pytest.importorskip(xp)))
    assert got == want and got.bad["bad_time"] >= len(TIMES_BAD) - 1 and got.time_forms
    assert len(got_tables) == len(want_tables)
    for (table, lines_got), (want_table, lines_want) in zip(got_tables, want_tables):
        assert table.equals(want_table) and table.column_names[-1] == "__time__"
        np.testing.assert_array_equal(lines_got, lines_want)
    keys_got, report_got = readers.read_times(path, roles, 64, xp=pytest.importorskip(xp))
    np.testing.assert_array_equal(keys_got, keys_want)
    assert report_got == report_want


@pytest.mark.parametrize("xp", XPS)
def test_the_data_stage_writes_the_same_raw_data_with_the_vectorized_reader(tmp_path, xp):
    path = _write(tmp_path / "rows.csv", _hostile_lines(",")[:-20] + [_line(i, ",") for i in range(500)])
    (_, report, tables), (_, want_report, want_tables) = _made_by_each_reader(tmp_path, xp, [
        f"data.path={path}", "data.label=clicked", "data.continuous=price,score", "data.categorical=user,city",
        "data.multihot=tags", "data.ignore=note"])
    assert report == want_report and report["bad_rows"] > 40
    assert all(tables[s].equals(want_tables[s]) for s in want_tables)


def _made_by_each_reader(tmp_path, xp: str, settings: list[str]) -> tuple[tuple, tuple]:
    """What the data stage makes of a table with ``settings`` (``meta.json``, ``ingest_report.json``, each split's
    rows) through the vectorized reader on ``xp``'s device, then through the Arrow reader."""
    device = "cpu" if xp == "numpy" else "cuda"
    made = {}
    for reader in ("vectorized", "arrow"):
        cfg = load_config(None, [f"workdir={tmp_path / reader}", "data.source=table", *settings,
                                 "data.on_bad_lines=skip", f"data.reader={reader}", f"device={device}", "progress=off"])
        raw = ensure_raw(cfg)
        made[reader] = (json.loads((raw.root / "meta.json").read_text()),
                        json.loads((raw.root / "ingest_report.json").read_text()),
                        {s: pa.concat_tables([pq.read_table(p) for p in parts]) for s, parts in raw.splits.items()})
    return made["vectorized"], made["arrow"]


@pytest.mark.parametrize("xp", XPS)
@pytest.mark.parametrize("rows", [[], [b""], [b"\r", b""], [b"1,2"], [_line(1, ",", price="x"), b"garbage"]], ids=repr)
def test_files_without_a_good_row(tmp_path, monkeypatch, xp, rows):
    report = _assert_same(_write(tmp_path / "rows.csv", rows), xp, monkeypatch)
    assert report.rows_kept == 0


def test_a_table_of_parquet_files_only_is_not_said_to_be_parsed_as_text(tmp_path, capsys):
    from pipeline.stages.data import text_array_module

    pq.write_table(pa.table({"clicked": [0, 1], "user": ["a", "b"]}), tmp_path / "rows.parquet")
    (tmp_path / "rows.csv").write_text("clicked,user\n0,a\n")
    for name, module in (("rows.parquet", None), ("rows.csv", "numpy"), ("*", "numpy")):
        cfg = load_config(None, ["data.source=table", f"data.path={tmp_path / name}", "data.label=clicked",
                                 "data.categorical=user", "data.reader=vectorized", "device=cpu"])
        assert text_array_module(cfg) == module
    assert capsys.readouterr().out.count("text parsed with numpy") == 2


@pytest.mark.parametrize("xp", XPS)
def test_a_table_of_hundreds_of_number_columns_names_the_bad_one(tmp_path, monkeypatch, xp):
    names = [f"x{k}" for k in range(300)]
    lines = [",".join(["1", *(f"{k * 0.5 + i}" for k in range(300))]) for i in range(50)]
    lines[7] = ",".join(
        ["1", *("oops" if k == 280 else f"{k * 0.5}" for k in range(300))])
    path = tmp_path / "wide.csv"
    path.write_text("clicked," + ",".join(names) + "\n" + "\n".join(lines) + "\n")
    roles = Roles("clicked", names, [], [], [], "")
    want, got = FileReport(str(path)), FileReport(str(path))
    want_tables = list(read_table(path, roles, 64, want))
    got_tables = list(read_table(path, roles, 64, got, xp=pytest.importorskip(xp)))
    assert got == want and got.examples[0]["reason"] == "x280: 'oops' is not a number"
    assert all(t.equals(w) for (t, _), (w, _) in zip(got_tables, want_tables))


@pytest.mark.parametrize("xp", XPS)
def test_the_data_stage_splits_by_time_the_same_with_the_vectorized_reader(tmp_path, xp):
    days = [f"2024-{1 + i % 12:02d}-{1 + i % 28:02d}" for i in range(2000)]
    lines = [f"{i % 2},{i * 0.5},u{i % 13},{day}" for i, day in enumerate(days)]
    lines[77] = "1,2.0,u1,someday"
    parts = [tmp_path / "a.csv", tmp_path / "b.csv"]
    for k, part in enumerate(parts):
        part.write_text("clicked,price,user,day\n" + "\n".join(lines[k::2]) + "\n")
    (meta, report, tables), (want_meta, want_report, want_tables) = _made_by_each_reader(tmp_path, xp, [
        f"data.path={tmp_path}/*.csv", "data.label=clicked", "data.continuous=price", "data.categorical=user",
        "data.time_column=day", "data.valid_fraction=0.1", "data.test_fraction=0.1"])
    assert meta["time_cuts"] == want_meta["time_cuts"] and want_meta["time_cuts"]["test"] is not None
    assert report == want_report and want_report["bad"] == {"bad_time": 1}
    assert all(tables[s].equals(t) for s, t in want_tables.items())


@pytest.mark.parametrize("files", [1, 3])
def test_running_out_of_memory_in_the_vectorized_parse_is_one_error_line_naming_the_setting(tmp_path, monkeypatch,
                                                                                         capsys, files):
    from pipeline.data import vectorized_text
    from pipeline.stages.cli import main

    for k in range(files):
        _write(tmp_path / f"rows{k}.csv", [_line(i, ",") for i in range(50)])

    def no_memory(*args, **kwargs):
        raise MemoryError("Out of memory allocating 1,073,741,824 bytes (allocated so far: 0 bytes).")

    monkeypatch.setattr(vectorized_text, "parse_block", no_memory)
    assert main(["run", "data", f"workdir={tmp_path / 'w'}", "data.source=table", f"data.path={tmp_path}/*.csv",
                 "data.label=clicked", "data.continuous=price,score", "data.categorical=user,city",
                 "data.multihot=tags", "data.ignore=note", "data.reader=vectorized", "device=cpu",
                 "progress=off"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "out of memory parsing" in err[0]
    assert "data.chunk_rows" in err[0] and "data.reader=arrow" in err[0]
