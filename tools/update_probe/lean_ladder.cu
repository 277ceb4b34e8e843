// Where the lean singles kernel's time goes: fp32 rows of dim 128, one row a warp (32 lanes x float4), a resident grid
// looping over the singles list. ADDR 0: the row's and gradient row's element offsets read from arrays (as row_traffic),
// 1: computed from the record (key, bag) through the per-slot arrays, the record loaded in the iteration, 2: the same
// with the next record loaded ahead (as sparse_update_singles). MATH 0: the row written back with a bit flipped (as
// row_traffic), 1: SGD, 2: row-wise Adagrad (its state read and written at the key, the sum of squares shuffled).
template <int ADDR, int MATH>
__device__ __forceinline__ void ladder(float* __restrict__ weights, const float* __restrict__ grad,
                                       float* __restrict__ state, const long long* __restrict__ rv,
                                       const long long* __restrict__ gv, const int* __restrict__ keys,
                                       const int* __restrict__ bags, const int* __restrict__ count,
                                       const long long* __restrict__ swo, const long long* __restrict__ sro,
                                       const long long* __restrict__ oo, int batch_size, long long stride, float lr) {
    const int lane = threadIdx.x & 31;
    const int warp = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    const int warps = (int)((gridDim.x * blockDim.x) >> 5);
    const int n = *count;
    int key = 0, bag = 0;
    if (ADDR == 2 && warp < n) {
        key = keys[warp];
        bag = bags[warp];
    }
    for (int i = warp; i < n; i += warps) {
        long long r, g;
        int k;
        if (ADDR == 0) {
            r = rv[i];
            g = gv[i];
            k = keys[i];
        } else {
            int kk, bb;
            if (ADDR == 1) {
                kk = keys[i];
                bb = bags[i];
            } else {
                kk = key;
                bb = bag;
                if (i < n - warps) {
                    key = keys[i + warps];
                    bag = bags[i + warps];
                }
            }
            const int s = bb / batch_size;
            r = swo[s] + ((long long)kk - sro[s]) * 128;
            g = (long long)(bb - s * batch_size) * stride + oo[s];
            k = kk;
        }
        float4 w = *reinterpret_cast<const float4*>(weights + r + 4 * lane);
        const float4 q = *reinterpret_cast<const float4*>(grad + g + 4 * lane);
        if (MATH == 0) {
            const unsigned int f = __float_as_uint(q.x) ^ __float_as_uint(q.y) ^ __float_as_uint(q.z) ^ __float_as_uint(q.w);
            unsigned int x = __float_as_uint(w.x);
            asm volatile("" : "+r"(x) : "r"(f));
            w = make_float4(__uint_as_float(x ^ 1u), __uint_as_float(__float_as_uint(w.y) ^ 1u),
                            __uint_as_float(__float_as_uint(w.z) ^ 1u), __uint_as_float(__float_as_uint(w.w) ^ 1u));
        } else if (MATH == 1) {
            w.x -= lr * q.x; w.y -= lr * q.y; w.z -= lr * q.z; w.w -= lr * q.w;
        } else {
            const float before = state[k];
            float sq = q.x * q.x + q.y * q.y + q.z * q.z + q.w * q.w;
            for (int off = 16; off > 0; off >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, off);
            const float m = before + sq / 128.0f;
            if (lane == 0) state[k] = m;
            const float step = lr / (sqrtf(m) + 1e-8f);
            w.x -= step * q.x; w.y -= step * q.y; w.z -= step * q.z; w.w -= step * q.w;
        }
        *reinterpret_cast<float4*>(weights + r + 4 * lane) = w;
    }
}

#define LADDER(ADDR, MATH)                                                                              \
    extern "C" __global__ void __launch_bounds__(256) ladder_##ADDR##_##MATH(                          \
        float* weights, const float* grad, float* state, const long long* rv, const long long* gv,      \
        const int* keys, const int* bags, const int* count, const long long* swo, const long long* sro, \
        const long long* oo, int batch_size, long long stride, float lr) {                              \
        ladder<ADDR, MATH>(weights, grad, state, rv, gv, keys, bags, count, swo, sro, oo, batch_size,   \
                           stride, lr);                                                                 \
    }
LADDER(0, 0)
LADDER(0, 1)
LADDER(0, 2)
LADDER(1, 0)
LADDER(1, 2)
LADDER(2, 0)
LADDER(2, 1)
LADDER(2, 2)

// The lean kernel's own row code (load_row, update_row of embedding_update.cuh) with the record carrying the row's
// and gradient row's element offsets, resolved when the list is made, the next record loaded ahead.
#include "embedding/embedding_update.cuh"

template <int OPT>
__device__ __forceinline__ void lean_resolved(float* __restrict__ weights, float* __restrict__ state,
                                              const int* __restrict__ keys, const long long* __restrict__ rv,
                                              const long long* __restrict__ gv, const int* __restrict__ count,
                                              const float* __restrict__ grad, int D, float lr) {
    const int lane = threadIdx.x & 31;
    const int first = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    const int groups = (int)((gridDim.x * blockDim.x) >> 5);
    const int n = *count;
    if (first >= n) return;
    int key = keys[first];
    long long elem = rv[first], goff = gv[first];
    for (int i = first; i < n; i += groups) {
        int next_key = key;
        long long next_elem = elem, next_goff = goff;
        if (i < n - groups) {
            next_key = keys[i + groups];
            next_elem = rv[i + groups];
            next_goff = gv[i + groups];
        }
        float w[1][4], m1[1][4], m2[1][4], g[1][4];
        float before;
        load_row<float, OPT, 1, 4>(weights + elem, nullptr, state, nullptr, key, elem, D, lane, 32, true, w, m1, m2,
                                   before);
        load_elems<float, 4>(grad + goff, lane * 4, D, true, g[0]);
        update_row<float, OPT, 1, 4>(weights + elem, nullptr, state, nullptr, key, elem, D, lane, 32, 0xffffffffu, true,
                                     w, m1, m2, g, before, lr, 1e-8f, 0.9f, 0.999f, 0.1f, 0.001f, 0.0f, 0, 0ull);
        key = next_key;
        elem = next_elem;
        goff = next_goff;
    }
}

#define LEAN_RESOLVED(NAME, OPT)                                                                        \
    extern "C" __global__ void __launch_bounds__(256) NAME(float* weights, float* state, const int* keys, \
                                                           const long long* rv, const long long* gv,    \
                                                           const int* count, const float* grad, int D,  \
                                                           float lr) {                                  \
        lean_resolved<OPT>(weights, state, keys, rv, gv, count, grad, D, lr);                           \
    }
LEAN_RESOLVED(lean_resolved_sgd, OPT_SGD)
LEAN_RESOLVED(lean_resolved_adagrad, OPT_ADAGRAD)
