// The update's memory traffic alone, as row_traffic.cu, one row a warp, with its row-wise state: MODE 0 none,
// 1 read and written, 2 read only.
template <int MODE>
__device__ __forceinline__ void rows_state(uint4* __restrict__ weights, const uint4* __restrict__ grad,
                                           float* __restrict__ state, const long long* __restrict__ row_vec,
                                           const long long* __restrict__ grad_vec, const long long* __restrict__ keys,
                                           long long n, int vectors) {
    const int lane = threadIdx.x & 31;
    const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    for (long long i = warp; i < n; i += warps) {
        const long long r = row_vec[i], g = grad_vec[i];
        float s = 0.0f;
        long long k = 0;
        if (MODE) {
            k = keys[i];
            s = state[k];
        }
        for (int v = lane; v < vectors; v += 32) {
            uint4 w = weights[r + v];
            const uint4 q = grad[g + v];
            const unsigned int f = q.x ^ q.y ^ q.z ^ q.w;
            asm volatile("" : "+r"(w.x) : "r"(f));
            if (MODE) asm volatile("" : "+r"(w.x) : "f"(s));
            weights[r + v] = make_uint4(w.x ^ 1u, w.y ^ 1u, w.z ^ 1u, w.w ^ 1u);
        }
        if (MODE == 1 && lane == 0) state[k] = s + 1.0f;
    }
}

#define ROWS_STATE(MODE)                                                                                \
    extern "C" __global__ void rows_state_##MODE(uint4* weights, const uint4* grad, float* state,       \
                                                  const long long* row_vec, const long long* grad_vec,  \
                                                  const long long* keys, long long n, int vectors) {    \
        rows_state<MODE>(weights, grad, state, row_vec, grad_vec, keys, n, vectors);                    \
    }
ROWS_STATE(0)
ROWS_STATE(1)
ROWS_STATE(2)
