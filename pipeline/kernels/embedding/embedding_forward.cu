// Table-batched pooled embedding forward: every slot (table, feature) of the batch in one launch.
//
// A group of `lanes` threads (a power of two <= 32, chosen from the largest dim) pools up to
// `bags_per_group` consecutive bags of one slot. It streams the ids of those bags (contiguous in
// `indices`) a warp-load at a time, broadcasts them by shuffle, and gathers the rows with 16-byte
// loads, four rows in flight whatever the bag boundaries, so one-hot bags get as many loads in flight
// as multi-hot ones. Each lane accumulates its N columns in fp32; at a bag boundary the sum (scaled by
// 1/len for mean pooling) goes straight into columns output_offsets[s] .. output_offsets[s+1] of the
// bag's row of the [B, total_dim] output (the concat is fused), fp32 or rounded once to fp16 or bf16 (the
// dtype the dense part computes in under autocast, so no cast of its own reads and writes the rows
// again). Empty bags write zeros. Dims or offsets that are not a multiple of the vector width take the
// element-wise path for that slot.
#include "embedding_common.cuh"

template <typename W, typename O>
__device__ __forceinline__ void pooled_forward(
    const W* __restrict__ weights,
    const long long* __restrict__ slot_weight_offsets,  // [S] element offset of the slot's table
    const long long* __restrict__ output_offsets,       // [S + 1] column offsets (the D offsets)
    const unsigned char* __restrict__ slot_mean,        // [S] 1: mean pooling, 0: sum
    const long long* __restrict__ indices,              // [nnz] local row ids
    const long long* __restrict__ offsets,              // [S * B + 1] bag boundaries
    int num_slots, int batch_size, int bags_per_group, int log_lanes, int weights_aligned,
    int output_aligned, O* __restrict__ out) {
    constexpr int N = Vec<W>::N;
    constexpr int Q = VecOf<O, N>::Q;  // output elements a vector store writes
    const int lanes = 1 << log_lanes;
    const int lane = threadIdx.x & (lanes - 1);
    const long long group = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> log_lanes;
    const int groups_per_slot = (batch_size + bags_per_group - 1) / bags_per_group;
    if (group >= (long long)num_slots * groups_per_slot) return;
    const unsigned int mask = group_mask(lanes);

    const int s = (int)(group / groups_per_slot);
    const int b_begin = (int)(group - (long long)s * groups_per_slot) * bags_per_group;
    const int b_end = min(b_begin + bags_per_group, batch_size);
    const long long* bag_offsets = offsets + (long long)s * batch_size;
    const long long col0 = output_offsets[s];
    const int D = (int)(output_offsets[s + 1] - col0);
    const long long row_stride = output_offsets[num_slots];
    const W* table = weights + slot_weight_offsets[s];
    const bool vec_w = weights_aligned && (slot_weight_offsets[s] % N == 0) && (D % N == 0);
    const bool vec_o = output_aligned && (col0 % Q == 0) && (D % Q == 0) && (row_stride % Q == 0);
    const bool mean = slot_mean[s] != 0;
    const long long id_begin = bag_offsets[b_begin];
    const long long id_end = bag_offsets[b_end];

    for (int c0 = 0; c0 < D; c0 += lanes * N) {
        const int d0 = c0 + lane * N;
        const bool active = d0 < D;
        float acc[N];
#pragma unroll
        for (int k = 0; k < N; ++k) acc[k] = 0.0f;
        int b = b_begin;
        long long bag_start = id_begin;
        long long bag_end = bag_offsets[b + 1];

        // Writes bag b's pooled row and moves on to bag b + 1.
        auto flush = [&]() {
            if (active) {
                const float scale = (mean && bag_end > bag_start) ? 1.0f / (float)(bag_end - bag_start) : 1.0f;
#pragma unroll
                for (int k = 0; k < N; ++k) acc[k] *= scale;
                store_elems<O, N>(out + (long long)b * row_stride + col0, d0, D, vec_o && d0 + N <= D, acc);
            }
#pragma unroll
            for (int k = 0; k < N; ++k) acc[k] = 0.0f;
            ++b;
            bag_start = bag_end;
            if (b < b_end) bag_end = bag_offsets[b + 1];
        };

        for (long long base = id_begin; base < id_end; base += lanes) {
            const long long mine = base + lane < id_end ? __ldg(indices + base + lane) : 0;
            const int n = (int)min((long long)lanes, id_end - base);
            for (int j = 0; j < n; j += 4) {
                float v[4][N];
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const long long r = __shfl_sync(mask, mine, (j + u) & (lanes - 1), lanes);
                    if (active && j + u < n) load_elems_ro<W, N>(table + r * D, d0, D, vec_w, v[u]);
                }
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    if (j + u < n) {
                        while (base + j + u >= bag_end) flush();
                        if (active) {
#pragma unroll
                            for (int k = 0; k < N; ++k) acc[k] += v[u][k];
                        }
                    }
                }
            }
        }
        while (b < b_end) flush();
    }
}

// Names: pooled_forward_<weights dtype>_<output dtype>.
#define POOLED_FORWARD(NAME, W, O)                                                                      \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                             \
        const W* weights, const long long* slot_weight_offsets, const long long* output_offsets,         \
        const unsigned char* slot_mean, const long long* indices, const long long* offsets,             \
        int num_slots, int batch_size, int bags_per_group, int log_lanes, int weights_aligned,          \
        int output_aligned, O* out) {                                                                   \
        pooled_forward<W, O>(weights, slot_weight_offsets, output_offsets, slot_mean, indices, offsets, \
                             num_slots, batch_size, bags_per_group, log_lanes, weights_aligned,         \
                             output_aligned, out);                                                      \
    }
#define POOLED_FORWARD_TO(WNAME, W)                                                                     \
    POOLED_FORWARD(pooled_forward_##WNAME##_f32, W, float)                                              \
    POOLED_FORWARD(pooled_forward_##WNAME##_f16, W, f16)                                                \
    POOLED_FORWARD(pooled_forward_##WNAME##_bf16, W, bf16)

POOLED_FORWARD_TO(f32, float)
POOLED_FORWARD_TO(f16, f16)
POOLED_FORWARD_TO(bf16, bf16)
