// The fused update per segment: candidates to embedding_backward.cu's sparse_update, the same sums and
// updates (see there and embedding_update.cuh) scheduled another way; launcher.UPDATE_KERNELS picks one.
// Instantiated in embedding_update_runs.cu (the segment lists, the singles' kernels and the capped ones, which
// training runs) and embedding_update_runs_uncapped.cu (the uncapped candidates): a run compiles only the first.
//
// sparse_update puts a thread group on every sorted position. Only the first position of a segment
// works; the group walks a chain of dependent global loads: its key, the binary search of the key's
// table, the bags of the segment (after comparing keys to find its end), and only then the gradient
// rows; the row and its state travel meanwhile. Here the segments are listed first, on the device:
//
// 1. count_segments: per block of sorted positions, how many segments start there.
// 2. (host) torch.cumsum of those counts, on the device: where each block's segments go in the list;
//    its last entry is how many segments there are, which only the device reads (no host sync).
// 3. compact_segments: one record per segment, in position order: its first position (segment i
//    spans seg_begin[i] .. seg_begin[i + 1]), its key, the bag of its first position, and whether it
//    holds part of a longer run (it then stores its partial sum for sparse_update_long, as in
//    sparse_update, in the same slot).
// 4. sparse_update_runs: groups take segments from the list, one after another (i, i + groups, ...):
//
//    - no group is spent on a position inside a segment (in a Zipf-skewed 20-hot batch five groups
//      of six only read two keys and leave, and a block waits for its slowest group), and no group
//      compares keys to find where its segment ends;
//    - the record carries what the row's loads need: the row's slot, hence its table, dim and first
//      row, comes from its first bag through small cached per-slot arrays (no binary search), so one
//      global load (the record) stands before the row, its state and the first gradient row, which
//      are issued together, where sparse_update waits on three in a row (its key, the keys and bags
//      of its segment, the gradient rows); a segment of one position (most rows of a uniform batch)
//      loads no bag and shuffles nothing;
//    - a group loads the next segment's record while it updates this one, so when the grid holds
//      only as many groups as the GPU keeps resident (the launcher's looped candidates), the record
//      is in registers when the group gets to it: the data loads are the only global latency left per
//      segment, and no block is launched for nothing;
//    - MIN_BLOCKS (__launch_bounds__) caps the registers so that more groups are resident;
//    - the launcher may give a row half the lanes (two 16-byte vectors each, CHUNKS = 2), so that a
//      warp updates two rows at once and issues the per-row instructions (slot and offset
//      arithmetic, the Adagrad reduction's shuffles, loop control) once for both.
//
// The sums are those of sparse_update: the same segments, their gradient rows added in position order
// two at a time, one owner per row, no atomics (with two vectors a lane, a row's Adagrad sum of
// squares adds its terms in another order).
#pragma once

#include "embedding_update.cuh"

// Whether a segment starts at sorted position p (< nnz): a run of equal keys starts there, or p is a
// multiple of SEGMENT.
template <typename K>
__device__ __forceinline__ bool segment_starts(const K* __restrict__ sorted_keys, long long p) {
    return p % SEGMENT == 0 || sorted_keys[p - 1] != sorted_keys[p];
}

// Where a flagged position of a block goes in its list: `before` (the entries of the blocks before it) plus the
// flagged positions before it in its block. ballot: its warp's flags; warp_counts: each warp's count of flags, written
// by its lane 0 before a __syncthreads.
__device__ __forceinline__ int list_index(int before, unsigned int ballot, const int* warp_counts) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int i = before + __popc(ballot & ((1u << lane) - 1u));
    for (int w = 0; w < warp; ++w) i += warp_counts[w];
    return i;
}

// Whether the segment that starts at sorted position p holds part of a longer run (it stores its partial sum for
// sparse_update_long): its run started before p, or goes on past the segment's SEGMENT-aligned end.
template <typename K>
__device__ __forceinline__ bool segment_split(const K* __restrict__ sorted_keys, long long nnz, long long p) {
    const K key = sorted_keys[p];
    const long long limit = min(nnz, (p / SEGMENT + 1) * SEGMENT);
    return (p > 0 && sorted_keys[p - 1] == key) || (limit < nnz && sorted_keys[limit] == key);
}

template <typename K>
__device__ __forceinline__ void count_segments(const K* __restrict__ sorted_keys, long long nnz,
                                               int* __restrict__ block_counts) {
    const long long p = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int starts = __syncthreads_count(p < nnz && segment_starts<K>(sorted_keys, p));
    if (threadIdx.x == 0) block_counts[blockIdx.x] = starts;
}

// block_ends: the inclusive cumulative sum of count_segments' counts (same blocks of positions).
template <typename K>
__device__ __forceinline__ void compact_segments(
    const K* __restrict__ sorted_keys, const int* __restrict__ sorted_bags, long long nnz,
    const int* __restrict__ block_ends, int* __restrict__ seg_begin, K* __restrict__ seg_key,
    int* __restrict__ seg_bag, unsigned char* __restrict__ seg_split) {
    __shared__ int warp_starts[32];
    const long long p = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const bool start = p < nnz && segment_starts<K>(sorted_keys, p);
    const unsigned int ballot = __ballot_sync(0xffffffffu, start);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) warp_starts[warp] = __popc(ballot);
    __syncthreads();
    if (p == nnz - 1) seg_begin[block_ends[blockIdx.x]] = (int)nnz;  // where the last segment ends
    if (!start) return;
    const int i = list_index(blockIdx.x ? block_ends[blockIdx.x - 1] : 0, ballot, warp_starts);
    seg_begin[i] = (int)p;
    seg_key[i] = sorted_keys[p];
    seg_bag[i] = sorted_bags[p];
    seg_split[i] = segment_split<K>(sorted_keys, nnz, p);
}

#define SEGMENT_LIST(SUFFIX, K)                                                                         \
    extern "C" __global__ void count_segments_##SUFFIX(const K* sorted_keys, long long nnz,            \
                                                        int* block_counts) {                            \
        count_segments<K>(sorted_keys, nnz, block_counts);                                              \
    }                                                                                                   \
    extern "C" __global__ void compact_segments_##SUFFIX(                                               \
        const K* sorted_keys, const int* sorted_bags, long long nnz, const int* block_ends,             \
        int* seg_begin, K* seg_key, int* seg_bag, unsigned char* seg_split) {                           \
        compact_segments<K>(sorted_keys, sorted_bags, nnz, block_ends, seg_begin, seg_key, seg_bag,     \
                            seg_split);                                                                 \
    }


template <typename K>
struct Segment {
    int begin, end, bag;
    K key;
    bool split;
};

// A listed segment's record. APART: the list holds only some segments (compact_segments_apart), so each
// record's end is its own (seg_end) rather than the next record's start.
template <typename K, bool APART = false>
__device__ __forceinline__ Segment<K> segment_at(int i, const int* __restrict__ seg_begin,
                                                 const int* __restrict__ seg_end, const K* __restrict__ seg_key,
                                                 const int* __restrict__ seg_bag,
                                                 const unsigned char* __restrict__ seg_split) {
    return Segment<K>{seg_begin[i], APART ? seg_end[i] : seg_begin[i + 1], seg_bag[i], seg_key[i], seg_split[i] != 0};
}

// Sums one segment's gradient rows and updates its row (or stores the partial sum of a longer run). SINGLE: the
// segment is known to be the one occurrence of its row (no code for longer segments is compiled).
template <typename W, typename K, int OPT, int CHUNKS, bool SINGLE = false>
__device__ __forceinline__ void update_segment(
    const Segment<K>& seg, W* __restrict__ weights, float* __restrict__ master, float* __restrict__ state1,
    float* __restrict__ state2, const int* __restrict__ sorted_bags, const long long* __restrict__ offsets,
    const long long* __restrict__ slot_weight_offsets, const long long* __restrict__ slot_row_offsets,
    const long long* __restrict__ output_offsets, const unsigned char* __restrict__ slot_mean,
    const void* __restrict__ grad, float* __restrict__ partials, long long grad_stride, int batch_size, int lane,
    int lanes, unsigned int mask, int weights_aligned, int grad_aligned, int grad_bf16, float lr, float eps,
    float beta1, float beta2, float bias1, float bias2, float weight_decay, int stochastic, unsigned long long seed) {
    constexpr int N = Vec<W>::N;
    const int s = seg.bag / batch_size;  // every bag of a segment is of a slot of the row's table
    const int D = (int)(output_offsets[s + 1] - output_offsets[s]);
    const long long elem = slot_weight_offsets[s] + ((long long)seg.key - slot_row_offsets[s]) * D;
    const bool vec_w = weights_aligned && (elem % N == 0) && (D % N == 0);
    const bool vec_g = grad_aligned && (D % N == 0);
    const int chunk = lanes * N;
    W* wrow = weights + elem;
    float* mrow = master ? master + elem : nullptr;

    float w[CHUNKS][N], m1[CHUNKS][N], m2[CHUNKS][N], g[CHUNKS][N];
    float before = 0.0f;
    if (SINGLE || !seg.split)
        load_row<W, OPT, CHUNKS, N>(wrow, mrow, state1, state2, (long long)seg.key, elem, D, lane, lanes, vec_w, w, m1,
                                    m2, before);
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
        for (int k = 0; k < N; ++k) g[c][k] = 0.0f;
    if (SINGLE || seg.end - seg.begin == 1) {
        // One occurrence (most rows of a uniform batch): every lane finds the gradient row from the record,
        // no bag is loaded or shuffled.
        long long goff;
        float scale;
        bag_gradient(seg.bag, batch_size, grad_stride, output_offsets, slot_mean, offsets, goff, scale);
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
            const int d0 = c * chunk + lane * N;
            if (d0 < D) {
                float v[N];
                load_grad<N>(grad, goff, d0, D, vec_g, grad_bf16, v);
#pragma unroll
                for (int k = 0; k < N; ++k) g[c][k] += scale * v[k];
            }
        }
    } else {
        for (int base = seg.begin; base < seg.end; base += lanes) {
            const int j = base + lane;
            long long goff = 0;
            float scale = 0.0f;
            if (j < seg.end)
                bag_gradient(j == seg.begin ? seg.bag : sorted_bags[j], batch_size, grad_stride, output_offsets,
                             slot_mean, offsets, goff, scale);
            add_gradient_rows<CHUNKS, N>(grad, goff, scale, min(lanes, seg.end - base), D, lane, lanes, mask, vec_g,
                                         grad_bf16, g);
        }
    }

    if (!SINGLE && seg.split) {
        const int first_of_run = seg.begin % SEGMENT == 0 ? 0 : 1;
        float* slot = partials + (2 * (long long)(seg.begin / SEGMENT) + first_of_run) * (long long)(CHUNKS * chunk);
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
            const int d0 = c * chunk + lane * N;
            if (d0 < D) store_f32<N>(slot, d0, D, true, g[c]);
        }
        return;
    }
    update_row<W, OPT, CHUNKS, N>(wrow, mrow, state1, state2, (long long)seg.key, elem, D, lane, lanes, mask, vec_w, w,
                                  m1, m2, g, before, lr, eps, beta1, beta2, bias1, bias2, weight_decay, stochastic,
                                  seed);
}

// Group q of the grid's G groups updates segments q, q + G, q + 2G, ... of the *seg_count listed,
// loading each next record before it updates the current segment. max_segments (nnz) bounds the list.
// APART: the list is compact_segments_apart's segments of more than one occurrence, seg_end their ends.
template <typename W, typename K, int OPT, int CHUNKS, bool APART = false>
__device__ __forceinline__ void sparse_update_runs(
    W* __restrict__ weights, float* __restrict__ master, float* __restrict__ state1, float* __restrict__ state2,
    const int* __restrict__ seg_begin, const int* __restrict__ seg_end, const K* __restrict__ seg_key,
    const int* __restrict__ seg_bag,
    const unsigned char* __restrict__ seg_split, const int* __restrict__ seg_count, long long max_segments,
    const int* __restrict__ sorted_bags, const long long* __restrict__ offsets,
    const long long* __restrict__ slot_weight_offsets, const long long* __restrict__ slot_row_offsets,
    const long long* __restrict__ output_offsets, const unsigned char* __restrict__ slot_mean,
    const void* __restrict__ grad, long long grad_stride, float* __restrict__ partials, int batch_size, int log_lanes,
    int weights_aligned, int grad_aligned, int grad_bf16, float lr, float eps, float beta1, float beta2,
    float bias1, float bias2, float weight_decay, int stochastic, unsigned long long seed) {
    const int lanes = 1 << log_lanes;
    const int lane = threadIdx.x & (lanes - 1);
    const long long first = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> log_lanes;
    const long long groups = ((long long)gridDim.x * blockDim.x) >> log_lanes;
    if (first >= max_segments) return;
    // The first record is loaded before the count is known: the list is allocated for max_segments.
    Segment<K> seg = segment_at<K, APART>((int)first, seg_begin, seg_end, seg_key, seg_bag, seg_split);
    const int count = *seg_count;
    const unsigned int mask = group_mask(lanes);
    for (long long i = first; i < count; i += groups) {
        Segment<K> next = seg;
        if (i + groups < count)
            next = segment_at<K, APART>((int)(i + groups), seg_begin, seg_end, seg_key, seg_bag, seg_split);
        update_segment<W, K, OPT, CHUNKS>(seg, weights, master, state1, state2, sorted_bags, offsets,
                                          slot_weight_offsets, slot_row_offsets, output_offsets, slot_mean, grad,
                                          partials, grad_stride, batch_size, lane, lanes, mask, weights_aligned,
                                          grad_aligned, grad_bf16, lr, eps, beta1, beta2, bias1, bias2, weight_decay,
                                          stochastic, seed);
        seg = next;
    }
}

#define SPARSE_UPDATE_RUNS(NAME, W, K, OPT, CHUNKS, MIN_BLOCKS)                                         \
    extern "C" __global__ void __launch_bounds__(256, MIN_BLOCKS) NAME(                                 \
        W* weights, float* master, float* state1, float* state2, const int* seg_begin, const K* seg_key, \
        const int* seg_bag, const unsigned char* seg_split, const int* seg_count, long long max_segments, \
        const int* sorted_bags, const long long* offsets, const long long* slot_weight_offsets,         \
        const long long* slot_row_offsets, const long long* output_offsets,                             \
        const unsigned char* slot_mean, const void* grad, long long grad_stride, float* partials,       \
        int batch_size, int log_lanes, int weights_aligned, int grad_aligned,                           \
        int grad_bf16, float lr, float eps, float beta1, float beta2, float bias1, float bias2,         \
        float weight_decay, int stochastic, unsigned long long seed) {                                  \
        sparse_update_runs<W, K, OPT, CHUNKS>(weights, master, state1, state2, seg_begin, nullptr,      \
                                              seg_key, seg_bag, seg_split, seg_count, max_segments,     \
                                              sorted_bags, offsets, slot_weight_offsets,                \
                                              slot_row_offsets, output_offsets, slot_mean, grad,        \
                                              grad_stride, partials, batch_size, log_lanes,             \
                                              weights_aligned, grad_aligned, grad_bf16, lr, eps, beta1, \
                                              beta2, bias1, bias2, weight_decay, stochastic, seed);     \
    }

// Names: sparse_update_runs[_capped]_<optimizer>_<weights dtype>_<key type>_c<chunks>: c1 and c2 (a row
// in one or two vectors per lane), and the wide rows of sparse_update (c4 for fp32, c2 for 16-bit).
#define SPARSE_UPDATE_RUNS_KEYS(PREFIX, OPTNAME, OPT, WNAME, W, CHUNKS, MIN_BLOCKS)                     \
    SPARSE_UPDATE_RUNS(PREFIX##_##OPTNAME##_##WNAME##_i32_c##CHUNKS, W, int, OPT, CHUNKS, MIN_BLOCKS)   \
    SPARSE_UPDATE_RUNS(PREFIX##_##OPTNAME##_##WNAME##_i64_c##CHUNKS, W, long long, OPT, CHUNKS, MIN_BLOCKS)

// The segments of one occurrence apart (singles_apart, the update training runs). A row that occurs once in a batch
// (nearly every row of a uniform batch) needs no loop over gradient rows, no shuffle and no partial sum. Listed apart
// from the other segments, such rows get a lean kernel (sparse_update_singles) whose few registers keep more groups
// resident than the capped loop (6 blocks of fp32 SGD or Adagrad rows against 4), each group looping over the singles
// with the next record loaded ahead; the other segments go to the capped loop over a list of their own (one loop
// over one list that skipped the other kind would wait on a record for every segment it skipped).

// Whether sorted position p (< nnz) holds the only occurrence of its key.
template <typename K>
__device__ __forceinline__ bool single_at(const K* __restrict__ sorted_keys, long long nnz, long long p) {
    const K key = sorted_keys[p];
    return (p == 0 || sorted_keys[p - 1] != key) && (p + 1 == nnz || sorted_keys[p + 1] != key);
}

// Per block of sorted positions: block_counts[block] singles start there, block_counts[blocks + block] other segments.
template <typename K>
__device__ __forceinline__ void count_segments_apart(const K* __restrict__ sorted_keys, long long nnz,
                                                     int* __restrict__ block_counts) {
    const long long p = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const bool start = p < nnz && segment_starts<K>(sorted_keys, p);
    const bool single = start && single_at<K>(sorted_keys, nnz, p);
    const int singles = __syncthreads_count(single);
    const int others = __syncthreads_count(start && !single);
    if (threadIdx.x == 0) {
        block_counts[blockIdx.x] = singles;
        block_counts[gridDim.x + blockIdx.x] = others;
    }
}

// Where the segment that starts at sorted position p ends: the next segment start of its block (a segment never
// crosses a multiple of SEGMENT, and a block's size is one), else the end of its SEGMENT-aligned span or of the ids.
// starts: each warp's ballot of the block's segment starts, from shared memory.
__device__ __forceinline__ long long segment_end(long long p, long long nnz, const unsigned int* starts) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long warp_base = p - lane;
    long long end = min(nnz, (p / SEGMENT + 1) * SEGMENT);
    const unsigned int later = starts[warp] & ~((2u << lane) - 1u);
    if (later) return min(end, warp_base + __ffs(later) - 1);
    for (int w = warp + 1; w < (int)(blockDim.x >> 5) && warp_base + 32 * (w - warp) < end; ++w)
        if (starts[w]) return min(end, warp_base + 32 * (w - warp) + __ffs(starts[w]) - 1);
    return end;
}

// block_ends: count_segments_apart's counts, each half summed inclusively. Singles: their key and bag; the
// others: as compact_segments' records, with their own ends. Blocks of a multiple of SEGMENT positions.
template <typename K>
__device__ __forceinline__ void compact_segments_apart(
    const K* __restrict__ sorted_keys, const int* __restrict__ sorted_bags, long long nnz,
    const int* __restrict__ block_ends, K* __restrict__ single_key, int* __restrict__ single_bag,
    int* __restrict__ seg_begin, int* __restrict__ seg_end, K* __restrict__ seg_key, int* __restrict__ seg_bag,
    unsigned char* __restrict__ seg_split) {
    __shared__ int warp_counts[2][32];
    __shared__ unsigned int warp_starts[32];
    const long long p = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const bool start = p < nnz && segment_starts<K>(sorted_keys, p);
    const bool single = start && single_at<K>(sorted_keys, nnz, p);
    const unsigned int singles = __ballot_sync(0xffffffffu, single);
    const unsigned int others = __ballot_sync(0xffffffffu, start && !single);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) {
        warp_counts[0][warp] = __popc(singles);
        warp_counts[1][warp] = __popc(others);
        warp_starts[warp] = singles | others;
    }
    __syncthreads();
    if (!start) return;
    const int kind = single ? 0 : 1;
    const long long half = (long long)kind * gridDim.x;
    const int i = list_index(blockIdx.x ? block_ends[half + blockIdx.x - 1] : 0, single ? singles : others,
                             warp_counts[kind]);
    const K key = sorted_keys[p];
    if (single) {
        single_key[i] = key;
        single_bag[i] = sorted_bags[p];
        return;
    }
    seg_begin[i] = (int)p;
    seg_end[i] = (int)segment_end(p, nnz, warp_starts);
    seg_key[i] = key;
    seg_bag[i] = sorted_bags[p];
    seg_split[i] = segment_split<K>(sorted_keys, nnz, p);
}

#define SEGMENT_LIST_APART(SUFFIX, K)                                                                   \
    extern "C" __global__ void count_segments_apart_##SUFFIX(const K* sorted_keys, long long nnz,      \
                                                              int* block_counts) {                      \
        count_segments_apart<K>(sorted_keys, nnz, block_counts);                                        \
    }                                                                                                   \
    extern "C" __global__ void compact_segments_apart_##SUFFIX(                                         \
        const K* sorted_keys, const int* sorted_bags, long long nnz, const int* block_ends,             \
        K* single_key, int* single_bag, int* seg_begin, int* seg_end, K* seg_key, int* seg_bag,         \
        unsigned char* seg_split) {                                                                     \
        compact_segments_apart<K>(sorted_keys, sorted_bags, nnz, block_ends, single_key, single_bag,    \
                                  seg_begin, seg_end, seg_key, seg_bag, seg_split);                     \
    }

// Group q of the grid's G groups updates singles q, q + G, q + 2G, ... of the *single_count listed, loading each
// next record before it updates the current row. Rows that one pass of lanes covers.
template <typename W, typename K, int OPT>
__device__ __forceinline__ void sparse_update_singles(
    W* __restrict__ weights, float* __restrict__ master, float* __restrict__ state1, float* __restrict__ state2,
    const K* __restrict__ single_key, const int* __restrict__ single_bag, const int* __restrict__ single_count,
    long long max_segments, const long long* __restrict__ offsets, const long long* __restrict__ slot_weight_offsets,
    const long long* __restrict__ slot_row_offsets, const long long* __restrict__ output_offsets,
    const unsigned char* __restrict__ slot_mean, const void* __restrict__ grad, long long grad_stride, int batch_size,
    int log_lanes, int weights_aligned, int grad_aligned, int grad_bf16, float lr, float eps,
    float beta1, float beta2, float bias1, float bias2, float weight_decay, int stochastic, unsigned long long seed) {
    // 32-bit positions (the list holds fewer than 2**31 ids' segments) and nothing kept that a loop can
    // reload from the cache: registers are what bound the resident groups here.
    const int lanes = 1 << log_lanes;
    const int lane = threadIdx.x & (lanes - 1);
    const int first = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> log_lanes);
    const int groups = (int)((gridDim.x * blockDim.x) >> log_lanes);
    if (first >= max_segments) return;
    K key = single_key[first];  // the list is allocated for max_segments: loaded before the count is known
    int bag = single_bag[first];
    const int count = *single_count;
    for (int i = first; i < count; i += groups) {
        K next_key = key;
        int next_bag = bag;
        if (i < count - groups) {
            next_key = single_key[i + groups];
            next_bag = single_bag[i + groups];
        }
        update_segment<W, K, OPT, 1, true>(Segment<K>{0, 1, bag, key, false}, weights, master, state1, state2, nullptr,
                                           offsets, slot_weight_offsets, slot_row_offsets, output_offsets, slot_mean,
                                           grad, nullptr, grad_stride, batch_size, lane, lanes, group_mask(lanes),
                                           weights_aligned, grad_aligned, grad_bf16, lr, eps, beta1, beta2, bias1,
                                           bias2, weight_decay, stochastic, seed);
        key = next_key;
        bag = next_bag;
    }
}

#define SPARSE_UPDATE_SINGLES(NAME, W, K, OPT, MIN_BLOCKS)                                              \
    extern "C" __global__ void __launch_bounds__(256, MIN_BLOCKS) NAME(                                 \
        W* weights, float* master, float* state1, float* state2, const K* single_key,                   \
        const int* single_bag, const int* single_count, long long max_segments,                         \
        const long long* offsets, const long long* slot_weight_offsets,                                 \
        const long long* slot_row_offsets, const long long* output_offsets,                             \
        const unsigned char* slot_mean, const void* grad, long long grad_stride,                        \
        int batch_size, int log_lanes, int weights_aligned, int grad_aligned, int grad_bf16, float lr,  \
        float eps, float beta1, float beta2, float bias1, float bias2, float weight_decay,              \
        int stochastic, unsigned long long seed) {                                                      \
        sparse_update_singles<W, K, OPT>(weights, master, state1, state2, single_key, single_bag,       \
                                         single_count, max_segments, offsets, slot_weight_offsets,      \
                                         slot_row_offsets, output_offsets, slot_mean, grad,             \
                                         grad_stride, batch_size, log_lanes,                            \
                                         weights_aligned, grad_aligned, grad_bf16, lr, eps, beta1,      \
                                         beta2, bias1, bias2, weight_decay, stochastic, seed);          \
    }

// The capped loop over the list of the other segments.
#define SPARSE_UPDATE_RUNS_APART(NAME, W, K, OPT, MIN_BLOCKS)                                           \
    extern "C" __global__ void __launch_bounds__(256, MIN_BLOCKS) NAME(                                 \
        W* weights, float* master, float* state1, float* state2, const int* seg_begin,                  \
        const int* seg_end, const K* seg_key, const int* seg_bag, const unsigned char* seg_split,       \
        const int* seg_count, long long max_segments, const int* sorted_bags,                           \
        const long long* offsets, const long long* slot_weight_offsets,                                 \
        const long long* slot_row_offsets, const long long* output_offsets,                             \
        const unsigned char* slot_mean, const void* grad, long long grad_stride, float* partials,       \
        int batch_size, int log_lanes, int weights_aligned, int grad_aligned,                           \
        int grad_bf16, float lr, float eps, float beta1, float beta2, float bias1, float bias2,         \
        float weight_decay, int stochastic, unsigned long long seed) {                                  \
        sparse_update_runs<W, K, OPT, 1, true>(weights, master, state1, state2, seg_begin, seg_end,     \
                                               seg_key, seg_bag, seg_split, seg_count, max_segments,    \
                                               sorted_bags, offsets, slot_weight_offsets,               \
                                               slot_row_offsets, output_offsets, slot_mean, grad,       \
                                               grad_stride, partials, batch_size, log_lanes,            \
                                               weights_aligned, grad_aligned, grad_bf16, lr, eps,       \
                                               beta1, beta2, bias1, bias2, weight_decay, stochastic,    \
                                               seed);                                                   \
    }
