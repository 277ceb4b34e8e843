// Shared by the embedding kernels: rounding modes, 16-byte row loads and stores, sub-warp masks and the
// hash behind stochastic rounding, over the storage types of floats.cuh. Self-contained (no CUDA
// headers): NVRTC compiles it with no include path.
#pragma once

#include "floats.cuh"

__device__ __forceinline__ f16 round_toward_zero(float x, f16) {
    f16 r;
    asm("cvt.rz.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
    return r;
}
__device__ __forceinline__ bf16 round_toward_zero(float x, bf16) {
    return bf16{(unsigned short)(__float_as_uint(x) >> 16)};
}

// Rounds x to one of its two neighbours in T, the farther one with probability equal to the distance
// from the nearer one over the gap, so the expected stored value is x (u32: uniform random bits).
template <typename T> __device__ __forceinline__ T round_stochastic(float x, unsigned int u32) {
    const T lo = round_toward_zero(x, T{});
    const float lo_f = to_f32(lo);
    if (lo_f == x || x != x) return lo;
    T hi;
    hi.bits = (unsigned short)(lo.bits + 1);
    const float hi_f = to_f32(hi);
    if (isinf(hi_f)) return lo;
    const float p = (x - lo_f) / (hi_f - lo_f);
    const float u = (float)(u32 >> 8) * (1.0f / 16777216.0f);
    return u < p ? hi : lo;
}
template <> __device__ __forceinline__ float round_stochastic<float>(float x, unsigned int) { return x; }

__device__ __forceinline__ unsigned int mix_hash(unsigned long long seed, unsigned long long i) {
    unsigned long long x = seed ^ (i * 0x9E3779B97F4A7C15ull);
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return (unsigned int)x;
}

// Elements per 16-byte access.
template <typename T> struct Vec { static constexpr int N = 16 / sizeof(T); };

// Loads N elements of p[d0 ...] as floats: 16-byte loads when `aligned` (p + d0 on a 16-byte boundary, or
// an 8-byte one for four 16-bit elements, and d0 + N <= D), else element by element with zeros past D.
// N is 4 or 8 (a 16-byte vector of the row's storage type, which may be wider than T's).
template <typename T, int N>
__device__ __forceinline__ void load_elems(const T* p, int d0, int D, bool aligned, float (&v)[N]) {
    if (aligned) {
        if constexpr (sizeof(T) == 4) {
#pragma unroll
            for (int q = 0; q < N / 4; ++q) {
                const float4 w = *reinterpret_cast<const float4*>(reinterpret_cast<const float*>(p) + d0 + 4 * q);
                v[4 * q] = w.x; v[4 * q + 1] = w.y; v[4 * q + 2] = w.z; v[4 * q + 3] = w.w;
            }
        } else if constexpr (N == 4) {
            const uint2 w = *reinterpret_cast<const uint2*>(p + d0);
            const unsigned int words[2] = {w.x, w.y};
#pragma unroll
            for (int k = 0; k < 2; ++k) {
                v[2 * k] = half_bits_to_f32((unsigned short)(words[k] & 0xffffu), T{});
                v[2 * k + 1] = half_bits_to_f32((unsigned short)(words[k] >> 16), T{});
            }
        } else {
#pragma unroll
            for (int q = 0; q < N / 8; ++q) {
                const uint4 w = *reinterpret_cast<const uint4*>(p + d0 + 8 * q);
                const unsigned int words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    v[8 * q + 2 * k] = half_bits_to_f32((unsigned short)(words[k] & 0xffffu), T{});
                    v[8 * q + 2 * k + 1] = half_bits_to_f32((unsigned short)(words[k] >> 16), T{});
                }
            }
        }
    } else {
#pragma unroll
        for (int k = 0; k < N; ++k) v[k] = d0 + k < D ? to_f32(p[d0 + k]) : 0.0f;
    }
}

__device__ __forceinline__ float ldg_f32(const float* p) { return __ldg(p); }
__device__ __forceinline__ float ldg_f32(const f16* p) {
    return to_f32(f16{__ldg(reinterpret_cast<const unsigned short*>(p))});
}
__device__ __forceinline__ float ldg_f32(const bf16* p) {
    return to_f32(bf16{__ldg(reinterpret_cast<const unsigned short*>(p))});
}

// Read-only variant for the forward pass (non-coherent cache path).
template <typename T, int N>
__device__ __forceinline__ void load_elems_ro(const T* p, int d0, int D, bool aligned, float (&v)[N]) {
    if (aligned) {
        if constexpr (sizeof(T) == 4) {
#pragma unroll
            for (int q = 0; q < N / 4; ++q) {
                const float4 w = __ldg(reinterpret_cast<const float4*>(reinterpret_cast<const float*>(p) + d0 + 4 * q));
                v[4 * q] = w.x; v[4 * q + 1] = w.y; v[4 * q + 2] = w.z; v[4 * q + 3] = w.w;
            }
        } else {
#pragma unroll
            for (int q = 0; q < N / 8; ++q) {
                const uint4 w = __ldg(reinterpret_cast<const uint4*>(p + d0 + 8 * q));
                const unsigned int words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    v[8 * q + 2 * k] = half_bits_to_f32((unsigned short)(words[k] & 0xffffu), T{});
                    v[8 * q + 2 * k + 1] = half_bits_to_f32((unsigned short)(words[k] >> 16), T{});
                }
            }
        }
    } else {
#pragma unroll
        for (int k = 0; k < N; ++k) v[k] = d0 + k < D ? ldg_f32(p + d0 + k) : 0.0f;
    }
}

// Stores N floats to p[d0 ...] (fp32 storage): 16-byte stores when `aligned`, else up to D.
template <int N>
__device__ __forceinline__ void store_f32(float* p, int d0, int D, bool aligned, const float (&v)[N]) {
    if (aligned) {
#pragma unroll
        for (int q = 0; q < N / 4; ++q)
            *reinterpret_cast<float4*>(p + d0 + 4 * q) = make_float4(v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]);
    } else {
#pragma unroll
        for (int k = 0; k < N; ++k)
            if (d0 + k < D) p[d0 + k] = v[k];
    }
}

// Stores the 16-bit words of N elements to p[d0 ...]: 16-byte stores when `aligned` (8-byte ones for N = 4),
// else up to D.
template <typename T, int N>
__device__ __forceinline__ void store_bits(T* p, int d0, int D, bool aligned, const unsigned short (&bits)[N]) {
    if (aligned) {
        unsigned int words[N / 2];
#pragma unroll
        for (int k = 0; k < N / 2; ++k) words[k] = bits[2 * k] | ((unsigned int)bits[2 * k + 1] << 16);
        if constexpr (N == 4) {
            *reinterpret_cast<uint2*>(p + d0) = make_uint2(words[0], words[1]);
        } else {
#pragma unroll
            for (int q = 0; q < N / 8; ++q)
                *reinterpret_cast<uint4*>(p + d0 + 8 * q) =
                    make_uint4(words[4 * q], words[4 * q + 1], words[4 * q + 2], words[4 * q + 3]);
        }
    } else {
#pragma unroll
        for (int k = 0; k < N; ++k)
            if (d0 + k < D) p[d0 + k].bits = bits[k];
    }
}

// Stores N floats to p[d0 ...] in T (rounded to nearest for 16-bit T): vector stores when `aligned`, else up to D.
template <typename T, int N>
__device__ __forceinline__ void store_elems(T* p, int d0, int D, bool aligned, const float (&v)[N]) {
    if constexpr (sizeof(T) == 4) {
        store_f32<N>(reinterpret_cast<float*>(p), d0, D, aligned, v);
    } else {
        unsigned short bits[N];
#pragma unroll
        for (int k = 0; k < N; ++k) bits[k] = round_nearest<T>(v[k]).bits;
        store_bits<T, N>(p, d0, D, aligned, bits);
    }
}

// Elements of one vector access of a row whose storage vector holds N elements, in T: 4 fp32, or N 16-bit ones.
template <typename T, int N> struct VecOf { static constexpr int Q = sizeof(T) == 4 ? 4 : N; };

// A gradient row's N elements at grad[off + d0 ...] as floats, from fp32 or (grad_bf16) bf16 storage.
template <int N>
__device__ __forceinline__ void load_grad(const void* grad, long long off, int d0, int D, bool aligned, bool grad_bf16,
                                          float (&v)[N]) {
    if (grad_bf16)
        load_elems<bf16, N>(static_cast<const bf16*>(grad) + off, d0, D, aligned, v);
    else
        load_elems<float, N>(static_cast<const float*>(grad) + off, d0, D, aligned, v);
}

// The lanes of this thread's sub-warp group of `lanes` (a power of two <= 32) threads.
__device__ __forceinline__ unsigned int group_mask(int lanes) {
    if (lanes == 32) return 0xffffffffu;
    const unsigned int first = (threadIdx.x & 31) & ~(unsigned int)(lanes - 1);
    return ((1u << lanes) - 1u) << first;
}
