"""The served dense part on a GPU as CUDA graphs against the same module run as it is (marker ``gpu``).

Batches of every padding case (one row, a power of two, between two, the largest graph batch, beyond it) go
through one runner with graphs and one without, in turn, so a graph replays after others and after batches of
other sizes; the answers must be equal.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from export.dense import DenseRunner, save_dense
from pipeline.modules.models import ModelSizes, build_model
from pipeline.schema import Column, Schema

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("num_dense", [2, 0])
def test_cuda_graphs_answer_as_the_module_run_as_it_is(tmp_path, num_dense):
    columns = [Column("label", "label", "float32"), Column("C1", "categorical", "int32", cardinality=50),
               Column("C2", "categorical", "int32", cardinality=7)]
    columns += [Column(f"I{k}", "continuous", "float32") for k in range(num_dense)]
    model = build_model("dlrm", Schema(columns), ModelSizes.preset("small"), seed=0).eval()
    path = save_dense(model, tmp_path / "model.pt")
    graphs = DenseRunner(path, "cuda", cuda_graphs=True, max_batch=64)
    eager = DenseRunner(path, "cuda")
    assert graphs.cuda_graphs and not eager.cuda_graphs
    rng = np.random.default_rng(0)
    for rows in (1, 3, 64, 17, 32, 100, 3, 1):
        dense = rng.normal(size=(rows, num_dense)).astype(np.float32) if num_dense else None
        pooled = rng.normal(size=(rows, model.embedding.output_dim)).astype(np.float32)
        got, expected = graphs(dense, pooled), eager(dense, pooled)
        assert got.shape == expected.shape == (rows, 1)
        # The same kernels on the same inputs; cuBLAS may pick another algorithm for the padded batch size.
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
        # the pooled rows of a GPU cache, a tensor on the device: copied into the graph's input there
        on_device = torch.from_numpy(pooled).cuda()
        np.testing.assert_array_equal(graphs(dense, on_device), got)
        np.testing.assert_allclose(eager(dense, on_device), expected, rtol=0, atol=0)
    torch.cuda.synchronize()


@pytest.mark.parametrize("num_dense", [2, 0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_rows_of_a_gpu_cache_gathered_in_the_graph_answer_as_gathered_before(tmp_path, num_dense, dtype):
    """A batch given as the rows where a GPU cache holds them (``CachedRows``) is gathered inside the CUDA graph: the
    same answers as the gathered rows given as a tensor, over every padding case, and after the cache's rows are
    replaced by others (a new store version of other shapes) the graphs gather from the new ones."""
    from export.cache_torch import CachedRows

    columns = [Column("label", "label", "float32")]
    columns += [Column(f"C{k}", "categorical", "int32", cardinality=50) for k in range(3)]
    columns += [Column(f"I{k}", "continuous", "float32") for k in range(num_dense)]
    model = build_model("dlrm", Schema(columns), ModelSizes.preset("small"), seed=0).eval()
    path = save_dense(model, tmp_path / "model.pt")
    graphs = DenseRunner(path, "cuda", cuda_graphs=True, max_batch=64)
    eager = DenseRunner(path, "cuda")
    dim = model.embedding.output_dim // 3
    rng = np.random.default_rng(0)
    for version in range(2):
        rows = torch.from_numpy(rng.normal(size=(90 + version, dim)).astype(np.float32)).to("cuda", dtype)
        for batch in (1, 3, 64, 17, 32, 100, 3, 1):
            dense = rng.normal(size=(batch, num_dense)).astype(np.float32) if num_dense else None
            slots = rng.integers(0, len(rows), (batch, 3))
            got = graphs(dense, CachedRows(rows, slots))
            expected = eager(dense, rows[torch.from_numpy(slots).cuda()].reshape(batch, -1).float())
            assert got.shape == expected.shape == (batch, 1)
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(eager(dense, CachedRows(rows, slots)), expected)
        assert graphs._gathering_graphs, "the rows were gathered before the graph, not in it"
    torch.cuda.synchronize()
