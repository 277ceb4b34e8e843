import gzip
import json
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.data.ingest import split_codes
from pipeline.data.line_blocks import LongLine, line_blocks
from pipeline.data.readers import FileReport, _read_text, read_criteo
from pipeline.data.text_format import MAX_LINE_BYTES
from pipeline.errors import BadInputError
from pipeline.stages.config import load_config
from pipeline.stages.data import ensure_raw

ROWS = 300
COUNT = " (a label is one row's outcome: a count of clicks or a rate is none; give each outcome its row)"
# line number (1-based) -> (kind, what the report says)
MALFORMED = {
    5: ("wrong_field_count", "expected 40 fields, found 39"),
    10: ("wrong_field_count", "expected 40 fields, found an empty line"),
    15: ("not_a_number", "I3: 'abc' is not an integer"),
    20: ("bad_label", "label: expected 0 or 1, found '2'" + COUNT),
    25: ("invalid_utf8", "invalid UTF-8"),
    30: ("wrong_field_count", "expected 40 fields, found 41"),
}


def _criteo_line(i: int) -> list[str]:
    ints = [str(i * 13 + k - 5) if (i + k) % 4 else "" for k in range(13)]
    cats = [f"{(i * 31 + k) % 997:08x}" if (i + k) % 5 else "" for k in range(26)]
    return [str(i % 2), *ints, *cats]


def _criteo_bytes() -> bytes:
    lines = ["\t".join(_criteo_line(i)) for i in range(1, ROWS + 1)]
    lines[4] = "\t".join(_criteo_line(5)[:39])
    lines[9] = ""
    lines[14] = "\t".join(_criteo_line(15)[:3] + ["abc"] + _criteo_line(15)[4:])
    lines[19] = "\t".join(["2"] + _criteo_line(20)[1:])
    lines[29] = "\t".join(_criteo_line(30) + ["extra"])
    data = [line.encode() for line in lines]
    data[24] = data[24][:-3] + b"\xff\xfe"
    return b"\n".join(data) + b"\n"


@pytest.fixture(params=["day_0.tsv", "day_0.tsv.gz"])
def criteo_file(request, tmp_path):
    path = tmp_path / request.param
    data = _criteo_bytes()
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


def _cfg(tmp_path, *overrides):
    return load_config(None, [f"workdir={tmp_path / 'work'}", "data.chunk_rows=64", "progress=off", *overrides])


def test_criteo_skip_counts_and_reports_every_malformed_row(tmp_path, criteo_file, capsys):
    cfg = _cfg(tmp_path, "data.source=criteo", f"data.path={criteo_file}", "data.on_bad_lines=skip")
    raw = ensure_raw(cfg)
    good = ROWS - len(MALFORMED)
    assert sum(raw.rows.values()) == good
    report = json.loads((raw.root / "ingest_report.json").read_text())
    assert report["status"] == "ok"
    assert (report["rows_read"], report["rows_kept"], report["bad_rows"]) == (ROWS, good, len(MALFORMED))
    assert report["bad"] == {"wrong_field_count": 3, "not_a_number": 1, "bad_label": 1, "invalid_utf8": 1}
    assert [e["line"] for e in report["examples"]] == sorted(MALFORMED)
    for example in report["examples"]:
        assert MALFORMED[example["line"]][1] in example["reason"]
    assert report["examples"][2]["excerpt"].startswith("1\t")  # line 15's text
    assert "malformed 6" in capsys.readouterr().out

    table = pa.concat_tables([pq.read_table(p) for s in ("train", "valid", "test") for p in raw.splits[s]])
    assert table.schema.field("label").type == pa.int8()
    assert table.schema.field("I1").type == pa.int64() and table.schema.field("C1").type == pa.string()
    names = ["label", *[f"I{i}" for i in range(1, 14)], *[f"C{i}" for i in range(1, 27)]]

    def typed(fields):  # what a kept line should become: empty -> None, numbers -> int
        return tuple(None if v == "" else (int(v) if n[0] in "lI" else v) for n, v in zip(names, fields))

    want = sorted((typed(_criteo_line(i)) for i in range(1, ROWS + 1) if i not in MALFORMED), key=repr)
    got = sorted((tuple(r.values()) for r in table.to_pylist()), key=repr)
    assert got == want


def test_criteo_error_mode_stops_names_the_first_problems_and_saves_the_report(tmp_path, criteo_file):
    cfg = _cfg(tmp_path, "data.source=criteo", f"data.path={criteo_file}")
    with pytest.raises(BadInputError) as err:
        ensure_raw(cfg)
    message = str(err.value)
    assert "line 5: expected 40 fields, found 39" in message and "data.on_bad_lines=skip" in message
    raw = cfg.paths.raw
    report = json.loads((raw / "ingest_report.json").read_text())
    assert report["status"] == "failed" and report["bad_rows"] >= 1
    assert report["files"][0]["stopped_at_line"] is not None
    assert not (raw / "meta.json").exists()
    assert not list(raw.glob("*/*.parquet"))


def test_criteo_rows_that_parse_but_are_wrong(tmp_path):
    # no unparsable number here, so the block takes the typed fast path
    lines = ["\t".join(_criteo_line(i)) for i in range(1, 51)]
    lines[2] = "\t".join(["2"] + _criteo_line(3)[1:])
    lines[6] = "\t".join(_criteo_line(7)[:20])
    path = tmp_path / "day.tsv"
    path.write_text("\n".join(lines))  # no newline at the end
    raw = ensure_raw(_cfg(tmp_path, "data.source=criteo", f"data.path={path}", "data.on_bad_lines=skip"))
    report = json.loads((raw.root / "ingest_report.json").read_text())
    assert [(e["line"], e["reason"]) for e in report["examples"]] == [
        (3, "label: expected 0 or 1, found '2'" + COUNT), (7, "expected 40 fields, found 20")]
    assert sum(raw.rows.values()) == 48


def _read_criteo(path, chunk_rows: int = 64) -> tuple[pa.Table | None, np.ndarray, FileReport]:
    report = FileReport(str(path))
    blocks = list(read_criteo(path, chunk_rows, report))
    table = pa.concat_tables([t for t, _ in blocks]) if blocks else None
    return table, np.concatenate([lines for _, lines in blocks]) if blocks else np.zeros(0, np.int64), report


# values Arrow's typed parse took (hex, spaces around a number, a label written 00 / 01 / -0) while
# the checks of the text path refuse them: the same line was kept or malformed by what else its block held
REFUSED = {2: (1, "0x10", "not_a_number"), 3: (2, " 7", "not_a_number"), 4: (3, "7 ", "not_a_number"),
           5: (0, "00", "bad_label"), 6: (0, "01", "bad_label"), 7: (0, "-0", "bad_label"),
           8: (4, "0X1f", "not_a_number")}


@pytest.mark.parametrize("with_text_path", [False, True])
def test_a_value_is_judged_alone_whatever_else_its_block_holds(tmp_path, with_text_path):
    lines = [_criteo_line(i) for i in range(1, 21)]
    for line, (column, value, _) in REFUSED.items():
        lines[line - 1][column] = value
    if with_text_path:  # a value that does not convert sends the block to the text path
        lines[14][5] = "zz"
    path = tmp_path / "day.tsv"
    path.write_text("".join("\t".join(fields) + "\n" for fields in lines))
    _, kept, report = _read_criteo(path)
    want = {"not_a_number": 4 + with_text_path, "bad_label": 3}
    assert report.bad == want and report.rows_kept == 20 - sum(want.values())
    assert set(REFUSED) & set(kept.tolist()) == set()


def test_a_byte_order_mark_is_dropped_at_the_start_of_the_file_only(tmp_path):
    lines = ["\t".join(_criteo_line(i)) for i in range(1, 3)]
    path = tmp_path / "day.tsv"
    path.write_bytes(("\ufeff" + lines[0] + "\n" + lines[1] + "\n").encode())
    table, kept, report = _read_criteo(path)
    assert kept.tolist() == [1, 2] and table.column("label").to_pylist() == [1, 0] and report.bad == {}
    # line 2 is the first line Arrow parses in its block, once the empty line before it is taken out
    path.write_bytes(("\n\ufeff" + lines[1] + "\n").encode())
    table, kept, report = _read_criteo(path)
    assert table is None and report.bad == {"wrong_field_count": 1, "bad_label": 1}
    assert report.examples[1]["reason"] == "label: expected 0 or 1, found '\\ufeff0'"


def _lines_of(items) -> list:
    """The lines the blocks of ``line_blocks`` hold, in order, a long line as ("long", excerpt, length); each block
    is read as it comes (a view is valid until the next one is asked for)."""
    found = []
    for item in items:
        if isinstance(item, LongLine):
            found.append(("long", item.excerpt, item.length))
        else:
            data = bytes(item)
            assert data.endswith(b"\n")
            found += data.split(b"\n")[:-1]
    return found


@pytest.mark.parametrize("views", [False, True])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("suffix", ["", ".gz"])
def testline_blocks_give_every_line_once_whole_or_as_too_long(tmp_path, views, seed, suffix):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 400, 20_000)
    lengths[rng.choice(lengths.size, 6, replace=False)] = rng.integers(MAX_LINE_BYTES // 2, 3 * MAX_LINE_BYTES, 6)
    lines = [bytes(rng.integers(32, 127, n, dtype=np.uint8)) for n in lengths]
    ending = b"" if seed % 2 else b"\n"  # the last line with or without its newline
    content = b"\n".join(lines) + ending
    path = tmp_path / f"day.tsv{suffix}"
    path.write_bytes(gzip.compress(b"\xef\xbb\xbf" + content) if suffix else b"\xef\xbb\xbf" + content)
    allocate = (lambda size: np.empty(size, dtype=np.uint8)) if views else None
    found = _lines_of(line_blocks(path, 1 << 20, allocate))
    assert len(found) == len(lines)
    for line, got in zip(lines, found):
        if isinstance(got, tuple):  # only a line over the limit stands as a long one, with its start
            assert len(line) > MAX_LINE_BYTES + 1 and got[1] == line[:200] and got[2] <= len(line)
        else:
            assert got == line


@pytest.mark.parametrize("content, lines", [(b"", []), (b"a", [b"a"]), (b"a\n", [b"a"]), (b"\xef\xbb", [b"\xef\xbb"]),
                                            (b"\xef\xbb\xbf", []), (b"\xef\xbb\xbfa\n\n", [b"a", b""])])
def testline_blocks_of_files_shorter_than_a_byte_order_mark(tmp_path, content, lines):
    path = tmp_path / "day.tsv"
    path.write_bytes(content)
    stale = lambda size: np.frombuffer(b"\xef\xbb\xbf" * (size // 3 + 1), np.uint8)[:size].copy()
    assert _lines_of(line_blocks(path, 1 << 20, stale)) == lines


def testline_blocks_of_a_file_with_carriage_return_line_ends(tmp_path):
    path = tmp_path / "day.tsv"
    path.write_bytes(b"a\tb\rc\r\rd" * 100_000)  # no \n in the first read: \r ends lines
    assert _lines_of(line_blocks(path, 1 << 20)) == (b"a\tb\rc\r\rd" * 100_000).split(b"\r")


def test_text_that_is_not_an_integer_is_not_called_out_of_range(tmp_path):
    lines = [_criteo_line(i) for i in range(1, 5)]
    lines[0][1], lines[1][1], lines[2][1] = "--5", "\u0663", "99999999999999999999"
    path = tmp_path / "day.tsv"
    path.write_text("".join("\t".join(fields) + "\n" for fields in lines))
    _, _, report = _read_criteo(path)
    assert [e["reason"] for e in report.examples] == [
        "I1: '--5' is not an integer", "I1: '\u0663' is not an integer",
        "I1: '99999999999999999999' is outside the 64-bit integer range"]


def test_a_line_with_two_problems_is_counted_once(tmp_path):
    lines = ["\t".join(_criteo_line(i)).encode() for i in range(1, 5)]
    lines[1] = lines[1].replace(b"\t", b"\t\r", 1) + b"\xff"  # a stray \r and broken UTF-8
    path = tmp_path / "day.tsv"
    path.write_bytes(b"\n".join(lines) + b"\n")
    _, kept, report = _read_criteo(path)
    assert report.bad == {"carriage_return": 1} and (report.rows_read, report.rows_kept) == (4, 3)
    assert len(report.examples) == 1 and kept.tolist() == [1, 3, 4]


def test_splits_are_deterministic_by_line_and_follow_the_fractions():
    lines = np.arange(1, 200_001)
    codes = split_codes(lines, 0, 7, 0.1, 0.2)
    np.testing.assert_array_equal(codes, split_codes(lines, 0, 7, 0.1, 0.2))
    np.testing.assert_array_equal(codes[5000:6000], split_codes(lines[5000:6000], 0, 7, 0.1, 0.2))
    assert np.mean(codes == 1) == pytest.approx(0.1, abs=0.005)
    assert np.mean(codes == 2) == pytest.approx(0.2, abs=0.005)
    assert not np.array_equal(codes, split_codes(lines, 0, 8, 0.1, 0.2))
    assert not np.array_equal(codes, split_codes(lines, 1, 7, 0.1, 0.2))


def _table_rows(n: int = 40) -> dict[str, list]:
    return {
        "clicked": [i % 2 for i in range(n)],
        "price": [None if i % 7 == 0 else i * 1.5 for i in range(n)],
        "user": [None if i % 9 == 0 else f"u{i % 5}" for i in range(n)],
        "tags": [None if i % 11 == 0 else [f"t{i % 3}", f"t{i % 4}"][: 1 + i % 2] for i in range(n)],
        "note": ["x"] * n,
    }


def _write_text(path, sep, rows):
    def cell(v):
        if v is None:
            return ""
        return "|".join(v) if isinstance(v, list) else str(v)

    names = list(rows)
    lines = [sep.join(names)] + [sep.join(cell(rows[c][i]) for c in names) for i in range(len(rows["clicked"]))]
    path.write_text("\n".join(lines) + "\n")


TABLE_ROLES = ["data.source=table", "data.label=clicked", "data.continuous=price", "data.categorical=user",
               "data.multihot=tags", "data.ignore=note"]


@pytest.mark.parametrize("name", ["rows.csv", "rows.tsv", "rows.parquet"])
def test_table_reader_with_multihot(tmp_path, name):
    rows = _table_rows()
    path = tmp_path / name
    if name.endswith(".parquet"):
        pq.write_table(pa.table(rows), path)
    else:
        _write_text(path, "," if name.endswith(".csv") else "\t", rows)
    raw = ensure_raw(_cfg(tmp_path, *TABLE_ROLES, f"data.path={path}", "data.valid_fraction=0.2"))
    assert (raw.label, raw.continuous, raw.categorical, raw.multihot) == ("label", ["price"], ["user"], ["tags"])
    table = pa.concat_tables([pq.read_table(p) for s in ("train", "valid", "test") for p in raw.splits[s]])
    assert table.num_rows == 40 and table.column_names == ["label", "price", "user", "tags"]
    assert table.schema.field("label").type == pa.int8()
    assert table.schema.field("price").type == pa.float64()
    assert table.schema.field("user").type == pa.string()
    assert table.schema.field("tags").type == pa.list_(pa.string())
    got = sorted(table.to_pylist(), key=repr)
    want = sorted(({"label" if k == "clicked" else k: rows[k][i] for k in ("clicked", "price", "user", "tags")}
                   for i in range(40)), key=repr)
    assert got == want
    assert raw.rows["valid"] > 0


def test_table_reader_takes_true_and_false_labels_as_pandas_writes_them(tmp_path):
    """A bool column written by pandas' ``to_csv`` reads True / False: 1 / 0, in any case; other words stay bad."""
    path = tmp_path / "rows.csv"
    path.write_text("clicked,user\nTrue,a\nFalse,b\ntrue,c\nFALSE,d\nyes,e\n1,f\n")
    cfg = _cfg(tmp_path, "data.source=table", f"data.path={path}", "data.label=clicked", "data.categorical=user",
               "data.on_bad_lines=skip")
    raw = ensure_raw(cfg)
    report = json.loads((raw.root / "ingest_report.json").read_text())
    assert report["bad"] == {"bad_label": 1}
    labels = {user: label for s in raw.splits.values() for p in s
              for user, label in zip(*pq.read_table(p, columns=["user", "label"]).to_pydict().values())}
    assert labels == {"a": 1, "b": 0, "c": 1, "d": 0, "f": 1}


def test_table_reader_counts_bad_numbers_and_labels(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("\ufeffclicked,price,user\r\n1,2.5,a\r\n0,oops,b\r\n3,1,c\r\n1,1e3,d\r\n0,nan,e\r\n")
    cfg = _cfg(tmp_path, "data.source=table", f"data.path={path}", "data.label=clicked",
               "data.continuous=price", "data.categorical=user", "data.on_bad_lines=skip")
    raw = ensure_raw(cfg)
    report = json.loads((raw.root / "ingest_report.json").read_text())
    assert report["bad"] == {"not_a_number": 1, "bad_label": 1}
    assert [(e["line"], e["reason"]) for e in report["examples"]] == [
        (3, "price: 'oops' is not a number"), (4, "clicked: expected 0 or 1, found '3'" + COUNT)]
    prices = sorted(v for s in raw.splits.values() for p in s for v in pq.read_table(p).column("price").to_pylist()
                    if v is not None)
    assert prices == [2.5, 1000.0] and sum(raw.rows.values()) == 3
    users = sorted(v for s in raw.splits.values() for p in s for v in pq.read_table(p).column("user").to_pylist())
    assert users == ["a", "d", "e"]  # no stray carriage returns


@pytest.mark.parametrize("reader", ["arrow", "vectorized"])
def test_a_header_line_repeated_inside_a_file_is_reported_as_one(tmp_path, reader):
    """CSV files joined with their header lines (``cat a.csv b.csv``): each header after the first is a malformed row
    whose reason says it is a header line, not only that the label is not 0 or 1."""
    path = tmp_path / "joined.csv"
    path.write_text("clicked,price,user\n1,2.5,a\n0,1.0,b\nclicked,price,user\n1,3.0,c\n")
    cfg = _cfg(tmp_path, "data.source=table", f"data.path={path}", "data.label=clicked", "data.continuous=price",
               "data.categorical=user", "data.on_bad_lines=skip", f"data.reader={reader}")
    raw = ensure_raw(cfg)
    report = json.loads((raw.root / "ingest_report.json").read_text())
    assert report["bad"] == {"bad_label": 1} and sum(raw.rows.values()) == 3
    [example] = report["examples"]
    assert example["line"] == 4 and "the column's own name: a header line inside the file" in example["reason"]


def test_table_reader_takes_pandas_missing_markers_as_missing_numbers_and_keeps_them_as_categories(tmp_path):
    """R writes a missing number as NA, a database export NULL: pandas reads these (and N/A, None, #N/A, <NA>...) as
    missing, and so does a number column here. In a categorical column they are the text written (NA is Namibia)."""
    markers = ["NA", "N/A", "n/a", "NULL", "null", "None", "#N/A", "<NA>", "-nan", ""]
    lines = [f"{k % 2},{marker},{marker or 'empty'}" for k, marker in enumerate(markers)]
    path = tmp_path / "rows.csv"
    path.write_text("clicked,price,country\n" + "\n".join([*lines, "1,2.5,NA", "0,NAN2,x"]) + "\n")
    cfg = _cfg(tmp_path, "data.source=table", f"data.path={path}", "data.label=clicked",
               "data.continuous=price", "data.categorical=country", "data.on_bad_lines=skip")
    raw = ensure_raw(cfg)
    report = json.loads((raw.root / "ingest_report.json").read_text())
    assert report["bad"] == {"not_a_number": 1}
    rows = [row for s in raw.splits.values() for p in s for row in pq.read_table(p).to_pylist()]
    assert Counter((r["country"], r["price"]) for r in rows) == Counter(
        [(marker or "empty", None) for marker in markers] + [("NA", 2.5)])


def test_separate_files_per_split(tmp_path):
    rows = _table_rows()
    for name in ("train.csv", "valid.csv", "test.csv"):
        _write_text(tmp_path / name, ",", rows)
    cfg = _cfg(tmp_path, *TABLE_ROLES, f"data.path={tmp_path / 'train.csv'}",
               f"data.valid_path={tmp_path / 'valid.csv'}", f"data.test_path={tmp_path / 'test.csv'}")
    raw = ensure_raw(cfg)
    assert raw.rows == {"train": 40, "valid": 40, "test": 40}


def test_many_files_are_read_in_parallel_and_numbered_in_order(tmp_path):
    folder = tmp_path / "days"
    folder.mkdir()
    for day in range(3):
        (folder / f"day_{day}.tsv").write_bytes(b"".join(
            ("\t".join(_criteo_line(day * 100 + i)) + "\n").encode() for i in range(1, 101)))
    cfg = _cfg(tmp_path, "data.source=criteo", f"data.path={folder}", "data.chunk_rows=30")
    raw = ensure_raw(cfg)
    assert sum(raw.rows.values()) == 300
    names = [p.name for p in raw.splits["train"]]
    assert names == [f"part-{i:05d}.parquet" for i in range(len(names))]
    first = pq.read_table(raw.splits["train"][0]).column("I2")[0].as_py()
    assert first < 100 * 13  # parts of day_0 come first


def test_a_column_given_two_roles_names_both_settings(tmp_path):
    (tmp_path / "rows.csv").write_text("clicked,price,user\n1,2,a\n")
    with pytest.raises(BadInputError, match=r"column\(s\) \['price'\] are given more than one role \('price' in "
                                            r"data.continuous and data.categorical\)"):
        ensure_raw(_cfg(tmp_path, "data.source=table", f"data.path={tmp_path / 'rows.csv'}", "data.label=clicked",
                        "data.continuous=price", "data.categorical=[user,price]"))


@pytest.mark.parametrize("setup, message", [
    (lambda p: None, "does not exist"),
    (lambda p: p.write_bytes(b""), "is empty"),
    (lambda p: p.write_text("clicked,price,user\n"), "is empty"),
    (lambda p: p.write_text("clicked,cost,user\n1,2,a\n"), "declared column(s) ['price'] not found"),
    (lambda p: p.write_text("clicked,price,user,extra\n1,2,a,b\n"), "column(s) ['extra'] have no role"),
    (lambda p: p.write_text("clicked;price;user\n1;2;a\n"),
     "the file has columns ['clicked;price;user']: its header looks cut by ';', but a .csv file's lines are cut at ','"),
])
def test_clear_errors_for_unusable_input(tmp_path, setup, message):
    path = tmp_path / "rows.csv"
    setup(path)
    cfg = _cfg(tmp_path, "data.source=table", f"data.path={path}", "data.label=clicked",
               "data.continuous=price", "data.categorical=user")
    with pytest.raises(BadInputError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                       .replace(")", r"\)")):
        ensure_raw(cfg)


@pytest.mark.parametrize("suffix", ["csv", "parquet"])
@pytest.mark.parametrize("timed", [False, True])
def test_an_empty_part_among_others_adds_no_rows_and_all_rows_malformed_is_one_clear_error(tmp_path, suffix, timed):
    """Spark and Dask write a part file of no rows for an empty partition: it stopped the run ("is empty")."""
    folder = tmp_path / "parts"
    folder.mkdir()
    frame = pa.table({"clicked": [i % 2 for i in range(100)], "price": [float(i) for i in range(100)],
                      "user": [f"u{i % 4}" for i in range(100)], "ts": list(range(100))})
    for i, part in enumerate((frame.slice(0, 60), frame.slice(0, 0), frame.slice(60))):
        if suffix == "parquet":
            pq.write_table(part, folder / f"part-{i}.parquet")
        else:
            part.to_pandas().to_csv(folder / f"part-{i}.csv", index=False)
    if suffix == "csv":
        (folder / "part-3.csv").write_bytes(b"")
    common = ["data.source=table", f"data.path={folder}", "data.label=clicked", "data.continuous=price",
              "data.categorical=user", *(["data.time_column=ts"] if timed else ["data.ignore=[ts]"])]
    raw = ensure_raw(_cfg(tmp_path, *common))
    assert sum(raw.rows.values()) == 100
    bad = tmp_path / "bad.csv"
    bad.write_text("clicked,price,user,ts\n" + "".join(f"1,x{i},u,{i}\n" for i in range(30)))
    with pytest.raises(BadInputError, match=r"every one of the 30 rows read is malformed \(\{'not_a_number': 30\}"):
        ensure_raw(_cfg(tmp_path, *common[:1], f"data.path={bad}", *common[2:], "data.on_bad_lines=skip",
                        "data.name=bad"))


@pytest.mark.parametrize("name", ["rows.csv", "rows.parquet"])
def test_a_declared_column_named_twice_is_one_clear_error(tmp_path, name):
    path = tmp_path / name
    columns = [pa.array([1, 0]), pa.array([1.5, 2.5]), pa.array([7.0, 8.0]), pa.array(["a", "b"])]
    if name.endswith(".parquet"):
        pq.write_table(pa.Table.from_arrays(columns, names=["clicked", "price", "price", "user"]), path)
    else:
        path.write_text("clicked,price,price,user\n1,1.5,7.0,a\n0,2.5,8.0,b\n")
    cfg = _cfg(tmp_path, "data.source=table", f"data.path={path}", "data.label=clicked",
               "data.continuous=price", "data.categorical=user")
    with pytest.raises(BadInputError, match=rf"{path}: the column name\(s\) \['price'\] appear more than once"):
        ensure_raw(cfg)


def test_empty_criteo_file_and_missing_roles(tmp_path):
    empty = tmp_path / "day.tsv.gz"
    empty.write_bytes(gzip.compress(b""))
    with pytest.raises(BadInputError, match="is empty"):
        ensure_raw(_cfg(tmp_path, "data.source=criteo", f"data.path={empty}"))
    with pytest.raises(BadInputError, match="needs column roles"):
        ensure_raw(_cfg(tmp_path, "data.source=table", f"data.path={empty}"))


def test_parquet_integer_categories_nan_and_bad_labels(tmp_path):
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({
        "clicked": pa.array([1, 0, 2, None, 1], pa.int64()),
        "price": pa.array([1.0, float("nan"), 3.0, 4.0, None]),
        "item": pa.array([7, 8, 9, 10, None], pa.int32()),
        "tags": pa.array([[1, 2], [], None, [3], [4]], pa.list_(pa.int64())),
    }), path)
    cfg = _cfg(tmp_path, "data.source=table", f"data.path={path}", "data.label=clicked", "data.continuous=price",
               "data.categorical=item", "data.multihot=tags", "data.on_bad_lines=skip")
    raw = ensure_raw(cfg)
    report = json.loads((raw.root / "ingest_report.json").read_text())
    assert report["bad"] == {"bad_label": 2}
    assert [(e["line"], e["reason"]) for e in report["examples"]] == [
        (3, "clicked: expected 0 or 1, found '2'" + COUNT), (4, "clicked: expected 0 or 1, found ''")]
    table = pa.concat_tables([pq.read_table(p) for s in raw.splits.values() for p in s])
    rows = sorted(table.to_pylist(), key=lambda r: r["item"] or "")
    assert rows == [
        {"label": 1, "price": None, "item": None, "tags": ["4"]},
        {"label": 1, "price": 1.0, "item": "7", "tags": ["1", "2"]},
        {"label": 0, "price": None, "item": "8", "tags": []},
    ]


def test_parquet_unsigned_and_dictionary_columns_are_checked_as_their_values(tmp_path):
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({
        "clicked": pa.array(["1", "0", "1", "2", "0"]).dictionary_encode(),
        "price": pa.array(["1.5", "oops", "2.5", "3", "4"]).dictionary_encode(),
        "count": pa.array([2**63 - 1, 7, 2**64 - 1, 8, None], pa.uint64()),
        "item": pa.array(["a", "b", "a", "c", None]).dictionary_encode(),
    }), path)
    cfg = _cfg(tmp_path, "data.source=table", f"data.path={path}", "data.label=clicked",
               "data.continuous=[price,count]", "data.categorical=item", "data.on_bad_lines=skip")
    raw = ensure_raw(cfg)
    report = json.loads((raw.root / "ingest_report.json").read_text())
    assert report["bad"] == {"not_a_number": 1, "out_of_range": 1, "bad_label": 1}
    assert [(e["line"], e["reason"]) for e in report["examples"]] == [
        (2, "price: 'oops' is not a number"), (3, "count: '18446744073709551615' is outside the 64-bit integer range"),
        (4, "clicked: expected 0 or 1, found '2'" + COUNT)]
    table = pa.concat_tables([pq.read_table(p) for s in raw.splits.values() for p in s])
    assert table.schema.field("count").type == pa.int64() and table.schema.field("item").type == pa.string()
    assert sorted(table.to_pylist(), key=lambda r: r["price"]) == [
        {"label": 1, "price": 1.5, "count": 2**63 - 1, "item": "a"},
        {"label": 0, "price": 4.0, "count": None, "item": None}]


def test_parquet_float_and_boolean_categories_are_their_python_text_and_list_items_holding_the_separator_are_bad(
        tmp_path):
    """pandas widens integer ids with a missing one to floats; such a column and a boolean one were refused, where
    the same data as CSV was read. A float or boolean id is the text Python's str gives it (what a client sends
    for it, what pandas writes to a CSV). A list item holding data.list_separator would be served as two items."""
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({
        "clicked": pa.array([1, 0, 1, 0, 1, 0], pa.int64()),
        "item": pa.array([7.0, float("nan"), 3.5, None, -0.0, 1e20]),
        "flag": pa.array([True, False, None, True, True, False]),
        "tags": pa.array([["a"], ["b|c", "d"], [], None, ["e", "f"], ["|"]], pa.list_(pa.string())),
    }), path)
    cfg = _cfg(tmp_path, "data.source=table", f"data.path={path}", "data.label=clicked",
               "data.categorical=[item,flag]", "data.multihot=tags", "data.on_bad_lines=skip")
    raw = ensure_raw(cfg)
    report = json.loads((raw.root / "ingest_report.json").read_text())
    assert report["bad"] == {"separator_in_item": 2}
    assert [e["line"] for e in report["examples"]] == [2, 6]
    assert report["examples"][0]["reason"].startswith("tags: an item of ['b|c', 'd'] holds data.list_separator")
    table = pa.concat_tables([pq.read_table(p) for s in raw.splits.values() for p in s])
    assert table.schema.field("item").type == pa.string() and table.schema.field("flag").type == pa.string()
    rows = sorted(table.to_pylist(), key=lambda r: str(r["item"]))
    assert rows == [{"label": 1, "item": "-0.0", "flag": "True", "tags": ["e", "f"]},
                    {"label": 1, "item": "3.5", "flag": None, "tags": []},
                    {"label": 1, "item": "7.0", "flag": "True", "tags": ["a"]},
                    {"label": 0, "item": None, "flag": "True", "tags": None}]
    nothing = tmp_path / "nothing.parquet"  # pandas writes a column of None only as Arrow's null type
    pq.write_table(pa.table({"clicked": [1, 0], "item": pa.nulls(2), "price": pa.nulls(2), "tags": pa.nulls(2)}),
                   nothing)
    empty = ensure_raw(_cfg(tmp_path, "data.source=table", f"data.path={nothing}", "data.label=clicked",
                            "data.categorical=[item]", "data.continuous=[price]", "data.multihot=tags",
                            "data.name=nothing"))
    table = pa.concat_tables([pq.read_table(p) for s in empty.splits.values() for p in s])
    assert table.column("item").null_count == table.column("price").null_count == table.column("tags").null_count == 2
    with pytest.raises(BadInputError, match=r"line 2: tags: an item of .* holds data.list_separator"):
        ensure_raw(_cfg(tmp_path, "data.source=table", f"data.path={path}", "data.label=clicked", "data.name=strict",
                        "data.categorical=[item,flag]", "data.multihot=tags"))


def test_a_number_column_of_integers_in_one_file_and_floats_in_another_is_served_as_floats(tmp_path):
    """The request layout was typed from the first raw file only: the other file's fractions were refused."""
    from export.repository import raw_columns

    folder = tmp_path / "in"
    folder.mkdir()
    pq.write_table(pa.table({"clicked": [0, 1] * 20, "x": pa.array(range(40), pa.int64()), "c": ["a"] * 40}),
                   folder / "part0.parquet")
    pq.write_table(pa.table({"clicked": [1, 0] * 20, "x": [i + 0.5 for i in range(40)], "c": ["b"] * 40}),
                   folder / "part1.parquet")
    cfg = _cfg(tmp_path, "data.source=table", f"data.path={folder}", "data.label=clicked", "data.continuous=[x]",
               "data.categorical=[c]")
    columns = raw_columns(ensure_raw(cfg), cfg.data.list_separator)
    assert tuple(columns.layout.floats) == ("x",) and not columns.layout.integers


# Splits by time (data.time_column)

TIMED = ["data.source=table", "data.label=clicked", "data.continuous=[row]", "data.categorical=[user]",
         "data.time_column=ts"]


def _timed_rows(n: int, time) -> list[dict]:
    """Rows ``row`` 0..n-1 whose time grows with ``row`` (``time(row)``), shuffled."""
    order = np.random.default_rng(1).permutation(n)
    return [{"clicked": int(i % 2), "row": int(i), "user": f"u{i % 7}", "ts": time(int(i))} for i in order]


def _write_files(folder, rows: list[dict], files: int, suffix: str) -> None:
    folder.mkdir()
    for f, part in enumerate(np.array_split(np.arange(len(rows)), files)):
        chunk = [rows[i] for i in part]
        if suffix == "parquet":
            pq.write_table(pa.table({k: [r[k] for r in chunk] for k in chunk[0]}), folder / f"part{f}.parquet")
        else:
            lines = [",".join(chunk[0])] + [",".join(str(r[k]) for k in r) for r in chunk]
            (folder / f"part{f}.csv").write_text("\n".join(lines) + "\n")


def _rows_of(raw, split: str) -> list[int]:
    return sorted(int(v) for p in raw.splits[split] for v in pq.read_table(p).column("row").to_pylist())


@pytest.mark.parametrize("suffix", ["csv", "parquet"])
def test_a_time_column_puts_the_latest_rows_in_test_and_those_just_before_in_valid(tmp_path, suffix):
    def time(i):  # ISO text in the CSV, some with a zone (UTC+1 written one hour later); epoch seconds in parquet
        if suffix == "parquet":
            return 1_700_000_000 + 60 * i
        minute = np.datetime64("2024-03-01T00:00") + np.timedelta64(i, "m")
        return f"{minute + np.timedelta64(1, 'h')}:00+01:00" if i % 5 == 0 else str(minute)

    _write_files(tmp_path / "days", _timed_rows(300, time), files=3, suffix=suffix)
    cfg = _cfg(tmp_path, *TIMED, f"data.path={tmp_path / 'days'}", "data.valid_fraction=0.2",
               "data.test_fraction=0.1", "data.chunk_rows=40")
    raw = ensure_raw(cfg)
    assert _rows_of(raw, "test") == list(range(270, 300))
    assert _rows_of(raw, "valid") == list(range(210, 270))
    assert _rows_of(raw, "train") == list(range(210))
    assert pq.read_table(raw.splits["train"][0]).column_names == ["label", "row", "user"]  # ts is no feature
    meta = json.loads((raw.root / "meta.json").read_text())
    assert meta["time_column"] == "ts" and meta["params"]["time_column"] == "ts"
    first = {"valid": time(210), "test": time(270)}
    if suffix == "csv":
        first = {"valid": "2024-03-01T03:30", "test": "2024-03-01T04:30"}
    assert meta["time_cuts"] == first


def test_rows_of_the_time_at_a_cut_go_to_the_later_split(tmp_path):
    path = tmp_path / "days.csv"
    lines = ["clicked,row,user,ts"] + [f"{i % 2},{i},u{i % 3},2024-01-{1 + i // 10:02d}" for i in range(100)]
    path.write_text("\n".join(lines) + "\n")
    common = [*TIMED, f"data.path={path}", "data.valid_fraction=0.2", "data.test_fraction=0.15"]
    raw = ensure_raw(_cfg(tmp_path, *common))
    # test: the latest 15 rows start within day 9 (rows 80..89), so all of day 9 and 10 go there
    assert _rows_of(raw, "test") == list(range(80, 100))
    assert _rows_of(raw, "valid") == list(range(60, 80))  # the 20 rows before the test cut start in day 7
    assert raw.rows == {"train": 60, "valid": 20, "test": 20}
    same = ensure_raw(_cfg(tmp_path / "again", *common))
    assert all(_rows_of(same, s) == _rows_of(raw, s) for s in ("train", "valid", "test"))
    path.write_text("\n".join(lines[:1] + [f"{i % 2},{i},u,2024-01-01" for i in range(20)]) + "\n")
    with pytest.raises(BadInputError, match="data.time_column=ts: the first test time is 2024-01-01, the earliest"):
        ensure_raw(_cfg(tmp_path / "one-day", *common))


def test_integer_times_of_two_units_are_one_clear_error(tmp_path):
    """Epoch seconds and milliseconds in one column (files of two systems joined) were taken: the milliseconds
    sorted after every second, so test was their latest rows, whatever the period."""
    path = tmp_path / "joined.csv"
    seconds = [1_767_225_600 + 60 * i for i in range(100)]
    path.write_text("clicked,row,user,ts\n" + "".join(
        f"{i % 2},{i},u{i % 3},{t * 1000 if i % 2 else t}\n" for i, t in enumerate(seconds)))
    with pytest.raises(BadInputError, match=r"data.time_column=ts: its integer times mix units: 50 of epoch seconds "
                                            r"\(as 1767225600\), 50 of epoch milliseconds \(as 1767225660000\)"):
        ensure_raw(_cfg(tmp_path, *TIMED, f"data.path={path}"))
    path.write_text("clicked,row,user,ts\n" + "".join(f"{i % 2},{i},u{i % 3},{t * 1000}\n"
                                                       for i, t in enumerate(seconds)))
    assert ensure_raw(_cfg(tmp_path / "one-unit", *TIMED, f"data.path={path}")).rows["test"] == 10


def test_with_test_path_pinned_valid_is_the_latest_part_of_path(tmp_path):
    _write_files(tmp_path / "days", _timed_rows(200, lambda i: 1_000 + i), files=2, suffix="csv")
    test = tmp_path / "test.csv"
    test.write_text("clicked,row,user,ts\n" + "".join(f"1,{1000 + i},u1,{5_000 + i}\n" for i in range(7)))
    cfg = _cfg(tmp_path, *TIMED, f"data.path={tmp_path / 'days'}", f"data.test_path={test}",
               "data.valid_fraction=0.25", "data.test_fraction=0.1")
    raw = ensure_raw(cfg)
    assert _rows_of(raw, "valid") == list(range(150, 200))
    assert _rows_of(raw, "train") == list(range(150))
    assert _rows_of(raw, "test") == list(range(1000, 1007))


def test_with_both_splits_pinned_no_time_pass_runs_and_path_is_all_train(tmp_path, capsys):
    _write_files(tmp_path / "days", _timed_rows(50, lambda i: 1_000 + i), files=1, suffix="csv")
    valid, test = tmp_path / "valid.csv", tmp_path / "test.csv"
    valid.write_text("clicked,row,user,ts\n" + "".join(f"1,{1000 + i},u1,{5_000 + i}\n" for i in range(5)))
    test.write_text("clicked,row,user,ts\n" + "".join(f"1,{2000 + i},u1,{6_000 + i}\n" for i in range(4)))
    raw = ensure_raw(_cfg(tmp_path, *TIMED, f"data.path={tmp_path / 'days'}", f"data.valid_path={valid}",
                          f"data.test_path={test}"))
    assert raw.rows == {"train": 50, "valid": 5, "test": 4}
    assert "reading the time column" not in capsys.readouterr().out
    meta = json.loads((raw.root / "meta.json").read_text())
    assert meta["time_column"] == "ts" and meta["time_cuts"] is None


def test_a_file_pinned_to_a_split_is_not_read_for_data_path_too(tmp_path):
    """data.path=folder/ with data.test_path=folder/test.csv read the test rows twice: they trained the model."""
    folder = tmp_path / "in"
    folder.mkdir()
    header = "clicked,row,user\n"
    (folder / "a.csv").write_text(header + "".join(f"{i % 2},{i},u{i % 3}\n" for i in range(300)))
    (folder / "test.csv").write_text(header + "".join(f"{i % 2},{1000 + i},u1\n" for i in range(40)))
    common = ["data.source=table", "data.label=clicked", "data.continuous=[row]", "data.categorical=[user]",
              f"data.path={folder}", f"data.test_path={folder / 'test.csv'}"]
    raw = ensure_raw(_cfg(tmp_path, *common))
    assert raw.rows["train"] + raw.rows["valid"] == 300 and _rows_of(raw, "test") == list(range(1000, 1040))
    with pytest.raises(BadInputError, match=r"data.path=.*test.csv names only files that data.valid_path / "
                                            r"data.test_path pin"):
        ensure_raw(_cfg(tmp_path, *common[:4], f"data.path={folder / 'test.csv'}", common[5], "data.name=again"))


def test_the_time_column_is_part_of_how_a_dataset_was_made(tmp_path, capsys):
    _write_files(tmp_path / "days", _timed_rows(100, lambda i: i), files=1, suffix="csv")
    common = [*TIMED[:-1], f"data.path={tmp_path / 'days'}", "data.test_fraction=0.2"]
    by_time = ensure_raw(_cfg(tmp_path, *common, "data.time_column=ts"))
    assert _rows_of(by_time, "test") == list(range(80, 100))
    at_random = ensure_raw(_cfg(tmp_path, *common, "data.ignore=[ts]"))
    assert "made with other settings" in capsys.readouterr().out
    assert _rows_of(at_random, "test") != list(range(80, 100))
    assert "time_column" not in json.loads((at_random.root / "meta.json").read_text())


@pytest.mark.parametrize("with_text_path", [False, True])
def test_a_nan_word_is_missing_or_malformed_by_its_spelling_whatever_else_its_block_holds(tmp_path, with_text_path):
    """Arrow's typed parse reads ``nan`` in any case; the checks take pandas' missing words only (nan, NaN, NAN)."""
    rows = ["1,nan,a", "0,Nan,b", "1,NaN,c", "0,nAN,d", "1,2.5,e"] + (["0,oops,f"] if with_text_path else [])
    path = tmp_path / "rows.csv"
    path.write_text("clicked,price,user\n" + "\n".join(rows) + "\n")
    cfg = _cfg(tmp_path, "data.source=table", f"data.path={path}", "data.label=clicked", "data.continuous=price",
               "data.categorical=user", "data.on_bad_lines=skip")
    raw = ensure_raw(cfg)
    report = json.loads((raw.root / "ingest_report.json").read_text())
    assert report["bad"] == {"not_a_number": 2 + with_text_path}
    assert [e["line"] for e in report["examples"]] == [3, 5] + ([7] if with_text_path else [])
    users = sorted(u for s in raw.splits.values() for p in s for u in pq.read_table(p).column("user").to_pylist())
    assert users == ["a", "c", "e"]


def test_a_read_that_raises_ends_its_reading_thread_at_once(tmp_path):
    """The blocks' generator, held by the error's traceback, was closed by the garbage collector wherever it ran:
    once inside the start of another thread, which then hung the test suite."""
    import gc
    import threading

    path = tmp_path / "rows.csv"
    path.write_bytes(b"a" * (MAX_LINE_BYTES + 10) + b"\n" + b"1,2\n" * 100_000)
    before = {t.ident for t in threading.enumerate()}
    gc.disable()
    try:
        with pytest.raises(BadInputError, match="the header line is longer than") as err:
            list(_read_text(path, None, {"a": "int"}, ",", False, True, 64, FileReport(str(path)), True, "|"))
        assert err.value is not None  # the traceback, and with it the reading's frames, kept alive
        assert [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()] == []
    finally:
        gc.enable()
