// Pooled embedding backward fused with the sparse optimizer update, in two kernels around a sort.
// Instantiated in embedding_backward.cu (row keys and sparse_update_long, which training runs) and
// embedding_update_position.cu (sparse_update: the `position` candidate, and batches of 2**31 ids or more).
//
// 1. row_keys: for every id of the batch, its global row (row offset of the slot's table + id: the
//    index into row-wise state, shared tables included) and the bag it came from.
// 2. (host) torch.sort of the keys groups equal rows together; the bags follow their keys.
// 3. sparse_update: a group of `lanes` threads per sorted position; only the first position of each
//    segment (a run of equal keys, cut at every SEGMENT positions) does work. It finds the row's table
//    from the key (binary search over the tables' first rows) and, for a whole run, starts loading the
//    row and its optimizer state at once, while it sums the gradient rows of the segment (scaled by
//    1/len for mean-pooled bags) in fp32 registers; then it applies SGD, row-wise Adagrad or lazy Adam
//    to that row alone and stores it in the weights' dtype (round to nearest or stochastic rounding;
//    optionally through an fp32 master copy). A run cut into several segments stores their sums.
// 4. sparse_update_long: the runs cut into segments; a group per run adds its segments' sums in order
//    and updates the row as above. No atomics: each row has exactly one owner, and sums are in a fixed
//    order, so results do not depend on scheduling.
#pragma once

#include "embedding_update.cuh"

// A group of 2^log_lanes threads per bag, lane j writing ids j, j + lanes, ...: a multi-hot bag's keys are written
// by adjacent threads (one thread a bag wrote 20-hot bags' keys 20 apart, uncoalesced: 0.92 ms for 34M ids).
template <typename K>
__device__ __forceinline__ void row_keys(
    const long long* __restrict__ indices, const long long* __restrict__ offsets,
    const long long* __restrict__ slot_row_offsets, int num_slots, int batch_size, int log_lanes,
    K* __restrict__ keys, int* __restrict__ bag_of) {
    const long long thread = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long bag = thread >> log_lanes;
    if (bag >= (long long)num_slots * batch_size) return;
    const int lanes = 1 << log_lanes;
    const long long base = slot_row_offsets[bag / batch_size];
    const long long end = offsets[bag + 1];
    for (long long p = offsets[bag] + (thread & (lanes - 1)); p < end; p += lanes) {
        keys[p] = (K)(base + indices[p]);
        bag_of[p] = (int)bag;
    }
}

#define ROW_KEYS(NAME, K)                                                                               \
    extern "C" __global__ void NAME(const long long* indices, const long long* offsets,                 \
                                    const long long* slot_row_offsets, int num_slots, int batch_size,  \
                                    int log_lanes, K* keys, int* bag_of) {                              \
        row_keys<K>(indices, offsets, slot_row_offsets, num_slots, batch_size, log_lanes, keys, bag_of); \
    }


// The table holding global row `key`: the last t with table_row_starts[t] <= key.
template <typename K>
__device__ __forceinline__ int table_of(K key, const long long* __restrict__ table_row_starts, int num_tables) {
    int lo = 0, hi = num_tables;
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (table_row_starts[mid] <= (long long)key) lo = mid;
        else hi = mid;
    }
    return lo;
}

// CHUNKS: how many lanes * N column chunks a row may span (1, or enough for dim 512).
template <typename W, typename K, int OPT, int CHUNKS>
__device__ __forceinline__ void sparse_update(
    W* __restrict__ weights, float* __restrict__ master, float* __restrict__ state1, float* __restrict__ state2,
    const K* __restrict__ sorted_keys, const int* __restrict__ sorted_bags, const long long* __restrict__ offsets,
    const long long* __restrict__ table_row_starts, const long long* __restrict__ table_weight_offsets,
    const long long* __restrict__ table_dims, int num_tables, const long long* __restrict__ output_offsets,
    const unsigned char* __restrict__ slot_mean, const void* __restrict__ grad, long long grad_stride,
    float* __restrict__ partials, long long nnz, int batch_size, int log_lanes, int weights_aligned,
    int grad_aligned, int grad_bf16, float lr, float eps, float beta1, float beta2, float bias1, float bias2,
    float weight_decay, int stochastic, unsigned long long seed) {
    constexpr int N = Vec<W>::N;
    const int lanes = 1 << log_lanes;
    const int lane = threadIdx.x & (lanes - 1);
    const long long pos = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> log_lanes;
    if (pos >= nnz) return;
    const K key = sorted_keys[pos];
    const bool run_start = pos == 0 || sorted_keys[pos - 1] != key;
    const bool at_boundary = pos % SEGMENT == 0;
    if (!run_start && !at_boundary) return;
    const long long seg_end = min(nnz, (pos / SEGMENT + 1) * SEGMENT);
    const bool split = !run_start || (seg_end < nnz && sorted_keys[seg_end] == key);
    const unsigned int mask = group_mask(lanes);

    const int t = table_of<K>(key, table_row_starts, num_tables);
    const int D = (int)table_dims[t];
    const long long elem = table_weight_offsets[t] + ((long long)key - table_row_starts[t]) * D;
    const bool vec_w = weights_aligned && (elem % N == 0) && (D % N == 0);
    const bool vec_g = grad_aligned && (D % N == 0);
    const int chunk = lanes * N;
    W* wrow = weights + elem;
    float* mrow = master ? master + elem : nullptr;

    // A whole run's row and state are loaded first, so they travel while the gradient is summed.
    float w[CHUNKS][N], m1[CHUNKS][N], m2[CHUNKS][N], g[CHUNKS][N];
    float before = 0.0f;
    if (!split) load_row<W, OPT, CHUNKS, N>(wrow, mrow, state1, state2, key, elem, D, lane, lanes, vec_w, w, m1, m2,
                                            before);
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
        for (int k = 0; k < N; ++k) g[c][k] = 0.0f;

    for (long long base = pos;; base += lanes) {
        const long long j = base + lane;
        const bool in = j < seg_end && sorted_keys[j] == key;
        const int n = __popc(__ballot_sync(mask, in));
        long long goff = 0;
        float scale = 0.0f;
        if (in) bag_gradient(sorted_bags[j], batch_size, grad_stride, output_offsets, slot_mean, offsets, goff, scale);
        add_gradient_rows<CHUNKS, N>(grad, goff, scale, n, D, lane, lanes, mask, vec_g, grad_bf16, g);
        if (n < lanes) break;
    }

    if (split) {
        float* slot = partials + (2 * (pos / SEGMENT) + (at_boundary ? 0 : 1)) * (long long)(CHUNKS * chunk);
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
            const int d0 = c * chunk + lane * N;
            if (d0 < D) store_f32<N>(slot, d0, D, true, g[c]);
        }
        return;
    }
    update_row<W, OPT, CHUNKS, N>(wrow, mrow, state1, state2, (long long)key, elem, D, lane, lanes, mask, vec_w, w,
                                  m1, m2, g, before, lr, eps, beta1, beta2, bias1, bias2, weight_decay, stochastic,
                                  seed);
}

// The rows whose run crosses a segment boundary: a group per segment k owns the run that crosses
// its end and starts inside it; it adds that run's partial sums in position order and updates.
template <typename W, typename K, int OPT, int CHUNKS>
__device__ __forceinline__ void sparse_update_long(
    W* __restrict__ weights, float* __restrict__ master, float* __restrict__ state1, float* __restrict__ state2,
    const K* __restrict__ sorted_keys, const long long* __restrict__ table_row_starts,
    const long long* __restrict__ table_weight_offsets, const long long* __restrict__ table_dims, int num_tables,
    const float* __restrict__ partials, long long nnz, int log_lanes, int weights_aligned,
    float lr, float eps, float beta1, float beta2, float bias1, float bias2, float weight_decay,
    int stochastic, unsigned long long seed) {
    constexpr int N = Vec<W>::N;
    const int lanes = 1 << log_lanes;
    const int lane = threadIdx.x & (lanes - 1);
    const long long k = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> log_lanes;
    const long long first = k * SEGMENT, end = first + SEGMENT;
    if (end >= nnz) return;
    const K key = sorted_keys[end];
    if (sorted_keys[end - 1] != key) return;                 // no run crosses this segment's end
    if (first > 0 && sorted_keys[first - 1] == key) return;  // the run started in an earlier segment
    const unsigned int mask = group_mask(lanes);

    const int t = table_of<K>(key, table_row_starts, num_tables);
    const int D = (int)table_dims[t];
    const long long elem = table_weight_offsets[t] + ((long long)key - table_row_starts[t]) * D;
    const bool vec_w = weights_aligned && (elem % N == 0) && (D % N == 0);
    const int chunk = lanes * N;
    const long long stride = (long long)(CHUNKS * chunk);
    W* wrow = weights + elem;
    float* mrow = master ? master + elem : nullptr;

    float w[CHUNKS][N], m1[CHUNKS][N], m2[CHUNKS][N], g[CHUNKS][N];
    float before = 0.0f;
    load_row<W, OPT, CHUNKS, N>(wrow, mrow, state1, state2, key, elem, D, lane, lanes, vec_w, w, m1, m2, before);
    const float* head = partials + (2 * k + (sorted_keys[first] == key ? 0 : 1)) * stride;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
        const int d0 = c * chunk + lane * N;
        if (d0 < D) load_elems<float, N>(head, d0, D, true, g[c]);
        else
#pragma unroll
            for (int q = 0; q < N; ++q) g[c][q] = 0.0f;
    }
    // The run ends before the first position past `end` with another key (binary search), so the
    // partial sums to add are known up front and their loads overlap.
    long long lo = end, hi = nnz;
    while (hi - lo > 1) {
        const long long mid = lo + (hi - lo) / 2;
        if (sorted_keys[mid] == key) lo = mid;
        else hi = mid;
    }
    const long long last = lo / SEGMENT;
#pragma unroll 4
    for (long long m = k + 1; m <= last; ++m) {
        const float* part = partials + 2 * m * stride;
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
            const int d0 = c * chunk + lane * N;
            if (d0 < D) {
                float v[N];
                load_elems<float, N>(part, d0, D, true, v);
#pragma unroll
                for (int q = 0; q < N; ++q) g[c][q] += v[q];
            }
        }
    }
    update_row<W, OPT, CHUNKS, N>(wrow, mrow, state1, state2, (long long)key, elem, D, lane, lanes, mask, vec_w, w,
                                  m1, m2, g, before, lr, eps, beta1, beta2, bias1, bias2, weight_decay, stochastic,
                                  seed);
}

// A group per sorted position (the `position` candidate, and batches of 2**31 ids or more).
#define SPARSE_UPDATE_POSITION(NAME, W, K, OPT, CHUNKS)                                                 \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                             \
        W* weights, float* master, float* state1, float* state2, const K* sorted_keys,                  \
        const int* sorted_bags, const long long* offsets, const long long* table_row_starts,            \
        const long long* table_weight_offsets, const long long* table_dims, int num_tables,             \
        const long long* output_offsets, const unsigned char* slot_mean, const void* grad,              \
        long long grad_stride, float* partials, long long nnz, int batch_size,                          \
        int log_lanes, int weights_aligned, int grad_aligned, int grad_bf16, float lr, float eps,       \
        float beta1, float beta2, float bias1, float bias2, float weight_decay, int stochastic,          \
        unsigned long long seed) {                                                                      \
        sparse_update<W, K, OPT, CHUNKS>(weights, master, state1, state2, sorted_keys, sorted_bags,     \
                                         offsets, table_row_starts, table_weight_offsets, table_dims,   \
                                         num_tables, output_offsets, slot_mean, grad, grad_stride,      \
                                         partials, nnz, batch_size, log_lanes,                          \
                                         weights_aligned, grad_aligned, grad_bf16, lr, eps, beta1,      \
                                         beta2, bias1, bias2, weight_decay, stochastic, seed);          \
    }

// The runs cut into segments, whichever kernel updated the rest.
#define SPARSE_UPDATE_LONG(NAME, W, K, OPT, CHUNKS)                                                     \
    extern "C" __global__ void __launch_bounds__(256) NAME##_long(                                      \
        W* weights, float* master, float* state1, float* state2, const K* sorted_keys,                  \
        const long long* table_row_starts, const long long* table_weight_offsets,                       \
        const long long* table_dims, int num_tables, const float* partials, long long nnz,              \
        int log_lanes, int weights_aligned, float lr, float eps, float beta1, float beta2,              \
        float bias1, float bias2, float weight_decay, int stochastic, unsigned long long seed) {        \
        sparse_update_long<W, K, OPT, CHUNKS>(weights, master, state1, state2, sorted_keys,             \
                                              table_row_starts, table_weight_offsets, table_dims,       \
                                              num_tables, partials, nnz, log_lanes, weights_aligned,    \
                                              lr, eps, beta1, beta2, bias1, bias2, weight_decay,        \
                                              stochastic, seed);                                        \
    }

// Names: sparse_update_<optimizer>_<weights dtype>_<key type>_c<chunks>[_long]; wide rows (c4 for fp32, c2
// for 16-bit) reach dim 512. KIND: SPARSE_UPDATE_POSITION or SPARSE_UPDATE_LONG.
#define SPARSE_UPDATE_KEYS(KIND, OPTNAME, OPT, WNAME, W, WIDE)                                          \
    KIND(sparse_update_##OPTNAME##_##WNAME##_i32_c1, W, int, OPT, 1)                                    \
    KIND(sparse_update_##OPTNAME##_##WNAME##_i64_c1, W, long long, OPT, 1)                              \
    KIND(sparse_update_##OPTNAME##_##WNAME##_i32_c##WIDE, W, int, OPT, WIDE)                            \
    KIND(sparse_update_##OPTNAME##_##WNAME##_i64_c##WIDE, W, long long, OPT, WIDE)

#define SPARSE_UPDATE_ALL(KIND, OPTNAME, OPT)                                                           \
    SPARSE_UPDATE_KEYS(KIND, OPTNAME, OPT, f32, float, 4)                                               \
    SPARSE_UPDATE_KEYS(KIND, OPTNAME, OPT, f16, f16, 2)                                                 \
    SPARSE_UPDATE_KEYS(KIND, OPTNAME, OPT, bf16, bf16, 2)
