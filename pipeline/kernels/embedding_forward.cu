// Table-batched pooled embedding forward: every slot (table, feature) of the batch in one launch.
//
// A group of `lanes` threads (a power of two <= 32, chosen from the largest dim) pools one bag
// `bag = s * B + b`: it reads the bag's ids cooperatively (one per lane, then broadcast by shuffle),
// gathers the rows with 16-byte loads, four rows in flight, accumulates in fp32, scales by 1/len for
// mean pooling and writes straight into columns output_offsets[s] .. output_offsets[s+1] of row b of
// the [B, total_dim] fp32 output (the concat is fused). Dims or offsets that are not a multiple of the
// vector width take the element-wise path for that slot. Empty bags write zeros.
#include "embedding_common.cuh"

template <typename W>
__device__ __forceinline__ void pooled_forward(
    const W* __restrict__ weights,
    const long long* __restrict__ slot_weight_offsets,  // [S] element offset of the slot's table
    const long long* __restrict__ output_offsets,       // [S + 1] column offsets (the D offsets)
    const unsigned char* __restrict__ slot_mean,        // [S] 1: mean pooling, 0: sum
    const long long* __restrict__ indices,              // [nnz] local row ids
    const long long* __restrict__ offsets,              // [S * B + 1] bag boundaries
    int num_slots, int batch_size, int log_lanes, int weights_aligned, int output_aligned,
    float* __restrict__ out) {
    constexpr int N = Vec<W>::N;
    const int lanes = 1 << log_lanes;
    const int lane = threadIdx.x & (lanes - 1);
    const long long bag = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> log_lanes;
    if (bag >= (long long)num_slots * batch_size) return;
    const unsigned int mask = group_mask(lanes);

    const int s = (int)(bag / batch_size);
    const int b = (int)(bag - (long long)s * batch_size);
    const long long start = offsets[bag];
    const long long end = offsets[bag + 1];
    const long long col0 = output_offsets[s];
    const int D = (int)(output_offsets[s + 1] - col0);
    const W* table = weights + slot_weight_offsets[s];
    const bool vec_w = weights_aligned && (slot_weight_offsets[s] % N == 0) && (D % N == 0);
    const bool vec_o = output_aligned && (col0 % 4 == 0) && (D % 4 == 0);
    const float scale = (slot_mean[s] && end > start) ? 1.0f / (float)(end - start) : 1.0f;
    float* out_row = out + (long long)b * output_offsets[num_slots] + col0;

    for (int c0 = 0; c0 < D; c0 += lanes * N) {
        const int d0 = c0 + lane * N;
        const bool active = d0 < D;
        float acc[N];
#pragma unroll
        for (int k = 0; k < N; ++k) acc[k] = 0.0f;

        for (long long base = start; base < end; base += lanes) {
            const long long mine = base + lane < end ? __ldg(indices + base + lane) : 0;
            const int n = (int)min((long long)lanes, end - base);
            int j = 0;
            for (; j + 4 <= n; j += 4) {
                const long long r0 = __shfl_sync(mask, mine, j, lanes);
                const long long r1 = __shfl_sync(mask, mine, j + 1, lanes);
                const long long r2 = __shfl_sync(mask, mine, j + 2, lanes);
                const long long r3 = __shfl_sync(mask, mine, j + 3, lanes);
                if (active) {
                    float v0[N], v1[N], v2[N], v3[N];
                    load_elems_ro<W, N>(table + r0 * D, d0, D, vec_w, v0);
                    load_elems_ro<W, N>(table + r1 * D, d0, D, vec_w, v1);
                    load_elems_ro<W, N>(table + r2 * D, d0, D, vec_w, v2);
                    load_elems_ro<W, N>(table + r3 * D, d0, D, vec_w, v3);
#pragma unroll
                    for (int k = 0; k < N; ++k) acc[k] += (v0[k] + v1[k]) + (v2[k] + v3[k]);
                }
            }
            for (; j < n; ++j) {
                const long long r = __shfl_sync(mask, mine, j, lanes);
                if (active) {
                    float v[N];
                    load_elems_ro<W, N>(table + r * D, d0, D, vec_w, v);
#pragma unroll
                    for (int k = 0; k < N; ++k) acc[k] += v[k];
                }
            }
        }
        if (active) {
#pragma unroll
            for (int k = 0; k < N; ++k) acc[k] *= scale;
            store_f32<N>(out_row, d0, D, vec_o && d0 + N <= D, acc);
        }
    }
}

#define POOLED_FORWARD(NAME, W)                                                                         \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                             \
        const W* weights, const long long* slot_weight_offsets, const long long* output_offsets,         \
        const unsigned char* slot_mean, const long long* indices, const long long* offsets,             \
        int num_slots, int batch_size, int log_lanes, int weights_aligned, int output_aligned,          \
        float* out) {                                                                                   \
        pooled_forward<W>(weights, slot_weight_offsets, output_offsets, slot_mean, indices, offsets,    \
                          num_slots, batch_size, log_lanes, weights_aligned, output_aligned, out);      \
    }

POOLED_FORWARD(pooled_forward_f32, float)
POOLED_FORWARD(pooled_forward_f16, f16)
POOLED_FORWARD(pooled_forward_bf16, bf16)
