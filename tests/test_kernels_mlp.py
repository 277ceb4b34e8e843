"""The ReLU MLP op: the reference against ``nn.Sequential`` with autograd, the masks' layout, the custom ops on
CPU (opcheck, torch.compile, FLOP count), the ``MLP`` module's paths, and on a GPU (marker ``gpu``) the cuBLASLt
product and the mask-gradient kernel against the reference (outputs, masks, gradients), their fallbacks, and a
compiled DLRM step."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipeline.kernels.mlp import cublaslt, launcher, ops, reference, relu_mlp
from pipeline.modules.models import MLP, MLP_BACKENDS, mlp, use_mlp_backend
from pipeline.train import config


def _layers(widths: list[int], in_width: int, dtype=torch.float32, device="cpu", seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    weights, biases, width = [], [], in_width
    for out in widths:
        weights.append((torch.randn(out, width, generator=generator) / width ** 0.5).to(device, dtype))
        biases.append((torch.randn(out, generator=generator) * 0.1).to(device, dtype))
        width = out
    return weights, biases


def _sequential(weights, biases, last_relu: bool):
    def run(x):
        for i, (w, b) in enumerate(zip(weights, biases)):
            x = nn.functional.linear(x, w, b)
            if i < len(weights) - 1 or last_relu:
                x = torch.relu(x)
        return x
    return run


def _grads(function, x, weights, biases, grad):
    leaves = [t.detach().clone().requires_grad_() for t in (x, *weights, *biases)]
    layers = len(weights)
    out = function(leaves[0], leaves[1:1 + layers], leaves[1 + layers:])
    return out.detach(), torch.autograd.grad(out, leaves, grad)


# --- the reference and the masks -------------------------------------------------------------------------


@pytest.mark.parametrize("last_relu", [False, True])
@pytest.mark.parametrize("widths", [[24, 8, 1], [40], [16, 136, 8]])
def test_reference_and_op_on_cpu_match_the_layers_one_by_one_with_autograd(widths, last_relu):
    x = torch.randn(37, 16, dtype=torch.float64)
    weights, biases = _layers(widths, 16, torch.float64)
    grad = torch.randn(37, widths[-1], dtype=torch.float64)
    expected, expected_grads = _grads(lambda x, w, b: _sequential(w, b, last_relu)(x), x, weights, biases, grad)
    got, got_grads = _grads(lambda x, w, b: relu_mlp(x, w, b, last_relu), x, weights, biases, grad)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    for g, e in zip(got_grads, expected_grads):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


def test_a_mask_row_is_a_multiple_of_128_bits_with_bit_j_mod_8_of_byte_j_div_8_for_column_j():
    positive = torch.zeros(3, 130, dtype=torch.bool)
    positive[0, 0] = positive[1, 9] = positive[2, 129] = True
    mask = reference.pack_mask(positive)
    assert mask.shape == (3, 32) and mask.dtype == torch.uint8
    assert mask[0, 0] == 1 and mask[1, 1] == 2 and mask[2, 16] == 2 and int(mask.sum()) == 5
    random = torch.rand(5, 1000) > 0.5
    assert torch.equal(reference.unpack_mask(reference.pack_mask(random), 1000), random)


def test_only_half_relu_layers_of_tensor_core_widths_write_masks():
    assert reference.has_mask(torch.bfloat16, 16, 1024, relu=True)
    assert reference.has_mask(torch.float16, 480, 8, relu=True)
    assert not reference.has_mask(torch.float32, 16, 1024, relu=True)
    assert not reference.has_mask(torch.bfloat16, 13, 1024, relu=True)
    assert not reference.has_mask(torch.bfloat16, 256, 1, relu=True)
    assert not reference.has_mask(torch.bfloat16, 16, 1024, relu=False)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    weights, biases = _layers([32, 8, 1], 16, torch.bfloat16)
    outputs, masks = reference.forward(x, weights, biases, last_relu=False)
    assert [tuple(m.shape) for m in masks] == [(4, 16), (4, 16), (0,)]
    assert torch.equal(reference.unpack_mask(masks[0], 32), outputs[0] > 0)


def test_mismatched_layers_are_refused():
    x = torch.randn(4, 16)
    weights, biases = _layers([32, 8], 16)
    with pytest.raises(ValueError, match="layer 1 takes 32 inputs"):
        relu_mlp(x, [weights[0], weights[0]], biases, False)
    with pytest.raises(ValueError, match="as many biases as weights"):
        relu_mlp(x, weights, biases[:1], False)
    with pytest.raises(ValueError, match="in x's dtype"):
        relu_mlp(x, [w.double() for w in weights], biases, False)


# --- the ops on CPU ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_on_cpu(dtype):
    x = torch.randn(8, 16, dtype=dtype)
    weights, biases = _layers([24, 8], 16, dtype)
    torch.library.opcheck(ops.mlp_forward, (x, weights, biases, True))
    leaves = (x.clone().requires_grad_(), [w.clone().requires_grad_() for w in weights],
              [b.clone().requires_grad_() for b in biases], False)
    torch.library.opcheck(ops.mlp_forward, leaves)
    outputs, masks = reference.forward(x, weights, biases, False)
    torch.library.opcheck(ops.mlp_backward, (torch.randn(8, 8, dtype=dtype), x, weights, outputs, masks, False))


def test_compiled_mlp_holds_the_op_as_one_node_and_matches_eager():
    x = torch.randn(16, 16, dtype=torch.bfloat16)
    weights, biases = _layers([32, 24, 1], 16, torch.bfloat16)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w, b: relu_mlp(x, w, b, False), backend=backend, fullgraph=True)
    grad = torch.randn(16, 1, dtype=torch.bfloat16)
    expected, expected_grads = _grads(lambda x, w, b: relu_mlp(x, w, b, False), x, weights, biases, grad)
    got, got_grads = _grads(compiled, x, weights, biases, grad)
    assert len(graphs) == 1 and "torch.ops.pipeline.relu_mlp.default" in graphs[0]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    for g, e in zip(got_grads, expected_grads):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_the_flop_counter_counts_the_products_forward_and_backward():
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randn(10, 16, requires_grad=True)
    weights, biases = _layers([24, 8, 1], 16)
    with FlopCounterMode(display=False) as counter:
        relu_mlp(x, weights, biases, False).sum().backward()
    assert counter.get_total_flops() == 3 * 2 * 10 * (16 * 24 + 24 * 8 + 8 * 1)


def test_the_settings_name_the_modules_backends_and_a_model_takes_one_for_every_mlp():
    from tests.test_kernels_interaction import _dlrm

    assert config.MLP_BACKENDS == MLP_BACKENDS and config.TrainConfig().mlp_backend == "torch"
    model = _dlrm()
    use_mlp_backend(model, "cublaslt")
    assert [m.backend for m in model.modules() if isinstance(m, MLP)] == ["cublaslt", "cublaslt"]
    with pytest.raises(ValueError, match="mlp backend"):
        use_mlp_backend(model, "fast")
    with pytest.raises(ValueError, match="train.mlp_backend"):
        config.TrainConfig(mlp_backend="fast")


def test_the_module_keeps_sequential_layers_and_runs_them_one_by_one_off_the_gpu():
    torch.manual_seed(0)
    module = mlp([32, 8, 1], 13, last_activation=False)
    use_mlp_backend(module, "cublaslt")
    assert isinstance(module, MLP) and list(module.state_dict()) == list(nn.Sequential(*module).state_dict())
    x = torch.randn(5, 13)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(module(x), nn.Sequential(*module)(x), rtol=0, atol=0)


def _documented_linear(rows, weight, out, *, epilogue, bias, aux=None):
    """cuBLASLt's product with the RELU_AUX_BIAS epilogue as its documentation describes it, in fp32 on the CPU."""
    assert epilogue == cublaslt.RELU_AUX_BIAS and out.is_contiguous() and bias.shape == (out.shape[1],)
    assert aux.shape == reference.mask_shape(*out.shape) and aux.dtype == torch.uint8
    z = rows.float() @ weight.float().t() + bias.float()
    aux.copy_(reference.pack_mask(z > 0))
    out.copy_(z.relu())


def test_the_mask_gradient_zeroes_what_the_mask_leaves_out_and_sums_the_columns_in_fp32():
    g = torch.randn(300, 24).to(torch.bfloat16)
    g[0, 0], g[1, 1] = float("nan"), float("inf")
    positive = torch.rand(300, 24) > 0.5
    positive[0, 0] = positive[1, 1] = False
    out, sums = reference.grad_through_mask(g, reference.pack_mask(positive))
    assert torch.equal(out, torch.where(positive, g, torch.zeros((), dtype=torch.bfloat16)))
    assert sums.dtype == torch.bfloat16
    exact = torch.where(positive, g.double(), 0).sum(0)
    torch.testing.assert_close(sums.double(), exact, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("last_relu", [False, True])
@pytest.mark.parametrize("widths,in_width", [([1024, 512, 256, 1], 480), ([64, 13, 32, 8], 24), ([128], 16)])
def test_the_cuda_ops_layers_take_each_mask_where_the_documented_epilogues_put_it(monkeypatch, widths, in_width,
                                                                                   last_relu):
    """The CUDA op's own logic (which layer's product writes a mask, which backward pass reads it back, where the
    bias gradients land) over cuBLASLt's documented epilogue and the mask kernel's reference, against the reference:
    what the GPU tests check with the library and the kernel themselves."""
    monkeypatch.setattr(cublaslt, "linear", _documented_linear)
    through_masks = []

    def documented_kernel(g, mask):
        through_masks.append(mask)
        return reference.grad_through_mask(g, mask)

    monkeypatch.setattr(launcher, "supported", lambda g, mask: True)
    monkeypatch.setattr(launcher, "grad_through_mask", documented_kernel)
    monkeypatch.setattr(ops, "kernels_usable", lambda: True)
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(64, in_width, generator=generator).to(torch.bfloat16)
    weights, biases = _layers(widths, in_width, torch.bfloat16)
    got = ops._forward_cuda(x, weights, biases, last_relu)
    outputs, masks = reference.forward(x, weights, biases, last_relu)
    assert [tuple(m.shape) for m in got[len(widths):]] == [tuple(m.shape) for m in masks]
    for g, e in zip(got[:len(widths)], outputs):
        torch.testing.assert_close(g.float(), e.float(), rtol=2e-2, atol=2e-2)
    for mask, expected, output in zip(got[len(widths):], masks, outputs):
        if expected.numel():  # a bit may differ only where the output rounds to about zero (fp32 against bf16)
            differ = reference.unpack_mask(mask, output.shape[1]) != reference.unpack_mask(expected, output.shape[1])
            assert bool((output.float().abs()[differ] < 2e-2).all())
    grad = torch.randn(64, widths[-1], generator=generator).to(torch.bfloat16)
    got_grads = ops._backward_cuda(grad, x, weights, got[:len(widths)], got[len(widths):], last_relu)
    expected = ops._reference_backward(grad, x, weights, outputs, last_relu)
    for g, e in zip(got_grads, expected):
        assert g.shape == e.shape and g.dtype == e.dtype
        torch.testing.assert_close(g.float(), e.float(), rtol=5e-2, atol=5e-2 * max(1.0, e.float().abs().max().item()))
    assert [m.data_ptr() for m in through_masks] == [m.data_ptr() for m in reversed(got[len(widths):]) if m.numel()]


# --- on a GPU ----------------------------------------------------------------------------------------------


def _cuda_layers(widths, in_width, dtype, seed=0):
    return _layers(widths, in_width, dtype, "cuda", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,in_width,width", [(37, 16, 24), (1024, 480, 1024), (65536, 256, 128),
                                                 (300, 1000, 1000)])
def test_the_forward_product_writes_the_relu_and_the_masks_of_the_reference(dtype, rows, in_width, width):
    x = torch.randn(rows, in_width, device="cuda", dtype=dtype)
    weights, biases = _cuda_layers([width], in_width, dtype)
    out = x.new_empty(rows, width)
    mask = torch.full(reference.mask_shape(rows, width), 0xAA, dtype=torch.uint8, device="cuda")
    cublaslt.linear(x, weights[0], out, epilogue=cublaslt.RELU_AUX_BIAS, bias=biases[0], aux=mask)
    z = (x.double() @ weights[0].double().t() + biases[0].double())
    torch.testing.assert_close(out.double(), z.relu(), rtol=2e-2, atol=2e-2)
    # away from zero the sign is certain whatever the rounding: there the mask is the reference's
    clear = z.abs() > 1e-2
    assert torch.equal(reference.unpack_mask(mask, width)[clear], (z > 0)[clear])
    assert bool(reference.unpack_mask(mask, width)[out > 0].all())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,width", [(37, 24), (300, 2056), (4096, 256), (65536, 1024)])
def test_the_mask_kernel_matches_its_reference(dtype, rows, width):
    g = torch.randn(rows, width, device="cuda", dtype=dtype)
    positive = torch.rand(rows, width, device="cuda") > 0.4
    g[~positive] = float("nan")  # what the mask leaves out is zero, whatever it held
    mask = reference.pack_mask(positive)
    out, sums = launcher.grad_through_mask(g, mask)
    expected, _ = reference.grad_through_mask(g, mask)
    assert torch.equal(out, expected) and not out.isnan().any()
    exact = torch.where(positive, g.double(), 0).sum(0)
    assert sums.dtype == dtype
    torch.testing.assert_close(sums.double(), exact, rtol=1e-2, atol=1e-3 * exact.abs().max().item())


@pytest.mark.gpu
def test_the_mask_kernel_takes_a_strided_gradient():
    g = torch.randn(1000, 520, device="cuda", dtype=torch.bfloat16)[:, 8:]
    positive = torch.rand(1000, 512, device="cuda") > 0.5
    out, sums = launcher.grad_through_mask(g, reference.pack_mask(positive))
    expected, expected_sums = reference.grad_through_mask(g, reference.pack_mask(positive))
    assert torch.equal(out, expected)
    torch.testing.assert_close(sums.float(), expected_sums.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("widths,in_width,last_relu", [([1024, 1024, 512, 256, 1], 480, False),
                                                       ([512, 256, 128], 16, True), ([64, 13, 32, 1], 24, False)])
def test_the_op_on_cuda_matches_the_layers_one_by_one_in_the_same_dtype(monkeypatch, dtype, widths, in_width,
                                                                        last_relu):
    x = torch.randn(2048, in_width, device="cuda", dtype=dtype)
    weights, biases = _cuda_layers(widths, in_width, dtype)
    grad = torch.randn(2048, widths[-1], device="cuda", dtype=dtype)
    expected, expected_grads = _grads(lambda x, w, b: _sequential(w, b, last_relu)(x), x, weights, biases, grad)
    kernel, launches = launcher.grad_through_mask, []
    monkeypatch.setattr(launcher, "grad_through_mask", lambda g, mask: launches.append(mask) or kernel(g, mask))
    got, got_grads = _grads(lambda x, w, b: relu_mlp(x, w, b, last_relu), x, weights, biases, grad)
    masked = [reference.has_mask(dtype, ([in_width, *widths])[i], width, reference.relu_after(i, len(widths), last_relu))
              for i, width in enumerate(widths)]
    assert len(launches) == sum(masked)
    torch.testing.assert_close(got, expected, rtol=3e-2, atol=3e-2)
    for g, e in zip(got_grads, expected_grads):
        scale = e.float().abs().max().item()
        torch.testing.assert_close(g.float(), e.float(), rtol=5e-2, atol=2e-2 * scale)


@pytest.mark.gpu
def test_the_op_falls_back_to_torch_where_cublaslt_has_no_algorithm(monkeypatch):
    x = torch.randn(512, 16, device="cuda", dtype=torch.bfloat16)
    weights, biases = _cuda_layers([64, 32, 1], 16, torch.bfloat16)
    grad = torch.randn(512, 1, device="cuda", dtype=torch.bfloat16)
    expected, expected_grads = _grads(lambda x, w, b: relu_mlp(x, w, b, False), x, weights, biases, grad)

    def no_algorithm(*args, **kwargs):
        raise cublaslt.NoAlgorithm("none")

    monkeypatch.setattr(cublaslt, "linear", no_algorithm)
    got, got_grads = _grads(lambda x, w, b: relu_mlp(x, w, b, False), x, weights, biases, grad)
    outputs, masks = ops.mlp_forward(x, weights, biases, False)[:3], ops.mlp_forward(x, weights, biases, False)[3:]
    assert torch.equal(reference.unpack_mask(masks[0], 64), outputs[0] > 0)
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
    for g, e in zip(got_grads, expected_grads):
        torch.testing.assert_close(g.float(), e.float(), rtol=5e-2, atol=5e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_opcheck_on_cuda(dtype):
    x = torch.randn(64, 16, device="cuda", dtype=dtype)
    weights, biases = _cuda_layers([32, 16, 1], 16, dtype)
    torch.library.opcheck(ops.mlp_forward, (x, weights, biases, False))
    outputs = ops.mlp_forward(x, weights, biases, False)
    torch.library.opcheck(ops.mlp_backward, (torch.randn(64, 1, device="cuda", dtype=dtype), x, weights,
                                             outputs[:3], outputs[3:], False))


@pytest.mark.gpu
def test_a_compiled_dlrm_step_in_bf16_runs_the_op_and_trains_like_its_layers_one_by_one():
    """The MLP module in training under bf16 autocast and Inductor: its forward is the op (one node of the graph),
    and five SGD steps follow those of the same model whose MLPs run layer by layer."""
    from torch._inductor.compile_fx import compile_fx

    from pipeline.modules.models import DLRM
    from tests.test_kernels_interaction import _batches, _dlrm, _in_bf16, _recording
    from tests.test_kernels_ops import train_steps

    fused = _dlrm(dim=32, features=26, backend="cuda", optimizer="sgd").cuda()
    plain = copy.deepcopy(fused)
    use_mlp_backend(fused, "cublaslt")
    assert isinstance(plain, DLRM) and isinstance(plain.top, MLP)
    plain.bottom, plain.top = nn.Sequential(*plain.bottom), nn.Sequential(*plain.top)
    batches = _batches(fused, steps=5, batch=1024, device="cuda")
    torch._dynamo.reset()
    graphs = []
    step = torch.compile(_in_bf16(fused), backend=_recording(graphs, compile_fx), fullgraph=True)
    expected = train_steps(plain, _in_bf16(plain), batches, [0.05] * 5)
    got = train_steps(fused, step, batches, [0.05] * 5)
    assert len(graphs) == 1 and graphs[0].count("torch.ops.pipeline.relu_mlp.default") == 2
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
