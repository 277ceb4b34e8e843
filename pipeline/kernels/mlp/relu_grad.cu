// The gradient through a ReLU whose bit mask the forward's product wrote (cuBLASLt's RELU_AUX_BIAS layout: row b
// is `mask_stride` bytes, bit j % 8 of byte j / 8 set where output j was positive), and the bias gradient of the
// layer the ReLU follows, in one pass:
//
//   out[b, j] = bit (b, j) ? g[b, j] : 0          sums[j] += sum over b of out[b, j]   (fp32; zeroed before)
//
// g and out are [rows, 8 * groups] fp16 or bf16, contiguous and 16-byte aligned. A block is 256 threads over a
// tile of 32 column groups (8 columns each: one 16-byte load and one mask byte) and a chunk of rows, each warp
// taking every 8th row of the chunk. Its column sums are added in shared memory, then into `sums` with one atomic
// add per column. Blocks are numbered tile-fastest: tile = block % tiles, chunk = block / tiles.
// Self-contained (no CUDA headers): NVRTC compiles it with no include path.

#include "floats.cuh"

typedef unsigned int u32;

template <typename T>
__device__ __forceinline__ void grad_through_mask(const uint4* __restrict__ g, const unsigned char* __restrict__ mask,
                                                  uint4* __restrict__ out, float* __restrict__ sums, long long rows,
                                                  int groups, long long mask_stride, int tiles, long long chunk_rows) {
    __shared__ __align__(16) float partial[8][256];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int tile = blockIdx.x % tiles;
    const long long chunk = blockIdx.x / tiles;
    const int group = tile * 32 + lane;
    const long long first = chunk * chunk_rows;
    const long long last = first + chunk_rows < rows ? first + chunk_rows : rows;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (group < groups) {
        for (long long r = first + warp; r < last; r += 8) {
            const uint4 v = g[r * groups + group];
            const u32 bits = mask[r * mask_stride + group];
            u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const u32 keep = ((bits >> (2 * i)) & 1u ? 0x0000FFFFu : 0u) | ((bits >> (2 * i + 1)) & 1u ? 0xFFFF0000u : 0u);
                w[i] &= keep;
                acc[2 * i] += half_bits_to_f32((unsigned short)(w[i] & 0xFFFFu), T{});
                acc[2 * i + 1] += half_bits_to_f32((unsigned short)(w[i] >> 16), T{});
            }
            out[r * groups + group] = make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
    float4* row = reinterpret_cast<float4*>(partial[warp]);
    row[2 * lane] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    row[2 * lane + 1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
    __syncthreads();
    const int column = tile * 256 + threadIdx.x;
    if (column < groups * 8) {
        float total = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) total += partial[i][threadIdx.x];
        atomicAdd(sums + column, total);
    }
}

#define RELU_MASK_GRAD(NAME, T)                                                                                   \
    extern "C" __global__ void __launch_bounds__(256)                                                             \
        NAME(const uint4* g, const unsigned char* mask, uint4* out, float* sums, long long rows, int groups,      \
             long long mask_stride, int tiles, long long chunk_rows) {                                            \
        grad_through_mask<T>(g, mask, out, sums, rows, groups, mask_stride, tiles, chunk_rows);                  \
    }

RELU_MASK_GRAD(relu_mask_grad_f16, f16)
RELU_MASK_GRAD(relu_mask_grad_bf16, bf16)
