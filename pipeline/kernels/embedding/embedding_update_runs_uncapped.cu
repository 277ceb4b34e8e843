// The uncapped per-segment update kernels, candidates timed beside the capped ones (bench embedding
// --sweep-update-kernels): embedding_update_runs.cuh.
#include "embedding_update_runs.cuh"

// The registers as the compiler wants them (at 256 threads a block, up to 255 a thread).
#define SPARSE_UPDATE_RUNS_UNCAPPED(OPTNAME, OPT)                                                       \
    SPARSE_UPDATE_RUNS_KEYS(sparse_update_runs, OPTNAME, OPT, f32, float, 1, 1)                         \
    SPARSE_UPDATE_RUNS_KEYS(sparse_update_runs, OPTNAME, OPT, f32, float, 2, 1)                         \
    SPARSE_UPDATE_RUNS_KEYS(sparse_update_runs, OPTNAME, OPT, f32, float, 4, 1)                         \
    SPARSE_UPDATE_RUNS_KEYS(sparse_update_runs, OPTNAME, OPT, f16, f16, 1, 1)                           \
    SPARSE_UPDATE_RUNS_KEYS(sparse_update_runs, OPTNAME, OPT, f16, f16, 2, 1)                           \
    SPARSE_UPDATE_RUNS_KEYS(sparse_update_runs, OPTNAME, OPT, bf16, bf16, 1, 1)                         \
    SPARSE_UPDATE_RUNS_KEYS(sparse_update_runs, OPTNAME, OPT, bf16, bf16, 2, 1)

SPARSE_UPDATE_RUNS_UNCAPPED(sgd, OPT_SGD)
SPARSE_UPDATE_RUNS_UNCAPPED(adagrad, OPT_ADAGRAD)
SPARSE_UPDATE_RUNS_UNCAPPED(adam, OPT_ADAM)
