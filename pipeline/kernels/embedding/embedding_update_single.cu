// The `segments_single` candidate (launcher.UPDATE_KERNELS): the segments of one occurrence of a row updated by a lean
// kernel of a group each (sparse_update_single), the others by the capped loop that skips them. Rows that one pass
// of lanes covers; wider rows run the capped kernel alone. What each does: embedding_update_runs.cuh.
#include "embedding_update_runs.cuh"

#define SPARSE_UPDATE_SINGLE(NAME, W, K, OPT, MIN_BLOCKS)                                               \
    extern "C" __global__ void __launch_bounds__(256, MIN_BLOCKS) NAME(                                 \
        W* weights, float* master, float* state1, float* state2, const int* seg_begin, const K* seg_key, \
        const int* seg_bag, const unsigned char* seg_split, const int* seg_count,                       \
        const long long* offsets, const long long* slot_weight_offsets, const long long* slot_row_offsets, \
        const long long* output_offsets, const unsigned char* slot_mean, const float* grad,             \
        int num_slots, int batch_size, int log_lanes, int weights_aligned, int grad_aligned, float lr,  \
        float eps, float beta1, float beta2, float bias1, float bias2, float weight_decay,              \
        int stochastic, unsigned long long seed) {                                                      \
        sparse_update_single<W, K, OPT>(weights, master, state1, state2, seg_begin, seg_key, seg_bag,   \
                                        seg_split, seg_count, offsets, slot_weight_offsets,             \
                                        slot_row_offsets, output_offsets, slot_mean, grad, num_slots,   \
                                        batch_size, log_lanes, weights_aligned, grad_aligned, lr, eps,  \
                                        beta1, beta2, bias1, bias2, weight_decay, stochastic, seed);    \
    }

// sparse_update_single_<optimizer>_<weights dtype>_<key type> and sparse_update_runs_multi_..._c1 (the capped loop,
// its bound on resident blocks, skipping single segments), each bounded to the most resident blocks whose registers
// hold it without spilling (ptxas of CUDA 13.0 for sm_90).
#define SINGLE_AND_MULTI(OPTNAME, OPT, WNAME, W, SINGLE_BLOCKS, MULTI_BLOCKS)                           \
    SPARSE_UPDATE_SINGLE(sparse_update_single_##OPTNAME##_##WNAME##_i32, W, int, OPT, SINGLE_BLOCKS)    \
    SPARSE_UPDATE_SINGLE(sparse_update_single_##OPTNAME##_##WNAME##_i64, W, long long, OPT, SINGLE_BLOCKS) \
    SPARSE_UPDATE_RUNS_OF(sparse_update_runs_multi_##OPTNAME##_##WNAME##_i32_c1, W, int, OPT, 1, MULTI_BLOCKS, true) \
    SPARSE_UPDATE_RUNS_OF(sparse_update_runs_multi_##OPTNAME##_##WNAME##_i64_c1, W, long long, OPT, 1, MULTI_BLOCKS, true)

SINGLE_AND_MULTI(sgd, OPT_SGD, f32, float, 8, 4)
SINGLE_AND_MULTI(sgd, OPT_SGD, f16, f16, 6, 3)
SINGLE_AND_MULTI(sgd, OPT_SGD, bf16, bf16, 6, 3)
SINGLE_AND_MULTI(adagrad, OPT_ADAGRAD, f32, float, 8, 4)
SINGLE_AND_MULTI(adagrad, OPT_ADAGRAD, f16, f16, 5, 2)
SINGLE_AND_MULTI(adagrad, OPT_ADAGRAD, bf16, bf16, 5, 2)
SINGLE_AND_MULTI(adam, OPT_ADAM, f32, float, 6, 3)
SINGLE_AND_MULTI(adam, OPT_ADAM, f16, f16, 4, 2)
SINGLE_AND_MULTI(adam, OPT_ADAM, bf16, bf16, 4, 2)
