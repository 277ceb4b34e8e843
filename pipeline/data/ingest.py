"""The ingest: a dataset's input files read into the raw layout's splits, with the report of their malformed rows.

Several input files are read in parallel as Dask tasks, one per file.

The label column is written as ``label`` whatever its input name. Rows go to train / valid /
test by a hash of ``(seed, file, line)`` against ``data.valid_fraction`` and
``data.test_fraction``, unless ``data.valid_path`` / ``data.test_path`` name their own files.

With ``data.time_column`` (tables) the rows of ``data.path`` are split by time instead: test is
the latest ``data.test_fraction`` of them, valid the ``data.valid_fraction`` just before, train the
rest (a split pinned by its own path takes no rows of ``data.path``). A first pass reads only the
time column of every file (in parallel) and finds the two cut times, exact order statistics of
the values; the ingest pass then sends each row to the split of its time, and rows of the time at
a cut all go to the later split. A time is an integer (epoch seconds, milliseconds: one unit for
all rows) or ISO 8601 text (a date, or a date and time, without a zone read as UTC), or a parquet
timestamp or date column; all rows hold integers or all hold dates. A missing or unreadable time
makes the row malformed (``bad_time``). The time column is written only when it is also a feature.

``data.on_bad_lines=error`` (the default) stops at the first block with a malformed row and raises a
:class:`~pipeline.errors.BadInputError` naming them (the first ones, and what to do); ``skip`` drops them. Either
way they are counted, with examples, in ``ingest_report.json``.

Example::

    report = ingest(cfg.data, seed=0, root=Path("data/clicks/raw"), params=ingest_params(cfg.data))
    report["rows_written"]     # {"train": ..., "valid": ..., "test": ...}; raw/ingest_report.json holds it all
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.data import raw_folder, vectorized_text
from pipeline.data.config import DataConfig
from pipeline.data.input_files import input_files, table_format
from pipeline.data.line_blocks import DamagedFileError
from pipeline.data.readers import READER_VERSION, read_criteo, read_table, read_times
from pipeline.data.roles import Roles, criteo_roles, table_roles
from pipeline.data.text_format import EXAMPLES, SPACED, FileReport
from pipeline.data.time_split import TIME_KEY, TimeCuts
from pipeline.errors import BadInputError
from pipeline.files import write_json
from pipeline.progress import Progress


def reads_text(d: DataConfig) -> bool:
    """Whether any input file is text (Criteo TSV, a CSV / TSV table): what :func:`ingest`'s ``array_module``
    parses."""
    return d.source == "criteo" or any(table_format(p) != "parquet" for p, _ in input_files(d))


def ingest_params(d: DataConfig) -> dict:
    """The settings and input files (with sizes and times) that determine an ingest."""
    return {
        "reader_version": READER_VERSION,
        "inputs": [{"path": str(p.resolve()), "split": s, "bytes": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns}
                   for p, s in input_files(d)],
        "valid_fraction": d.valid_fraction,
        "test_fraction": d.test_fraction,
        "on_bad_lines": d.on_bad_lines,
        **({"roles": {"label": d.label, "continuous": d.continuous, "categorical": d.categorical,
                      "multihot": d.multihot, "ignore": d.ignore}, "list_separator": d.list_separator}
           if d.source == "table" else {}),
        **({"time_column": d.time_column} if d.time_column else {}),
    }


def ingest(d: DataConfig, seed: int, root: Path, params: dict, progress: str | bool = "auto",
           array_module: str | None = None) -> dict:
    """Read every input file into ``root`` (the raw layout); write ``ingest_report.json`` and ``meta.json``.

    ``array_module`` (``"numpy"`` or ``"cupy"``) parses text with array operations (:func:`read_criteo`'s and
    :func:`read_table`'s ``xp``); None: with ``pyarrow.csv``. Returns the report. Raises :class:`BadInputError`
    on malformed rows when ``on_bad_lines=error`` (after saving the report), and on missing, empty or mismatched
    inputs.
    """
    files = input_files(d)
    roles = criteo_roles() if d.source == "criteo" else table_roles(d)
    pinned = {s for _, s in files if s}
    rule = SplitRule(seed, 0.0 if "valid" in pinned else d.valid_fraction,
                     0.0 if "test" in pinned else d.test_fraction)
    if roles.time and (rule.valid_fraction or rule.test_fraction):
        rule = replace(rule, cuts=_time_cuts([p for p, s in files if s is None], roles, d, rule, array_module))
    jobs = [(i, path, split) for i, (path, split) in enumerate(files)]
    args = (d, roles, rule, root, array_module)
    raw_folder.clear(root)
    if len(jobs) == 1:
        results = [_ingest_file(*jobs[0], *args, progress=progress)]
    else:
        results = _ingest_in_parallel(jobs, args, progress)
    if array_module:
        vectorized_text.release_memory(importlib.import_module(array_module))
    report = _combine(results, d)
    report["notes"] = _id_type_notes([p for p, _ in files] if d.source == "table" else [],
                                     roles.categorical + roles.multihot)
    write_json(root / raw_folder.INGEST_REPORT, report)
    for note in report["notes"]:
        print(f"[data] note: {note}", flush=True)
    _print_report(report)
    _refuse_no_rows(report, [p for p, _ in files], d, root / raw_folder.INGEST_REPORT)
    if report["status"] == "failed":
        raw_folder.clear_splits(root)
        raise BadInputError(_failure_message(report, root / raw_folder.INGEST_REPORT))
    for split in raw_folder.SPLITS:
        (root / split).mkdir(parents=True, exist_ok=True)
        raw_folder.number_parts(root / split)
    write_json(root / raw_folder.META, {
        "version": raw_folder.RAW_VERSION,
        "source": d.source,
        "params": params,
        "label": raw_folder.LABEL,
        "continuous": roles.continuous,
        "categorical": roles.categorical,
        "multihot": roles.multihot,
        "rows": report["rows_written"],
        **({"time_column": roles.time, "time_cuts": rule.cuts.record() if rule.cuts else None} if roles.time else {}),
    })
    return report


@dataclass(frozen=True)
class SplitRule:
    """Where a row of ``data.path`` goes: by time with ``cuts``, else by a hash of (seed, file, line)
    against the fractions (:func:`split_codes`)."""

    seed: int
    valid_fraction: float
    test_fraction: float
    cuts: TimeCuts | None = None

    def codes(self, table: pa.Table, lines: np.ndarray, file_index: int) -> np.ndarray:
        """0 (train), 1 (valid) or 2 (test) for each row of ``table``."""
        if self.cuts is not None:
            return self.cuts.codes(table.column(TIME_KEY).to_numpy())
        return split_codes(lines, file_index, self.seed, self.valid_fraction, self.test_fraction)


def _time_cuts(paths: list[Path], roles: Roles, d: DataConfig, rule: SplitRule, array_module: str | None
               ) -> TimeCuts:
    """The first pass of a split by time: every file's time keys (in parallel), then the cuts."""
    print(f"[data] reading the time column {roles.time!r} of {len(paths)} file(s) to split by time", flush=True)
    xp = importlib.import_module(array_module) if array_module else None
    if len(paths) == 1:
        results = [read_times(paths[0], roles, d.chunk_rows, d.list_separator, xp)]
    else:
        import dask

        results = list(dask.compute(*[dask.delayed(read_times, pure=False)(p, roles, d.chunk_rows, d.list_separator, xp)
                                      for p in paths]))
    forms = {}
    for _, report in results:
        for form, line in report.time_forms.items():
            forms.setdefault(form, f"{report.file} line {line}")
    if len(forms) > 1:
        raise BadInputError(f"data.time_column={roles.time}: the column holds integers ({forms['integer']}) and "
                            f"dates ({forms['date/time']}), which do not compare; give every time in one form")
    keys = np.concatenate([k for k, _ in results]) if results else np.zeros(0, np.int64)
    cuts = TimeCuts.of(keys, rule.valid_fraction, rule.test_fraction, roles.time, dated="date/time" in forms)
    starts = ", ".join(f"{split} from {time}" for split, time in cuts.record().items() if time is not None)
    print(f"[data] split by {roles.time}: {starts or 'every row in train'}", flush=True)
    return cuts


def _ingest_file(index: int, path: Path, pinned: str | None, d: DataConfig, roles: Roles, rule: SplitRule,
                 root: Path, array_module: str | None, progress: str | bool = "off") -> dict:
    report = FileReport(str(path))
    writers = {s: raw_folder.PartWriter(root / s, d.chunk_rows, prefix=f"f{index:05d}") for s in raw_folder.SPLITS}
    stop = d.on_bad_lines == "error"
    xp = importlib.import_module(array_module) if array_module else None
    if d.source == "criteo":
        blocks = read_criteo(path, d.chunk_rows, report, stop, xp)
    else:
        blocks = read_table(path, roles, d.chunk_rows, report, stop, d.list_separator, xp)
    with Progress(path.name, unit="row", mode=progress, scaled=True) as bar:
        try:
            for table, lines in blocks:
                codes = None if pinned else rule.codes(table, lines, index)
                table = table.select(roles.columns).rename_columns([raw_folder.LABEL if n == roles.label else n
                                                                    for n in roles.columns])
                if pinned:
                    writers[pinned].write(table)
                else:
                    for code, split in enumerate(raw_folder.SPLITS):
                        writers[split].write(table.filter(pa.array(codes == code)))
                bar.update(table.num_rows)
        except DamagedFileError as err:
            report.error = str(err)
    for w in writers.values():
        w.close()
    return {"report": report, "rows_written": {s: w.rows for s, w in writers.items()}}


def _ingest_in_parallel(jobs: list, args: tuple, progress: str | bool) -> list[dict]:
    import dask
    from dask.callbacks import Callback

    tasks = [dask.delayed(_ingest_file, pure=False)(*job, *args) for job in jobs]
    with Progress("files", total=len(tasks), unit="file", mode=progress) as bar:

        class _Tick(Callback):
            def _posttask(self, key, result, dsk, state, worker_id):
                bar.update(1)

        with _Tick():
            return list(dask.compute(*tasks))


def split_codes(lines: np.ndarray, file_index: int, seed: int, valid_fraction: float, test_fraction: float
                ) -> np.ndarray:
    """0 (train), 1 (valid) or 2 (test) per row, from a hash of (seed, file, line): stable whatever the blocks."""
    mask = (1 << 64) - 1
    salt = (file_index * 0x9E3779B97F4A7C15) & mask ^ (seed * 0xD1B54A32D192ED03) & mask
    x = np.asarray(lines, dtype=np.uint64) + np.uint64(salt)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    u = (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    return np.where(u < test_fraction, 2, np.where(u < test_fraction + valid_fraction, 1, 0)).astype(np.int8)


# ----------------------------------------------------------------------------------------- report


def _combine(results: list[dict], d: DataConfig) -> dict:
    reports = [r["report"] for r in results]
    bad: dict[str, int] = {}
    for r in reports:
        for kind, count in r.bad.items():
            bad[kind] = bad.get(kind, 0) + count
    failed = (d.on_bad_lines == "error" and any(r.bad_rows for r in reports)) or any(r.error for r in reports)
    written = {s: sum(r["rows_written"][s] for r in results) for s in raw_folder.SPLITS}
    return {
        "status": "failed" if failed else "ok",
        "on_bad_lines": d.on_bad_lines,
        "rows_read": sum(r.rows_read for r in reports),
        "rows_kept": sum(r.rows_kept for r in reports),
        "bad_rows": sum(bad.values()),
        "bad": bad,
        "examples": [e for r in reports for e in sorted(r.examples, key=lambda e: e["line"])][:EXAMPLES],
        "rows_written": {s: (0 if failed else n) for s, n in written.items()},
        "files": [{"file": r.file, "rows_read": r.rows_read, "rows_kept": r.rows_kept, "bad": r.bad,
                   "stopped_at_line": r.stopped_at_line, **({"error": r.error} if r.error else {})}
                  for r in reports],
    }


def _refuse_no_rows(report: dict, paths: list[Path], d: DataConfig, report_path: Path) -> None:
    """A BadInputError when the input holds no row, or none that is not malformed. One empty file among others (a
    part of an empty partition, as Spark and Dask write them) is no error."""
    if report["rows_read"] == 0 and not any(f.get("error") for f in report["files"]):
        what = f"rows of {'Criteo TSV' if d.source == 'criteo' else 'data'}"
        if len(paths) == 1:
            raise BadInputError(f"{paths[0]} is empty: expected {what}")
        raise BadInputError(f"the {len(paths)} input files are all empty ({paths[0]}, ...): expected {what}")
    if report["status"] == "ok" and report["rows_kept"] == 0:
        raise BadInputError(f"every one of the {report['rows_read']} rows read is malformed ({report['bad']}; examples "
                            f"in {report_path}): fix the input, or check the column roles and data.list_separator")


def _print_report(report: dict) -> None:
    line = (f"[data] read {report['rows_read']} rows, kept {report['rows_kept']}, "
            f"malformed {report['bad_rows']} {report['bad'] or ''}")
    print(line.rstrip(), flush=True)
    for e in report["examples"][:5]:
        print(f"[data]   {e['file']}:{e['line']}: {e['reason']}: {e['excerpt']!r}", flush=True)


def _failure_message(report: dict, report_path: Path) -> str:
    damaged = [f["error"] for f in report["files"] if f.get("error")]
    if damaged:
        return damaged[0] + (f" ({len(damaged) - 1} more damaged file(s) in {report_path})"
                             if len(damaged) > 1 else "")
    shown, advice_given = [], set()
    for e in report["examples"][:3]:
        reason = e["reason"]
        advice = re.search(r" \((.*)\)$", reason)
        if advice and advice.group(1) in advice_given:  # said once is enough
            reason = reason[:advice.start()]
        elif advice:
            advice_given.add(advice.group(1))
        shown.append(f"{Path(e['file']).name} line {e['line']}: {reason} ({e['excerpt'][:60]!r})")
    first = "; ".join(shown)
    if report["bad"].get("open_quote", 0) * 3 >= report["bad_rows"] > 0:  # quoted line breaks: each splits a row
        advice = ("A quoted value that holds a line break is not read (a row is one line here): write the table with "
                  "no line break inside its values, or as parquet")
    elif sum(SPACED in e["reason"] for e in report["examples"]) * 2 > len(report["examples"]):  # the roles are right
        advice = "Fix the input as said"
    elif report["bad_rows"] and report["bad_rows"] >= report["rows_read"]:  # no row of it is well formed: skipping would keep nothing
        advice = ("Every row read was malformed: check the column roles (data.label, data.continuous, "
                  "data.categorical, data.multihot) and data.list_separator against the input")
    elif advice_given:  # a column written otherwise than read, not stray lines: skipping would bias what is kept
        advice = "Fix the input as said"
    elif report["bad"].get("invalid_utf8", 0) * 2 > report["bad_rows"]:  # mostly: a file in another encoding
        advice = ("Text that is not UTF-8 is most often a file saved in another encoding (Latin-1, Windows-1252): "
                  "save it as UTF-8 (skipping would drop every row holding such a character)")
    else:
        advice = "Fix the input or set data.on_bad_lines=skip to drop and count them"
    return (f"malformed input rows ({report['bad_rows']} found before stopping: {report['bad']}): {first}. "
            f"{advice}; details in {report_path}")


def _id_type_notes(files: list[Path], names: list[str]) -> list[str]:
    """What to say of categorical columns typed as integers in some parquet files and as floats in others (pandas
    widens an integer column with a blank to floats): each value becomes the text Python's ``str`` gives it, so the
    same id is two categories, ``7`` and ``7.0``."""
    kinds: dict[str, dict[str, Path]] = {}
    for path in files:
        if table_format(path) != "parquet":
            continue
        schema = pq.read_schema(path)
        for name in names:
            if name in schema.names:
                t = schema.field(name).type
                t = t.value_type if pa.types.is_list(t) or pa.types.is_large_list(t) else t
                kind = "integers" if pa.types.is_integer(t) else "floats" if pa.types.is_floating(t) else ""
                if kind:
                    kinds.setdefault(name, {}).setdefault(kind, path)
    return [f"column {name!r} holds integers in {found['integers'].name} and floats in {found['floats'].name} (pandas "
            "widens an integer column with a missing value): 7 and 7.0 become two categories; write it with one type "
            "(pandas' Int64 dtype keeps integers with missing values) or as text"
            for name, found in kinds.items() if len(found) == 2]
