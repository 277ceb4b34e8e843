// The candidate singles_apart (embedding_update_runs.cuh): the segments of one occurrence of a row listed apart
// and updated by a lean kernel with more groups resident, the others by the capped loop over a list of their own.
// Rows that one pass of lanes covers (c1); wider rows take the capped kernels of embedding_update_runs.cu.
#include "embedding_update_runs.cuh"

SEGMENT_LIST_APART(i32, int)
SEGMENT_LIST_APART(i64, long long)

// Names: sparse_update_singles[8]_<optimizer>_<weights dtype>_<key type> and sparse_update_runs_apart_<...>. The
// singles kernels are bounded to the most resident blocks their registers allow without spilling
// (tests/test_kernels_build.py), those named singles8 to 8 blocks (a full multiprocessor of 256-thread blocks) with
// what spills; the others to the capped kernels' bounds.
#define APART_KEYS(OPTNAME, OPT, WNAME, W, SINGLE_BLOCKS, RUNS_BLOCKS, K, KNAME)                        \
    SPARSE_UPDATE_SINGLES(sparse_update_singles_##OPTNAME##_##WNAME##_##KNAME, W, K, OPT, SINGLE_BLOCKS) \
    SPARSE_UPDATE_SINGLES(sparse_update_singles8_##OPTNAME##_##WNAME##_##KNAME, W, K, OPT,              \
                          (SINGLE_BLOCKS > 4 ? 8 : SINGLE_BLOCKS))                                      \
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
