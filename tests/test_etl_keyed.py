"""Categorify by 64-bit keys (the cuDF path's counting and look-ups, :mod:`pipeline.etl.ops.keyed`), run on
pandas: the same counts, vocabularies and codes as the pandas path's Arrow code, and exact when keys collide
(a key function that gives every string of one length the same key)."""

from __future__ import annotations

import uuid

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from pipeline.etl import Categorify, Workflow
from pipeline.etl.ops import keyed
from pipeline.etl.ops.categorify import (
    _all_counts_to_arrow,
    _count_partition,
    _count_partition_keyed,
    _encode,
    _flat_strings,
    _keyed_codes,
    _merge_partitions,
    _plain_strings,
)

NAMES = ["s", "i", "M"]
MULTIHOT = {"s": False, "i": False, "M": True}


def categorical_rows(n: int, seed: int, unseen: bool = False) -> pd.DataFrame:
    """Strings (Zipf, with nulls and non-ASCII text), integers with nulls, lists with missing lists and elements."""
    rng = np.random.default_rng(seed)
    shift = 1000 if unseen else 0
    strings = [None if r < 0.1 else f"v{z % 700 + shift * (r > 0.8)}é" for r, z in zip(rng.random(n), rng.zipf(1.3, n))]
    lists = [None if r < 0.1 else [None if j == 0 else f"t{j + shift * (r > 0.8)}" for j in rng.integers(0, 40, k)]
             for r, k in zip(rng.random(n), rng.integers(0, 4, n))]
    return pd.DataFrame({
        "s": pd.array(strings, dtype="string"),
        "i": pd.array(np.where(rng.random(n) < 0.15, None, rng.zipf(1.5, n) % 400 + shift * (rng.random(n) > 0.8)),
                      dtype="Int64"),
        "M": pd.Series(pd.arrays.ArrowExtensionArray(pa.array(lists, pa.list_(pa.string())))),
    })


def _as_dict(table: pa.Table) -> dict:
    return dict(zip(table["value"].to_pylist(), table["count"].to_pylist()))


def _keyed_fit(parts: list[pd.DataFrame], **params) -> Categorify:
    """A Categorify fitted as the cuDF path fits it: keyed counts of each partition, merged in a tree of 2."""
    level = [_count_partition_keyed(part, NAMES, MULTIHOT) for part in parts]
    while len(level) > 1:
        level = [_merge_partitions(*level[i:i + 2]) for i in range(0, len(level), 2)]
    stats = _all_counts_to_arrow(level[0])
    op = Categorify(**params)
    op.start_fit()
    op.fit_finalize(stats)
    return op


_STRONG_KEYS = keyed.string_keys


def _weak_keys(strings: pd.Series, seed: int = 0) -> np.ndarray:
    """Keys that collide on purpose (every string of one length has the same key), with real check keys."""
    if seed:
        return _STRONG_KEYS(strings, seed)
    return strings.str.len().fillna(0).to_numpy().astype(np.uint64)


def test_keyed_counts_of_a_partition_equal_the_arrow_counts():
    df = categorical_rows(3000, seed=1)
    by_keys = _all_counts_to_arrow(_count_partition_keyed(df, NAMES, MULTIHOT))
    by_arrow = _count_partition(df, NAMES, MULTIHOT)
    for name in NAMES:
        assert _as_dict(by_keys[name]["counts"]) == _as_dict(by_arrow[name]["counts"]), name
    assert by_keys["M"]["max_length"] == by_arrow["M"]["max_length"] == 3
    assert sum(_as_dict(by_arrow["s"]["counts"]).values()) == int(df["s"].notna().sum())


@pytest.mark.parametrize("collide", [False, True], ids=["xxhash-like keys", "colliding keys"])
@pytest.mark.parametrize("params", [{}, {"freq_threshold": 3, "max_vocab_size": 50}], ids=["all", "threshold"])
def test_keyed_vocabularies_and_codes_equal_the_pandas_path(monkeypatch, collide, params):
    if collide:
        monkeypatch.setattr(keyed, "string_keys", _weak_keys)
    train = categorical_rows(6000, seed=2)
    parts = [train.iloc[i:i + 1500] for i in range(0, len(train), 1500)]
    expected = Workflow(NAMES >> Categorify(**params)).fit(train).operators()[0][0]
    fitted = _keyed_fit(parts, **params)
    for name in NAMES:
        assert fitted.vocabularies[name].equals(expected.vocabularies[name]), name
        np.testing.assert_array_equal(fitted.counts[name], expected.counts[name], err_msg=name)
    assert fitted.max_lengths == expected.max_lengths
    valid = categorical_rows(2000, seed=3, unseen=True)
    for name in ("s", "i"):
        codes = _keyed_codes(_plain_strings(valid[name]), expected.vocabularies[name], expected.vocabulary_ids[name])
        want = expected.transform_column(name, valid[name])
        np.testing.assert_array_equal(codes, want, err_msg=name)
        assert (want == 1).any() and (want == 0).any() and (want >= 2).any(), "OOV, missing and known values"
    leaves = pc.list_flatten(pa.array(valid["M"].array))
    np.testing.assert_array_equal(_keyed_codes(_flat_strings(valid["M"]), expected.vocabularies["M"],
                                               expected.vocabulary_ids["M"]),
                                  _encode(leaves, expected.vocabularies["M"]))


def test_colliding_values_are_counted_apart_at_every_level(monkeypatch):
    monkeypatch.setattr(keyed, "string_keys", _weak_keys)
    first = keyed.count_columns([pd.Series(["ab", "cd", "ab", None, "e", "fg"]), pd.Series(["xy", "x", "xy"])])
    assert [dict(zip(f["value"], f["count"])) for f in first] == [{"ab": 2, "cd": 1, "e": 1, "fg": 1},
                                                                  {"xy": 2, "x": 1}]
    second = keyed.count_columns([pd.Series(["cd", "hi", "cd"]), pd.Series(["x", "ab"])])
    merged = keyed.merge_columns([first, second])
    assert [dict(zip(m["value"], m["count"])) for m in merged] == [{"ab": 2, "cd": 3, "e": 1, "fg": 1, "hi": 1},
                                                                   {"xy": 2, "x": 2, "ab": 1}]
    rows, counts = keyed.distinct_by_key(np.array([7, 7, 7, 7], dtype=np.uint64), np.array([3, 1, 3, 2], dtype=np.uint64),
                                         np.array([1, 10, 100, 1000]))
    assert dict(zip(pd.Series(["a", "b", "a", "c"]).take(rows), counts)) == {"a": 101, "b": 10, "c": 1000}


def test_a_look_up_confirms_each_key_by_its_check_key(monkeypatch):
    monkeypatch.setattr(keyed, "string_keys", _weak_keys)
    table = keyed.key_table(pd.Series(["a", "bb", "ccc"]))
    assert table.exact
    positions = keyed.look_up(table, pd.Series(["a", "x", "bb", "yy", None, "ccc", "dddd"]))
    np.testing.assert_array_equal(positions, [0, -1, 1, -1, -1, 2, -1])
    shared = keyed.key_table(pd.Series(["ab", "cd"]))
    assert not shared.exact
    with pytest.raises(ValueError, match="by its strings"):
        keyed.look_up(shared, pd.Series(["ab"]))
    vocab = pa.array(["ab", "cd", "e"])
    np.testing.assert_array_equal(_keyed_codes(pd.Series(["cd", "ab", "zz", None, "e", "f"]), vocab, uuid.uuid4().hex),
                                  [3, 2, 1, 0, 4, 1])


def test_keyed_counts_of_empty_and_all_missing_columns():
    empty, missing = pd.Series([], dtype="string"), pd.Series([None, None], dtype="string")
    out = keyed.count_columns([empty, missing, pd.Series(["a"], dtype="string")])
    assert [len(f) for f in out] == [0, 0, 1]
    assert keyed.look_up(keyed.key_table(pd.Series([], dtype="string")), missing).tolist() == [-1, -1]


def test_no_rows_are_coded_without_building_the_vocabularys_key_table():
    """Dask's metadata (an empty frame) goes through the transform on the client: it must not build key tables."""
    from pipeline.etl.ops import categorify

    vocab, vocab_id = pa.array(["a", "b"]), uuid.uuid4().hex
    codes = _keyed_codes(pd.Series([], dtype="string"), vocab, vocab_id)
    assert codes.dtype == np.int32 and len(codes) == 0
    assert not any(key[0] == vocab_id for key in categorify._KEY_TABLES_BY_ID.tables)
    assert _keyed_codes(pd.Series(["b", None]), vocab, vocab_id).tolist() == [3, 0]
    assert any(key[0] == vocab_id for key in categorify._KEY_TABLES_BY_ID.tables)


def test_merged_counts_keep_each_column_apart_where_a_partition_has_none_of_its_values():
    """A column empty (or all missing) in some partitions: the merge still finds which column each row is of."""
    empty = pd.Series([], dtype="string")
    parts = [keyed.count_columns([pd.Series(["a", "b", "a"]), empty, pd.Series([None, None], dtype="string")]),
             keyed.count_columns([empty, pd.Series(["a", "z"]), pd.Series(["q"])]),
             keyed.count_columns([pd.Series(["b"]), empty, empty])]
    merged = keyed.merge_columns(parts)
    assert [dict(zip(f["value"], f["count"])) for f in merged] == [{"a": 2, "b": 2}, {"a": 1, "z": 1}, {"q": 1}]
    assert merged.bounds == [0, 2, 4, 5]
    assert [dict(zip(f["value"], f["count"])) for f in keyed.merge_columns([merged, parts[1]])] == [
        {"a": 2, "b": 2}, {"a": 2, "z": 2}, {"q": 2}]


def test_copies_of_a_fitted_operator_share_its_key_tables_until_a_vocabulary_is_set_again(monkeypatch):
    """Each Dask task unpickles its own copy of the operator: the key table built for one task's copy serves the next
    (found by the vocabulary's id, not by the copy's object); a vocabulary fitted again gets a table of its own."""
    import pickle

    from pipeline.etl.ops import categorify

    monkeypatch.setattr(categorify, "_KEY_TABLES_BY_ID", categorify._KeyTablesById(1 << 30))
    builds = []
    monkeypatch.setattr(categorify, "key_table", lambda values: builds.append(len(values)) or keyed.key_table(values))
    train, valid = categorical_rows(3000, seed=4), categorical_rows(1000, seed=5, unseen=True)
    op = Workflow(["s"] >> Categorify()).fit(train).operators()[0][0]
    want = op.transform_column("s", valid["s"])
    for _ in range(3):
        copy = pickle.loads(pickle.dumps(op))
        codes = _keyed_codes(_plain_strings(valid["s"]), copy.vocabularies["s"], copy.vocabulary_ids["s"])
        np.testing.assert_array_equal(codes, want)
    first = len(op.vocabularies["s"])
    assert builds == [first]

    first_id = op.vocabulary_ids["s"]
    op = Workflow(["s"] >> Categorify(max_vocab_size=5)).fit(train).operators()[0][0]
    assert op.vocabulary_ids["s"] != first_id
    copy = pickle.loads(pickle.dumps(op))
    codes = _keyed_codes(_plain_strings(valid["s"]), copy.vocabularies["s"], copy.vocabulary_ids["s"])
    np.testing.assert_array_equal(codes, op.transform_column("s", valid["s"]))
    assert builds == [first, 5]


def test_key_tables_kept_by_id_stay_within_their_bytes_the_last_one_always_kept():
    from pipeline.etl.ops import categorify

    kept = categorify._KeyTablesById(budget=2 * 3 * 8 * 10)  # two tables of 10 values
    tables = {name: keyed.key_table(pd.Series([f"{name}{i}" for i in range(10)])) for name in "abc"}
    for name in "abc":
        kept.get((name,), lambda name=name: tables[name])
    assert list(kept.tables) == [("b",), ("c",)] and kept.held == 2 * 240
    kept.get(("b",), lambda: pytest.fail("b is kept"))
    kept.get(("a",), lambda: tables["a"])
    assert list(kept.tables) == [("b",), ("a",)]
    huge = categorify._KeyTablesById(budget=1)
    huge.get(("a",), lambda: tables["a"])
    assert list(huge.tables) == [("a",)]


def test_a_loaded_workflow_has_ids_for_its_vocabularies(tmp_path):
    train = categorical_rows(500, seed=6)
    workflow = Workflow(["s", "M"] >> Categorify()).fit(train)
    workflow.save(tmp_path / "wf")
    loaded = Workflow.load(tmp_path / "wf").operators()[0][0]
    assert set(loaded.vocabulary_ids) == {"s", "M"}
    assert loaded.vocabulary_ids["s"] != workflow.operators()[0][0].vocabulary_ids["s"]
