// Shared by the fused update kernels (embedding_backward.cu, embedding_update_runs.cu): the segments
// sorted positions are cut into, a bag's gradient row, the sum of a segment's gradient rows, and the
// load, optimizer step and store of one row. Self-contained (no CUDA headers), like the headers it includes.
#pragma once

#include "embedding_common.cuh"

enum { OPT_SGD = 0, OPT_ADAGRAD = 1, OPT_ADAM = 2 };

// Sorted positions are cut into segments of at most SEGMENT: a segment starts where a row's run of
// equal keys starts or at a multiple of SEGMENT. So a row that occurs thousands of times in a batch
// (a skewed id, a tiny table) is summed by many thread groups at once instead of serialising on one.
// A segment holding a whole run updates its row at once; the segments of a longer run store their
// partial sums, and sparse_update_long adds them in position order (deterministic) and updates.
// Partial slots: 2 * (pos / SEGMENT), plus 1 for a run that starts inside a segment's span.
#define SEGMENT 64

// The gradient row of `bag` (its offset in grad, whose rows are grad_stride elements apart) and its weight:
// 1/len for a bag of a mean-pooled slot, else 1.
__device__ __forceinline__ void bag_gradient(int bag, int batch_size, long long grad_stride,
                                             const long long* __restrict__ output_offsets,
                                             const unsigned char* __restrict__ slot_mean,
                                             const long long* __restrict__ offsets, long long& goff, float& scale) {
    const int s = bag / batch_size;
    goff = (long long)(bag - s * batch_size) * grad_stride + output_offsets[s];
    scale = slot_mean[s] ? 1.0f / (float)max(offsets[bag + 1] - offsets[bag], 1LL) : 1.0f;
}

// Adds to g the gradient rows of n consecutive sorted positions, whose offsets and weights lanes 0..n-1
// of the group hold, in position order, two rows at a time (the order every update kernel sums in).
template <int CHUNKS, int N>
__device__ __forceinline__ void add_gradient_rows(const void* __restrict__ grad, long long goff, float scale, int n,
                                                  int D, int lane, int lanes, unsigned int mask, bool vec_g,
                                                  bool grad_bf16, float (&g)[CHUNKS][N]) {
    const int chunk = lanes * N;
    int u = 0;
    for (; u + 2 <= n; u += 2) {
        const long long o0 = __shfl_sync(mask, goff, u, lanes);
        const long long o1 = __shfl_sync(mask, goff, u + 1, lanes);
        const float f0 = __shfl_sync(mask, scale, u, lanes);
        const float f1 = __shfl_sync(mask, scale, u + 1, lanes);
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
            const int d0 = c * chunk + lane * N;
            if (d0 < D) {
                float v0[N], v1[N];
                load_grad<N>(grad, o0, d0, D, vec_g, grad_bf16, v0);
                load_grad<N>(grad, o1, d0, D, vec_g, grad_bf16, v1);
#pragma unroll
                for (int k = 0; k < N; ++k) g[c][k] += f0 * v0[k] + f1 * v1[k];
            }
        }
    }
    for (; u < n; ++u) {
        const long long o = __shfl_sync(mask, goff, u, lanes);
        const float f = __shfl_sync(mask, scale, u, lanes);
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
            const int d0 = c * chunk + lane * N;
            if (d0 < D) {
                float v[N];
                load_grad<N>(grad, o, d0, D, vec_g, grad_bf16, v);
#pragma unroll
                for (int k = 0; k < N; ++k) g[c][k] += f * v[k];
            }
        }
    }
}

template <typename W, int N>
__device__ __forceinline__ void store_weights(W* p, int d0, int D, bool aligned, const float (&v)[N],
                                              bool stochastic, unsigned long long seed, long long elem) {
    if constexpr (sizeof(W) == 4) {
        store_f32<N>(reinterpret_cast<float*>(p), d0, D, aligned, v);
    } else {
        unsigned short bits[N];
#pragma unroll
        for (int k = 0; k < N; ++k)
            bits[k] = stochastic ? round_stochastic<W>(v[k], mix_hash(seed, (unsigned long long)(elem + d0 + k))).bits
                                 : round_nearest<W>(v[k]).bits;
        store_bits<W, N>(p, d0, D, aligned, bits);
    }
}

// Weight decay, the optimizer and the store of one row whose gradient sum is in g; w, m1, m2 hold the
// row and its Adam moments, `before` its row-wise Adagrad sum, all loaded by load_row.
template <typename W, int OPT, int CHUNKS, int N>
__device__ __forceinline__ void update_row(
    W* __restrict__ wrow, float* __restrict__ mrow, float* __restrict__ state1, float* __restrict__ state2,
    long long key, long long elem, int D, int lane, int lanes, unsigned int mask, bool vec_w,
    float (&w)[CHUNKS][N], float (&m1)[CHUNKS][N], float (&m2)[CHUNKS][N], float (&g)[CHUNKS][N], float before,
    float lr, float eps, float beta1, float beta2, float bias1, float bias2, float weight_decay,
    int stochastic, unsigned long long seed) {
    const int chunk = lanes * N;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
        for (int k = 0; k < N; ++k) g[c][k] += weight_decay * w[c][k];

    if constexpr (OPT == OPT_SGD) {
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
            for (int k = 0; k < N; ++k) w[c][k] -= lr * g[c][k];
    } else if constexpr (OPT == OPT_ADAGRAD) {
        float sq = 0.0f;
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
            for (int k = 0; k < N; ++k) sq += g[c][k] * g[c][k];
        for (int off = lanes / 2; off > 0; off >>= 1) sq += __shfl_xor_sync(mask, sq, off, lanes);
        const float m = before + sq / (float)D;
        if (lane == 0) state1[key] = m;
        const float step = lr / (sqrtf(m) + eps);
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
            for (int k = 0; k < N; ++k) w[c][k] -= step * g[c][k];
    } else {
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
            const int d0 = c * chunk + lane * N;
            if (d0 < D) {
#pragma unroll
                for (int k = 0; k < N; ++k) {
                    m1[c][k] = beta1 * m1[c][k] + (1.0f - beta1) * g[c][k];
                    m2[c][k] = beta2 * m2[c][k] + (1.0f - beta2) * g[c][k] * g[c][k];
                    w[c][k] -= lr * (m1[c][k] / bias1) / (sqrtf(m2[c][k] / bias2) + eps);
                }
                store_f32<N>(state1 + elem, d0, D, vec_w, m1[c]);
                store_f32<N>(state2 + elem, d0, D, vec_w, m2[c]);
            }
        }
    }

#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
        const int d0 = c * chunk + lane * N;
        if (d0 < D) {
            if (mrow) store_f32<N>(mrow, d0, D, vec_w, w[c]);
            store_weights<W, N>(wrow, d0, D, vec_w, w[c], stochastic != 0, seed, elem);
        }
    }
}

// Loads a row (or its fp32 master copy), its Adam moments and its row-wise Adagrad sum into registers.
template <typename W, int OPT, int CHUNKS, int N>
__device__ __forceinline__ void load_row(
    const W* __restrict__ wrow, const float* __restrict__ mrow, const float* __restrict__ state1,
    const float* __restrict__ state2, long long key, long long elem, int D, int lane, int lanes, bool vec_w,
    float (&w)[CHUNKS][N], float (&m1)[CHUNKS][N], float (&m2)[CHUNKS][N], float& before) {
    const int chunk = lanes * N;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
        const int d0 = c * chunk + lane * N;
#pragma unroll
        for (int k = 0; k < N; ++k) w[c][k] = m1[c][k] = m2[c][k] = 0.0f;
        if (d0 < D) {
            if (mrow) load_elems<float, N>(mrow, d0, D, vec_w, w[c]);
            else load_elems<W, N>(wrow, d0, D, vec_w, w[c]);
            if constexpr (OPT == OPT_ADAM) {
                load_elems<float, N>(state1 + elem, d0, D, vec_w, m1[c]);
                load_elems<float, N>(state2 + elem, d0, D, vec_w, m2[c]);
            }
        }
    }
    before = 0.0f;
    if constexpr (OPT == OPT_ADAGRAD) before = state1[key];
}
