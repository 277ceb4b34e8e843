"""The vectorized Criteo reader (numpy here, CuPy on a GPU) against the Arrow path of ``read_criteo``:
the same tables, line numbers and report (counts by kind in the same order, examples, where reading
stopped), for every kind of malformed line, in both ``on_bad_lines`` modes, across blocks, and for
random mutations of valid lines. The ``cupy`` cases run the same comparisons on the GPU."""

from __future__ import annotations

import gzip
import itertools
import json
import random
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from pipeline.data.readers import MAX_LINE_BYTES, FileReport, read_criteo
from pipeline.data.vectorized_text import CRITEO, KINDS, parse_block
from pipeline.stages.config import ConfigError, load_config
from pipeline.stages.data import ensure_raw

XPS = [pytest.param("numpy"), pytest.param("cupy", marks=pytest.mark.gpu)]


def _fields(i: int) -> list[bytes]:
    ints = [str(i * 13 + k - 40).encode() if (i + k) % 4 else b"" for k in range(13)]
    cats = [f"{(i * 2654435761 + k) % 2**32:08x}".encode() if (i + k) % 5 else b"" for k in range(26)]
    return [str(i % 2).encode(), *ints, *cats]


def _line(i: int, column: int | None = None, value: bytes = b"") -> bytes:
    fields = _fields(i)
    if column is not None:
        fields[column] = value
    return b"\t".join(fields)


def _read(path, xp, chunk_rows: int, stop: bool) -> tuple[list[tuple[pa.Table, np.ndarray]], FileReport]:
    report = FileReport(str(path))
    return list(read_criteo(path, chunk_rows, report, stop, xp)), report


def _assert_same(path, xp_name: str, chunk_rows: int = 64, stop: bool = False) -> FileReport:
    """Read ``path`` both ways; assert the same blocks, line numbers and report; return the report."""
    want_blocks, want = _read(path, None, chunk_rows, stop)
    got_blocks, got = _read(path, pytest.importorskip(xp_name), chunk_rows, stop)
    assert_same_reads(got_blocks, got, want_blocks, want)
    return want


def assert_same_reads(got_blocks: list, got: FileReport, want_blocks: list, want: FileReport,
                      floats: tuple[str, ...] = ()) -> None:
    """Two readers' (table, line numbers) blocks and reports are the same: the counts by kind in the order met, the
    tables (the columns ``floats`` to the bit, the sign of a zero too) and the line numbers."""
    assert got == want
    assert list(got.bad) == list(want.bad)
    assert len(got_blocks) == len(want_blocks)
    for (table, lines), (want_table, want_lines) in zip(got_blocks, want_blocks):
        assert table.schema == want_table.schema
        assert table.equals(want_table)
        for name in floats:
            got_bits, want_bits = (pc.drop_null(t.column(name)).to_numpy().view(np.uint64)
                                   for t in (table, want_table))
            np.testing.assert_array_equal(got_bits, want_bits)
        np.testing.assert_array_equal(lines, want_lines)


# Lines of every kind the readers know, malformed or not (the column: 0 is the label, 1..13 I1..I13)
LABELS_KEPT = [b"0", b"1", b"1.0", b"0.", b"1.000", b"true", b"FALSE", b"True", b"fAlSe"]
LABELS_BAD = [b"2", b"", b"01", b"00", b"-0", b" 1", b"1 ", b"+1", b"0x1", b"\xef\xbb\xbf1", b"1e0", b"\xc3\xa9",
              b"tru", b"truee", b"yes", b"f", b"false "]
INTS_KEPT = [b"", b"0", b"-0", b"007", b"9223372036854775807", b"-9223372036854775808", b"0" * 30 + b"5",
             b"-" + b"0" * 30 + b"9223372036854775808"]
NOT_INTS = [b"abc", b"0x10", b"0X1f", b" 7", b"7 ", b"--5", b"-", b"+5", b"1.5", b"1e3", "\u0663".encode(), b"5-",
            b"\xef\xbb\xbf5", b'"5"']
INTS_BEYOND = [b"9223372036854775808", b"-9223372036854775809", b"1" * 400, b"99999999999999999999",
               b"00000" + b"9223372036854775808"]
STRINGS_KEPT = ["é".encode(), "€".encode(), "😀".encode(), b'"q"', b"a b", b"0x1", b"\xef\xbb\xbf"]
NOT_UTF8 = [b"\xff", b"\xc3", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82", b"\x80", b"\xf0\x9f\x98",
            b"\xe0\x80\xaf", b"\xf5\x80\x80\x80"]


def _hostile_lines() -> list[bytes]:
    lines, i = [], 1

    def add(line: bytes) -> None:
        nonlocal i
        lines.append(line)
        i += 1

    for value in LABELS_KEPT + LABELS_BAD:
        add(_line(i, 0, value))
    for column, value in enumerate(INTS_KEPT + NOT_INTS + INTS_BEYOND):
        add(_line(i, 1 + column % 13, value))
    add(b"\t".join([b"1", *[b"x"] * 13, *_fields(i)[14:]]))  # every integer bad: I1 is reported
    add(_line(i, 5, b"abc") + b"\r")                           # \r\n line end, a bad value
    add(_line(i, 7, b"1" * 30))
    for column, value in enumerate(STRINGS_KEPT):
        add(_line(i, 14 + column, value))
    for k, value in enumerate(NOT_UTF8):
        add(_line(i, 14 + k, value) if k % 2 else _line(i) + value)  # inside a field, or at the end of the line
    add(_line(i, 20, b"ab\rcd"))                                  # a stray \r
    add(_line(i) + b"\r\r")                                       # \r\r\n: the first \r is inside
    add(_line(i, 3, b"\rx") + b"\xff")                            # a stray \r and broken UTF-8: counted once
    add(b"")                                                      # empty lines
    add(b"\r")
    add(b"\t".join(_fields(i)[:39]))                              # wrong field counts
    add(b"\t".join(_fields(i) + [b"extra"]))
    add(b"garbage")
    add(b"\t" * 79)
    add(b"\t".join(_fields(i)[:20]) + b"\r")
    add(_line(i) + b"\t" + b"y" * (MAX_LINE_BYTES + 1))            # over the length limit
    add(_line(i, 30, b"z" * (MAX_LINE_BYTES - len(_line(i, 30)))))  # at the limit: kept whole
    add(_line(i, 0, b"7") + b"\xff" * 10)                           # broken UTF-8 is found before the label
    for _ in range(30):
        add(_line(i) + (b"\r" if i % 3 == 0 else b""))             # good lines, some with \r\n ends
    return lines


def _write(path, data: bytes):
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


@pytest.mark.parametrize("xp", XPS)
@pytest.mark.parametrize("stop", [False, True])
@pytest.mark.parametrize("name", ["day.tsv", "day.tsv.gz"])
def test_malformed_lines_of_every_kind_give_the_arrow_paths_report(tmp_path, xp, stop, name):
    path = _write(tmp_path / name, b"\xef\xbb\xbf" + b"\n".join(_hostile_lines()) + b"\n")
    report = _assert_same(path, xp, stop=stop)
    if not stop:
        assert set(report.bad) == set(KINDS) - {"bad_time", "list_as_text"} and len(report.examples) == 20
        assert report.bad["bad_label"] == len(LABELS_BAD) and report.bad["out_of_range"] == len(INTS_BEYOND) + 1
        assert report.bad["invalid_utf8"] == len(NOT_UTF8) + 1 and report.bad["carriage_return"] == 3
        assert report.rows_kept == len(LABELS_KEPT) + len(INTS_KEPT) + len(STRINGS_KEPT) + 1 + 30
    else:
        assert report.stopped_at_line is not None and report.rows_kept == 0


@pytest.mark.parametrize("xp", XPS)
@pytest.mark.parametrize("stop", [False, True])
def test_a_file_of_many_blocks_with_bad_lines_near_their_edges(tmp_path, xp, stop):
    lines = [_line(i) for i in range(1, 24_001)]  # about 6 MiB: blocks of 1 MiB
    rng = random.Random(3)
    for k in rng.sample(range(len(lines)), 40):
        lines[k] = _line(k + 1, rng.randrange(14), rng.choice(NOT_INTS + INTS_BEYOND + LABELS_BAD))
    for k in range(3000, len(lines), 3100):  # runs of bad lines, about one a block, some across a block's end
        lines[k:k + 30] = [b"\t".join(_fields(k)[:30])] * 30
    path = _write(tmp_path / "day.tsv", b"\n".join(lines) + b"\n")
    report = _assert_same(path, xp, stop=stop)
    assert report.rows_read == (len(lines) if not stop else report.stopped_at_line)
    assert len(_read(path, None, 64, False)[0]) >= 5


@pytest.mark.parametrize("xp", XPS)
def test_block_cuts_do_not_change_what_the_vectorized_parse_finds(xp):
    lines = _hostile_lines()[:-3] + [_line(i) for i in range(200)]
    assert_same_whole_or_in_pieces(pytest.importorskip(xp), CRITEO, lines)


def assert_same_whole_or_in_pieces(xp, layout, lines: list[bytes]) -> None:
    """``lines`` parsed as one block and cut at 25 places give the same rows, line numbers and counts by kind."""
    whole = FileReport("f")
    table, kept, count = parse_block(xp, layout, b"".join(line + b"\n" for line in lines), 1, whole)
    cuts = sorted({0, len(lines), *random.Random(0).sample(range(1, len(lines)), 25)})
    parts, pieces = FileReport("f"), []
    for start, end in itertools.pairwise(cuts):
        block = b"".join(line + b"\n" for line in lines[start:end])
        pieces.append(parse_block(xp, layout, block, 1 + start, parts))
    assert count == len(lines) == sum(c for _, _, c in pieces)
    assert pa.concat_tables([t for t, _, _ in pieces]).equals(table)
    np.testing.assert_array_equal(np.concatenate([k for _, k, _ in pieces]), kept)
    assert parts.bad == whole.bad


@pytest.mark.parametrize("xp", XPS)
@pytest.mark.parametrize("data", [b"", b"\n", b"\r\n", b"\xef\xbb\xbf", b"1", b"\n\n\n"], ids=repr)
def test_files_with_no_row(tmp_path, xp, data):
    report = _assert_same(_write(tmp_path / "day.tsv", data), xp)
    assert report.rows_kept == 0
    block = data if data.endswith(b"\n") or not data else data + b"\n"  # a block is whole lines
    table, kept, count = parse_block(pytest.importorskip(xp), CRITEO, block, 1, FileReport("f"))
    assert (table.num_rows, kept.size, count) == (0, 0, block.count(b"\n"))


@pytest.mark.parametrize("xp", XPS)
@pytest.mark.parametrize("ends", ["\n", "\r\n", "\r", "none"])
def test_line_ends_and_a_file_without_a_last_newline(tmp_path, xp, ends):
    lines = [_line(i) for i in range(1, 300)]
    lines[40] = _line(41, 3, b"oops")
    end = b"\n" if ends == "none" else ends.encode()
    data = end.join(lines) + (b"" if ends == "none" else end)
    report = _assert_same(_write(tmp_path / "day.tsv", data), xp)
    assert (report.rows_read, report.rows_kept, report.bad) == (299, 298, {"not_a_number": 1})


MUTATIONS = [b"0", b"1", b"9", b"-", b"x", b" ", b"\t", b"\r", b"\n", b".", b'"', b"\x80", b"\xc3", b"\xa9", b"\xe2",
             b"\x82", b"\xac", b"\xed", b"\xa0", b"\xf0", b"\x9f", b"\xf4", b"\x90", b"\xff", b"\xc0", b"\xef\xbb\xbf",
             b"", b"\r\n", b"00"]
FIELD_VALUES = LABELS_KEPT + LABELS_BAD + INTS_KEPT + NOT_INTS + INTS_BEYOND + STRINGS_KEPT + NOT_UTF8


def mutated_line(rng: random.Random, line: bytes, mutations: list[bytes],
                 replace_field: Callable[[random.Random, bytes], bytes]) -> bytes:
    """``line`` changed 1 to 3 times: a piece of ``mutations`` put over a byte or between two, a few bytes taken out,
    or a field replaced (``replace_field``)."""
    for _ in range(rng.randint(1, 3)):
        at, what = rng.randrange(len(line) + 1), rng.random()
        if what < 0.3:
            line = line[:at] + rng.choice(mutations) + line[at + 1:]
        elif what < 0.5:
            line = line[:at] + rng.choice(mutations) + line[at:]
        elif what < 0.6:
            line = line[:at] + line[at + rng.randint(1, 4):]
        else:
            line = replace_field(rng, line)
    return line


def _field_replaced(rng: random.Random, line: bytes) -> bytes:
    """A field replaced by a value of every kind; the label and the integers more often."""
    fields = line.split(b"\t")
    column = rng.randrange(len(fields)) if rng.random() < 0.3 else rng.randrange(min(14, len(fields)))
    fields[column] = rng.choice(FIELD_VALUES)
    return b"\t".join(fields)


@pytest.mark.parametrize("xp", XPS)
@pytest.mark.parametrize("seed", range(12))
def test_random_mutations_of_valid_lines(tmp_path, xp, seed):
    rng = random.Random(seed)
    lines = [mutated_line(rng, _line(i), MUTATIONS, _field_replaced) if rng.random() < 0.4 else _line(i)
             for i in range(1, 401)]
    end = b"\r\n" if seed % 4 == 3 else b"\n"
    data = end.join(lines) + (end if seed % 3 else b"")
    path = _write(tmp_path / ("day.tsv.gz" if seed % 5 == 4 else "day.tsv"), data)
    report = _assert_same(path, xp)
    assert report.bad_rows > 20
    _assert_same(path, xp, stop=True)


@pytest.mark.parametrize("xp", XPS)
def test_the_data_stage_writes_the_same_raw_data_with_the_vectorized_reader(tmp_path, xp):
    path = _write(tmp_path / "day.tsv", b"\n".join(_hostile_lines()[:-3] + [_line(i) for i in range(500)]) + b"\n")
    device = "cpu" if xp == "numpy" else "cuda"
    made = {}
    for reader in ("arrow", "vectorized"):
        cfg = load_config(None, [f"workdir={tmp_path / reader}", "data.source=criteo", f"data.path={path}",
                                 "data.on_bad_lines=skip", f"data.reader={reader}", f"device={device}", "progress=off"])
        raw = ensure_raw(cfg)
        report = json.loads((raw.root / "ingest_report.json").read_text())
        tables = {s: pa.concat_tables([pq.read_table(p) for p in parts]) for s, parts in raw.splits.items()}
        made[reader] = (report, tables)
    (report, tables), (want_report, want_tables) = made["vectorized"], made["arrow"]
    assert report == want_report and report["bad_rows"] > 50
    assert all(tables[s].equals(want_tables[s]) for s in want_tables)


def test_the_reader_setting_is_checked():
    with pytest.raises(ConfigError, match="data.reader: expected auto, arrow or vectorized"):
        load_config(None, ["data.source=criteo", "data.path=day.tsv", "data.reader=gpu"])
    with pytest.raises(ConfigError, match="data.reader=vectorized parses input text"):
        load_config(None, ["data.source=synthetic", "data.reader=vectorized"])
    assert load_config(None, ["data.source=table", "data.path=rows.csv", "data.continuous=x",
                              "data.reader=vectorized"]).data.reader == "vectorized"


@pytest.mark.parametrize("works", [True, False])
def test_auto_parses_on_the_gpu_where_cupy_works_there_and_with_arrow_where_it_does_not(monkeypatch, capsys, works):
    import importlib.machinery
    import sys
    import types

    from pipeline.stages import data as data_stage

    cupy = types.ModuleType("cupy")
    cupy.__spec__ = importlib.machinery.ModuleSpec("cupy", None)

    def arange(n):
        if not works:
            raise RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime")
        return types.SimpleNamespace(sum=lambda: types.SimpleNamespace(get=lambda: n * (n - 1) // 2))

    cupy.arange = arange
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(data_stage, "resolve_device", lambda device: types.SimpleNamespace(is_cuda=device != "cpu"))
    cfg = load_config(None, ["data.source=criteo", "data.path=day.tsv", "device=cuda"])
    assert cfg.data.reader == "auto"
    assert data_stage.text_array_module(cfg) == ("cupy" if works else None)
    out = capsys.readouterr().out
    broken = "CuPy does not work here (RuntimeError: cudaErrorInsufficient"
    assert ("parsed with cupy" in out) if works else (broken in out)
    assert data_stage.text_array_module(load_config(None, ["data.source=criteo", "data.path=day.tsv",
                                                             "device=cpu"])) is None


@pytest.mark.parametrize("lends", [True, False])
def test_host_buffers_are_pinned_in_size_classes_and_pageable_where_no_pinned_memory_is_lent(lends):
    import types

    from pipeline.data.vectorized_text import host_array

    class Refused(Exception):
        pass

    asked = []

    def alloc_pinned_memory(size):
        asked.append(size)
        if not lends:
            raise Refused("cudaErrorMemoryAllocation: out of memory")
        return bytearray(size)

    xp = types.SimpleNamespace(cuda=types.SimpleNamespace(alloc_pinned_memory=alloc_pinned_memory,
                                                          runtime=types.SimpleNamespace(CUDARuntimeError=Refused)))
    for size in (50_400_000, 52_000_000, 5000):  # the first two of one class
        buffer = host_array(xp, size)
        assert buffer.dtype == np.uint8 and buffer.shape == (size,)
        buffer[-1] = 7
    assert asked[0] == asked[1] and 52_000_000 <= asked[0] < 50_400_000 * 9 // 8 and asked[2] == 8192


def test_reading_done_the_pools_of_gpu_and_pinned_memory_are_given_back():
    import types

    from pipeline.data.vectorized_text import release_memory

    freed = []
    pool = lambda name: types.SimpleNamespace(free_all_blocks=lambda: freed.append(name))
    xp = types.SimpleNamespace(get_default_memory_pool=lambda: pool("device"),
                               get_default_pinned_memory_pool=lambda: pool("pinned"))
    release_memory(xp)
    assert freed == ["device", "pinned"]
    release_memory(np)  # numpy keeps no pool
