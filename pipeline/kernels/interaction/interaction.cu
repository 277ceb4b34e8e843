// DLRM's pairwise dot interaction and its backward, fused: tensor-core products with fp32 accumulation.
//
// Forward:  out[b, p] = <x[b, i], x[b, j]> for the pairs j < i in torch.tril_indices(V, V, -1) order,
//           p = i * (i - 1) / 2 + j.
// Backward: gx[b, i] = sum over j != i of g[b, pair(i, j)] * x[b, j] (G, the pair gradients as a
//           symmetric V x V matrix with a zero diagonal, times the sample's vectors).
//
// A sample's V rows come in two parts read where they lie: row 0 from `head` (DLRM's bottom MLP output) and rows
// 1 .. V-1 from `tail` (the pooled embeddings, D apart), so nothing concatenates them first. A warp computes
// one sample at a time (samples w, w + warps, ...) in its own slice of shared memory.
// It copies CHUNK_WORDS words (256 bytes) of each of the sample's V rows at a time, with 16-byte
// loads when the rows allow, and multiplies with mma.sync: bf16 and fp16 as m16n8k16, fp32 as
// m16n8k8 on tf32 with every value split into a high and a low tf32 part (hi*hi + hi*lo + lo*hi,
// about fp32's precision). The V rows are padded to VP = 16 * MT, MT a template parameter.
//
// Forward: the Gram matrix X X^T, lower-triangle 16x8 tiles only, summed over the chunks in
// registers, then staged in shared memory in pair order and written out contiguously.
// Backward: G is built in shared memory from the sample's pair gradients; each chunk of X's
// columns is then replaced, 16 columns at a time, by the same columns of G X and written out.
//
// Shared rows are ROW_WORDS words apart, four more than a chunk, so the fragment loads of 8 rows
// x 4 words hit 32 different banks; the fp32 backward reads X down its columns and takes
// COLUMN_ROW_WORDS for the same reason. Self-contained (no CUDA headers): NVRTC compiles it with
// no include path.

#define CHUNK_WORDS 64
#define ROW_WORDS 68
#define COLUMN_ROW_WORDS 72

#include "floats.cuh"

typedef unsigned int u32;
typedef unsigned short u16;

extern __shared__ __align__(16) u32 smem[];

// Two results of one row, side by side in shared memory (col even): as they are stored in T.
__device__ __forceinline__ void store_two(u32* row, int col, float a, float b, float) {
    *reinterpret_cast<float2*>(row + col) = make_float2(a, b);
}
template <typename T> __device__ __forceinline__ void store_two(u32* row, int col, float a, float b, T) {
    row[col >> 1] = (u32)round_nearest<T>(a).bits | ((u32)round_nearest<T>(b).bits << 16);
}

// One 32-bit word of a fragment: two 16-bit values, or an fp32 value as a high and a low tf32 part.
template <typename T> struct Frag { u32 v; };
template <> struct Frag<float> { u32 hi, lo; };

template <typename T> __device__ __forceinline__ Frag<T> frag(u32 w) { return Frag<T>{w}; }
template <> __device__ __forceinline__ Frag<float> frag<float>(u32 w) {
    Frag<float> f;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(f.hi) : "f"(__uint_as_float(w)));
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(f.lo) : "f"(__uint_as_float(w) - __uint_as_float(f.hi)));
    return f;
}

__device__ __forceinline__ void mma_tf32(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// c += A B for one 16x8 tile and one k-step (16 values of 16-bit types, 8 of fp32).
__device__ __forceinline__ void mma(float (&c)[4], const Frag<bf16> (&a)[4], const Frag<bf16> (&b)[2]) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0].v), "r"(a[1].v), "r"(a[2].v), "r"(a[3].v), "r"(b[0].v), "r"(b[1].v));
}
__device__ __forceinline__ void mma(float (&c)[4], const Frag<f16> (&a)[4], const Frag<f16> (&b)[2]) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0].v), "r"(a[1].v), "r"(a[2].v), "r"(a[3].v), "r"(b[0].v), "r"(b[1].v));
}
__device__ __forceinline__ void mma(float (&c)[4], const Frag<float> (&a)[4], const Frag<float> (&b)[2]) {
    mma_tf32(c, a[0].lo, a[1].lo, a[2].lo, a[3].lo, b[0].hi, b[1].hi);
    mma_tf32(c, a[0].hi, a[1].hi, a[2].hi, a[3].hi, b[0].lo, b[1].lo);
    mma_tf32(c, a[0].hi, a[1].hi, a[2].hi, a[3].hi, b[0].hi, b[1].hi);
}

// The four 8x8 16-bit matrices whose rows lanes 0-7, 8-15, 16-23, 24-31 point at (p, 16 bytes each),
// transposed: q[i] of lane l holds matrix i's elements (2 (l % 4), l / 4) and (2 (l % 4) + 1, l / 4).
__device__ __forceinline__ void ldmatrix_x4_trans(const void* p, u32 (&q)[4]) {
    asm volatile(
        "{ .reg .u64 a; .reg .u32 s; cvta.to.shared.u64 a, %4; cvt.u32.u64 s, a;\n"
        "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [s]; }"
        : "=r"(q[0]), "=r"(q[1]), "=r"(q[2]), "=r"(q[3])
        : "l"(p)
        : "memory");
}

// Copies columns [c0, c0 + width) of sample b's V rows into shared memory (rows `stride` words apart), 16 bytes
// at a time when `vec` (D and both parts 16-byte aligned), and zeros columns [width, padded) of those rows. Row 0
// is `heads`' row b, rows 1.. are `tails`' (D apart), found here from the kernel's parameters, so no register
// holds them across the products.
template <typename T>
__device__ __forceinline__ void load_rows(const T* __restrict__ heads, long long head_stride,
                                          const T* __restrict__ tails, long long tail_stride, int b, int V, int D,
                                          int c0, int width, int padded, u32* dst, int stride, int vec, int lane) {
    constexpr int VE = 16 / sizeof(T);
    const T* head = heads + (long long)b * head_stride + c0;
    const T* tail = tails + (long long)b * tail_stride + c0;
    T* el = reinterpret_cast<T*>(dst);
    const int row_elems = stride * 4 / (int)sizeof(T);
    if (vec) {
        const int per_row = width / VE;
        for (int k = lane; k < V * per_row; k += 32) {
            const int r = k / per_row, v = k - r * per_row;
            *reinterpret_cast<uint4*>(dst + r * stride + v * 4) =
                *reinterpret_cast<const uint4*>((r == 0 ? head : tail + (r - 1) * D) + v * VE);
        }
        const int extra = padded - width;
        for (int k = lane; k < V * extra; k += 32) {
            const int r = k / extra;
            el[r * row_elems + width + (k - r * extra)] = T{};
        }
    } else {
        for (int k = lane; k < V * padded; k += 32) {
            const int r = k / padded, e = k - r * padded;
            el[r * row_elems + e] = e < width ? (r == 0 ? head : tail + (r - 1) * D)[e] : T{};
        }
    }
}

// The reverse of load_rows: columns [0, width) of `rows` shared rows into columns [c0, c0 + width).
template <typename T>
__device__ __forceinline__ void store_rows(T* __restrict__ dst, int rows, int D, int c0, int width, const u32* src,
                                           int stride, int vec, int lane) {
    constexpr int VE = 16 / sizeof(T);
    const T* el = reinterpret_cast<const T*>(src);
    const int row_elems = stride * 4 / (int)sizeof(T);
    if (vec) {
        const int per_row = width / VE;
        for (int k = lane; k < rows * per_row; k += 32) {
            const int r = k / per_row, v = k - r * per_row;
            *reinterpret_cast<uint4*>(dst + (long long)r * D + c0 + v * VE) =
                *reinterpret_cast<const uint4*>(src + r * stride + v * 4);
        }
    } else {
        for (int k = lane; k < rows * width; k += 32) {
            const int r = k / width, e = k - r * width;
            dst[(long long)r * D + c0 + e] = el[r * row_elems + e];
        }
    }
}

template <typename T, int MT>
__device__ __forceinline__ void dot_interaction_forward(const T* __restrict__ head, long long head_stride,
                                                        const T* __restrict__ tail, long long tail_stride,
                                                        T* __restrict__ out, int batch, int V, int D, int vec,
                                                        int warp_words) {
    constexpr int NT = 2 * MT;                         // 8-column tiles of the padded V
    constexpr int CE = CHUNK_WORDS * 4 / sizeof(T);    // values of a row per chunk
    constexpr int KE = 32 / sizeof(T);                 // values per k-step (8 words)
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    u32* xs = smem + (threadIdx.x >> 5) * warp_words;
    T* staged = reinterpret_cast<T*>(xs + 16 * MT * ROW_WORDS);
    const int pairs = V * (V - 1) / 2;
    const int warps = gridDim.x * (blockDim.x >> 5);

    for (int b = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); b < batch; b += warps) {
        float c[MT][NT][4];
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int q = 0; q < 4; ++q) c[m][n][q] = 0.0f;

        for (int c0 = 0; c0 < D; c0 += CE) {
            const int width = min(CE, D - c0);
            const int steps = (width + KE - 1) / KE;
            __syncwarp();
            load_rows<T>(head, head_stride, tail, tail_stride, b, V, D, c0, width, steps * KE, xs, ROW_WORDS, vec,
                         lane);
            __syncwarp();
            for (int s = 0; s < steps; ++s) {
                // B fragment of tile n: rows n*8 + g, words s*8 + t and + 4. The A fragment of
                // 16-row tile m is the B fragments of tiles 2m and 2m + 1 (both operands are X).
                Frag<T> bf[NT][2];
#pragma unroll
                for (int n = 0; n < NT; ++n) {
                    const u32* r = xs + (n * 8 + g) * ROW_WORDS + s * 8 + t;
                    bf[n][0] = frag<T>(r[0]);
                    bf[n][1] = frag<T>(r[4]);
                }
#pragma unroll
                for (int m = 0; m < MT; ++m) {
                    const Frag<T> a[4] = {bf[2 * m][0], bf[2 * m + 1][0], bf[2 * m][1], bf[2 * m + 1][1]};
#pragma unroll
                    for (int n = 0; n <= 2 * m + 1; ++n) {
                        if (n * 8 < V) mma(c[m][n], a, bf[n]);
                    }
                }
            }
        }

        // c[m][n]: rows m*16 + g (+8), columns n*8 + 2t (+1).
        __syncwarp();  // the previous sample's staged values are written out
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int n = 0; n <= 2 * m + 1; ++n)
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const int i = m * 16 + g + (q >> 1) * 8, j = n * 8 + 2 * t + (q & 1);
                    if (j < i && i < V) staged[i * (i - 1) / 2 + j] = round_nearest<T>(c[m][n][q]);
                }
        __syncwarp();
        T* ob = out + (long long)b * pairs;
        for (int p = lane; p < pairs; p += 32) ob[p] = staged[p];
    }
}

template <typename T, int MT>
__device__ __forceinline__ void dot_interaction_backward(const T* __restrict__ head, long long head_stride,
                                                         const T* __restrict__ tail, long long tail_stride,
                                                         const T* __restrict__ grad, long long grad_stride,
                                                         T* __restrict__ gx, int batch, int V, int D, int vec,
                                                         int warp_words) {
    constexpr int VP = 16 * MT;
    constexpr int XW = sizeof(T) == 4 ? COLUMN_ROW_WORDS : ROW_WORDS;
    constexpr int GW = VP * sizeof(T) / 4 + 4;         // words per row of G
    constexpr int GE = GW * 4 / sizeof(T);             // values per row of G
    constexpr int CE = CHUNK_WORDS * 4 / sizeof(T);
    constexpr int KE = 32 / sizeof(T);
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    u32* xs = smem + (threadIdx.x >> 5) * warp_words;
    u32* gs = xs + VP * XW;
    T* G = reinterpret_cast<T*>(gs);
    const int pairs = V * (V - 1) / 2;
    const int warps = gridDim.x * (blockDim.x >> 5);

    // The padded rows of X (the k of G X past V) and G's diagonal and padding stay zero.
    for (int w = lane; w < (VP - V) * XW; w += 32) xs[V * XW + w] = 0u;
    for (int w = lane; w < VP * GW; w += 32) gs[w] = 0u;

    for (int b = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); b < batch; b += warps) {
        const T* gb = grad + (long long)b * grad_stride;
        __syncwarp();
        for (int p = lane; p < pairs; p += 32) {
            const int i = (int)((1.0f + sqrtf((float)(8 * p + 1))) * 0.5f);  // exact for p < 2^21
            const int j = p - i * (i - 1) / 2;
            const T v = gb[p];
            G[i * GE + j] = v;
            G[j * GE + i] = v;
        }
        for (int c0 = 0; c0 < D; c0 += CE) {
            const int width = min(CE, D - c0);
            __syncwarp();
            load_rows<T>(head, head_stride, tail, tail_stride, b, V, D, c0, width, width, xs, XW, vec, lane);
            __syncwarp();
            for (int n0 = 0; n0 < width; n0 += 16) {
                float c[MT][2][4];
#pragma unroll
                for (int m = 0; m < MT; ++m)
#pragma unroll
                    for (int q = 0; q < 8; ++q) c[m][q >> 2][q & 3] = 0.0f;
#pragma unroll
                for (int s = 0; s < VP / KE; ++s) {
                    if (s * KE >= V) continue;
                    // B fragments of the two 8-column tiles at n0: X rows (the k) s*KE.., read down columns.
                    Frag<T> bf[2][2];
                    if constexpr (sizeof(T) == 2) {
                        u32 q[4];
                        ldmatrix_x4_trans(reinterpret_cast<const T*>(xs + (s * KE + (lane & 15)) * XW) + n0 +
                                              (lane >> 4) * 8, q);
                        bf[0][0] = frag<T>(q[0]);
                        bf[0][1] = frag<T>(q[1]);
                        bf[1][0] = frag<T>(q[2]);
                        bf[1][1] = frag<T>(q[3]);
                    } else {
                        const u32* r = xs + (s * KE + t) * XW + n0 + g;
                        bf[0][0] = frag<T>(r[0]);
                        bf[0][1] = frag<T>(r[4 * XW]);
                        bf[1][0] = frag<T>(r[8]);
                        bf[1][1] = frag<T>(r[4 * XW + 8]);
                    }
#pragma unroll
                    for (int m = 0; m < MT; ++m) {
                        const u32* r = gs + (m * 16 + g) * GW + s * 8 + t;
                        const Frag<T> a[4] = {frag<T>(r[0]), frag<T>(r[8 * GW]), frag<T>(r[4]), frag<T>(r[8 * GW + 4])};
                        mma(c[m][0], a, bf[0]);
                        mma(c[m][1], a, bf[1]);
                    }
                }
                __syncwarp();  // every lane has read these 16 columns: overwrite them with the result
#pragma unroll
                for (int m = 0; m < MT; ++m)
#pragma unroll
                    for (int n = 0; n < 2; ++n)
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            const int i = m * 16 + g + 8 * h;
                            if (i < V) store_two(xs + i * XW, n0 + n * 8 + 2 * t, c[m][n][2 * h], c[m][n][2 * h + 1], T{});
                        }
            }
            __syncwarp();
            store_rows<T>(gx + (long long)b * V * D, V, D, c0, width, xs, XW, vec, lane);
        }
    }
}

#define DOT_INTERACTION(NAME, T, MT, VP)                                                                       \
    extern "C" __global__ void __launch_bounds__(128) dot_interaction_forward_##NAME##_v##VP(                 \
        const T* head, long long head_stride, const T* tail, long long tail_stride, T* out, int batch, int V,  \
        int D, int vec, int warp_words) {                                                                      \
        dot_interaction_forward<T, MT>(head, head_stride, tail, tail_stride, out, batch, V, D, vec,            \
                                       warp_words);                                                            \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) dot_interaction_backward_##NAME##_v##VP(                \
        const T* head, long long head_stride, const T* tail, long long tail_stride, const T* grad,             \
        long long grad_stride, T* gx, int batch, int V, int D, int vec, int warp_words) {                      \
        dot_interaction_backward<T, MT>(head, head_stride, tail, tail_stride, grad, grad_stride, gx, batch, V, \
                                        D, vec, warp_words);                                                   \
    }

#define DOT_INTERACTION_SIZES(NAME, T) \
    DOT_INTERACTION(NAME, T, 1, 16)    \
    DOT_INTERACTION(NAME, T, 2, 32)    \
    DOT_INTERACTION(NAME, T, 3, 48)    \
    DOT_INTERACTION(NAME, T, 4, 64)

DOT_INTERACTION_SIZES(f32, float)
DOT_INTERACTION_SIZES(f16, f16)
DOT_INTERACTION_SIZES(bf16, bf16)
