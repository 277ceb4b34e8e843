"""DCN-V2's low-rank cross layer ``x0 * (x @ down^T @ up^T + bias) + x``, its element-wise work inside the matrix
products on the GPU.

- :mod:`.reference`: the plain-torch forward and backward (CPU path, fallback, test oracle);
- :mod:`.triton_kernels`: the products with the element-wise work as their epilogue or prologue (Triton);
- :mod:`.ops`: the ``pipeline::cross_layer`` and ``pipeline::cross_layer_backward`` custom ops (CPU: reference;
  CUDA: kernels and cuBLAS), fakes, autograd, and :func:`cross_layer`, what models call.
"""

from pipeline.kernels.cross.ops import cross_layer

__all__ = ["cross_layer"]
