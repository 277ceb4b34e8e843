// The per-segment update kernels that training runs (launcher.UPDATE_KERNEL, singles_apart): the two lists of the
// segments, the lean kernel of the rows of one occurrence and the capped loop over the others, for rows that one
// pass of lanes covers; the one segment list and the capped kernels over it, for wider rows (and the candidates
// segments_looped_capped and _2vec). What they do and why: embedding_update_runs.cuh.
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

// The rows of one occurrence apart (singles_apart), rows that one pass of lanes covers (c1).
SEGMENT_LIST_APART(i32, int)
SEGMENT_LIST_APART(i64, long long)

// Names: sparse_update_singles_<optimizer>_<weights dtype>_<key type> and sparse_update_runs_apart_<...>. The singles
// kernels are bounded to the most resident blocks their registers allow without spilling (tests/test_kernels_build.py:
// bounded to 8 blocks, fp32 rows spilled a little and ran slower), the others to the capped kernels' bounds.
#define APART_KEYS(OPTNAME, OPT, WNAME, W, SINGLE_BLOCKS, RUNS_BLOCKS, K, KNAME)                        \
    SPARSE_UPDATE_SINGLES(sparse_update_singles_##OPTNAME##_##WNAME##_##KNAME, W, K, OPT, SINGLE_BLOCKS) \
    SPARSE_UPDATE_RUNS_APART(sparse_update_runs_apart_##OPTNAME##_##WNAME##_##KNAME, W, K, OPT, RUNS_BLOCKS)
#define APART(OPTNAME, OPT, WNAME, W, SINGLE_BLOCKS, RUNS_BLOCKS)                                       \
    APART_KEYS(OPTNAME, OPT, WNAME, W, SINGLE_BLOCKS, RUNS_BLOCKS, int, i32)                            \
    APART_KEYS(OPTNAME, OPT, WNAME, W, SINGLE_BLOCKS, RUNS_BLOCKS, long long, i64)

APART(sgd, OPT_SGD, f32, float, 6, 4)
APART(sgd, OPT_SGD, f16, f16, 5, 3)
APART(sgd, OPT_SGD, bf16, bf16, 5, 3)
APART(adagrad, OPT_ADAGRAD, f32, float, 6, 4)
APART(adagrad, OPT_ADAGRAD, f16, f16, 5, 2)
APART(adagrad, OPT_ADAGRAD, bf16, bf16, 5, 2)
APART(adam, OPT_ADAM, f32, float, 4, 3)
APART(adam, OPT_ADAM, f16, f16, 4, 2)
APART(adam, OPT_ADAM, bf16, bf16, 4, 2)
