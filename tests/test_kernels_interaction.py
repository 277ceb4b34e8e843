"""The dot interaction: the reference against bmm + the lower-triangle pick, the custom ops on CPU
(opcheck, autograd, tracing, torch.compile), the kernels' build and launch arguments, and on a GPU
(marker ``gpu``) the kernels against an fp64 reference, opcheck, and a compiled DLRM step."""

from __future__ import annotations

import copy
import re
import threading

import pytest
import torch

from pipeline.kernels._compile import KERNEL_DIR
from pipeline.kernels.interaction import dot_interaction, launcher, ops, reference
from pipeline.modules.collection import EmbeddingCollection
from pipeline.modules.configs import EmbeddingOptimizerConfig, TableConfig
from pipeline.modules.models import DLRM, ModelSizes
from pipeline.sparse import KeyedJaggedTensor
from tests.test_kernels_build import _built_ptx_params
from tests.test_kernels_ops import train_steps

SOURCE = "interaction/interaction.cu"


def bmm_and_pick(vectors: torch.Tensor) -> torch.Tensor:
    """DLRM's interaction written the plain way: all products, then the pairs of torch.tril_indices."""
    v = vectors.shape[1]
    rows, cols = torch.tril_indices(v, v, offset=-1, device=vectors.device)
    return torch.bmm(vectors, vectors.transpose(1, 2)).flatten(1)[:, rows * v + cols]


def _parts(vectors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's first vector and the others: the two parts the ops take (views of ``vectors``)."""
    return vectors[:, 0], vectors[:, 1:]


# --- the reference and the ops on CPU ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("v", [0, 1, 2, 3, 27])
def test_reference_equals_bmm_and_the_tril_pick_exactly(v, dtype):
    vectors = torch.randn(5, v, 16, generator=torch.Generator().manual_seed(v)).to(dtype)
    out = reference.dot_interaction(vectors)
    assert out.dtype == dtype and out.shape == (5, v * (v - 1) // 2) and out.is_contiguous()
    assert torch.equal(out, bmm_and_pick(vectors))


@pytest.mark.parametrize("v", [2, 3, 9])
def test_reference_backward_is_the_gradient_of_bmm_and_the_pick(v):
    g = torch.Generator().manual_seed(v)
    vectors = torch.randn(4, v, 6, dtype=torch.float64, generator=g, requires_grad=True)
    grad = torch.randn(4, reference.pair_count(v), dtype=torch.float64, generator=g)
    (want,) = torch.autograd.grad(bmm_and_pick(vectors), vectors, grad)
    got = reference.dot_interaction_backward(vectors.detach(), grad)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"expected grad \[4, "):
        reference.dot_interaction_backward(vectors.detach(), grad[:, 1:])


def test_op_autograd_on_cpu_matches_autograd_of_bmm_and_the_pick():
    g = torch.Generator().manual_seed(0)
    vectors = torch.randn(3, 7, 5, dtype=torch.float64, generator=g)
    assert torch.autograd.gradcheck(ops.interaction_forward, tuple(p.clone().requires_grad_() for p in _parts(vectors)))
    half = torch.randn(16, 27, 32, generator=g).bfloat16().requires_grad_()
    grad = torch.randn(16, 351, generator=g).bfloat16()
    (want,) = torch.autograd.grad(bmm_and_pick(half), half, grad)
    (got,) = torch.autograd.grad(dot_interaction(half), half, grad)
    assert got.dtype == torch.bfloat16
    # one bmm with the symmetric pair matrix against autograd's two: the same sums, rounded apart
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=0.05)
    assert want.abs().max() > 10


@pytest.mark.parametrize("shape", [(3, 6, 8), (0, 4, 8), (2, 1, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_on_cpu(dtype, shape):
    g = torch.Generator().manual_seed(1)
    vectors = torch.randn(*shape, generator=g).to(dtype)
    grad = torch.randn(shape[0], reference.pair_count(shape[1]), generator=g).to(dtype)
    torch.library.opcheck(ops.interaction_forward, _parts(vectors))
    torch.library.opcheck(ops.interaction_forward, tuple(p.clone().requires_grad_() for p in _parts(vectors)))
    torch.library.opcheck(ops.interaction_backward, (*_parts(vectors), grad))


def test_vectors_must_be_three_dimensional_or_two_parts_of_one_width():
    with pytest.raises(ValueError, match=r"expected vectors \[B, V, D\], got shape \(4, 8\)"):
        dot_interaction(torch.zeros(4, 8))
    with pytest.raises(ValueError, match=r"two parts \[B, D\] and \[B, V - 1, D\], got shapes \(4, 8\) and \(4, 3, 6\)"):
        dot_interaction(torch.zeros(4, 8), torch.zeros(4, 3, 6))


def test_two_parts_give_what_their_concatenation_gives_with_gradients_for_each():
    g = torch.Generator().manual_seed(4)
    head = torch.randn(5, 6, dtype=torch.float64, generator=g, requires_grad=True)
    tail = torch.randn(5, 4, 6, dtype=torch.float64, generator=g, requires_grad=True)
    joined = torch.cat([head.unsqueeze(1), tail], 1)
    grad = torch.randn(5, 10, dtype=torch.float64, generator=g)
    want = torch.autograd.grad(bmm_and_pick(joined), (head, tail), grad)
    out = dot_interaction(head, tail)
    assert torch.equal(out, reference.dot_interaction(joined.detach()))
    got = torch.autograd.grad(out, (head, tail), grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _dlrm(dim: int = 8, features: int = 4, backend: str = "auto", optimizer: str = "adam") -> DLRM:
    names = [f"C{i}" for i in range(features)]
    tables = [TableConfig(f"t_{f}", 50 + 7 * i, dim, [f]) for i, f in enumerate(names)]
    emb = EmbeddingCollection(tables, names, EmbeddingOptimizerConfig(optimizer, lr=0.05), backend=backend,
                              generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)
    return DLRM(emb, 3, ModelSizes(embedding_dim=dim, bottom_mlp=[16, dim], top_mlp=[16, 1]))


def _batches(model: DLRM, steps: int, batch: int, device: str):
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        ids = torch.stack([torch.randint(0, t.rows, (batch,), generator=g) for t in model.embedding.tables], 1)
        dense = torch.randn(batch, 3, generator=g)
        labels = (torch.rand(batch, generator=g) < 0.5).float()
        kjt = KeyedJaggedTensor.from_dense(model.embedding.feature_names, ids)
        out.append((dense.to(device), kjt.to(device), labels.to(device)))
    return out


def test_dlrm_interaction_is_bmm_and_the_pick():
    model = _dlrm()
    dense, pooled = torch.randn(6, 3), torch.randn(6, model.embedding.output_dim)
    with torch.no_grad():
        vectors = torch.cat([model.bottom(dense).unsqueeze(1), pooled.view(6, 4, 8)], dim=1)
        want = model.top(torch.cat([vectors[:, 0], bmm_and_pick(vectors)], dim=1)).squeeze(1)
        assert torch.equal(model.dense_forward(dense, pooled), want)


def test_traced_dense_part_holds_plain_torch_ops_only():
    """What export saves: a traced model that loads without this package's custom ops."""
    model = _dlrm().eval()
    dense, pooled = torch.randn(5, 3), torch.randn(5, model.embedding.output_dim)
    with torch.no_grad():
        traced = torch.jit.trace(model.dense_part(), (dense, pooled), check_trace=False)
        graph = str(traced.inlined_graph)
        assert "aten::bmm" in graph and "pipeline::" not in graph
        dense, pooled = torch.randn(9, 3), torch.randn(9, model.embedding.output_dim)
        assert torch.equal(traced(dense, pooled), model.dense_forward(dense, pooled))


def _recording(graphs: list, compiler):
    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return compiler(gm, example_inputs)

    return backend


def _in_bf16(model):
    """``model``'s logits under bf16 autocast on CUDA, in fp32."""
    def step(dense, kjt):
        with torch.autocast("cuda", torch.bfloat16):
            return model(dense, kjt).float()
    return step


def test_compiled_dlrm_holds_the_op_as_one_node_and_trains_like_eager():
    eager = _dlrm()
    compiled = copy.deepcopy(eager)
    batches = _batches(eager, steps=3, batch=16, device="cpu")
    torch._dynamo.reset()
    graphs = []
    step = torch.compile(compiled, backend=_recording(graphs, lambda gm, _: gm.forward), fullgraph=True)
    expected = train_steps(eager, eager, batches, [0.05] * 3)
    got = train_steps(compiled, step, batches, [0.05] * 3)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert len(graphs) == 1 and "torch.ops.pipeline.dot_interaction.default" in graphs[0]
    assert "bmm" not in graphs[0]


# --- the kernels' build and launch arguments (CPU) ------------------------------------------------------


def test_launch_arguments_match_kernel_signatures(nvcc_build, monkeypatch):
    entries = _built_ptx_params(SOURCE, nvcc_build)
    launches = []
    monkeypatch.setattr(launcher, "launch", lambda source, function, device, grid, block, args, shared:
                        launches.append((function, args, block, shared)))
    monkeypatch.setattr(launcher, "supported", lambda head, tail: True)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for v in (2, 27, 33, 64):
            vectors = torch.zeros(3, v, 24, dtype=dtype)
            launcher.forward(*_parts(vectors))
            launcher.backward(*_parts(vectors), torch.zeros(3, reference.pair_count(v), dtype=dtype))
    assert len(launches) == 24 and {f for f, *_ in launches} >= {"dot_interaction_forward_bf16_v32",
                                                                  "dot_interaction_backward_f32_v64"}
    for function, args, block, shared in launches:
        assert function in entries, f"{function} is not a kernel of {SOURCE}"
        passed = [{"c_void_p": "u64", "c_int": "u32", "c_long": "u64"}[type(a).__name__] for a in args]
        assert passed == [t.replace("s", "u") for t in entries[function]], function
        assert block % 32 == 0 and 0 < block <= 128 and shared <= launcher.BLOCK_SHARED_BYTES


def test_no_16_bit_kernel_spills_registers_and_the_fp32_ones_barely(nvcc_build):
    """The 16-bit kernels (what training under autocast runs) keep everything in registers. The fp32 ones split
    each value into two tf32 parts and hold the sample's two parts' rows as they copy them: ptxas keeps the v32
    forward at 64 registers and spills 8 bytes there, which these bounds allow and no more."""
    result, _ = nvcc_build(SOURCE)
    assert result.returncode == 0, result.stderr
    spills = dict(re.findall(r"Function properties for (\w+)\n\s+\d+ bytes stack frame, (\d+) bytes spill stores",
                             result.stderr))
    assert len(spills) == 24, result.stderr
    for kernel, stored in spills.items():
        assert int(stored) <= (8 if "_f32_" in kernel else 0), (kernel, stored)


def test_the_shared_row_strides_are_the_same_in_the_launcher_and_the_kernel():
    source = (KERNEL_DIR / SOURCE).read_text()
    assert re.search(r"#define ROW_WORDS (\d+)", source).group(1) == str(launcher.ROW_WORDS)
    assert re.search(r"#define COLUMN_ROW_WORDS (\d+)", source).group(1) == str(launcher.COLUMN_ROW_WORDS)
    assert re.search(r"__launch_bounds__\((\d+)\)", source).group(1) == str(32 * launcher.MAX_WARPS)


def test_every_supported_shape_fits_a_block():
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for v in range(2, launcher.MAX_VECTORS + 1):
            for words in (launcher.forward_warp_words(v, dtype), launcher.backward_warp_words(v, dtype)):
                _, warps = launcher.geometry(65536, words)
                assert 4 * words * warps <= launcher.BLOCK_SHARED_BYTES and 1 <= warps <= launcher.MAX_WARPS
    # DLRM's shape in bf16: 9.4 KB (forward) and 11.3 KB (backward) a warp, four warps a block
    assert launcher.geometry(65536, launcher.forward_warp_words(27, torch.bfloat16)) == (4096, 4)
    assert launcher.geometry(65536, launcher.backward_warp_words(27, torch.bfloat16)) == (4096, 4)


def test_kernels_take_cuda_vectors_of_up_to_64_rows_in_three_dtypes():
    def supported(b, v, d, dtype=torch.float32, tail_dtype=None):
        return launcher.supported(_cuda_like(b, d, dtype=dtype), _cuda_like(b, v - 1, d, dtype=tail_dtype or dtype))

    assert supported(2, 64, 8) and supported(2, 27, 8, dtype=torch.bfloat16)
    assert not supported(2, 65, 8)
    assert not supported(2, 27, 8, dtype=torch.float64)
    assert not supported(2, 27, 8, dtype=torch.bfloat16, tail_dtype=torch.float32)
    assert not launcher.supported(torch.zeros(2, 8), torch.zeros(2, 26, 8))


def _cuda_like(*shape, dtype=torch.float32):
    """A tensor that says it is on CUDA without a GPU (the fake-tensor mode of torch.compile)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(*shape, dtype=dtype, device="cuda")


# --- on a GPU -------------------------------------------------------------------------------------------

SHAPES = [(1, 2, 1), (3, 5, 7), (257, 27, 128), (64, 16, 64), (33, 17, 40), (5, 64, 256), (7, 48, 300),
          (9, 33, 129), (2, 3, 512)]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HALF_ULP = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _within(got: torch.Tensor, exact: torch.Tensor, magnitude: torch.Tensor, dtype: torch.dtype) -> None:
    """``got`` is ``exact`` summed in fp32 (error below 2e-5 of the sum of the terms' magnitudes) and rounded
    to ``dtype`` (half an ulp)."""
    err = (got.double() - exact).abs()
    limit = HALF_ULP[dtype] * exact.abs() + 2e-5 * magnitude
    worst = (err - limit).argmax()
    assert bool((err <= limit).all()), (f"off by {err.flatten()[worst]:.3g} where {limit.flatten()[worst]:.3g} "
                                        f"is allowed (exact {exact.flatten()[worst]:.6g})")


def _symmetric(grad: torch.Tensor, v: int) -> torch.Tensor:
    b = grad.shape[0]
    rows, cols = torch.tril_indices(v, v, offset=-1, device=grad.device)
    matrix = grad.new_zeros(b, v, v)
    matrix[:, rows, cols] = grad
    return matrix + matrix.transpose(1, 2)


def _case(shape, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    b, v, d = shape
    vectors = torch.randn(b, v, d, device="cuda", generator=g).to(dtype)
    grad = torch.randn(b, reference.pair_count(v), device="cuda", generator=g).to(dtype)
    return vectors, grad


def _check_against_fp64(vectors, grad, out, grad_vectors):
    x, gd = vectors.double(), grad.double()
    assert out.dtype == vectors.dtype and grad_vectors.dtype == vectors.dtype
    _within(out, reference.dot_interaction(x), reference.dot_interaction(x.abs()), vectors.dtype)
    matrix = _symmetric(gd, x.shape[1])
    _within(grad_vectors, torch.bmm(matrix, x), torch.bmm(matrix.abs(), x.abs()), vectors.dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernels_match_the_fp64_reference(shape, dtype):
    vectors, grad = _case(shape, DTYPES[dtype])
    out, grad_vectors = launcher.forward(*_parts(vectors)), launcher.backward(*_parts(vectors), grad)
    torch.cuda.synchronize()
    _check_against_fp64(vectors, grad, out, grad_vectors)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_kernels_on_unaligned_vectors_and_a_strided_gradient(dtype):
    """A start off a 16-byte boundary takes the element-wise copies; the gradient of pairs that are columns
    of a wider tensor (DLRM's, cut from the top MLP's input) is read in place."""
    b, v, d = 40, 27, 128
    dt = DTYPES[dtype]
    g = torch.Generator(device="cuda").manual_seed(5)
    flat = torch.randn(b * v * d + 1, device="cuda", generator=g).to(dt)
    vectors = flat[1:].view(b, v, d)
    assert vectors.data_ptr() % 16 != 0
    wide = torch.randn(b, d + reference.pair_count(v), device="cuda", generator=g).to(dt)
    grad = wide[:, d:]
    assert not grad.is_contiguous()
    _check_against_fp64(vectors, grad, launcher.forward(*_parts(vectors)), launcher.backward(*_parts(vectors), grad))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_kernels_read_a_head_and_tail_of_their_own_where_they_lie(dtype):
    """DLRM's parts: the bottom MLP's output and the pooled rows, two tensors never concatenated; and the learned
    vector of a model without dense features, one row that every sample shares (row stride 0)."""
    b, v, d = 300, 27, 128
    dt = DTYPES[dtype]
    g = torch.Generator(device="cuda").manual_seed(9)
    head = torch.randn(b, d, device="cuda", generator=g).to(dt)
    pooled = torch.randn(b, (v - 1) * d, device="cuda", generator=g).to(dt)
    grad = torch.randn(b, reference.pair_count(v), device="cuda", generator=g).to(dt)
    for first in (head, head[:1].expand(b, d)):
        tail = pooled.view(b, v - 1, d)
        joined = torch.cat([first.unsqueeze(1), tail], 1)
        _check_against_fp64(joined, grad, launcher.forward(first, tail), launcher.backward(first, tail, grad))
        assert torch.equal(launcher.forward(first, tail), launcher.forward(*_parts(joined)))


@pytest.mark.gpu
def test_dlrm_batch_in_bf16():
    vectors, grad = _case((65536, 27, 128), torch.bfloat16, seed=7)
    _check_against_fp64(vectors, grad, launcher.forward(*_parts(vectors)), launcher.backward(*_parts(vectors), grad))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_ops_run_the_kernels_on_cuda_and_the_reference_past_64_vectors(dtype):
    vectors, grad = _case((33, 27, 64), dtype, seed=3)
    x = vectors.clone().requires_grad_()
    out = dot_interaction(x)
    (grad_vectors,) = torch.autograd.grad(out, x, grad)
    assert torch.equal(out, launcher.forward(*_parts(vectors)))
    assert torch.equal(grad_vectors, launcher.backward(*_parts(vectors), grad))
    wide, wide_grad = _case((4, 65, 16), dtype, seed=4)
    assert not launcher.supported(*_parts(wide))
    assert torch.equal(dot_interaction(wide), reference.dot_interaction(wide))
    assert torch.equal(ops.interaction_backward(*_parts(wide), wide_grad),
                       reference.dot_interaction_backward(wide, wide_grad))


@pytest.mark.gpu
def test_kernels_launch_from_a_thread_that_made_no_cuda_call():
    """A fresh thread (like autograd's backward thread) has no current CUDA context until a runtime call
    makes one: the launch must make it, not fail with an invalid context."""
    vectors, grad = _case((8, 27, 32), torch.float32, seed=8)
    expected = launcher.backward(*_parts(vectors), grad)
    results = []
    worker = threading.Thread(target=lambda: results.append(launcher.backward(*_parts(vectors), grad)))
    worker.start()
    worker.join()
    assert len(results) == 1 and torch.equal(results[0], expected)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_on_cuda(dtype):
    vectors, grad = _case((6, 27, 40), dtype, seed=6)
    torch.library.opcheck(ops.interaction_forward, _parts(vectors))
    torch.library.opcheck(ops.interaction_forward, tuple(p.clone().requires_grad_() for p in _parts(vectors)))
    torch.library.opcheck(ops.interaction_backward, (*_parts(vectors), grad))


@pytest.mark.gpu
def test_compiled_dlrm_step_in_bf16_autocast_runs_the_kernels_like_eager():
    """DLRM under bf16 autocast and inductor, whole graph: the interaction is one op node, its kernels run in
    both graphs, and the losses follow eager's."""
    from torch._inductor.compile_fx import compile_fx

    eager = _dlrm(dim=32, features=26, backend="cuda", optimizer="sgd").cuda()
    compiled = copy.deepcopy(eager)
    batches = _batches(eager, steps=5, batch=512, device="cuda")
    torch._dynamo.reset()
    graphs = []
    step = torch.compile(_in_bf16(compiled), backend=_recording(graphs, compile_fx), fullgraph=True)
    calls = []
    original = launcher.launch
    launcher.launch = lambda source, function, *args, **kw: (calls.append(function), original(source, function,
                                                                                          *args, **kw))
    try:
        expected = train_steps(eager, _in_bf16(eager), batches, [0.05] * 5)
        eager_calls, calls[:] = list(calls), []
        got = train_steps(compiled, step, batches, [0.05] * 5)
    finally:
        launcher.launch = original
    assert len(graphs) == 1 and "torch.ops.pipeline.dot_interaction.default" in graphs[0]
    for kernel in ("dot_interaction_forward_bf16_v32", "dot_interaction_backward_bf16_v32"):
        assert eager_calls.count(kernel) == 5 and calls.count(kernel) >= 5, (kernel, eager_calls, calls)
    # inductor fuses the MLPs' bf16 arithmetic otherwise: a few bf16 ulps over five steps
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
