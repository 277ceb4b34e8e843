"""The embedding op family: pooled lookups of many tables packed in one tensor, and their fused
sparse-optimizer backward.

- ``embedding_forward.cu`` / ``embedding_backward.cu`` / ``embedding_common.cuh``: the CUDA kernels (the
  backward's in ``embedding_backward.cuh``, its update a group per sorted position instantiated in
  ``embedding_update_position.cu``);
  ``embedding_update.cuh``: what the update kernels share; ``embedding_update_runs.cuh``: the candidate
  update kernels that work per segment (``launcher.UPDATE_KERNELS``), instantiated in
  ``embedding_update_runs.cu`` (those training runs: the rows of one occurrence listed apart, and the capped ones)
  and ``embedding_update_runs_uncapped.cu``;
  ``row_traffic.cu``: the update's memory traffic alone, the rate ``bench embedding`` compares the kernels with;
- :mod:`.reference`: the plain-torch reference (CPU path, test oracle);
- :mod:`.launcher`: argument checks, launch geometry, the sort between the backward kernels;
- :mod:`.ops`: the ``pipeline::embedding_*`` custom ops (CPU: reference; CUDA: kernels), fakes, autograd;
- :mod:`.packing`: :class:`TablePacking`, the packing of the tables the ops read;
- :mod:`.backends`: :class:`TorchBackend` and :class:`CudaBackend`, what a collection calls.

The contract (tensor shapes, the update rules) is in ``docs/EMBEDDING.md``.
"""

from pipeline.kernels.embedding.backends import CudaBackend, TorchBackend
from pipeline.kernels.embedding.packing import DimGroup, TablePacking

__all__ = ["CudaBackend", "DimGroup", "TablePacking", "TorchBackend"]
