// The per-segment update kernels that training runs (launcher.UPDATE_KERNEL): the segment list and the
// capped kernels. What they do and why: embedding_update_runs.cuh.
#include "embedding_update_runs.cuh"

SEGMENT_LIST(i32, int)
SEGMENT_LIST(i64, long long)

// Capped: each kernel bounded to the most resident blocks whose registers still hold it without spilling
// (ptxas of CUDA 13.0 for sm_90; tests/test_kernels_build.py checks that none spills). That is one
// block a multiprocessor more than the uncapped kernel gets for fp32 rows with SGD or Adagrad (dim 128:
// 64 registers instead of 71, 32 warps resident instead of 24), fp32 Adam rows of two vectors a lane
// and 16-bit SGD rows of one; the others keep as many blocks resident as uncapped.
#define CAPPED(OPTNAME, OPT, WNAME, W, CHUNKS, MIN_BLOCKS)                                              \
    SPARSE_UPDATE_RUNS_KEYS(sparse_update_runs_capped, OPTNAME, OPT, WNAME, W, CHUNKS, MIN_BLOCKS)

CAPPED(sgd, OPT_SGD, f32, float, 1, 4)
CAPPED(sgd, OPT_SGD, f32, float, 2, 3)
CAPPED(sgd, OPT_SGD, f32, float, 4, 2)
CAPPED(sgd, OPT_SGD, f16, f16, 1, 3)
CAPPED(sgd, OPT_SGD, f16, f16, 2, 2)
CAPPED(sgd, OPT_SGD, bf16, bf16, 1, 3)
CAPPED(sgd, OPT_SGD, bf16, bf16, 2, 2)
CAPPED(adagrad, OPT_ADAGRAD, f32, float, 1, 4)
CAPPED(adagrad, OPT_ADAGRAD, f32, float, 2, 3)
CAPPED(adagrad, OPT_ADAGRAD, f32, float, 4, 2)
CAPPED(adagrad, OPT_ADAGRAD, f16, f16, 1, 2)
CAPPED(adagrad, OPT_ADAGRAD, f16, f16, 2, 2)
CAPPED(adagrad, OPT_ADAGRAD, bf16, bf16, 1, 2)
CAPPED(adagrad, OPT_ADAGRAD, bf16, bf16, 2, 2)
CAPPED(adam, OPT_ADAM, f32, float, 1, 3)
CAPPED(adam, OPT_ADAM, f32, float, 2, 2)
CAPPED(adam, OPT_ADAM, f32, float, 4, 1)
CAPPED(adam, OPT_ADAM, f16, f16, 1, 2)
CAPPED(adam, OPT_ADAM, f16, f16, 2, 1)
CAPPED(adam, OPT_ADAM, bf16, bf16, 1, 2)
CAPPED(adam, OPT_ADAM, bf16, bf16, 2, 1)
