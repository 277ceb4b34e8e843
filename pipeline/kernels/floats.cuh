// 16-bit float storage types and their conversions, shared by every kernel source. Self-contained (no
// CUDA headers), so NVRTC compiles it with no include path; nvcc finds it with -I pipeline/kernels.
#pragma once

struct __align__(2) f16 { unsigned short bits; };
struct __align__(2) bf16 { unsigned short bits; };

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(f16 v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
    return f;
}
__device__ __forceinline__ float to_f32(bf16 v) { return __uint_as_float(((unsigned int)v.bits) << 16); }

__device__ __forceinline__ float half_bits_to_f32(unsigned short bits, f16) { return to_f32(f16{bits}); }
__device__ __forceinline__ float half_bits_to_f32(unsigned short bits, bf16) { return to_f32(bf16{bits}); }

template <typename T> __device__ __forceinline__ T round_nearest(float x);
template <> __device__ __forceinline__ float round_nearest<float>(float x) { return x; }
template <> __device__ __forceinline__ f16 round_nearest<f16>(float x) {
    f16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
    return r;
}
template <> __device__ __forceinline__ bf16 round_nearest<bf16>(float x) {
    bf16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
    return r;
}
