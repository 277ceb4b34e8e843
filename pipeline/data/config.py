"""Settings of the data stage: which raw data, and how it is read."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.errors import check_range


@dataclass
class DataConfig:
    """Where the raw rows come from.

    ``source``: ``synthetic`` (the built-in Criteo-like generator), ``criteo`` (TSV: label, I1..I13,
    C1..C26, empty = missing; ``.gz`` too) or ``table`` (any CSV / TSV / parquet with the column roles
    declared below).
    """

    source: str = field(default="synthetic", metadata={"help": "synthetic | criteo | table"})
    path: str = field(default="", metadata={"help": "input file, folder or glob (criteo and table sources)"})
    valid_path: str = field(
        default="", metadata={"help": "criteo / table: file(s) for the validation split (then not carved from path)"}
    )
    test_path: str = field(
        default="", metadata={"help": "criteo / table: file(s) for the test split (then not carved from path)"}
    )
    name: str = field(default="", metadata={"help": "dataset folder under workdir (default: the source's name)"})
    rows: int = field(default=1_000_000, metadata={"help": "synthetic: rows in all splits together"})
    size: float = field(
        default=0.01,
        metadata={"help": "synthetic: table-size knob; 1.0 gives Criteo-sized cardinalities (up to ~10M)"},
    )
    valid_fraction: float = field(default=0.1, metadata={"help": "fraction of rows in the validation split"})
    test_fraction: float = field(default=0.1, metadata={"help": "fraction of rows in the test split"})
    chunk_rows: int = field(default=250_000, metadata={"help": "rows per generated / ingested chunk (memory bound)"})
    workers: int = field(default=0, metadata={
        "help": "synthetic: processes making rows (0: one per core from 4M rows, where they pay for their start; "
                "1: this process)"})
    on_bad_lines: str = field(
        default="error", metadata={"help": "error | skip: what a malformed input row does (skipped rows are counted)"}
    )
    reader: str = field(default="auto", metadata={
        "help": "criteo, table (CSV/TSV): auto | arrow | vectorized: how the text is parsed and checked. arrow: "
                "pyarrow.csv; vectorized: array operations, through CuPy on the GPU when the device is cuda, else "
                "numpy (a block quoting otherwise than whole values goes to arrow); both "
                "give the same rows and report. auto: vectorized on the GPU when the device is cuda and CuPy works "
                "there, else arrow"})
    label: str = field(default="label", metadata={"help": "table: the 0/1 label column"})
    continuous: list[str] = field(default_factory=list, metadata={"help": "table: numeric feature columns"})
    categorical: list[str] = field(default_factory=list, metadata={"help": "table: categorical feature columns"})
    multihot: list[str] = field(
        default_factory=list, metadata={"help": "table: list-valued categorical columns (multi-hot)"}
    )
    ignore: list[str] = field(default_factory=list, metadata={"help": "table: columns of the input to drop"})
    list_separator: str = field(default="|", metadata={"help": "table, CSV/TSV: separator inside a multi-hot cell"})
    time_column: str = field(default="", metadata={
        "help": "table: a column ordering the rows in time (integers such as epoch seconds, or ISO 8601 dates and "
                "times; a feature only if listed as one): test gets the latest data.test_fraction of the rows, "
                "valid the data.valid_fraction before them (unless pinned by their paths), the rows of a time at "
                "a cut the later split; empty: rows are split at random"})
    rebuild: bool = field(default=False, metadata={
        "help": "replace an existing dataset ingested from files when these settings differ from how it was made"})

    def __post_init__(self) -> None:
        if self.source not in ("synthetic", "criteo", "table"):
            raise ValueError(f"data.source: expected synthetic, criteo or table, got {self.source!r}")
        if self.on_bad_lines not in ("error", "skip"):
            raise ValueError(f"data.on_bad_lines: expected error or skip, got {self.on_bad_lines!r}")
        if self.reader not in ("auto", "arrow", "vectorized"):
            raise ValueError(f"data.reader: expected auto, arrow or vectorized, got {self.reader!r}")
        if self.reader == "vectorized" and self.source == "synthetic":
            raise ValueError("data.reader=vectorized parses input text (data.source=criteo or table), and "
                             "data.source=synthetic reads none: set data.reader=auto")
        if self.source == "synthetic":
            given = [f"data.{name}" for name in ("path", "valid_path", "test_path", "continuous", "categorical",
                                                 "multihot", "ignore", "time_column") if getattr(self, name)]
            given += ["data.label"] if self.label != "label" else []
            if given:
                raise ValueError(f"{', '.join(given)}: read from the input of data.source=table (a CSV, TSV or "
                                 "parquet table) or criteo, and data.source=synthetic (the default) makes rows of its "
                                 "own: add data.source=table (or criteo)")
        if self.source != "synthetic" and not self.path:
            raise ValueError(f"data.path is required for data.source={self.source}")
        if self.time_column and self.source == "criteo":
            raise ValueError(f"data.time_column needs data.source=table (data.source={self.source} has no column "
                             "of its own to order rows by)")
        check_range("data.rows", self.rows, 1)
        check_range("data.chunk_rows", self.chunk_rows, 1)
        check_range("data.workers", self.workers, 0)
        check_range("data.size", self.size, 0, low_open=True)
        check_range("data.valid_fraction", self.valid_fraction, 0, 1, high_open=True)
        check_range("data.test_fraction", self.test_fraction, 0, 1, high_open=True)
        if not self.list_separator:
            raise ValueError("data.list_separator must not be empty")
        if self.valid_fraction + self.test_fraction >= 1:
            raise ValueError("data.valid_fraction + data.test_fraction must leave rows for training")

    def splits_without_rows(self) -> list[str]:
        """The evaluation splits (valid, test) that these settings give no row, whatever the input holds: a fraction of
        0 without a file of their own, or a share of synthetic ``rows`` that rounds to none."""
        if self.source == "synthetic":
            from pipeline.data.synthetic import split_rows

            rows = split_rows(self.rows, self.valid_fraction, self.test_fraction)
            return [split for split in ("valid", "test") if rows[split] == 0]
        return [split for split in ("valid", "test")
                if getattr(self, f"{split}_fraction") == 0 and not getattr(self, f"{split}_path")]

    @property
    def dataset_name(self) -> str:
        return self.name or self.source
