"""The hash table's operations through the kernels of ``hashtable.cu``: the same functions, arguments and
results as :mod:`.reference`, on CUDA tensors.

``place`` orders the batch with one ``torch.sort`` of ``hash_order_keys`` (stable: a repeated key's
positions stay in batch order), and for the tables of a group a second, stable, of each key's table (int16),
then one warp per bucket places the bucket's keys (``place_keys``, each bucket's first position found by
``bucket_firsts`` where the batch has at least as many keys as the storage buckets); ``find`` and ``locate`` give each key a
group of ``FIND_GROUP`` threads; rows move with ``copy_rows`` (``read_rows``, ``take_rows``, ``write_rows``).

Example::

    placed = place(storage, keys, None, policy=LRU, clock=1, assign=True)
    write_rows(storage.values, placed.writers, rows)
    values, found = find(storage, keys)
"""

from __future__ import annotations

import torch

from pipeline.kernels._launch import i32, i64, launch, ptr
from pipeline.kernels.hashtable.reference import Placement, Storage

SOURCE = "hashtable/hashtable.cu"
BLOCK = 256
FIND_GROUP = 8  # threads per key in find_keys; as FIND_GROUP in hashtable.cu
COPY_GROUP = 8  # threads per row in copy_rows; as COPY_GROUP in hashtable.cu
WARP = 32


def _blocks(threads: int) -> int:
    return -(-threads // BLOCK)


def _aligned(*tensors: torch.Tensor | None) -> bool:
    """Rows that 16-byte accesses can move: a multiple of 4 floats, every tensor on a 16-byte boundary."""
    present = [t for t in tensors if t is not None]
    return present[0].shape[-1] % 4 == 0 and all(t.data_ptr() % 16 == 0 for t in present)


def _find(storage: Storage, keys: torch.Tensor, values: bool, tables: torch.Tensor | None = None,
          bucket_starts: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    n = keys.numel()
    out = torch.empty(n, storage.values.shape[1], dtype=torch.float32, device=keys.device) if values else None
    found = torch.empty(n, dtype=torch.bool, device=keys.device)
    slots = torch.empty(n, dtype=torch.int64, device=keys.device)
    dim = storage.values.shape[1]
    launch(SOURCE, "find_keys", keys.device, _blocks(n * FIND_GROUP), BLOCK,
           [ptr(storage.digests), ptr(storage.keys), ptr(storage.values), i64(storage.num_buckets), ptr(bucket_starts),
            ptr(tables), i32(dim), i32(_aligned(storage.values, out)), ptr(keys), i64(n), ptr(out), ptr(found),
            ptr(slots)])
    return out, found, slots


def locate(storage: Storage, keys: torch.Tensor, tables: torch.Tensor | None = None,
           bucket_starts: torch.Tensor | None = None) -> torch.Tensor:
    """int64 ``[n]``: the slot of each key, -1 where it is not in the table (with ``tables``, int16: in its table of a
    group, as :func:`.reference.locate`)."""
    return _find(storage, keys, False, tables, bucket_starts)[2]


def find(storage: Storage, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 ``[n, dim]``: each key's row, zeros where it is missing; bool ``[n]``: found)."""
    out, found, _ = _find(storage, keys, values=True)
    return out, found


def _copy_rows(dst: torch.Tensor, dst_index: torch.Tensor | None, src: torch.Tensor, src_index: torch.Tensor | None,
               fallback: torch.Tensor | None, n: int) -> None:
    launch(SOURCE, "copy_rows", dst.device, _blocks(n * COPY_GROUP), BLOCK,
           [ptr(dst), ptr(dst_index), ptr(src), ptr(src_index), ptr(fallback), i64(n), i32(dst.shape[1]),
            i32(_aligned(dst, src, fallback)), ptr(None)])


def read_rows(values: torch.Tensor, slots: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """``[n, dim]``: row ``slots[p]`` of ``values``, or ``fallback[p]`` where ``slots[p] < 0``."""
    out = torch.empty_like(fallback)
    _copy_rows(out, None, values, slots, fallback, slots.numel())
    return out


def take_rows(values: torch.Tensor, slots: torch.Tensor, taken: torch.Tensor) -> torch.Tensor:
    """``[n, dim]``: row ``slots[p]`` of ``values`` where ``taken[p]`` (there ``slots[p] >= 0``); the other rows are
    left unset."""
    n = slots.numel()
    out = torch.empty(n, values.shape[1], dtype=values.dtype, device=values.device)
    _copy_rows(out, torch.where(taken, torch.arange(n, device=slots.device), -1), values, slots, None, n)
    return out


def write_rows(values: torch.Tensor, writers: torch.Tensor, rows: torch.Tensor) -> None:
    """``values[writers[p]] = rows[p]`` where ``writers[p] >= 0`` (distinct slots)."""
    _copy_rows(values, writers, rows, None, None, writers.numel())


def place(storage: Storage, keys: torch.Tensor, scores: torch.Tensor | None, policy: int, clock: int,
          assign: bool, tables: torch.Tensor | None = None, bucket_starts: torch.Tensor | None = None) -> Placement:
    """As :func:`.reference.place` (``tables``: int16): decide every key's slot and write the slots' digests, keys
    and scores."""
    n = keys.numel()
    device = keys.device
    hashed = torch.empty_like(keys)
    launch(SOURCE, "hash_order_keys", device, _blocks(n), BLOCK, [ptr(keys), i64(n), ptr(hashed)])
    ordered, order = torch.sort(hashed, stable=True)
    if tables is not None:  # by table, each table's keys still in hash order (.reference.sort_order)
        tables, by_table = torch.sort(tables[order], stable=True)
        order, ordered = order[by_table], ordered[by_table]
    slots, writers = torch.empty_like(keys), torch.empty_like(keys)
    was_new = torch.empty(n, dtype=torch.bool, device=device)
    evicted = torch.zeros(n, dtype=torch.bool, device=device)
    evicted_keys, evicted_scores = torch.zeros_like(keys), torch.zeros_like(keys)  # 0 where nothing was evicted
    num_tables = 1 if tables is None else bucket_starts.numel() - 1
    evictions = torch.zeros(num_tables, dtype=torch.int64, device=device)
    firsts = None
    if storage.num_buckets <= n:  # a warp a bucket, else a warp a position (see place_keys)
        firsts = torch.full((storage.num_buckets,), -1, dtype=torch.int64, device=device)
        launch(SOURCE, "bucket_firsts", device, _blocks(n), BLOCK,
               [ptr(ordered), ptr(tables), i64(n), i64(storage.num_buckets), ptr(bucket_starts), ptr(firsts)])
    launch(SOURCE, "place_keys", device, _blocks((storage.num_buckets if firsts is not None else n) * WARP), BLOCK,
           [ptr(storage.digests), ptr(storage.keys), ptr(storage.scores), i64(storage.num_buckets), ptr(bucket_starts),
            ptr(tables), ptr(keys), ptr(ordered), ptr(order), i64(n), ptr(scores), i32(policy), i64(clock),
            i32(assign), ptr(slots), ptr(was_new), ptr(writers), ptr(evicted), ptr(evicted_keys), ptr(evicted_scores),
            ptr(evictions), ptr(firsts)])
    return Placement(slots, was_new, writers, evicted, evicted_keys, evicted_scores, evictions)
