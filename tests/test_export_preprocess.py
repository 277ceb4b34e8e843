"""The served preprocess (a request's raw tensors -> the model's tensors) equals the workflow's own transform, bit
for bit, for every kind of operator; and the index Categorify looks values up in equals a plain dictionary.

The reference is what the ETL computes: the raw rows as its parquet reader gives them through every operator's
own ``transform`` on a frame (``Workflow.transform_partition``). The served path takes the same rows as a request:
its text as the client sends it (zero-padded bytes, ``UINT8 [B, m, W]``) and as fixed-width ``S`` arrays (read in
place from those), kept in blocks through the operators' ``transform_many``. The rows hold values unseen at fit,
missing values of every kind (a null number, an empty string, a null or empty list), text that is not ASCII, long
values and values with a NUL byte, at 1, 32 and 1,000 rows.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from export.preprocess import Preprocessor, RawColumns
from export.request import TEXT, text_values
from pipeline.etl import (
    Bucketize,
    Cast,
    Categorify,
    Clip,
    FillMissing,
    HashBucket,
    HashedCross,
    HashIds,
    LogOp,
    MissingIndicator,
    Normalize,
    Workflow,
)
from pipeline.etl.column_schema import input_schema, to_schema
from pipeline.etl.ops import text_lookup
from pipeline.etl.ops.text_lookup import LONG_BYTES, TextWords, VocabularyIndex

# LogOp of the negative values drawn below gives NaN on purpose (their bits are compared too).
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in log1p:RuntimeWarning")

ROLES = {"label": "label", "continuous": ["I1", "I2", "I3", "F1", "F2"],
         "categorical": ["C1", "C2", "C3", "C4", "C5", "C6", "K"], "multihot": ["M1", "M2"]}
ODD = ["é-été", "x" * (LONG_BYTES + 40), "nul\x00inside"]
"""Values drawn beside the others: text that is not ASCII, one longer than the index holds by its words, one with a
NUL byte. The rows fitted on hold empty strings too, which a request cannot send (an empty value is missing)."""


def _table(n: int, seed: int, unseen: float, odd: tuple[str, ...] = tuple(ODD)) -> pa.Table:
    """Raw rows as the data stage writes them: a share ``unseen`` of the text drawn beyond what the fit saw, and
    some of the values ``odd``."""
    rng = np.random.default_rng(seed)

    def words(prefix: str, vocab: int) -> list:
        drawn = rng.zipf(1.4, n) % vocab + np.where(rng.random(n) < unseen, vocab, 0)
        values = [f"{prefix}{v:x}" * (1 + v % 3) for v in drawn]  # 1 to 3 words of 8 bytes
        for row in np.flatnonzero(rng.random(n) < 0.08):
            values[row] = odd[row % len(odd)]
        return [None if r < 0.1 else v for r, v in zip(rng.random(n), values)]

    def bags(prefix: str) -> list:
        return [None if r < 0.1 else [f"{prefix}{v}" for v in rng.zipf(1.5, rng.integers(0, 5)) % 30 + (r > 0.9) * 30]
                for r in rng.random(n)]

    def numbers(kind: pa.DataType) -> pa.Array:
        values = rng.lognormal(1, 2, n).round() - 3
        return pa.array(values if kind == pa.float64() else values.astype(np.int64), kind, mask=rng.random(n) < 0.2)

    columns = {"label": pa.array(rng.integers(0, 2, n), pa.int8()), "I1": numbers(pa.int64()),
               "I2": numbers(pa.int64()), "I3": numbers(pa.int64()), "F1": numbers(pa.float64()),
               "F2": numbers(pa.float64())}
    columns.update({name: pa.array(words(name.lower(), 40 + 200 * k), pa.string())
                    for k, name in enumerate(ROLES["categorical"][:-1])})
    columns["K"] = pa.array(rng.integers(0, 60, n) * np.where(rng.random(n) < unseen, 7, 1), pa.int64(),
                            mask=rng.random(n) < 0.1)
    columns.update(M1=pa.array(bags("m"), pa.list_(pa.string())), M2=pa.array(bags("t"), pa.list_(pa.string())))
    return pa.table(columns)


def _workflow(integers: bool) -> Workflow:
    """Every kind of operator a saved workflow may hold, on the raw columns of :data:`ROLES` (``K`` with
    ``integers``)."""
    k = ["K"] if integers else []
    return Workflow(
        (["label"] >> Cast("float32"))
        + (["I1", "F1"] >> FillMissing(strategy="median") >> Clip(min_value=0) >> LogOp() >> Normalize())
        + (["I2", "F2"] >> FillMissing(fill_value=-1.5) >> Clip(min_value=-2, max_value=50) >> LogOp())
        + (["I1", "F1", "F2"] >> MissingIndicator())
        + (["I3"] >> Bucketize([0, 5, 50]))
        + (["C1", "C2", "M1"] >> Categorify())
        + (["C3", "C4", *k] >> Categorify(freq_threshold=3, max_vocab_size=25))
        + (["C5", "M2"] >> HashBucket(101))
        + (["C6"] >> HashIds(1024))
        + (["C1", *(k or ["C2"])] >> HashedCross(61))
    )


@pytest.fixture(scope="module", params=["text", "text and integers"])
def served(request) -> tuple[Preprocessor, Workflow]:
    """The preprocess of the workflow fitted on raw rows; its categorical columns all text, or with an integer one
    (whose values a request carries as text, and the workflow reads as numbers)."""
    roles = dict(ROLES, categorical=[c for c in ROLES["categorical"] if request.param != "text" or c != "K"])
    train = _table(3000, seed=0, unseen=0.0, odd=(*ODD, "")).select(["label", *roles["continuous"],
                                                                     *roles["categorical"], *roles["multihot"]])
    workflow = _workflow("K" in roles["categorical"]).fit(train.to_pandas(types_mapper=pd.ArrowDtype))
    schema = to_schema(workflow.output_schema(input_schema(roles)), {}, 1024)
    raw = RawColumns.from_arrow(train.schema, roles["continuous"], roles["categorical"], roles["multihot"],
                                label="label")
    return Preprocessor(raw, schema, workflow.transform_columns), workflow


def _as_bytes(tensors: dict) -> dict:
    """The request with its text as fixed-width ``S`` arrays, the other form the preprocess takes."""
    return {name: text_values(values) if name in TEXT else values for name, values in tensors.items()}


def _assert_same_bits(got: dict, expected: dict) -> None:
    assert sorted(got) == sorted(expected)
    for name, values in expected.items():
        assert got[name].dtype == values.dtype and got[name].shape == values.shape, name
        bits = f"u{values.itemsize}"
        assert np.array_equal(got[name].view(bits), values.view(bits)), name


@pytest.mark.parametrize("rows", [1, 32, 1000])
def test_preprocess_equals_the_workflows_own_transform_for_every_operator(served, rows):
    preprocess, workflow = served
    table = _table(rows, seed=rows, unseen=0.3).select(["label", *preprocess.raw.layout.columns])
    frame = table.to_pandas(types_mapper=pd.ArrowDtype)  # as the ETL's reader gives it
    expected = preprocess.tensors(Workflow.transform_partition(frame, workflow.output))
    assert sorted(expected) == ["CATEGORICAL_IDS", "DENSE", "MULTIHOT_IDS", "MULTIHOT_LENGTHS"]
    request = preprocess.raw.layout.tensors(frame)
    for got in (preprocess(request), preprocess(_as_bytes(request))):
        _assert_same_bits(got, expected)
    # every row missing everything
    nothing = pd.DataFrame({name: pd.Series([None] * rows, dtype=frame[name].dtype) for name in frame.columns})
    expected = preprocess.tensors(Workflow.transform_partition(nothing, workflow.output))
    _assert_same_bits(preprocess(_as_bytes(preprocess.raw.layout.tensors(nothing))), expected)


def test_fixed_width_strings_are_read_whole_and_as_arrow_reads_text(served):
    """Fixed-width bytes with a NUL byte inside a value are read whole, and bytes that are not UTF-8 with the
    invalid bytes replaced (as Arrow reads them): the same tensors as a request of that text."""
    preprocess, _ = served
    table = _table(4, seed=9, unseen=0.0).select(["label", *preprocess.raw.layout.columns])
    frame = table.to_pandas(types_mapper=pd.ArrowDtype)
    request = preprocess.raw.layout.tensors(frame)
    for sent, read in (([b"c11\x00tail", b"c2", b"", b"nul\x00inside"], [b"c11\x00tail", b"c2", b"", b"nul\x00inside"]),
                       ([b"\xff\xfec1", b"c2", b"", b"c11"], ["\ufffd\ufffdc1".encode(), b"c2", b"", b"c11"])):
        strings = np.full(text_values(request["STRINGS"]).shape, b"21", object)  # a number: K, where it is, reads it
        text = strings.copy()
        strings[:, 0], text[:, 0] = sent, read
        fixed = strings.astype("S")
        sent_tensor = np.ascontiguousarray(fixed).view(np.uint8).reshape(*fixed.shape, fixed.itemsize)
        expected = preprocess(dict(request, STRINGS=text))
        _assert_same_bits(preprocess(dict(request, STRINGS=sent_tensor)), expected)
        _assert_same_bits(preprocess(dict(request, STRINGS=fixed)), expected)


def _reference(vocabularies: dict, values: list, names: list[str]) -> list[int]:
    """Each value's position in its column's vocabulary (the first where it is there twice), by a dictionary."""
    positions = {name: {} for name in vocabularies}
    for name, vocab in vocabularies.items():
        for k, value in enumerate(vocab.to_pylist()):
            positions[name].setdefault(value, k)
    return [-1 if value is None else positions[name].get(value, -1) for value, name in zip(values, names)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_vocabulary_index_finds_what_a_dictionary_finds(seed):
    rng = np.random.default_rng(seed)

    def value() -> str:
        kind = rng.integers(0, 8)
        if kind == 0:
            return ODD[rng.integers(0, len(ODD))]
        if kind == 1:
            return "y" * int(rng.integers(LONG_BYTES - 2, LONG_BYTES + 3))  # either side of the bound
        return f"v{rng.integers(0, 60)}" * int(rng.integers(1, 5))

    vocabularies = {f"c{k}": pa.array(list(dict.fromkeys(value() for _ in range(size))) + ["dup", "dup"], pa.string())
                    for k, size in enumerate((0, 3, 50, 400))}
    index = VocabularyIndex(vocabularies)
    names = list(vocabularies)
    for rows in (1, 7, 100, 600):  # the binary search of the keys (of 400 values: in their order), the hash table
        looked_up = [[None if rng.random() < 0.1 else value() for _ in range(rows)] for _ in names]
        flat = [v for column in looked_up for v in column]
        expected = _reference(vocabularies, flat, [name for name in names for _ in range(rows)])
        for kind in (pa.string(), pa.large_string()):
            assert index.positions(TextWords.of_arrow(pa.array(flat, kind)), names, rows).tolist() == expected
        sliced = pa.array(["pad"] + flat, pa.string()).slice(1)
        assert index.positions(TextWords.of_arrow(sliced), names, rows).tolist() == expected
        as_bytes = np.array([(v or "").encode() for v in flat], dtype="S")  # empty: missing
        held = [v is None or "\x00" not in v for v in flat]  # fixed-width values hold no NUL byte
        found = index.positions(TextWords.of_fixed_width(as_bytes), names, rows, first=2, absent=1, missing=0)
        codes = [0 if not v else e + 2 if e >= 0 else 1 for e, v in zip(expected, flat)]
        assert [f for f, h in zip(found.tolist(), held) if h] == [c for c, h in zip(codes, held) if h]


def _colliding(seed: np.uint64) -> tuple[str, str]:
    """Two texts of 16 ASCII bytes with one key in the column of ``seed``: a second text's last word solved for."""
    rng = np.random.default_rng(0)
    first = np.frombuffer(b"abcdefghABCDEFGH", "<u8")
    inner = text_lookup._mix(np.array([seed ^ first[0]], np.uint64))[0]
    while True:
        other = rng.integers(0x21, 0x7F, 8).astype(np.uint8).view("<u8")[0]
        last = inner ^ first[1] ^ text_lookup._mix(np.array([seed ^ other], np.uint64))[0]
        tail = np.array([last], "<u8").view(np.uint8)
        if tail.min() >= 0x21 and tail.max() < 0x7F:
            return first.tobytes().decode(), (np.array([other, last], "<u8")).tobytes().decode()


def test_values_sharing_a_key_are_told_apart_by_their_bytes():
    probe = VocabularyIndex({"c": pa.array(["z"])})
    seed = probe._columns(("c",))[1][0]
    one, other = _colliding(seed)
    keys = [text_lookup._keys(TextWords.of_arrow(pa.array([v])).words, np.array([seed]))[0][0] for v in (one, other)]
    assert one != other and keys[0] == keys[1]
    both = VocabularyIndex({"c": pa.array(["a", one, other])})
    alone = VocabularyIndex({"c": pa.array(["a", one])})
    for times in (1, 600):  # a few values (a binary search of the keys) and many (the hash table)
        values = TextWords.of_arrow(pa.array([one, other, "a", "b"] * times))
        assert both.positions(values, ["c"], 4 * times).tolist() == [1, 2, 0, -1] * times
        assert alone.positions(values, ["c"], 4 * times).tolist() == [1, -1, 0, -1] * times  # its key, not it
