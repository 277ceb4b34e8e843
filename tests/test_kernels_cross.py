"""DCN-V2's low-rank cross layer: the ``pipeline::cross_layer`` op and its backward against autograd through the
plain expression, on the CPU (the reference) and on a GPU (the Triton kernels, fp16 and bf16)."""

from __future__ import annotations

import pytest
import torch

from pipeline.kernels.cross import ops, reference
from pipeline.modules.configs import EmbeddingOptimizerConfig
from pipeline.modules.models import DCNv2, ModelSizes, build_model
from pipeline.schema import Column, Schema


def _layer(batch, width, rank, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    return (rand(batch, width), rand(batch, width), rand(rank, width, scale=width ** -0.5),
            rand(width, rank, scale=rank ** -0.5), rand(width, scale=0.1), rand(batch, width))


def _plain_grads(x0, x, down, up, bias, grad):
    leaves = [t.detach().requires_grad_() for t in (x0, x, down, up, bias)]
    a, b, d, w, c = leaves
    y = a * torch.nn.functional.linear(torch.nn.functional.linear(b, d), w, c) + b
    y.backward(grad)
    return y.detach(), [t.grad for t in leaves]


def _op_grads(x0, x, down, up, bias, grad):
    leaves = [t.detach().requires_grad_() for t in (x0, x, down, up, bias)]
    y = ops.cross_forward(*leaves)[0]
    y.backward(grad)
    return y.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("batch,width,rank", [(64, 40, 8), (5, 24, 24), (0, 16, 4)])
def test_op_matches_autograd_of_the_plain_layer_on_cpu(batch, width, rank):
    inputs = _layer(batch, width, rank, torch.float64, "cpu")
    y, grads = _op_grads(*inputs)
    y_plain, grads_plain = _plain_grads(*inputs)
    torch.testing.assert_close(y, y_plain)
    for name, got, want in zip(["x0", "x", "down", "up", "bias"], grads, grads_plain):
        torch.testing.assert_close(got, want, msg=lambda m, name=name: f"{name}: {m}")


def test_op_checks_its_shapes():
    x0, x, down, up, bias, _ = _layer(4, 16, 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match="up must be"):
        ops.cross_forward(x0, x, down, up.t().contiguous(), bias)
    with pytest.raises(ValueError, match="x0 and x"):
        ops.cross_forward(x0[:, :8], x, down, up, bias)


def _dcnv2(device, seed=0):
    schema = Schema([Column("label", "label", "float32"), *[Column(f"I{i}", "continuous", "float32") for i in range(2)],
                     *[Column(f"C{i}", "categorical", "int32", cardinality=c) for i, c in enumerate([50, 20, 7])]])
    sizes = ModelSizes(embedding_dim=16, bottom_mlp=[32, 16], top_mlp=[32, 16, 1], cross_rank=8)
    return build_model("dcnv2", schema, sizes, EmbeddingOptimizerConfig("sgd"), seed=seed).to(device)


def test_dcnv2_cpu_forward_is_the_plain_cross_layer():
    model = _dcnv2("cpu")
    assert isinstance(model, DCNv2) and isinstance(model.cross[0], torch.nn.Sequential)
    dense, pooled = torch.randn(9, 2), torch.randn(9, model.embedding.output_dim)
    x0 = torch.cat([model.bottom(dense), pooled], dim=1)
    x = x0
    for layer in model.cross:
        x = x0 * layer(x) + x
    torch.testing.assert_close(model.dense_forward(dense, pooled), model.deep(x).squeeze(1))


CUDA_SHAPES = [(4096, 3456, 512), (1000, 200, 48), (77, 130, 16), (0, 64, 16)]
TOLERANCE = {torch.bfloat16: dict(atol=3e-2, rtol=3e-2), torch.float16: dict(atol=5e-3, rtol=5e-3)}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("batch,width,rank", CUDA_SHAPES)
def test_kernels_match_the_reference_on_gpu(batch, width, rank, dtype):
    """The kernels against the reference run in fp32 on the same half-precision inputs."""
    inputs = _layer(batch, width, rank, dtype, "cuda", seed=batch + width)
    y, grads = _op_grads(*inputs)
    y_want, grads_want = _op_grads(*(t.float() for t in inputs))
    scale = max(1.0, float(y_want.abs().max())) if batch else 1.0
    torch.testing.assert_close(y.float() / scale, y_want / scale, **TOLERANCE[dtype])
    for name, got, want in zip(["x0", "x", "down", "up", "bias"], grads, grads_want):
        assert got.dtype == dtype, name
        scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
        torch.testing.assert_close(got.float() / scale, want / scale, **TOLERANCE[dtype],
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.gpu
def test_cross_layer_takes_the_kernels_on_gpu_and_the_plain_expression_when_traced(monkeypatch):
    calls = []
    monkeypatch.setattr(ops, "cross_forward", lambda *a: calls.append(a) or reference.forward(*a))
    monkeypatch.setattr(ops, "TRITON_FOUND", True)
    x0, x, down, up, bias, _ = _layer(8, 32, 4, torch.bfloat16, "cuda")
    ops.cross_layer(x0, x, down.float(), up.float(), bias.float())
    assert len(calls) == 1 and all(t.dtype == torch.bfloat16 for t in calls[0])
    ops.cross_layer(x0.float(), x.float(), down.float(), up.float(), bias.float())
    torch.jit.trace(lambda a, b: ops.cross_layer(a, b, down, up, bias), (x0, x), check_trace=False)
    assert len(calls) == 1, "fp32 and traced calls take the plain expression"


@pytest.mark.gpu
def test_compiled_dcnv2_under_autocast_matches_the_plain_model_on_gpu():
    """The training step's path (torch.compile, bf16 autocast) through the op, against the same model with its cross
    layers as plain expressions."""
    model = _dcnv2("cuda")
    dense = torch.randn(300, 2, device="cuda")
    pooled = torch.randn(300, model.embedding.output_dim, device="cuda", requires_grad=True)
    compiled = torch.compile(model.dense_forward)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = compiled(dense, pooled)
    out.float().sum().backward()
    grads = [p.grad.clone() for p in model.cross.parameters()] + [pooled.grad.clone()]
    model.zero_grad()
    pooled.grad = None
    with torch.autocast("cuda", dtype=torch.bfloat16):
        x0 = torch.cat([model.bottom(dense), pooled.to(torch.bfloat16)], dim=1)
        x = x0
        for layer in model.cross:
            x = x0 * layer(x) + x
        want = model.deep(x).squeeze(1)
    want.float().sum().backward()
    torch.testing.assert_close(out.float(), want.float(), atol=3e-2, rtol=3e-2)
    for got, p in zip(grads, list(model.cross.parameters()) + [pooled]):
        scale = max(1.0, float(p.grad.abs().max()))
        torch.testing.assert_close(got / scale, p.grad / scale, atol=3e-2, rtol=3e-2)


def test_flop_counter_counts_the_ops_products():
    from torch.utils.flop_counter import FlopCounterMode

    x0, x, down, up, bias, grad = _layer(32, 24, 8, torch.float32, "cpu")
    leaves = [t.requires_grad_() for t in (x0, x, down, up, bias)]
    with FlopCounterMode(display=False) as counter:
        ops.cross_forward(*leaves)[0].backward(grad)
    with FlopCounterMode(display=False) as plain:
        _plain_grads(x0, x, down, up, bias, grad)
    assert counter.get_total_flops() == plain.get_total_flops() == 6 * 2 * 32 * 24 * 8
