"""The ReLU MLP op family: Linear + ReLU layers whose bias and ReLU run inside cuBLASLt's forward products on a GPU,
with the ReLU's bit mask beside each output, and whose ReLU gradient and bias gradient are one pass over that mask.

- :mod:`.cublaslt`: the ``ctypes`` binding to torch's ``libcublasLt`` (the product with the bias, ReLU and mask
  epilogue, plans cached);
- ``relu_grad.cu`` and :mod:`.launcher`: the ReLU's gradient from the mask and the bias gradient, one kernel;
- :mod:`.reference`: the plain-torch reference (CPU path, fallback, test oracle) and the ReLU masks' layout;
- :mod:`.ops`: the ``pipeline::relu_mlp`` and ``pipeline::relu_mlp_backward`` custom ops (CPU: reference; CUDA:
  cuBLASLt forward, the mask kernel backward), fakes, autograd, FLOP formulas, and :func:`relu_mlp`, what models
  call.
"""

from pipeline.kernels.mlp.ops import relu_mlp

__all__ = ["relu_mlp"]
