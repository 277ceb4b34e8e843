// The hash table of embedding ids: find, the placement of a writing call's keys, and row copies.
//
// Layout (docs/HASHTABLE.md): `capacity` = num_buckets * SLOTS slots; per slot a digest byte (0: empty),
// a 64-bit key, a 64-bit score, and a row of `dim` floats in `values` [capacity, dim]. A key's hash
// h = mix64(key) picks its bucket ((h >> 32) * num_buckets >> 32) and its digest (h & 0xff, or 1 when
// that is 0). The plain-torch reference (reference.py) is the same table, operation for operation.
// The tables of a group share one storage: table t holds buckets bucket_starts[t] .. bucket_starts[t + 1] - 1, a
// key given with its table (`tables`, int16) lives among its table's buckets, and the slots a call returns count
// from its table's first; a lone table passes null for both, its buckets being the storage's num_buckets.
// Self-contained (no CUDA headers), so NVRTC compiles it with no include path and nvcc compiles it as is.

#define SLOTS 128       // slots per bucket, as in reference.py
#define FIND_GROUP 8    // threads per key in find_keys: each holds 16 of the bucket's digests
#define COPY_GROUP 8    // threads per row in copy_rows
#define FULL_WARP 0xffffffffu
#define LRU 0           // score policies, as in reference.py
#define LFU 1
#define MAX_SCORE 0x7fffffffffffffffll
#define SIGN_BIT 0x8000000000000000ull  // flipped in a hash, its unsigned order is the signed one

typedef unsigned long long u64;

// MurmurHash3's 64-bit finalizer: a bijection, so distinct keys have distinct hashes.
__device__ __forceinline__ u64 mix64(u64 h) {
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ull;
    h ^= h >> 33;
    return h;
}

__device__ __forceinline__ long long bucket_of(u64 h, long long num_buckets) {
    return (long long)(((h >> 32) * (u64)num_buckets) >> 32);
}

// The buckets of a key's table: the first of the storage and how many.
struct TableBuckets {
    long long first, count;
};

__device__ __forceinline__ TableBuckets table_buckets(const long long* __restrict__ bucket_starts, int table,
                                                      long long num_buckets) {
    if (bucket_starts == nullptr) return {0, num_buckets};
    const long long first = bucket_starts[table];
    return {first, bucket_starts[table + 1] - first};
}

__device__ __forceinline__ unsigned int digest_of(u64 h) {
    const unsigned int low = (unsigned int)(h & 0xffu);
    return low == 0u ? 1u : low;
}

// Bit j set where byte j of `word` equals the byte repeated four times in `target4`: the zero bytes of
// their xor, found exactly (the sums stay within each byte, so no carry crosses into the next).
__device__ __forceinline__ unsigned int byte_matches(unsigned int word, unsigned int target4) {
    const unsigned int x = word ^ target4;
    const unsigned int zero = ~(((x & 0x7f7f7f7fu) + 0x7f7f7f7fu) | x | 0x7f7f7f7fu);  // 0x80 in each zero byte
    return ((zero >> 7) & 1u) | ((zero >> 14) & 2u) | ((zero >> 21) & 4u) | ((zero >> 28) & 8u);
}

// Keys whose signed order is the unsigned order of their hashes (bucket first), for torch.sort.
extern "C" __global__ void __launch_bounds__(256) hash_order_keys(const long long* __restrict__ keys, long long n,
                                                                  long long* __restrict__ out) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = (long long)(mix64((u64)keys[i]) ^ SIGN_BIT);
}

// The hash of sorted position i (hash_order_keys' output, sorted).
__device__ __forceinline__ u64 hash_at(const long long* __restrict__ ordered, long long i) {
    return (u64)ordered[i] ^ SIGN_BIT;
}

// Copies one row of `dim` floats with the `lanes` threads of a group (`g`: this thread's rank), 16-byte
// accesses when `aligned` (dim % 4 == 0, both rows on 16-byte boundaries), four in flight per thread.
// A null `src` writes zeros.
__device__ __forceinline__ void copy_row(float* __restrict__ dst, const float* __restrict__ src, int dim, bool aligned,
                                         int g, int lanes) {
    if (aligned) {
        const int vectors = dim >> 2;
        const float4* s = reinterpret_cast<const float4*>(src);
        float4* d = reinterpret_cast<float4*>(dst);
        for (int v0 = g; v0 < vectors; v0 += 4 * lanes) {
            float4 r[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const int v = v0 + u * lanes;
                r[u] = (src != nullptr && v < vectors) ? __ldg(s + v) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const int v = v0 + u * lanes;
                if (v < vectors) d[v] = r[u];
            }
        }
    } else {
        for (int c = g; c < dim; c += lanes) dst[c] = src != nullptr ? __ldg(src + c) : 0.0f;
    }
}

// Find: a group of FIND_GROUP threads per key. The group loads the bucket's 128 digests with one
// 16-byte load per thread, compares them four at a time (byte_matches), loads the keys only where a
// digest matches, and the thread that finds the key hands its slot to the group, which copies the row
// (or zeros) to out[i]. `out` and `slots` may be null (not wanted).
extern "C" __global__ void __launch_bounds__(256) find_keys(
    const unsigned char* __restrict__ digests, const long long* __restrict__ table_keys,
    const float* __restrict__ values, long long num_buckets, const long long* __restrict__ bucket_starts,
    const short* __restrict__ tables, int dim, int aligned, const long long* __restrict__ keys, long long n,
    float* __restrict__ out, bool* __restrict__ found, long long* __restrict__ slots) {
    const long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / FIND_GROUP;
    if (i >= n) return;  // the whole group: its threads share i
    const int g = threadIdx.x % FIND_GROUP;
    const unsigned int group = ((1u << FIND_GROUP) - 1u) << ((threadIdx.x & 31u) & ~(unsigned int)(FIND_GROUP - 1));
    const u64 key = (u64)keys[i];
    const u64 h = mix64(key);
    const TableBuckets span = table_buckets(bucket_starts, tables != nullptr ? tables[i] : 0, num_buckets);
    const long long base = (span.first + bucket_of(h, span.count)) * SLOTS;
    const unsigned int target = digest_of(h) * 0x01010101u;
    const uint4 d = __ldg(reinterpret_cast<const uint4*>(digests + base) + g);
    unsigned int hits = byte_matches(d.x, target) | (byte_matches(d.y, target) << 4) |
                        (byte_matches(d.z, target) << 8) | (byte_matches(d.w, target) << 12);
    int pos = -1;
    while (hits != 0u) {
        const int p = 16 * g + __ffs(hits) - 1;
        hits &= hits - 1u;
        if ((u64)__ldg(table_keys + base + p) == key) {
            pos = p;
            break;
        }
    }
    const unsigned int holder = __ballot_sync(group, pos >= 0);
    if (holder != 0u) pos = __shfl_sync(group, pos, __ffs(holder) - 1);
    const long long slot = holder != 0u ? base + pos : -1;
    if (g == 0) {
        found[i] = holder != 0u;
        if (slots != nullptr) slots[i] = slot >= 0 ? slot - span.first * SLOTS : -1;
    }
    if (out != nullptr)
        copy_row(out + i * dim, slot >= 0 ? values + slot * dim : nullptr, dim, aligned != 0, g, FIND_GROUP);
}

// The end of the run of positions from i on that hold ordered[i] of table `table` (one key's repeats in one
// table), found by the whole warp, 128 positions an iteration: a hot key repeated thousands of times in a batch
// costs tens of loads, not thousands.
__device__ __forceinline__ long long run_end(const long long* __restrict__ ordered, const short* __restrict__ tables,
                                             int table, long long n, long long i, int lane) {
    const long long value = ordered[i];
    long long end = i + 1;
    for (;;) {
        int first_other = 4;  // the first of this lane's four positions that ends the run (4: none)
#pragma unroll
        for (int j = 3; j >= 0; --j) {
            const long long q = end + 4 * lane + j;
            if (q >= n || ordered[q] != value || (tables != nullptr && tables[q] != table)) first_other = j;
        }
        const unsigned int stops = __ballot_sync(FULL_WARP, first_other < 4);
        if (stops != 0u) {
            const int l = __ffs(stops) - 1;
            return end + 4 * l + __shfl_sync(FULL_WARP, first_other, l);
        }
        end += 128;
    }
}

// The first sorted position of each storage bucket that holds a key of the call (`firsts`, filled with -1 by the
// caller), a thread a position: the position whose bucket differs from the one before it writes itself.
extern "C" __global__ void __launch_bounds__(256) bucket_firsts(const long long* __restrict__ ordered,
                                                                const short* __restrict__ tables, long long n,
                                                                long long num_buckets,
                                                                const long long* __restrict__ bucket_starts,
                                                                long long* __restrict__ firsts) {
    const long long q = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (q >= n) return;
    const int table = tables != nullptr ? tables[q] : 0;
    const TableBuckets span = table_buckets(bucket_starts, table, num_buckets);
    const long long bucket = bucket_of(hash_at(ordered, q), span.count);
    if (q == 0 || (tables != nullptr && tables[q - 1] != table) || bucket_of(hash_at(ordered, q - 1), span.count) != bucket)
        firsts[span.first + bucket] = q;
}

// Whether sorted position q is one of the bucket's: of `table`, its hash in `bucket` (of the table's `count`).
__device__ __forceinline__ bool in_bucket(const long long* __restrict__ ordered, const short* __restrict__ tables,
                                          long long n, int table, long long bucket, long long count, long long q) {
    return q < n && (tables == nullptr || tables[q] == table) && bucket_of(hash_at(ordered, q), count) == bucket;
}

// Whether sorted positions a and b hold one key of one table.
__device__ __forceinline__ bool same_key(const long long* __restrict__ ordered, const short* __restrict__ tables,
                                         long long a, long long b) {
    return ordered[a] == ordered[b] && (tables == nullptr || tables[a] == tables[b]);
}

// The slot of the bucket (0 .. SLOTS - 1) that holds `key`, whose digest is `digest`, -1 where none or where the lane
// is not `active`; every lane of the warp looks up its own key. Lane l holds the digests of slots 4l .. 4l + 3 in
// `digest4`, which each lane reads from it in turn; a key is read only where a digest matches.
__device__ __forceinline__ int slot_in_bucket(unsigned int digest4, const long long* __restrict__ table_keys,
                                              long long base, long long key, unsigned int digest, bool active) {
    const unsigned int target = digest * 0x01010101u;
    int own = -1;
    for (int l = 0; l < 32; ++l) {
        const unsigned int word = __shfl_sync(FULL_WARP, digest4, l);
        if (!active || own >= 0) continue;
        for (unsigned int hits = byte_matches(word, target); hits != 0u; hits &= hits - 1u) {
            const int j = 4 * l + __ffs(hits) - 1;
            if (table_keys[base + j] == key) {
                own = j;
                break;
            }
        }
    }
    return own;
}

// The placement of a writing call: one warp per bucket walks the bucket's keys in hash order (`ordered`:
// hash_order_keys sorted, `order`: their batch positions, stable; for a group, then sorted by table, stable,
// `tables` the table of each sorted position) twice. First the keys in the table, 32 positions at once: each keeps
// its slot and gets its score. Then the new keys, one at a time: the lowest empty slot, else, if the key's score is
// higher than the lowest score among the slots this call has not touched, that slot (the lowest slot on ties), whose
// key is evicted, else none. Lane l keeps the digests of slots 4l..4l+3 in a register and a bit per slot touched by
// this call; a slot's digest and key are written by its own lane only. Writes digests, keys and scores; the rows are
// copied by the caller (copy_rows).
// With `firsts` (bucket_firsts'), warp w places the keys of the storage's bucket w (num_buckets warps, which the
// caller uses when the batch has at least as many keys: a warp a bucket, starting where `firsts` says); else
// warp w looks at sorted position w (n warps) and places its bucket's keys if w is the first of them. Either
// way every launched warp may hold a bucket, rather than one warp in as many as a bucket has positions (which
// would keep the blocks of long-running warps resident with their other warps idle).
//
// Out, per batch position p: slots[p] (in the key's table, -1: not placed), was_new[p], writers[p] (the
// slot of the storage the row of position p goes to, -1: none; the key's last position with `assign`, else
// its first and only when new), and, at a key's first position, evicted[p] (zeroed by the caller) with the
// evicted key and score; evictions[t] (zeroed by the caller) counts the keys evicted from table t.
extern "C" __global__ void __launch_bounds__(256) place_keys(
    unsigned char* __restrict__ digests, long long* __restrict__ table_keys, long long* __restrict__ table_scores,
    long long num_buckets, const long long* __restrict__ bucket_starts, const short* __restrict__ tables,
    const long long* __restrict__ keys, const long long* __restrict__ ordered, const long long* __restrict__ order,
    long long n, const long long* __restrict__ given_scores, int policy, long long clock, int assign,
    long long* __restrict__ slots, bool* __restrict__ was_new, long long* __restrict__ writers,
    bool* __restrict__ evicted, long long* __restrict__ evicted_keys, long long* __restrict__ evicted_scores,
    long long* __restrict__ evictions, const long long* __restrict__ firsts) {
    const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    long long start, bucket;  // the bucket's first sorted position; the bucket, in its table
    int table;
    TableBuckets span;
    if (firsts != nullptr) {
        if (warp >= num_buckets) return;  // the whole warp
        start = firsts[warp];
        if (start < 0) return;  // no key of this call in the bucket
        table = tables != nullptr ? tables[start] : 0;
        span = table_buckets(bucket_starts, table, num_buckets);
        bucket = warp - span.first;
    } else {
        start = warp;
        if (start >= n) return;
        table = tables != nullptr ? tables[start] : 0;
        span = table_buckets(bucket_starts, table, num_buckets);
        bucket = bucket_of(hash_at(ordered, start), span.count);
        if (start > 0 && (tables == nullptr || tables[start - 1] == table) &&
            bucket_of(hash_at(ordered, start - 1), span.count) == bucket)
            return;  // not the bucket's first position
    }
    const long long base = (span.first + bucket) * SLOTS;
    const long long mine = base + 4 * lane;  // this lane's first slot
    unsigned int digest4 = *reinterpret_cast<const unsigned int*>(digests + mine);  // byte j: slot mine + j
    unsigned int touched = 0u;                                                    // bit j: slot mine + j
    long long evicted_here = 0;

    // First walk: the keys already in the table, 32 sorted positions at a time. The lanes at the first position of
    // a key look it up together (a repeated key's other positions take its slot from the lane of its first position
    // in the chunk, or from the chunk before); each key keeps its slot and gets its score: under LRU the clock,
    // under LFU its occurrences added, a given score from the key's first position (its last with `assign`).
    int carried = -1;     // the slot of the key the chunk before ended in (-1: none)
    int first_own = -1;   // this lane's slot in the bucket's first chunk, which the second walk reuses
    bool one_chunk = false;
    for (long long i0 = start;; i0 += 32) {
        const long long q = i0 + lane;
        const bool here = in_bucket(ordered, tables, n, table, bucket, span.count, q);
        const unsigned int present = __ballot_sync(FULL_WARP, here);
        if (present == 0u) break;  // the bucket's positions are contiguous
        const bool starts_run = here && (q == start || !same_key(ordered, tables, q - 1, q));
        const unsigned int starts = __ballot_sync(FULL_WARP, starts_run);
        const long long p = here ? order[q] : 0;
        int own = -1;
        if (starts != 0u)
            own = slot_in_bucket(digest4, table_keys, base, starts_run ? keys[p] : 0,
                                 starts_run ? digest_of(hash_at(ordered, q)) : 0u, starts_run);
        const unsigned int upto = starts & ((2u << lane) - 1u);  // the run starts at or before this lane
        const int from = upto != 0u ? 31 - __clz(upto) : 0;
        const int taken = __shfl_sync(FULL_WARP, own, from);
        own = upto != 0u ? taken : carried;
        carried = __shfl_sync(FULL_WARP, own, 31);
        if (here && own >= 0) {
            const long long slot = base + own;
            const bool last = q + 1 >= n || !same_key(ordered, tables, q, q + 1);
            if (policy == LRU) {
                if (starts_run) table_scores[slot] = clock;
            } else if (policy == LFU) {
                // the lane that ends the run's part of this chunk adds the part's positions
                if (lane == 31 || ((present >> (lane + 1)) & 1u) == 0u || ((starts >> (lane + 1)) & 1u) != 0u)
                    atomicAdd(reinterpret_cast<unsigned long long*>(table_scores + slot),
                              (unsigned long long)(lane - from + 1));
            } else if (assign ? last : starts_run) {
                table_scores[slot] = given_scores[p];
            }
            slots[p] = slot - span.first * SLOTS;
            was_new[p] = false;
            writers[p] = assign && last ? slot : -1;
        }
        for (unsigned int found = __ballot_sync(FULL_WARP, starts_run && own >= 0); found != 0u; found &= found - 1u) {
            const int held = __shfl_sync(FULL_WARP, own, __ffs(found) - 1);  // touched, marked by its slot's lane
            if ((held >> 2) == lane) touched |= 1u << (held & 3);
        }
        if (i0 == start) {
            first_own = own;
            one_chunk = present != FULL_WARP;
        }
        if (present != FULL_WARP) break;
    }

    // Second walk: the new keys, one at a time in sorted order (each placement changes what the next one finds):
    // the lowest empty slot, else, if the key's score is higher than the lowest score among the slots this call has
    // not touched, that slot (the lowest slot on ties), whose key is evicted, else none. The walk looks at 32
    // positions at a time and places only the first positions of keys not in the table.
    for (long long i0 = start;; i0 += 32) {
        const long long q = i0 + lane;
        const bool here = in_bucket(ordered, tables, n, table, bucket, span.count, q);
        const unsigned int present = __ballot_sync(FULL_WARP, here);
        if (present == 0u) break;
        const bool first = here && (q == start || !same_key(ordered, tables, q - 1, q));
        int own = -1;
        if (i0 == start && one_chunk)
            own = first_own;  // no key placed yet: as the first walk found them
        else if (__ballot_sync(FULL_WARP, first) != 0u)
            own = slot_in_bucket(digest4, table_keys, base, first ? keys[order[q]] : 0,
                                 first ? digest_of(hash_at(ordered, q)) : 0u, first);
        for (unsigned int todo = __ballot_sync(FULL_WARP, first && own < 0); todo != 0u; todo &= todo - 1u) {
            const long long i = i0 + __ffs(todo) - 1;
            const long long end = run_end(ordered, tables, table, n, i, lane);
            const long long first_at = order[i];
            const long long key = keys[first_at];
            const unsigned int digest = digest_of(hash_at(ordered, i));

            const unsigned int empty = byte_matches(digest4, 0u);
            const unsigned int with_empty = __ballot_sync(FULL_WARP, empty != 0u);
            const bool has_empty = with_empty != 0u;
            long long lowest = MAX_SCORE;
            int pos;
            if (has_empty) {
                pos = __shfl_sync(FULL_WARP, 4 * lane + __ffs(empty) - 1, __ffs(with_empty) - 1);
            } else {
                // A full bucket: the lowest score among the slots not touched, the lowest slot on ties
                // (SLOTS: none below MAX_SCORE).
                pos = SLOTS;
                for (int j = 0; j < 4; ++j) {
                    if (((touched >> j) & 1u) == 0u && table_scores[mine + j] < lowest) {
                        lowest = table_scores[mine + j];
                        pos = 4 * lane + j;
                    }
                }
                for (int offset = 16; offset > 0; offset >>= 1) {
                    const long long other = __shfl_xor_sync(FULL_WARP, lowest, offset);
                    const int other_pos = __shfl_xor_sync(FULL_WARP, pos, offset);
                    if (other < lowest || (other == lowest && other_pos < pos)) {
                        lowest = other;
                        pos = other_pos;
                    }
                }
            }

            const long long last = order[end - 1];
            long long score;
            if (policy == LRU) score = clock;
            else if (policy == LFU) score = end - i;
            else score = given_scores[assign ? last : first_at];
            const bool evict = !has_empty && pos < SLOTS && score > lowest;
            const bool stored = has_empty || evict;
            const long long slot = stored ? base + pos : -1;
            __syncwarp();  // every lane has read the old scores before the slot's lane writes the new one

            if (stored && (pos >> 2) == lane) {
                const int j = pos & 3;
                if (evict) {
                    evicted_keys[first_at] = table_keys[mine + j];
                    evicted_scores[first_at] = lowest;
                }
                digest4 = (digest4 & ~(0xffu << (8 * j))) | (digest << (8 * j));
                digests[mine + j] = (unsigned char)digest;
                table_keys[mine + j] = key;
                table_scores[mine + j] = score;
                touched |= 1u << j;
            }
            if (lane == 0) evicted[first_at] = evict;
            evicted_here += evict;
            const long long writer = !stored ? -1 : assign ? last : first_at;
            const long long in_table = stored ? slot - span.first * SLOTS : -1;
            for (long long r = i + lane; r < end; r += 32) {
                const long long at = order[r];
                slots[at] = in_table;
                was_new[at] = true;
                writers[at] = at == writer ? slot : -1;
            }
            __syncwarp();  // the next key sees this one's slot
        }
        if (present != FULL_WARP) break;
    }
    if (lane == 0 && evicted_here != 0)
        atomicAdd(reinterpret_cast<unsigned long long*>(evictions + table), (unsigned long long)evicted_here);
}

// Row copies, a group of COPY_GROUP threads per row i < n (with `bounds`, only bounds[0] <= i < bounds[1]: a
// range the device knows and the host does not): dst[d] = src[s], d = dst_index[i] (or i when dst_index is
// null; skipped when d < 0), s = src_index[i] (or i when null), fallback[i] when s < 0. A group
// takes rows i, i + groups, ... (groups: all the launched ones), so a launch of fewer blocks than rows / groups
// a block copies them all on fewer multiprocessors (rows crossing the bus wait on it, not on the SMs). Blocks of up
// to 1024 threads: a copy through host memory runs as a few large blocks (host_rows.py).
extern "C" __global__ void __launch_bounds__(1024) copy_rows(
    float* __restrict__ dst, const long long* __restrict__ dst_index, const float* __restrict__ src,
    const long long* __restrict__ src_index, const float* __restrict__ fallback, long long n, int dim,
    int aligned, const long long* __restrict__ bounds) {
    const long long groups = (long long)gridDim.x * blockDim.x / COPY_GROUP;
    const int g = threadIdx.x % COPY_GROUP;
    const long long lo = bounds != nullptr ? bounds[0] : 0;
    const long long hi = bounds != nullptr ? min(bounds[1], n) : n;
    for (long long i = lo + ((long long)blockIdx.x * blockDim.x + threadIdx.x) / COPY_GROUP; i < hi; i += groups) {
        const long long d = dst_index != nullptr ? dst_index[i] : i;
        if (d < 0) continue;
        const long long s = src_index != nullptr ? src_index[i] : i;
        copy_row(dst + d * dim, s >= 0 ? src + s * dim : fallback + i * dim, dim, aligned != 0, g, COPY_GROUP);
    }
}
