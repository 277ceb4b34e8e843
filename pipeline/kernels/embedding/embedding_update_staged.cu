// Candidate: the capped per-segment loop (embedding_update_runs.cuh) with each group's next segments staged in
// shared memory by asynchronous copies (cp.async), STAGES - 1 segments ahead of the one it updates.
//
// The capped loop keeps one segment's bytes in flight a group: its row, its state and its first gradient row are
// loaded into registers and the group waits for them before it can update, so the memory system holds as many
// rows in flight as groups are resident, and more registers for more rows cost resident groups (the candidates
// that prefetched a second row into registers or L1 ran slower). An asynchronous copy lands in shared memory
// instead: while a group updates segment i, the copies of segments i + G and i + 2G (G: the groups of the grid)
// are in flight, with no register held for them. Each lane copies and later reads only its own 16-byte slices
// (the elements it updates), so a lane waits on its own copies (cp.async.wait_group) and no barrier is needed.
//
// Staged per segment: its record (first position, end, first bag, key, whether split), the row (its fp32 master
// copy where there is one) and the Adam moments where the row is 16-byte aligned, the row-wise Adagrad sum, the
// first position's gradient row where the gradient is aligned, and the bags of the segment's first `lanes`
// positions. What is not staged (an unaligned row, the gradient rows past the first) is loaded as the capped
// kernel loads it; the sums and updates are the capped kernel's, in the same order.
#include "embedding_update_runs.cuh"

#define STAGED_BLOCK 256
#define STAGED_SHARED_BYTES 49152  // the static shared memory of a block

__device__ __forceinline__ unsigned int shared_address(const void* p) {
    unsigned int a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
__device__ __forceinline__ void copy_async_16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(shared_address(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void copy_async_4(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(shared_address(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int PENDING> __device__ __forceinline__ void copy_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
}

// What a thread stages per segment: 16-byte quads (the row, the Adam moments, the first gradient row; a chunk of
// N elements is N / 4 quads as floats, one quad as 16-bit weights) and words (the record, the Adagrad sum, a bag).
template <typename W, typename K, int OPT, int CHUNKS>
struct Stage {
    static constexpr int N = Vec<W>::N;
    static constexpr int QF = N / 4;  // quads of one chunk's floats
    static constexpr int ROW = 0, M1 = CHUNKS * QF, M2 = M1 + (OPT == OPT_ADAM ? CHUNKS * QF : 0);
    static constexpr int GRAD = M2 + (OPT == OPT_ADAM ? CHUNKS * QF : 0);
    static constexpr int QUADS = GRAD + CHUNKS * QF;
    enum { BEGIN, END, BAG, SPLIT, LANE_BAG, SUM, WORDS };
    static constexpr int BYTES = 16 * QUADS + 4 * WORDS + (int)sizeof(K);
    static constexpr int STAGES = STAGED_SHARED_BYTES / (STAGED_BLOCK * BYTES) < 3
                                      ? STAGED_SHARED_BYTES / (STAGED_BLOCK * BYTES) : 3;
};

template <typename K, int STAGES, int QUADS, int WORDS>
struct StagedShared {
    uint4 quad[STAGES][QUADS][STAGED_BLOCK];
    int word[STAGES][WORDS][STAGED_BLOCK];
    K key[STAGES][STAGED_BLOCK];
};

// Where a segment's row is: its slot (from its first bag), dim and first element, and whether the row and the
// gradient rows can move in 16-byte vectors.
struct RowPlace {
    int D;
    long long elem;
    bool vec_w, vec_g;
};

template <typename K, int N>
__device__ __forceinline__ RowPlace row_place(int bag, K key, int batch_size, const long long* __restrict__ output_offsets,
                                              const long long* __restrict__ slot_weight_offsets,
                                              const long long* __restrict__ slot_row_offsets, int weights_aligned,
                                              int grad_aligned) {
    const int s = bag / batch_size;
    const int D = (int)(output_offsets[s + 1] - output_offsets[s]);
    const long long elem = slot_weight_offsets[s] + ((long long)key - slot_row_offsets[s]) * D;
    return RowPlace{D, elem, weights_aligned && (elem % N == 0) && (D % N == 0), grad_aligned && (D % N == 0)};
}

// The 16-byte quads of a chunk's N floats read back from this thread's slices as floats.
template <int QF, int N, typename Shared>
__device__ __forceinline__ void read_floats(const Shared& sh, int stage, int first_quad, float (&v)[N]) {
#pragma unroll
    for (int q = 0; q < QF; ++q) {
        const uint4 u = sh.quad[stage][first_quad + q][threadIdx.x];
        v[4 * q] = __uint_as_float(u.x);
        v[4 * q + 1] = __uint_as_float(u.y);
        v[4 * q + 2] = __uint_as_float(u.z);
        v[4 * q + 3] = __uint_as_float(u.w);
    }
}

template <typename W, int N, typename Shared>
__device__ __forceinline__ void read_weights(const Shared& sh, int stage, int quad, float (&v)[N]) {
    const uint4 u = sh.quad[stage][quad][threadIdx.x];
    if constexpr (sizeof(W) == 4) {
        v[0] = __uint_as_float(u.x); v[1] = __uint_as_float(u.y); v[2] = __uint_as_float(u.z); v[3] = __uint_as_float(u.w);
    } else {
        const unsigned int words[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            v[2 * k] = half_bits_to_f32((unsigned short)(words[k] & 0xffffu), W{});
            v[2 * k + 1] = half_bits_to_f32((unsigned short)(words[k] >> 16), W{});
        }
    }
}

// Starts the copies of one segment into stage `stage`.
template <typename W, typename K, int OPT, int CHUNKS, typename Shared>
__device__ __forceinline__ void stage_segment(
    Shared& sh, int stage, const Segment<K>& seg, const W* __restrict__ weights, const float* __restrict__ master,
    const float* __restrict__ state1, const float* __restrict__ state2, const int* __restrict__ sorted_bags,
    const long long* __restrict__ slot_weight_offsets, const long long* __restrict__ slot_row_offsets,
    const long long* __restrict__ output_offsets, const float* __restrict__ grad, long long grad_stride,
    int batch_size, int lane, int lanes, int weights_aligned, int grad_aligned) {
    using S = Stage<W, K, OPT, CHUNKS>;
    constexpr int N = S::N, QF = S::QF;
    const int t = threadIdx.x;
    sh.word[stage][S::BEGIN][t] = seg.begin;
    sh.word[stage][S::END][t] = seg.end;
    sh.word[stage][S::BAG][t] = seg.bag;
    sh.word[stage][S::SPLIT][t] = seg.split;
    sh.key[stage][t] = seg.key;
    const RowPlace at = row_place<K, N>(seg.bag, seg.key, batch_size, output_offsets, slot_weight_offsets,
                                        slot_row_offsets, weights_aligned, grad_aligned);
    const int chunk = lanes * N;
    if (!seg.split) {
        if (at.vec_w) {
#pragma unroll
            for (int c = 0; c < CHUNKS; ++c) {
                const int d0 = c * chunk + lane * N;
                if (d0 < at.D) {
                    if (master) {
#pragma unroll
                        for (int q = 0; q < QF; ++q)
                            copy_async_16(&sh.quad[stage][S::ROW + c * QF + q][t], master + at.elem + d0 + 4 * q);
                    } else {
                        copy_async_16(&sh.quad[stage][S::ROW + c * QF][t], weights + at.elem + d0);
                    }
                    if constexpr (OPT == OPT_ADAM) {
#pragma unroll
                        for (int q = 0; q < QF; ++q) {
                            copy_async_16(&sh.quad[stage][S::M1 + c * QF + q][t], state1 + at.elem + d0 + 4 * q);
                            copy_async_16(&sh.quad[stage][S::M2 + c * QF + q][t], state2 + at.elem + d0 + 4 * q);
                        }
                    }
                }
            }
        }
        if constexpr (OPT == OPT_ADAGRAD) copy_async_4(&sh.word[stage][S::SUM][t], state1 + seg.key);
    }
    if (at.vec_g) {
        const int s = seg.bag / batch_size;
        const float* grow = grad + (long long)(seg.bag - s * batch_size) * grad_stride + output_offsets[s];
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
            const int d0 = c * chunk + lane * N;
            if (d0 < at.D) {
#pragma unroll
                for (int q = 0; q < QF; ++q) copy_async_16(&sh.quad[stage][S::GRAD + c * QF + q][t], grow + d0 + 4 * q);
            }
        }
    }
    if (seg.end - seg.begin > 1 && seg.begin + lane < seg.end)
        copy_async_4(&sh.word[stage][S::LANE_BAG][t], sorted_bags + seg.begin + lane);
}

// Updates the segment staged in `stage` (its copies complete): update_segment's sums and update, with the staged
// parts read from shared memory.
template <typename W, typename K, int OPT, int CHUNKS, typename Shared>
__device__ __forceinline__ void update_staged_segment(
    const Shared& sh, int stage, W* __restrict__ weights, float* __restrict__ master, float* __restrict__ state1,
    float* __restrict__ state2, const int* __restrict__ sorted_bags, const long long* __restrict__ offsets,
    const long long* __restrict__ slot_weight_offsets, const long long* __restrict__ slot_row_offsets,
    const long long* __restrict__ output_offsets, const unsigned char* __restrict__ slot_mean,
    const float* __restrict__ grad, float* __restrict__ partials, long long grad_stride, int batch_size, int lane,
    int lanes, unsigned int mask, int weights_aligned, int grad_aligned, float lr, float eps, float beta1,
    float beta2, float bias1, float bias2, float weight_decay, int stochastic, unsigned long long seed) {
    using S = Stage<W, K, OPT, CHUNKS>;
    constexpr int N = S::N, QF = S::QF;
    const int t = threadIdx.x;
    const Segment<K> seg{sh.word[stage][S::BEGIN][t], sh.word[stage][S::END][t], sh.word[stage][S::BAG][t],
                         sh.key[stage][t], sh.word[stage][S::SPLIT][t] != 0};
    const RowPlace at = row_place<K, N>(seg.bag, seg.key, batch_size, output_offsets, slot_weight_offsets,
                                        slot_row_offsets, weights_aligned, grad_aligned);
    const int D = at.D;
    const int chunk = lanes * N;
    W* wrow = weights + at.elem;
    float* mrow = master ? master + at.elem : nullptr;

    float w[CHUNKS][N], m1[CHUNKS][N], m2[CHUNKS][N], g[CHUNKS][N], first[CHUNKS][N];
    float before = 0.0f;
    if (!seg.split) {
        if (at.vec_w) {
#pragma unroll
            for (int c = 0; c < CHUNKS; ++c) {
                const int d0 = c * chunk + lane * N;
#pragma unroll
                for (int k = 0; k < N; ++k) w[c][k] = m1[c][k] = m2[c][k] = 0.0f;
                if (d0 < D) {
                    if (mrow) read_floats<QF, N>(sh, stage, S::ROW + c * QF, w[c]);
                    else read_weights<W, N>(sh, stage, S::ROW + c * QF, w[c]);
                    if constexpr (OPT == OPT_ADAM) {
                        read_floats<QF, N>(sh, stage, S::M1 + c * QF, m1[c]);
                        read_floats<QF, N>(sh, stage, S::M2 + c * QF, m2[c]);
                    }
                }
            }
            if constexpr (OPT == OPT_ADAGRAD) before = __int_as_float(sh.word[stage][S::SUM][t]);
        } else {
            load_row<W, OPT, CHUNKS, N>(wrow, mrow, state1, state2, (long long)seg.key, at.elem, D, lane, lanes, false,
                                        w, m1, m2, before);
        }
    }
    long long goff;
    float scale;
    bag_gradient(seg.bag, batch_size, grad_stride, output_offsets, slot_mean, offsets, goff, scale);
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
        const int d0 = c * chunk + lane * N;
#pragma unroll
        for (int k = 0; k < N; ++k) g[c][k] = first[c][k] = 0.0f;
        if (d0 < D) {
            if (at.vec_g) read_floats<QF, N>(sh, stage, S::GRAD + c * QF, first[c]);
            else load_elems<float, N>(grad + goff, d0, D, false, first[c]);
        }
    }
    if (seg.end - seg.begin == 1) {
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
            for (int k = 0; k < N; ++k) g[c][k] += scale * first[c][k];
    } else {
        for (int base = seg.begin; base < seg.end; base += lanes) {
            const int j = base + lane;
            long long joff = 0;
            float jscale = 0.0f;
            if (j < seg.end)
                bag_gradient(base == seg.begin ? sh.word[stage][S::LANE_BAG][t] : sorted_bags[j], batch_size,
                             grad_stride, output_offsets, slot_mean, offsets, joff, jscale);
            if (base == seg.begin)
                add_gradient_rows<CHUNKS, N, true>(grad, joff, jscale, min(lanes, seg.end - base), D, lane, lanes, mask,
                                                   at.vec_g, g, first);
            else
                add_gradient_rows<CHUNKS, N>(grad, joff, jscale, min(lanes, seg.end - base), D, lane, lanes, mask,
                                             at.vec_g, g);
        }
    }

    if (seg.split) {
        const int first_of_run = seg.begin % SEGMENT == 0 ? 0 : 1;
        float* slot = partials + (2 * (long long)(seg.begin / SEGMENT) + first_of_run) * (long long)(CHUNKS * chunk);
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
            const int d0 = c * chunk + lane * N;
            if (d0 < D) store_f32<N>(slot, d0, D, true, g[c]);
        }
        return;
    }
    update_row<W, OPT, CHUNKS, N>(wrow, mrow, state1, state2, (long long)seg.key, at.elem, D, lane, lanes, mask,
                                  at.vec_w, w, m1, m2, g, before, lr, eps, beta1, beta2, bias1, bias2, weight_decay,
                                  stochastic, seed);
}

// Group q of the grid's G groups updates segments q, q + G, q + 2G, ... of the *seg_count listed, as
// sparse_update_runs does, with the copies of the next STAGES - 1 segments in flight.
template <typename W, typename K, int OPT, int CHUNKS>
__device__ __forceinline__ void sparse_update_staged(
    W* __restrict__ weights, float* __restrict__ master, float* __restrict__ state1, float* __restrict__ state2,
    const int* __restrict__ seg_begin, const K* __restrict__ seg_key, const int* __restrict__ seg_bag,
    const unsigned char* __restrict__ seg_split, const int* __restrict__ seg_count, long long max_segments,
    const int* __restrict__ sorted_bags, const long long* __restrict__ offsets,
    const long long* __restrict__ slot_weight_offsets, const long long* __restrict__ slot_row_offsets,
    const long long* __restrict__ output_offsets, const unsigned char* __restrict__ slot_mean,
    const float* __restrict__ grad, float* __restrict__ partials, int num_slots, int batch_size, int log_lanes,
    int weights_aligned, int grad_aligned, float lr, float eps, float beta1, float beta2, float bias1, float bias2,
    float weight_decay, int stochastic, unsigned long long seed) {
    using S = Stage<W, K, OPT, CHUNKS>;
    constexpr int STAGES = S::STAGES;
    static_assert(STAGES >= 2, "a staged kernel needs two stages in a block's shared memory");
    __shared__ StagedShared<K, STAGES, S::QUADS, S::WORDS> sh;
    const int lanes = 1 << log_lanes;
    const int lane = threadIdx.x & (lanes - 1);
    const long long first = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> log_lanes;
    const long long groups = ((long long)gridDim.x * blockDim.x) >> log_lanes;
    if (first >= max_segments) return;
    // Records are read one stage ahead of their copies, so that a group never waits on a record it just asked for.
    Segment<K> ahead = segment_at<K>((int)first, seg_begin, seg_key, seg_bag, seg_split);
    const int count = *seg_count;
    const unsigned int mask = group_mask(lanes);
    const long long grad_stride = output_offsets[num_slots];
    long long next = first;  // the next segment to stage; `ahead` holds its record
#pragma unroll
    for (int p = 0; p < STAGES - 1; ++p) {
        if (next < count)
            stage_segment<W, K, OPT, CHUNKS>(sh, p, ahead, weights, master, state1, state2, sorted_bags,
                                             slot_weight_offsets, slot_row_offsets, output_offsets, grad, grad_stride,
                                             batch_size, lane, lanes, weights_aligned, grad_aligned);
        copy_async_commit();
        next += groups;
        if (next < count) ahead = segment_at<K>((int)next, seg_begin, seg_key, seg_bag, seg_split);
    }
    int stage = 0;
    for (long long i = first; i < count; i += groups) {
        const int fill = stage == 0 ? STAGES - 1 : stage - 1;  // the stage the last segment was updated from
        if (next < count)
            stage_segment<W, K, OPT, CHUNKS>(sh, fill, ahead, weights, master, state1, state2, sorted_bags,
                                             slot_weight_offsets, slot_row_offsets, output_offsets, grad, grad_stride,
                                             batch_size, lane, lanes, weights_aligned, grad_aligned);
        copy_async_commit();
        next += groups;
        if (next < count) ahead = segment_at<K>((int)next, seg_begin, seg_key, seg_bag, seg_split);
        copy_async_wait<STAGES - 1>();
        update_staged_segment<W, K, OPT, CHUNKS>(sh, stage, weights, master, state1, state2, sorted_bags, offsets,
                                                 slot_weight_offsets, slot_row_offsets, output_offsets, slot_mean,
                                                 grad, partials, grad_stride, batch_size, lane, lanes, mask,
                                                 weights_aligned, grad_aligned, lr, eps, beta1, beta2, bias1, bias2,
                                                 weight_decay, stochastic, seed);
        stage = stage + 1 == STAGES ? 0 : stage + 1;
    }
    copy_async_wait<0>();  // no copy outlives the block
}

#define SPARSE_UPDATE_STAGED(NAME, W, K, OPT, CHUNKS, MIN_BLOCKS)                                       \
    extern "C" __global__ void __launch_bounds__(STAGED_BLOCK, MIN_BLOCKS) NAME(                        \
        W* weights, float* master, float* state1, float* state2, const int* seg_begin, const K* seg_key, \
        const int* seg_bag, const unsigned char* seg_split, const int* seg_count, long long max_segments, \
        const int* sorted_bags, const long long* offsets, const long long* slot_weight_offsets,         \
        const long long* slot_row_offsets, const long long* output_offsets,                             \
        const unsigned char* slot_mean, const float* grad, float* partials, int num_slots,              \
        int batch_size, int log_lanes, int weights_aligned, int grad_aligned, float lr, float eps,      \
        float beta1, float beta2, float bias1, float bias2, float weight_decay, int stochastic,          \
        unsigned long long seed) {                                                                      \
        sparse_update_staged<W, K, OPT, CHUNKS>(weights, master, state1, state2, seg_begin, seg_key,    \
                                                seg_bag, seg_split, seg_count, max_segments, sorted_bags, \
                                                offsets, slot_weight_offsets, slot_row_offsets,         \
                                                output_offsets, slot_mean, grad, partials, num_slots,   \
                                                batch_size, log_lanes, weights_aligned, grad_aligned,   \
                                                lr, eps, beta1, beta2, bias1, bias2, weight_decay,      \
                                                stochastic, seed);                                      \
    }

// Names as the capped kernels': sparse_update_staged_<optimizer>_<weights dtype>_<key type>_c<chunks>, for the row
// shapes whose two stages fit a block's static shared memory (launcher.STAGED_SHAPES), each bounded to the most
// resident blocks whose registers hold it without spilling (ptxas of CUDA 13.0 for sm_90), by key type.
#define STAGED(OPTNAME, OPT, WNAME, W, CHUNKS, MIN_BLOCKS_I32, MIN_BLOCKS_I64)                          \
    SPARSE_UPDATE_STAGED(sparse_update_staged_##OPTNAME##_##WNAME##_i32_c##CHUNKS, W, int, OPT, CHUNKS, \
                         MIN_BLOCKS_I32)                                                                \
    SPARSE_UPDATE_STAGED(sparse_update_staged_##OPTNAME##_##WNAME##_i64_c##CHUNKS, W, long long, OPT, CHUNKS, \
                         MIN_BLOCKS_I64)

STAGED(sgd, OPT_SGD, f32, float, 1, 4, 4)
STAGED(sgd, OPT_SGD, f32, float, 2, 2, 2)
STAGED(sgd, OPT_SGD, f16, f16, 1, 2, 2)
STAGED(sgd, OPT_SGD, bf16, bf16, 1, 2, 2)
STAGED(adagrad, OPT_ADAGRAD, f32, float, 1, 4, 3)
STAGED(adagrad, OPT_ADAGRAD, f32, float, 2, 2, 2)
STAGED(adagrad, OPT_ADAGRAD, f16, f16, 1, 2, 2)
STAGED(adagrad, OPT_ADAGRAD, bf16, bf16, 1, 2, 2)
STAGED(adam, OPT_ADAM, f32, float, 1, 3, 3)
