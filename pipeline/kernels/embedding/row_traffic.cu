// How fast this GPU reads rows at random and writes them back: bench embedding's measure of the rate the update's
// bytes can move at (a touched row read, a gradient row read, the row written), beside the copy's rate, which moves
// its bytes in order. Rows are read and written as they are: no sort, no segment, no optimizer; only the memory
// traffic, with as little else as a kernel can do.
//
// A warp takes ROWS rows at a time, in the order given (bench embedding passes the update's: by row key), and issues
// all their loads before any store, each lane 16 bytes of a row at a time. row_vec / grad_vec: where each row and
// its gradient row start, in 16-byte vectors. Each 32-bit word of a row is written back with its lowest bit changed by
// the lowest bit of the gradient word beside it (a weight moves by at most one unit in its last place): the store
// needs the gradient's load, which the compiler would otherwise drop as unused (an empty inline asm does not keep it:
// ptxas sees no use of the value).
template <int ROWS>
__device__ __forceinline__ void rows_read_write(uint4* __restrict__ weights, const uint4* __restrict__ grad,
                                                const long long* __restrict__ row_vec,
                                                const long long* __restrict__ grad_vec, long long n, int row_vectors,
                                                int grad_vectors) {
    const int lane = threadIdx.x & 31;
    const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    const int vectors = max(row_vectors, grad_vectors);
    for (long long base = warp * ROWS; base < n; base += warps * ROWS) {
        long long r[ROWS], g[ROWS];
#pragma unroll
        for (int u = 0; u < ROWS; ++u) {
            r[u] = base + u < n ? row_vec[base + u] : -1;
            g[u] = base + u < n ? grad_vec[base + u] : 0;
        }
        for (int v = lane; v < vectors; v += 32) {
            uint4 w[ROWS], q[ROWS];
#pragma unroll
            for (int u = 0; u < ROWS; ++u) {
                w[u] = q[u] = make_uint4(0, 0, 0, 0);
                if (r[u] >= 0) {
                    if (v < row_vectors) w[u] = weights[r[u] + v];
                    if (v < grad_vectors) q[u] = grad[g[u] + v];
                }
            }
#pragma unroll
            for (int u = 0; u < ROWS; ++u) {
                if (r[u] >= 0 && v < row_vectors)
                    weights[r[u] + v] = make_uint4(w[u].x ^ (q[u].x & 1u), w[u].y ^ (q[u].y & 1u),
                                                   w[u].z ^ (q[u].z & 1u), w[u].w ^ (q[u].w & 1u));
            }
        }
    }
}

#define ROWS_READ_WRITE(ROWS)                                                                           \
    extern "C" __global__ void rows_read_write_##ROWS(uint4* weights, const uint4* grad,               \
                                                       const long long* row_vec, const long long* grad_vec, \
                                                       long long n, int row_vectors, int grad_vectors) { \
        rows_read_write<ROWS>(weights, grad, row_vec, grad_vec, n, row_vectors, grad_vectors);          \
    }

ROWS_READ_WRITE(1)
ROWS_READ_WRITE(2)
ROWS_READ_WRITE(4)
ROWS_READ_WRITE(8)
