// A stable LSD radix sort of (key, 32-bit value) pairs over the low `key_bits` bits of non-negative keys.
//
// Why not torch.sort: it sorts a key with its int64 position over every bit of the key type, and a caller
// that wants its own values sorted gathers them by position afterwards (a random read of each). The embedding
// backward sorts row keys of at most 27 bits (a hundred million rows) with the int32 bag of each id: here the
// bag travels with its key, 4 bytes instead of 8, over 3 passes of up to 9 bits instead of 4 of 8, and no
// gather follows.
//
// Each pass sorts by one digit of DIGIT bits, in two kernels around a cumulative sum (torch, on the device):
//
// 1. radix_histogram: per tile of TILE consecutive keys, how many keys hold each digit, stored digit-major
//    (counts[digit * tiles + tile]).
// 2. (host) torch.cumsum of those counts: the end, in the output, of each (digit, tile)'s keys.
// 3. radix_scatter: each tile again. A warp ranks its keys 32 at a time, in position order: keys with the same
//    digit find each other (__match_any_sync), each takes its place among them after the warp's earlier keys
//    of that digit. The block then orders its tile by digit in shared memory (warps in order within a digit)
//    and writes it out, consecutive threads to consecutive places of a digit's run: the stores of a run are
//    coalesced. Equal digits keep their order (warp, then round, then lane is position order), so the sort
//    is stable and the result does not depend on scheduling.
#define SORT_THREADS 256
#define SORT_WARPS (SORT_THREADS / 32)
#define MAX_DIGIT_BITS 9
#define MAX_RADIX (1 << MAX_DIGIT_BITS)
#define DIGITS_PER_THREAD (MAX_RADIX / SORT_THREADS)

// Keys a thread holds: a tile is SORT_THREADS * ITEMS keys (4096 of int32, 2048 of int64: the tile's keys
// and values are staged in shared memory).
template <typename K> struct Tile { static constexpr int ITEMS = sizeof(K) == 4 ? 16 : 8; };

template <typename K>
__device__ __forceinline__ unsigned int digit_of(K key, int shift, unsigned int mask) {
    return (unsigned int)((unsigned long long)key >> shift) & mask;
}

template <typename K>
__device__ __forceinline__ void radix_histogram(const K* __restrict__ keys, long long n, int shift, int bits,
                                                int tiles, int* __restrict__ counts) {
    constexpr int ITEMS = Tile<K>::ITEMS;
    __shared__ int hist[MAX_RADIX];
    const int radix = 1 << bits;
    const unsigned int mask = radix - 1;
    for (int d = threadIdx.x; d < radix; d += SORT_THREADS) hist[d] = 0;
    __syncthreads();
    const long long base = (long long)blockIdx.x * (SORT_THREADS * ITEMS);
    const unsigned int lt = (1u << (threadIdx.x & 31)) - 1u;
#pragma unroll 4
    for (int i = 0; i < ITEMS; ++i) {
        const long long p = base + i * SORT_THREADS + threadIdx.x;
        const unsigned int d = p < n ? digit_of<K>(keys[p], shift, mask) : MAX_RADIX;
        // one shared-memory add per distinct digit of the warp: skewed keys do not queue on one counter
        const unsigned int peers = __match_any_sync(0xffffffffu, d);
        if (d != MAX_RADIX && (peers & lt) == 0) atomicAdd(&hist[d], __popc(peers));
    }
    __syncthreads();
    for (int d = threadIdx.x; d < radix; d += SORT_THREADS) counts[(long long)d * tiles + blockIdx.x] = hist[d];
}

// Exclusive scan of the block's MAX_RADIX values, DIGITS_PER_THREAD consecutive ones a thread; `warp_sums` is
// SORT_WARPS ints of shared memory.
__device__ __forceinline__ void block_exclusive_scan(int (&v)[DIGITS_PER_THREAD], int* warp_sums) {
    int total = 0;
#pragma unroll
    for (int k = 0; k < DIGITS_PER_THREAD; ++k) {
        const int x = v[k];
        v[k] = total;
        total += x;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int inclusive = total;
#pragma unroll
    for (int s = 1; s < 32; s <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, inclusive, s);
        if (lane >= s) inclusive += y;
    }
    if (lane == 31) warp_sums[warp] = inclusive;
    __syncthreads();
    int before = inclusive - total;
    for (int w = 0; w < warp; ++w) before += warp_sums[w];
#pragma unroll
    for (int k = 0; k < DIGITS_PER_THREAD; ++k) v[k] += before;
}

// ends: the inclusive cumulative sum of radix_histogram's counts of this pass (same tiles).
template <typename K>
__device__ __forceinline__ void radix_scatter(const K* __restrict__ keys_in, const int* __restrict__ values_in,
                                              long long n, int shift, int bits, int tiles,
                                              const int* __restrict__ counts, const int* __restrict__ ends,
                                              K* __restrict__ keys_out, int* __restrict__ values_out) {
    constexpr int ITEMS = Tile<K>::ITEMS;
    constexpr int TILE = SORT_THREADS * ITEMS;
    // A warp's keys of each digit, then where they go in the tile's order; once each key knows its place, the
    // same memory stages the tile in that order.
    union Shared {
        int warp_digit[SORT_WARPS][MAX_RADIX];
        struct {
            K keys[TILE];
            int values[TILE];
        } staged;
    };
    __shared__ Shared shared;
    __shared__ int to_output[MAX_RADIX];  // the output position of a digit's place 0 in the tile's order
    __shared__ int warp_sums[SORT_WARPS];
    int (&warp_digit)[SORT_WARPS][MAX_RADIX] = shared.warp_digit;
    const int radix = 1 << bits;
    const unsigned int mask = radix - 1;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int i = threadIdx.x; i < SORT_WARPS * MAX_RADIX; i += SORT_THREADS) (&warp_digit[0][0])[i] = 0;
    const long long tile_start = (long long)blockIdx.x * TILE;
    const long long base = tile_start + (long long)warp * (TILE / SORT_WARPS);
    K key[ITEMS];
    int value[ITEMS], place[ITEMS];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const long long p = base + i * 32 + lane;
        key[i] = p < n ? keys_in[p] : (K)0;
        value[i] = p < n ? values_in[p] : 0;
    }
    __syncthreads();
    const unsigned int lt = (1u << lane) - 1u;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const bool in = base + i * 32 + lane < n;  // the keys past n are the warp's last ones: they rank no key
        const unsigned int d = in ? digit_of<K>(key[i], shift, mask) : MAX_RADIX;
        const unsigned int peers = __match_any_sync(0xffffffffu, d);
        place[i] = in ? warp_digit[warp][d] + __popc(peers & lt) : 0;
        __syncwarp();
        if (in && (peers & lt) == 0) warp_digit[warp][d] += __popc(peers);
        __syncwarp();
    }
    __syncthreads();
    // Per digit: the warps' counts become their first places in the tile's order (digits in order, warps in
    // order within a digit), and to_output maps a place of that digit to its output position.
    int first[DIGITS_PER_THREAD];
#pragma unroll
    for (int k = 0; k < DIGITS_PER_THREAD; ++k) {
        const int d = threadIdx.x * DIGITS_PER_THREAD + k;
        first[k] = 0;
        for (int w = 0; w < SORT_WARPS; ++w) first[k] += warp_digit[w][d];
    }
    block_exclusive_scan(first, warp_sums);
#pragma unroll
    for (int k = 0; k < DIGITS_PER_THREAD; ++k) {
        const int d = threadIdx.x * DIGITS_PER_THREAD + k;
        if (d < radix) {
            const long long at = (long long)d * tiles + blockIdx.x;
            to_output[d] = ends[at] - counts[at] - first[k];
        }
        int running = first[k];
        for (int w = 0; w < SORT_WARPS; ++w) {
            const int c = warp_digit[w][d];
            warp_digit[w][d] = running;
            running += c;
        }
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < ITEMS; ++i)
        if (base + i * 32 + lane < n) place[i] += warp_digit[warp][digit_of<K>(key[i], shift, mask)];
    __syncthreads();  // warp_digit is read: its memory now stages the tile
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        if (base + i * 32 + lane < n) {
            shared.staged.keys[place[i]] = key[i];
            shared.staged.values[place[i]] = value[i];
        }
    }
    __syncthreads();
    const int valid = (int)min((long long)TILE, n - tile_start);
    for (int j = threadIdx.x; j < valid; j += SORT_THREADS) {
        const K k = shared.staged.keys[j];
        const int at = to_output[digit_of<K>(k, shift, mask)] + j;
        keys_out[at] = k;
        values_out[at] = shared.staged.values[j];
    }
}

#define RADIX_SORT(SUFFIX, K)                                                                           \
    extern "C" __global__ void __launch_bounds__(SORT_THREADS) radix_histogram_##SUFFIX(               \
        const K* keys, long long n, int shift, int bits, int tiles, int* counts) {                     \
        radix_histogram<K>(keys, n, shift, bits, tiles, counts);                                       \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(SORT_THREADS) radix_scatter_##SUFFIX(                 \
        const K* keys_in, const int* values_in, long long n, int shift, int bits, int tiles,           \
        const int* counts, const int* ends, K* keys_out, int* values_out) {                            \
        radix_scatter<K>(keys_in, values_in, n, shift, bits, tiles, counts, ends, keys_out, values_out); \
    }

RADIX_SORT(i32, int)
RADIX_SORT(i64, long long)
