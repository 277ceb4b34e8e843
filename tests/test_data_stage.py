import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.data import synthetic
from pipeline.data.metrics import ClickMetrics, roc_auc
from pipeline.data.raw_folder import RawDataset
from pipeline.errors import UserError
from pipeline.stages.cli import main
from pipeline.stages.config import load_config
from pipeline.stages.data import ensure_raw, run

ROWS = 30_000


def _cfg(tmp_path, *overrides):
    return load_config(None, [f"workdir={tmp_path}", f"data.rows={ROWS}", "data.chunk_rows=7000", "seed=5",
                              "progress=off", *overrides])


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("stage")
    cfg = _cfg(tmp_path)
    return cfg, ensure_raw(cfg)


def test_raw_layout_and_meta(made):
    cfg, raw = made
    assert raw.root == cfg.paths.raw
    assert raw.rows == {"train": 24_000, "valid": 3_000, "test": 3_000}
    assert [p.name for p in raw.splits["train"]] == [f"part-{i:05d}.parquet" for i in range(4)]
    meta = json.loads((raw.root / "meta.json").read_text())
    assert meta["version"] == 1 and meta["source"] == "synthetic" and meta["label"] == "label"
    assert meta["continuous"] == [f"I{i}" for i in range(1, 14)]
    assert meta["categorical"] == [f"C{i}" for i in range(1, 27)] and meta["multihot"] == []
    assert meta["params"]["rows"] == ROWS and meta["params"]["seed"] == 5
    assert "cardinalities" not in json.dumps(meta)
    for split, parts in raw.splits.items():
        table = pa.concat_tables([pq.read_table(p) for p in parts])
        assert table.num_rows == raw.rows[split]
        assert table.schema.field("label").type == pa.int8()
        assert table.schema.field("C26").type == pa.string()


def test_oracle_is_written_and_can_be_recomputed(made):
    cfg, raw = made
    assert set(raw.oracle) == {"train", "valid", "test"}
    for split, metrics in raw.oracle.items():
        assert metrics["rows"] == raw.rows[split]
        assert 0.7 < metrics["auc"] < 0.9 and 0.2 < metrics["positive_rate"] < 0.3
        assert 0.3 < metrics["logloss"] < 0.6
    model = synthetic.ClickModel.create(cfg.seed, cfg.data.size)
    chunks = list(synthetic.iter_split(model, "valid", raw.rows["valid"], 1000))
    labels = np.concatenate([c.table.column("label").to_numpy() for c in chunks])
    probability = np.concatenate([c.probability for c in chunks])
    stored = pq.read_table(raw.splits["valid"][0]).column("label").to_numpy()
    np.testing.assert_array_equal(labels, stored)
    assert raw.oracle["valid"]["auc"] == pytest.approx(roc_auc(labels, probability), abs=1e-4)
    metrics = ClickMetrics()
    metrics.update(labels, probability)
    assert metrics.result()["logloss"] == pytest.approx(raw.oracle["valid"]["logloss"], rel=1e-9)


def test_reused_when_settings_match_rebuilt_when_not(made, capsys):
    cfg, raw = made
    stamp = raw.splits["train"][0].stat().st_mtime_ns
    again = ensure_raw(cfg)
    assert again.rows == raw.rows and raw.splits["train"][0].stat().st_mtime_ns == stamp
    assert "building" not in capsys.readouterr().out
    # chunking is not part of the params: the rows would be the same
    assert ensure_raw(load_config(None, [f"workdir={cfg.workdir}", f"data.rows={ROWS}", "data.chunk_rows=5000",
                                         "seed=5"])).rows == raw.rows
    smaller = ensure_raw(_cfg(cfg.workdir, "data.size=0.002"))
    assert "size: 0.01 -> 0.002" in capsys.readouterr().out
    assert smaller.params["size"] == 0.002
    ensure_raw(cfg)  # leave the module's data as it was


def test_unfinished_folder_is_rebuilt(tmp_path, capsys):
    cfg = _cfg(tmp_path, "data.rows=5000")
    ensure_raw(cfg)
    (cfg.paths.raw / "meta.json").unlink()
    raw = ensure_raw(cfg)
    assert "no finished raw data" in capsys.readouterr().out
    assert RawDataset.load(cfg.paths.raw).rows == raw.rows


@pytest.mark.parametrize("damage", ["removed", "truncated", "added"])
def test_a_damaged_raw_folder_is_noticed_and_made_again(tmp_path, capsys, damage):
    cfg = _cfg(tmp_path, "data.rows=20000", "data.chunk_rows=4000")
    made = ensure_raw(cfg)
    whole = {s: pa.concat_tables([pq.read_table(p) for p in made.splits[s]]) for s in made.splits}
    part = made.splits["train"][1]
    if damage == "removed":
        part.unlink()
    elif damage == "truncated":
        part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    else:
        part.with_name("part-00099.parquet").write_bytes(part.read_bytes())
    capsys.readouterr()
    again = ensure_raw(cfg)
    assert "building it again" in capsys.readouterr().out
    assert again.rows == made.rows
    for split, table in whole.items():
        assert pa.concat_tables([pq.read_table(p) for p in again.splits[split]]).equals(table)


def test_a_damaged_dataset_named_alone_is_one_clear_error(tmp_path):
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"clicked": np.arange(600) % 2, "price": np.arange(600) * 0.5}), path)
    roles = ["data.source=table", "data.name=mine", "data.label=clicked", "data.continuous=[price]"]
    made = ensure_raw(_cfg(tmp_path, *roles, f"data.path={path}"))
    made.splits["train"][0].unlink()
    with pytest.raises(UserError, match=r"holds 0 rows in 0 part\(s\) where .*meta.json says .*data.path"):
        ensure_raw(_cfg(tmp_path, "data.name=mine"))
    assert ensure_raw(_cfg(tmp_path, *roles, f"data.path={path}")).rows == made.rows


def test_cli_data_command(tmp_path, capsys):
    assert main(["data", f"workdir={tmp_path}", "data.rows=4000", "data.chunk_rows=3000"]) == 0
    assert "oracle_test_auc" in capsys.readouterr().out
    summary = run(load_config(None, [f"workdir={tmp_path}", "data.rows=4000", "data.chunk_rows=3000"]))
    assert summary["rebuilt"] is False and summary["rows"]["train"] == 3200
    assert main(["data", f"workdir={tmp_path}", "data.source=criteo", f"data.path={tmp_path / 'nope.tsv'}"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_dataset_ingested_from_files_is_kept_and_replaced_only_on_request(tmp_path, capsys):
    def table(path, rows, seed):
        rng = np.random.default_rng(seed)
        pq.write_table(pa.table({"clicked": rng.integers(0, 2, rows), "price": rng.random(rows),
                                 "item": [f"i{v}" for v in rng.integers(0, 50, rows)]}), path)

    table(tmp_path / "a.parquet", 400, 1)
    table(tmp_path / "b.parquet", 300, 2)
    roles = ["data.source=table", "data.name=mine", "data.label=clicked", "data.continuous=[price]",
             "data.categorical=[item]"]
    made = ensure_raw(_cfg(tmp_path, *roles, f"data.path={tmp_path / 'a.parquet'}"))
    assert made.source == "table" and sum(made.rows.values()) == 400
    capsys.readouterr()
    # a later stage given only the dataset's name uses it as it was made
    again = ensure_raw(_cfg(tmp_path, "data.name=mine"))
    assert again.source == "table" and again.rows == made.rows
    assert "as it was made" in capsys.readouterr().out
    # other files under the same name are refused without data.rebuild=true, and nothing is replaced
    other = [*roles, f"data.path={tmp_path / 'b.parquet'}"]
    assert main(["data", f"workdir={tmp_path}", *other]) == 2
    said = capsys.readouterr().err
    assert "data.rebuild=true" in said
    # in words, not two lists of records
    assert f"(input files: {tmp_path / 'b.parquet'} added; {tmp_path / 'a.parquet'} no longer given" in said
    assert RawDataset.load(made.root).rows == made.rows
    size = (tmp_path / "a.parquet").stat().st_size
    table(tmp_path / "a.parquet", 410, 1)
    assert main(["data", f"workdir={tmp_path}", *roles, f"data.path={tmp_path / 'a.parquet'}"]) == 2
    now = (tmp_path / "a.parquet").stat().st_size
    assert (f"(input files: {tmp_path / 'a.parquet'} changed ({size:,} -> {now:,} bytes, modified since)"
            in capsys.readouterr().err)
    rebuilt = ensure_raw(_cfg(tmp_path, *other, "data.rebuild=true"))
    assert sum(rebuilt.rows.values()) == 300


def test_processes_make_the_same_rows_and_oracle(tmp_path):
    """``data.workers=2``: blocks made by two processes, in order, give the files and oracle of one process."""
    other = ensure_raw(_cfg(tmp_path, "data.rows=150000", "data.workers=2"))
    alone = ensure_raw(_cfg(tmp_path / "alone", "data.rows=150000", "data.workers=1"))
    assert other.oracle == alone.oracle
    for split in ("train", "valid", "test"):
        assert [p.name for p in other.splits[split]] == [p.name for p in alone.splits[split]]
        for a, b in zip(other.splits[split], alone.splits[split]):
            assert pq.read_table(a).equals(pq.read_table(b))


def test_a_raw_folder_with_a_multi_hot_column_is_whole(tmp_path):
    """A list column's parquet leaf is named 'element': the check reads the top-level columns, so a dataset with
    multi-hot columns is not taken for damaged (and built again) at every run."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.data import raw_folder

    meta = {"label": "label", "continuous": ["I1"], "categorical": ["C1"], "multihot": ["tags"],
            "rows": {"train": 2, "valid": 0, "test": 0}}
    (tmp_path / "train").mkdir()
    table = pa.table({"label": [0, 1], "I1": [1.0, 2.0], "C1": ["a", "b"], "tags": pa.array([["x", "y"], []])})
    pq.write_table(table, tmp_path / "train" / "part-00000.parquet")
    assert raw_folder.damage(tmp_path, meta) is None
    pq.write_table(table.drop(["tags"]), tmp_path / "train" / "part-00000.parquet")
    assert "has no column(s) ['tags']" in raw_folder.damage(tmp_path, meta)


def test_data_is_not_made_again_under_a_reader_of_it(tmp_path):
    """A data stage with other settings used to clear the raw folder while an ETL of another process read it. It
    now waits for the reader, then makes its data."""
    import threading

    from pipeline.stages.data import raw_in_use

    cfg, other = _cfg(tmp_path), _cfg(tmp_path, "data.rows=20000")
    with raw_in_use(cfg) as raw:  # an ETL reads it
        maker = threading.Thread(target=run, args=(other,))
        maker.start()
        maker.join(timeout=3)
        assert maker.is_alive(), "the data was made again under its reader"
        assert RawDataset.load(cfg.paths.raw).rows == raw.rows
        assert sum(pq.read_metadata(p).num_rows for p in raw.splits["train"]) == raw.rows["train"]
    maker.join(timeout=120)
    assert not maker.is_alive()
    assert sum(RawDataset.load(cfg.paths.raw).rows.values()) == 20_000


def test_processes_wanting_the_same_data_at_once_make_it_once(tmp_path, monkeypatch):
    """Two runs on a new workdir at once (two trainings, say) each made the data into the same folder: one of them
    read the other's parts half written (a parquet error, or a traceback). Now one makes it; the other waits and
    uses it."""
    import threading

    from pipeline.stages import data as data_stage

    made, generate = [], data_stage._generate
    monkeypatch.setattr(data_stage, "_generate", lambda *a: (made.append(1), generate(*a)))
    cfg = _cfg(tmp_path)
    results, errors = [], []

    def want():
        try:
            results.append(ensure_raw(cfg))
        except Exception as err:  # noqa: BLE001 -- the test reports any failure of either
            errors.append(err)

    threads = [threading.Thread(target=want) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(results) == 2
    assert made == [1]
    assert results[0].rows == results[1].rows == {"train": 24_000, "valid": 3_000, "test": 3_000}
