"""A synthetic Criteo-like click log with a planted, learnable click model.

Columns are those of Criteo's display-advertising logs: ``label`` (int8 0/1), ``I1..I13``
(int64 counts with nulls, heavy-tailed; ``I2`` and ``I11`` can be negative) and ``C1..C26`` (8-char
lowercase hex strings with nulls, Zipf-distributed over vocabularies shaped like Criteo Kaggle's,
scaled by ``size``). Labels are drawn from known click probabilities, so the best possible AUC is
known (the *oracle*, written to ``oracle.json`` by the data stage).

The click model is built to be learnable from the data it generates:

* each categorical feature has effects only on its *head*: at most 32 values, each with
  probability at least 0.5% (seen 4,000 times in 800k rows); the long tail and nulls share a
  zero effect;
* dense effects are smooth functions of ``log1p(max(x, 0))`` with nulls counting as 0: what a
  standard ETL (clip at 0, log) gives a model, with a missing value's own effect, which a model
  learns from a missing indicator beside the filled value;
* six pairwise interactions are latent dot products (dimension 4) between the head values of two
  lower-cardinality features: what DLRM's dot interaction learns;
* the intercept is calibrated to a ~25% click rate, as in Criteo, and the overall strength
  (``_SIGNAL``) puts the oracle AUC near 0.80.

Rows are made in blocks of :data:`BLOCK_ROWS`; a block's random state depends only on
``(seed, split, block index)``, so a split's rows do not depend on how they are chunked, and any
block can be made alone. Everything is vectorized numpy: Zipf ranks come from an analytic inverse
CDF, strings from a bijective 32-bit hash of (feature, rank) written as fixed-width hex bytes and
wrapped into an Arrow string array without Python objects per value.

Example::

    model = ClickModel.create(seed=0, size=0.01)
    for chunk in iter_split(model, "train", rows=100_000, chunk_rows=50_000):
        chunk.table          # pyarrow.Table: label, I1..I13, C1..C26
        chunk.probability    # the true click probability of each row
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

GENERATOR_VERSION = 6
BLOCK_ROWS = 1 << 16
SPLITS = ("train", "valid", "test")
LABEL = "label"
CONTINUOUS = tuple(f"I{i}" for i in range(1, 14))
CATEGORICAL = tuple(f"C{i}" for i in range(1, 27))
CRITEO_CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
"""Distinct values of C1..C26 in the Criteo Kaggle display-advertising set (``size=1.0``)."""

SMALL_FLOOR = 32
"""A scaled cardinality never drops below ``min(base, SMALL_FLOOR)``, so small features stay categorical."""

_CAT_NULL_RATE = np.zeros(26)
for _name, _rate in {3: 0.034, 4: 0.034, 6: 0.12, 12: 0.034, 16: 0.034, 19: 0.44, 20: 0.44, 21: 0.034,
                     22: 0.76, 24: 0.034, 25: 0.44, 26: 0.44}.items():  # fmt: skip
    _CAT_NULL_RATE[_name - 1] = _rate
_DENSE_NULL_RATE = np.array([0.45, 0.0, 0.21, 0.22, 0.026, 0.22, 0.043, 0.0005, 0.043, 0.45, 0.043, 0.77, 0.22])
# log-normal shape of each count: value = floor(exp(mu + sigma * z)) - 1, at least 0
_DENSE_MU = np.array([1.0, 2.0, 2.0, 1.5, 7.5, 3.5, 1.5, 2.5, 4.0, 0.3, 1.0, 0.3, 1.5])
_DENSE_SIGMA = np.array([1.2, 1.5, 1.5, 1.0, 2.0, 1.8, 1.5, 1.2, 1.5, 0.6, 1.0, 0.8, 1.2])
_NEGATIVE_RATE = np.array([0, 0.05, 0, 0, 0, 0, 0, 0, 0, 0, 0.02, 0, 0])
_CAN_BE_NEGATIVE = (1, 10)  # I2 and I11, the only features with a nonzero _NEGATIVE_RATE
_SPLIT_ID = {"train": 0, "valid": 1, "test": 2}
_CALIBRATION_SPLIT = 7
_HEAD_MIN_PROBABILITY = 5e-3  # ~4000 sightings in 800k training rows
_HEAD_MAX = 32
_INTERACTION_DIM = 4
_INTERACTION_HEAD = 16
# (feature a, feature b, strength): lower-cardinality pairs, by position in CATEGORICAL (0-based)
_INTERACTIONS = ((8, 16, 0.5), (19, 5, 0.4), (13, 22, 0.4), (0, 21, 0.3), (24, 1, 0.3), (4, 17, 0.3))
_TARGET_CLICK_RATE = 0.25
_SIGNAL = 0.5  # overall strength of the planted effects: sets the oracle AUC near 0.80
_HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
# 256 entries of two hex characters; as little-endian uint16 the low byte is the first character.
_HEX_PAIRS = (_HEX[np.arange(256) >> 4].astype(np.uint16) | (_HEX[np.arange(256) & 15].astype(np.uint16) << 8))


def cardinalities(size: float) -> list[int]:
    """Vocabulary size of C1..C26 at a given ``size`` (1.0: Criteo Kaggle's own).

    >>> cardinalities(0.01)[:4]
    [32, 32, 101312, 22026]
    """
    if size <= 0:
        raise ValueError(f"size must be positive, got {size}")
    return [max(min(base, SMALL_FLOOR), round(base * size)) for base in CRITEO_CARDINALITIES]


def split_rows(rows: int, valid_fraction: float, test_fraction: float) -> dict[str, int]:
    """Rows per split: valid and test are rounded fractions of ``rows``, train gets the rest."""
    valid = round(rows * valid_fraction)
    test = round(rows * test_fraction)
    return {"train": rows - valid - test, "valid": valid, "test": test}


@dataclass
class SyntheticChunk:
    """Generated rows (``table``) and each row's true click probability."""

    table: pa.Table
    probability: np.ndarray

    def __len__(self) -> int:
        return self.table.num_rows


@dataclass
class ClickModel:
    """Everything that defines the synthetic data: vocabularies, distributions and the planted model.

    Build it with :meth:`create`; it is a pure function of ``(seed, size)``.
    """

    seed: int
    size: float
    cardinality: np.ndarray  # (26,) int64
    zipf_exponent: np.ndarray  # (26,)
    head: np.ndarray  # (26,) values of each feature that carry an effect (ranks 1..head)
    effect_offset: np.ndarray  # (26,) start of each feature's table in ``effects``
    effects: np.ndarray  # concatenated per-feature tables of head+1 entries; the last one (tail) is 0
    interactions: list[tuple[int, int, np.ndarray]]  # (feature a, feature b, U_a @ U_b.T with a zero last row/column)
    dense_weight: np.ndarray  # (13,)
    dense_center: np.ndarray  # (13,)
    dense_scale: np.ndarray  # (13,)
    intercept: float = 0.0

    @classmethod
    def create(cls, seed: int = 0, size: float = 0.01) -> ClickModel:
        card = np.array(cardinalities(size), dtype=np.int64)
        rng = np.random.default_rng([seed, 0x5EED, 1])
        exponent = rng.uniform(1.25, 1.6, size=26)
        head = np.array([_head_size(k, s) for k, s in zip(card, exponent)], dtype=np.int64)
        # A few features carry no signal at all, as in real logs; the others have effects of varied strength.
        strength = _SIGNAL * rng.uniform(0.15, 0.6, size=26) * (rng.random(26) > 0.2)
        tables = [np.append(rng.standard_normal(h) * s, 0.0) for h, s in zip(head, strength)]
        offset = np.cumsum([0] + [t.size for t in tables[:-1]]).astype(np.int64)
        interactions = []
        for a, b, scale in _INTERACTIONS:
            ha, hb = min(head[a], _INTERACTION_HEAD), min(head[b], _INTERACTION_HEAD)
            sd = np.sqrt(_SIGNAL * scale / np.sqrt(_INTERACTION_DIM))
            ua = np.vstack([rng.standard_normal((ha, _INTERACTION_DIM)) * sd, np.zeros(_INTERACTION_DIM)])
            ub = np.vstack([rng.standard_normal((hb, _INTERACTION_DIM)) * sd, np.zeros(_INTERACTION_DIM)])
            interactions.append((a, b, ua @ ub.T))
        dense_weight = _SIGNAL * rng.uniform(-1.0, 1.0, size=13)
        model = cls(seed, size, card, exponent, head, offset, np.concatenate(tables), interactions, dense_weight,
                    np.zeros(13), np.ones(13))
        model._calibrate()
        return model

    def _calibrate(self) -> None:
        """Standardize the dense terms and pick the intercept for a ~25% click rate, on a fixed sample."""
        draws = draw(self, _CALIBRATION_SPLIT, 0, 4 * BLOCK_ROWS)
        t = _log_counts(draws.counts, draws.dense_null)
        self.dense_center = t.mean(axis=1)
        self.dense_scale = t.std(axis=1) + 1e-9
        logit = self.logit(draws.ranks, draws.cat_null, draws.counts, draws.dense_null)
        lo, hi = -10.0, 10.0
        for _ in range(60):
            mid = (lo + hi) / 2
            if _sigmoid(logit + mid).mean() < _TARGET_CLICK_RATE:
                lo = mid
            else:
                hi = mid
        self.intercept = (lo + hi) / 2

    def logit(self, ranks: np.ndarray, cat_null: np.ndarray, counts: np.ndarray, dense_null: np.ndarray) -> np.ndarray:
        """Log-odds of a click, from Zipf ranks (26, n), null masks and dense counts (13, n).

        Depends only on what the data shows: ranks map one-to-one to the hex strings, and dense
        values enter as ``log1p(max(x, 0))`` with nulls as 0.
        """
        # tail ranks and nulls -> each table's last entry, which is zero
        head = self.head.astype(np.int32)[:, None]
        head_index = np.where(cat_null, head, np.minimum(ranks, head + 1) - 1)
        logit = self.effects.take(head_index + self.effect_offset.astype(np.int32)[:, None]).sum(axis=0)
        for a, b, products in self.interactions:
            ia = np.minimum(head_index[a], products.shape[0] - 1)
            ib = np.minimum(head_index[b], products.shape[1] - 1)
            logit += products.ravel().take(ia * products.shape[1] + ib)
        t = (_log_counts(counts, dense_null) - self.dense_center[:, None]) / self.dense_scale[:, None]
        logit += np.einsum("j,jn->n", self.dense_weight, t)  # not BLAS: its idle threads would spin
        logit -= _SIGNAL * 0.3 * t[5] ** 2  # one non-monotone dense effect: mid values of I6 click most
        return logit + self.intercept

    def hex_values(self, feature: int, ranks: np.ndarray) -> np.ndarray:
        """The (n, 8) uint8 hex spelling of ranks of one feature (bijective per feature)."""
        return _hex_bytes(hash32(ranks, feature, self.seed))


def generate_block(model: ClickModel, split: str, index: int, rows: int = BLOCK_ROWS) -> SyntheticChunk:
    """Rows of one block; the random state depends only on ``(model.seed, split, index)``.

    ``rows`` is :data:`BLOCK_ROWS` except for the last block of a split.
    """
    if split not in _SPLIT_ID:
        raise ValueError(f"split: expected one of {SPLITS}, got {split!r}")
    d = draw(model, _SPLIT_ID[split], index, rows)
    probability = _sigmoid(model.logit(d.ranks, d.cat_null, d.counts, d.dense_null))
    label = (d.label_uniform < probability).astype(np.int8)
    hashed = hash32(d.ranks, np.arange(26)[:, None], model.seed)
    text = _hex_bytes(hashed)  # (26, n, 8), one contiguous buffer per feature
    offsets = pa.py_buffer(np.arange(0, 8 * (rows + 1), 8, dtype=np.int32))
    columns: list[pa.Array] = [pa.array(label)]
    for j in range(13):
        columns.append(_with_nulls(pa.int64(), d.counts[j], d.dense_null[j]))
    for f in range(26):
        null = d.cat_null[f]
        columns.append(pa.StringArray.from_buffers(rows, offsets, pa.py_buffer(text[f]), _bitmap(null),
                                                   int(null.sum())))
    table = pa.Table.from_arrays(columns, names=[LABEL, *CONTINUOUS, *CATEGORICAL])
    return SyntheticChunk(table, probability)


def iter_split(model: ClickModel, split: str, rows: int, chunk_rows: int,
               pool: Executor | None = None, ahead: int = 0) -> Iterator[SyntheticChunk]:
    """The ``rows`` rows of a split, in chunks of ``chunk_rows`` (the last may be shorter).

    The concatenated rows are the same whatever ``chunk_rows`` is; memory holds at most about
    ``chunk_rows + BLOCK_ROWS`` rows. With ``pool`` (an executor, e.g. of processes) the blocks are
    made there, ``ahead`` of them at a time, and come back in order: the rows are the same.
    """
    if chunk_rows <= 0:
        raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
    pending: list[SyntheticChunk] = []
    pending_rows = 0
    blocks = -(-rows // BLOCK_ROWS)
    for index, block in enumerate(_blocks(model, split, rows, pool, ahead)):
        pending.append(block)
        pending_rows += len(pending[-1])
        while pending_rows >= chunk_rows or (index == blocks - 1 and pending_rows):
            merged = _concat(pending)
            take = min(chunk_rows, pending_rows)
            yield SyntheticChunk(merged.table.slice(0, take), merged.probability[:take])
            rest = SyntheticChunk(merged.table.slice(take), merged.probability[take:])
            pending, pending_rows = ([rest] if len(rest) else []), len(rest)


def write_criteo_tsv(path, model: ClickModel, split: str, rows: int, first: int = 0, end: int | None = None) -> int:
    """Blocks ``first`` to ``end - 1`` of a split of ``rows`` rows (all of them by default) as Criteo's TSV at ``path``:
    label, I1..I13, C1..C26, no header, a missing value an empty field. Returns the rows written. Parts of one split
    written by separate processes, each its own range of blocks, hold the split's rows once."""
    import pyarrow.csv as pacsv

    blocks = -(-rows // BLOCK_ROWS)
    end = blocks if end is None else min(end, blocks)
    options = pacsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
    written = 0
    with pacsv.CSVWriter(path, generate_block(model, split, 0, 1).table.schema, write_options=options) as writer:
        for index in range(first, end):
            block = generate_block(model, split, index, min(BLOCK_ROWS, rows - index * BLOCK_ROWS))
            writer.write_table(block.table)
            written += len(block)
    return written


def _blocks(model: ClickModel, split: str, rows: int, pool: Executor | None, ahead: int) -> Iterator[SyntheticChunk]:
    """A split's blocks in order, made here or ``ahead`` at a time in ``pool``."""
    jobs = iter([(model, split, index, min(BLOCK_ROWS, rows - index * BLOCK_ROWS))
                 for index in range(-(-rows // BLOCK_ROWS))])
    if pool is None:
        yield from (generate_block(*job) for job in jobs)
        return
    running = deque(pool.submit(generate_block, *job) for job in itertools.islice(jobs, max(1, ahead)))
    while running:
        block = running.popleft().result()
        job = next(jobs, None)
        if job is not None:
            running.append(pool.submit(generate_block, *job))
        yield block


@dataclass
class Draws:
    """The random numbers behind one block of rows, before they become values."""

    ranks: np.ndarray  # (26, n) int32 in [1, cardinality]
    cat_null: np.ndarray  # (26, n) bool
    counts: np.ndarray  # (13, n) int64
    dense_null: np.ndarray  # (13, n) bool
    label_uniform: np.ndarray  # (n,)


def draw(model: ClickModel, split_id: int, index: int, rows: int) -> Draws:
    """The draws of block ``index`` of a split: the same numbers for the same seed, split and block."""
    rng = np.random.default_rng([model.seed, split_id, index])
    u = rng.random((26, rows))
    ranks = zipf_ranks(u, model.cardinality[:, None], model.zipf_exponent[:, None])
    cat_null = rng.random((26, rows), dtype=np.float32) < _CAT_NULL_RATE[:, None]
    z = rng.standard_normal((13, rows))
    counts = np.floor(np.exp(_DENSE_MU[:, None] + _DENSE_SIGMA[:, None] * z)).astype(np.int64) - 1
    np.maximum(counts, 0, out=counts)
    extra = rng.random((3, rows), dtype=np.float32)
    for row, j in enumerate(_CAN_BE_NEGATIVE):
        counts[j] = np.where(extra[row] < _NEGATIVE_RATE[j], -1 - (extra[2] * 3).astype(np.int64), counts[j])
    dense_null = rng.random((13, rows), dtype=np.float32) < _DENSE_NULL_RATE[:, None]
    label_uniform = rng.random(rows)
    return Draws(ranks, cat_null, counts, dense_null, label_uniform)


def zipf_ranks(u: np.ndarray, k: np.ndarray | int, s: np.ndarray | float) -> np.ndarray:
    """Inverse CDF of the continuous power law x**-s on [1, k+1), floored: ranks 1..k, rank 1 most frequent.

    ``u``: uniform draws in [0, 1); ``k`` and ``s`` (> 0) broadcast against it; ``s == 1`` is the
    log-uniform law.
    """
    k, s = np.asarray(k), np.asarray(s, dtype=np.float64)
    one_minus_s = 1.0 - s
    if np.any(one_minus_s == 0):
        safe = np.where(one_minus_s == 0, 1.0, one_minus_s)
        x = np.where(one_minus_s == 0, (k + 1.0) ** u, (1.0 + u * ((k + 1.0) ** safe - 1.0)) ** (1.0 / safe))
    else:
        span = (k + 1.0) ** one_minus_s - 1.0
        x = (1.0 + u * span) ** (1.0 / one_minus_s)
    return np.minimum(x.astype(np.int32), k.astype(np.int32))


def _head_size(k: int, s: float) -> int:
    """How many of the most frequent ranks have probability at least _HEAD_MIN_PROBABILITY."""
    r = np.arange(1, min(k, _HEAD_MAX) + 1, dtype=np.float64)
    total = (k + 1.0) ** (1 - s) - 1.0
    p = ((r + 1) ** (1 - s) - r ** (1 - s)) / total
    return max(1, int((p >= _HEAD_MIN_PROBABILITY).sum()))


def _log_counts(counts: np.ndarray, null: np.ndarray) -> np.ndarray:
    return np.where(null, 0.0, np.log1p(np.maximum(counts, 0)))


def hash32(ranks: np.ndarray, feature: np.ndarray | int, seed: int) -> np.ndarray:
    """MurmurHash3's 32-bit finalizer of (rank + a per-feature salt): a bijection of ranks within a feature."""
    salt = (np.asarray(feature, dtype=np.uint64) * np.uint64(0x9E3779B9) + np.uint64(seed * 0x85EBCA77 & 0xFFFFFFFF))
    h = ranks.astype(np.uint32) + (salt & np.uint64(0xFFFFFFFF)).astype(np.uint32)  # wraps mod 2**32
    h ^= h >> np.uint32(16)
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> np.uint32(13)
    h *= np.uint32(0xC2B2AE35)
    h ^= h >> np.uint32(16)
    return h


def _hex_bytes(h: np.ndarray) -> np.ndarray:
    """uint32 array (...) -> uint8 array (..., 8) of its lowercase hex spelling, most significant first."""
    big_endian = np.ascontiguousarray(h, dtype=">u4").view(np.uint8).reshape(*h.shape, 4)
    return _HEX_PAIRS[big_endian].view(np.uint8).reshape(*h.shape, 8)


def _bitmap(null: np.ndarray) -> pa.Buffer | None:
    if not null.any():
        return None
    return pa.py_buffer(np.packbits(~null, bitorder="little"))


def _with_nulls(dtype: pa.DataType, values: np.ndarray, null: np.ndarray) -> pa.Array:
    return pa.Array.from_buffers(dtype, values.size, [_bitmap(null), pa.py_buffer(values)], int(null.sum()))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _concat(chunks: list[SyntheticChunk]) -> SyntheticChunk:
    if len(chunks) == 1:
        return chunks[0]
    return SyntheticChunk(pa.concat_tables([c.table for c in chunks]), np.concatenate([c.probability for c in chunks]))
