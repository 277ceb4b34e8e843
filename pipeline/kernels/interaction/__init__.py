"""The dot-interaction op family: DLRM's pairwise dot products of a sample's vectors, and their backward.

- ``interaction.cu``: the CUDA kernels (forward and backward, tensor-core products, fp32 accumulation);
- :mod:`.reference`: the plain-torch reference (CPU path, fallback, test oracle);
- :mod:`.launcher`: argument checks, shared-memory layout, launch geometry;
- :mod:`.ops`: the ``pipeline::dot_interaction`` and ``pipeline::dot_interaction_backward`` custom ops
  (CPU: reference; CUDA: kernels), fakes, autograd, and :func:`dot_interaction`, what models call.

The contract (pair order, dtypes, limits) is in ``docs/INTERACTION.md``.
"""

from pipeline.kernels.interaction.ops import dot_interaction
from pipeline.kernels.interaction.reference import pair_count

__all__ = ["dot_interaction", "pair_count"]
