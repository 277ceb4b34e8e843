"""A GPU instance's preprocess (export/device_preprocess.py) answers what the host's preprocess answers, or leaves the
batch to it; on the CPU here, and with CUDA graphs on a GPU (marker ``gpu``).

The rows hold values unseen at fit, missing numbers and text, values of one to three 64-bit words, at 1, 32 and 300
rows (several graphs on a GPU, replayed after one another). The batches the device must leave to the host (text that
is not UTF-8, a NUL byte inside a value, a value wider than the index holds by its words, values sharing a key)
get the host's answer and are counted as the host's; workflows with an operator the device does not run are not
planned at all.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from export.device_preprocess import DevicePreprocessor
from export.preprocess import STRINGS, Preprocessor, RawColumns
from pipeline.errors import BadInputError
from pipeline.etl import (
    Bucketize,
    Cast,
    Categorify,
    Clip,
    FillMissing,
    HashBucket,
    LogOp,
    MissingIndicator,
    Normalize,
    Workflow,
)
from pipeline.etl.column_schema import input_schema, to_schema
from pipeline.etl.ops.text_lookup import LONG_BYTES
from tests.test_export_preprocess import _colliding

# LogOp of the values below -1 that Clip(min_value=-2) lets through gives NaN on purpose (compared too).
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in log1p:RuntimeWarning")

CONTINUOUS = ["I1", "I2", "F1"]
CATEGORICAL = ["C1", "C2", "C3", "C4"]


def _rows(n: int, seed: int, unseen: float) -> pd.DataFrame:
    rng = np.random.default_rng(seed)

    def words(prefix: str, vocab: int) -> list:
        drawn = rng.zipf(1.3, n) % vocab + np.where(rng.random(n) < unseen, vocab, 0)
        return [None if r < 0.1 else f"{prefix}{v:x}" * (1 + v % 3) for r, v in zip(rng.random(n), drawn)]

    def numbers(floats: bool) -> pd.Series:
        values = rng.lognormal(1, 2, n).round() - 3
        missing = rng.random(n) < 0.2
        if floats:
            return pd.Series(np.where(missing, np.nan, values))
        return pd.Series(pd.arrays.IntegerArray(values.astype(np.int64), missing))

    frame = pd.DataFrame({"label": rng.integers(0, 2, n).astype(np.int8), "I1": numbers(False), "I2": numbers(False),
                          "F1": numbers(True)})
    for k, name in enumerate(CATEGORICAL):
        frame[name] = pd.array(words(name.lower(), 30 + 300 * k), dtype="string[pyarrow]")
    return frame


def _standard(threshold: int = 2) -> Workflow:
    """The standard workflow's operators (pipeline/etl/defaults.py), and a second chain of the other numeric ones."""
    return Workflow((["label"] >> Cast("float32"))
                    + (["I1", "F1"] >> FillMissing(strategy="median") >> LogOp(signed=True) >> Normalize())
                    + (["I2"] >> FillMissing(fill_value=-1.5) >> Clip(min_value=-2, max_value=50) >> LogOp())
                    + (CONTINUOUS >> MissingIndicator())
                    + (CATEGORICAL[:2] >> Categorify(freq_threshold=threshold))
                    + (CATEGORICAL[2:] >> Categorify(freq_threshold=threshold, max_vocab_size=40)))


def _preprocessor(workflow: Workflow, train: pd.DataFrame) -> Preprocessor:
    workflow.fit(train)
    roles = {"label": "label", "continuous": CONTINUOUS, "categorical": CATEGORICAL, "multihot": []}
    schema = to_schema(workflow.output_schema(input_schema(roles)), {}, 1024)
    arrow = pa.Table.from_pandas(train, preserve_index=False).schema
    raw = RawColumns.from_arrow(arrow, CONTINUOUS, CATEGORICAL, [], label="label")
    return Preprocessor(raw, schema, workflow.transform_columns, workflow)


@pytest.fixture(scope="module")
def host() -> Preprocessor:
    return _preprocessor(_standard(), _rows(4000, seed=0, unseen=0.0))


def _assert_same(got: dict, expected: dict) -> None:
    assert sorted(got) == sorted(expected)
    np.testing.assert_array_equal(got["CATEGORICAL_IDS"], expected["CATEGORICAL_IDS"])
    assert got["DENSE"].dtype == expected["DENSE"].dtype and got["DENSE"].shape == expected["DENSE"].shape
    np.testing.assert_allclose(got["DENSE"], expected["DENSE"], rtol=1e-6, atol=0)


def _check_device(host: Preprocessor, device: str) -> None:
    device_pre = DevicePreprocessor.plan(host, device, max_batch=256)
    assert device_pre is not None
    sizes = [1, 32, 300, 5, 32, 200]  # 300: more than the largest batch, the host's
    for k, rows in enumerate(sizes):
        tensors = host.layout.tensors(_rows(rows, seed=10 + k, unseen=0.3))
        _assert_same(device_pre(tensors), host(tensors))
    assert device_pre.batches_on_device == len(sizes) - 1 and device_pre.batches_on_host == 1
    # a whole batch the device reads as the host does: every code is the host's, not the host's answer taken
    tensors = host.layout.tensors(_rows(64, seed=3, unseen=0.5))
    _assert_same(device_pre(tensors), host(tensors))
    assert device_pre.batches_on_device == len(sizes)


def _check_left_to_host(host: Preprocessor, device: str) -> None:
    device_pre = DevicePreprocessor.plan(host, device, max_batch=256)
    column = host.layout.strings.index("C2")
    for value, on_host in (("é-été", False), ("not UTF-8", True), ("nul\x00inside", True),
                           ("y" * (LONG_BYTES + 8), True)):
        rows = _rows(40, seed=5, unseen=0.2)
        rows.loc[7, "C2"] = value
        tensors = host.layout.tensors(rows)
        if value == "not UTF-8":
            tensors[STRINGS][7, column, 0] = 0xFF
        before = device_pre.batches_on_host
        _assert_same(device_pre(tensors), host(tensors))
        assert device_pre.batches_on_host == before + on_host, value


def _seed(host: Preprocessor, column: str) -> np.uint64:
    """The seed of ``column``'s keys in the index of the Categorify that encodes it."""
    op = next(op for op, names in host.workflow.operators() if isinstance(op, Categorify) and column in names)
    return np.uint64(op.index().tables().seeds[column])


def test_the_device_answers_what_the_host_answers(host):
    _check_device(host, "cpu")


def test_a_batch_the_device_does_not_read_as_the_host_is_the_hosts(host):
    _check_left_to_host(host, "cpu")


def test_values_sharing_a_key_in_the_vocabulary_are_the_hosts(host):
    """A vocabulary holding both values of one key: the batch goes to the host, which tells them apart."""
    one, other = _colliding(_seed(host, "C1"))
    train = _rows(4000, seed=0, unseen=0.0)
    train.loc[:5, "C1"], train.loc[6:11, "C1"] = one, other
    both = _preprocessor(_standard(), train)
    assert _seed(both, "C1") == _seed(host, "C1")
    device_pre = DevicePreprocessor.plan(both, "cpu", max_batch=64)
    rows = _rows(20, seed=4, unseen=0.0)
    rows.loc[3, "C1"], rows.loc[4, "C1"] = other, one
    tensors = both.layout.tensors(rows)
    got = device_pre(tensors)
    _assert_same(got, both(tensors))
    assert device_pre.batches_on_host == 1 and got["CATEGORICAL_IDS"][3, 0] != got["CATEGORICAL_IDS"][4, 0] > 1


def test_a_bad_request_gets_the_hosts_error(host):
    device_pre = DevicePreprocessor.plan(host, "cpu", max_batch=64)
    tensors = host.layout.tensors(_rows(4, seed=1, unseen=0.0))
    tensors[STRINGS] = tensors[STRINGS][:3]
    with pytest.raises(BadInputError, match="same number of rows"):
        device_pre(tensors)


@pytest.mark.parametrize("other", ["hash buckets", "bucketize"])
def test_a_workflow_with_an_operator_the_device_does_not_run_is_the_hosts(other):
    train = _rows(500, seed=0, unseen=0.0)
    extra = (["C4"] >> HashBucket(50)) if other == "hash buckets" else (["F1"] >> Bucketize([0, 5]))
    workflow = Workflow((["label"] >> Cast("float32")) + (CONTINUOUS[:2] >> FillMissing()) + (CATEGORICAL[:3] >> Categorify())
                        + extra)
    host = _preprocessor(workflow, train)
    assert DevicePreprocessor.plan(host, "cpu", max_batch=64) is None
    assert DevicePreprocessor.plan(Preprocessor(host.raw, host.schema, host.transform), "cpu", 64) is None


def test_vocabularies_that_do_not_fit_on_the_device_leave_the_workflow_to_the_host(host, monkeypatch):
    import torch

    from export import device_preprocess

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(device_preprocess._Vocabulary, "__init__", out_of_memory)
    assert DevicePreprocessor.plan(host, "cpu", max_batch=64) is None


@pytest.mark.gpu
def test_on_the_gpu_cuda_graphs_answer_what_the_host_answers(host):
    _check_device(host, "cuda")
    _check_left_to_host(host, "cuda")
