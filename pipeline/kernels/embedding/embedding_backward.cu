// The backward's kernels that training runs: the row keys the sort groups, and sparse_update_long (the runs
// cut into segments). What they do: embedding_backward.cuh.
#include "embedding_backward.cuh"

ROW_KEYS(row_keys_i32, int)
ROW_KEYS(row_keys_i64, long long)

SPARSE_UPDATE_ALL(SPARSE_UPDATE_LONG, sgd, OPT_SGD)
SPARSE_UPDATE_ALL(SPARSE_UPDATE_LONG, adagrad, OPT_ADAGRAD)
SPARSE_UPDATE_ALL(SPARSE_UPDATE_LONG, adam, OPT_ADAM)
