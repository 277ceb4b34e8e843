// sparse_update, a thread group per sorted position: the `position` candidate of launcher.UPDATE_KERNELS, and
// the update of a batch of 2**31 ids or more (the per-segment kernels take int32 positions). What it does:
// embedding_backward.cuh.
#include "embedding_backward.cuh"

SPARSE_UPDATE_ALL(SPARSE_UPDATE_POSITION, sgd, OPT_SGD)
SPARSE_UPDATE_ALL(SPARSE_UPDATE_POSITION, adagrad, OPT_ADAGRAD)
SPARSE_UPDATE_ALL(SPARSE_UPDATE_POSITION, adam, OPT_ADAM)
