"""The ReLU MLP op family: Linear + ReLU layers whose bias, ReLU, ReLU gradient and bias gradient run
inside cuBLASLt's matrix products on a GPU.

- :mod:`.cublaslt`: the ``ctypes`` binding to torch's ``libcublasLt`` (products with epilogues, plans cached);
- :mod:`.reference`: the plain-torch reference (CPU path, fallback, test oracle) and the ReLU masks' layout;
- :mod:`.ops`: the ``pipeline::relu_mlp`` and ``pipeline::relu_mlp_backward`` custom ops (CPU: reference; CUDA:
  cuBLASLt), fakes, autograd, FLOP formulas, and :func:`relu_mlp`, what models call.
"""

from pipeline.kernels.mlp.ops import relu_mlp

__all__ = ["relu_mlp"]
