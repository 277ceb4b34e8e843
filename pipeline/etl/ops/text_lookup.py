"""Text values of several columns found in their vocabularies through 64-bit keys, with numpy and one hash index.

Categorify's serving path looks up every categorical value of a request. Arrow's ``index_in`` hashes the whole
vocabulary again on every call, and a Python dictionary costs a Python call per value. Here the index is built
once per operator: each vocabulary value gets a 64-bit key of its column and its bytes, the keys of all the
operator's columns go into one ``pandas.Index`` (whose ``get_indexer`` keeps a C hash table between calls), and
the values of a request, all columns together, are keyed the same way with a few numpy steps and found in one
``get_indexer`` call (a few values by a binary search of the keys sorted, which costs less than that call).

A value's bytes are read as little-endian 64-bit words, zero after its end (:class:`TextWords`); its key starts
from its column and folds in each of its words with a bijective mix, so two columns never give one value the same
key. No key is trusted alone: the value found is compared with the value looked up, word by word. A value that
holds no NUL byte is known by its words alone (its length is where its nonzero bytes end); the few values that
the words cannot hold are kept by their bytes in a dictionary and looked up there one by one: a value with a NUL
byte, one longer than :data:`LONG_BYTES` (its words would widen every value's to its own), and every value of a
key that two values of the vocabulary share.

Example::

    index = VocabularyIndex({"C1": pa.array(["a", "b"]), "C2": pa.array(["x", "y"])})
    words = TextWords.of_arrow(pa.array(["b", "zz", "y", None]))
    index.positions(words, ["C1", "C2"], 2)      # [1, -1, 1, -1]: "b" of C1, "zz" absent, "y" of C2, missing
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa

from pipeline.etl.blocks import fixed_width_words

LONG_BYTES = 128
"""Values longer than this many bytes are looked up by their bytes in a dictionary, not through their key."""
_SEARCHED = (64, 2048)
"""Up to this many values are found by a binary search of the sorted keys (the second: of an index of at most
:data:`_CACHED_KEYS` keys, which a search reads from the CPU's caches): ``get_indexer`` runs about 40 Python steps
a call, some 15 us warm and 250 us when the CPU's caches are cold (as between two requests of a served model), the
search one numpy call, then 10 to 20 ns a value against 100 ns or more (a cache miss a step of a large index)."""
_CACHED_KEYS = 1 << 18
_SORTED_FIRST = 64
"""More values than this are searched in the order of their keys (their sort then costs less than it saves)."""


@dataclass(frozen=True)
class TextWords:
    """Text values as rows of 64-bit words: each value's bytes little-endian, then zeros.

    ``words`` ``[n, W]`` uint64 (``W``: the words of the longest value held, at least one); ``missing`` a bool per
    value, or None where none is; ``by_bytes``: by row, the bytes of the values the words do not hold (those with a
    NUL byte or longer than :data:`LONG_BYTES`; their words are zero).
    """

    words: np.ndarray
    missing: np.ndarray | None
    by_bytes: dict[int, bytes]

    def __len__(self) -> int:
        return len(self.words)

    def value(self, row: int) -> bytes:
        """The bytes of the value of ``row``."""
        found = self.by_bytes.get(row)
        return self.words[row].tobytes().split(b"\0", 1)[0] if found is None else found

    @classmethod
    def of_fixed_width(cls, values: np.ndarray) -> TextWords:
        """The values of a numpy ``S`` array (none holding a NUL byte before its zero padding), an empty one missing."""
        words = fixed_width_words(values)
        missing = words[:, 0] == 0
        by_bytes = {}
        if words.shape[1] > LONG_BYTES // 8:
            rows = np.flatnonzero(words[:, LONG_BYTES // 8])
            by_bytes = {int(row): values[row].tobytes() for row in rows}
            words = words[:, : LONG_BYTES // 8].copy()
            words[rows] = 0
        return cls(words, missing if missing.any() else None, by_bytes)

    @classmethod
    def of_arrow(cls, strings: pa.Array) -> TextWords:
        """The values of an Arrow string or binary array (of either offset width); null: missing."""
        n = len(strings)
        if pa.types.is_null(strings.type) or n == 0:
            return cls(np.zeros((n, 1), np.uint64), np.ones(n, bool) if n else None, {})
        large = pa.types.is_large_string(strings.type) or pa.types.is_large_binary(strings.type)
        _, offsets, data = strings.buffers()
        offsets = np.frombuffer(offsets, np.int64 if large else np.int32)[strings.offset: strings.offset + n + 1]
        data = np.frombuffer(data, np.uint8) if data is not None else np.zeros(0, np.uint8)
        starts, lengths = offsets[:-1].astype(np.int64), np.diff(offsets).astype(np.int64)
        missing = strings.is_null().to_numpy(zero_copy_only=False) if strings.null_count else None
        if missing is not None:
            lengths[missing] = 0
        nul = np.flatnonzero(data[offsets[0]: offsets[-1]] == 0) + offsets[0]
        odd = np.flatnonzero(lengths > LONG_BYTES)
        if len(nul):
            odd = np.union1d(odd, np.searchsorted(offsets, nul, side="right") - 1)
            odd = odd[lengths[odd] > 0]  # a NUL byte of a missing value's slot
        by_bytes = {int(row): data[starts[row]: starts[row] + lengths[row]].tobytes() for row in odd}
        held = lengths.copy()
        held[odd] = 0
        width = max(-(-int(held.max(initial=0)) // 8) * 8, 8)
        padded = np.zeros(n * width, dtype=np.uint8)
        total = int(held.sum())
        if total:  # each held value's bytes to its row of the padded matrix, in one scatter
            before = np.cumsum(held) - held
            at = np.arange(total)
            padded[at + np.repeat(np.arange(n) * width - before, held)] = data[at + np.repeat(starts - before, held)]
        return cls(padded.view("<u8").reshape(n, width // 8), missing, by_bytes)


@dataclass(frozen=True)
class SearchTables:
    """What finds a value's position in a :class:`VocabularyIndex`, as arrays.

    ``keys`` (uint64) are the index's keys in its order: ``keys[:held]`` each of one value, the rest keys that two
    values share (their values are looked up by their bytes). By position in that order, and past it (at ``-1``:
    an absent key) for entries that match no value: ``first`` word, ``counts`` of nonzero words (uint8), the
    value's ``positions`` in its vocabulary, and where its words after the first start in ``rest``
    (``rest_starts``). ``seeds``: each column's seed, which its values' keys start from."""

    keys: np.ndarray
    held: int
    first: np.ndarray
    counts: np.ndarray
    positions: np.ndarray
    rest: np.ndarray
    rest_starts: np.ndarray
    seeds: dict[str, np.uint64]


class VocabularyIndex:
    """The values of several columns' vocabularies (by column name, Arrow string arrays of distinct values), found
    by :meth:`positions`; built once, about 90 bytes a value (a third of it the hash table)."""

    def __init__(self, vocabularies: Mapping[str, pa.Array]) -> None:
        sizes = [len(vocab) for vocab in vocabularies.values()]
        starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        values = TextWords.of_arrow(pa.concat_arrays([v.cast(pa.large_string()) for v in vocabularies.values()])
                                    if vocabularies else pa.array([], pa.large_string()))
        columns = np.repeat(np.arange(len(sizes)), sizes)
        self._number = {name: k for k, name in enumerate(vocabularies)}
        self._seeds = _mix(np.arange(1, len(sizes) + 1, dtype=np.uint64))
        self._runs: dict[tuple[str, ...], tuple[np.ndarray, np.ndarray]] = {}
        keys, counts = _keys(values.words, self._seeds[columns])
        positions = np.arange(len(keys)) - np.repeat(starts[:-1], sizes)
        odd = np.zeros(len(keys), dtype=bool)  # the values looked up by their bytes
        odd[list(values.by_bytes)] = True
        held = np.flatnonzero(~odd)
        index, shared = pd.Index(keys[held]), np.zeros(0, np.uint64)
        if not index.is_unique:  # a key of two values (or a value there twice): those are looked up by their bytes
            twice = index.duplicated(keep=False)
            shared, odd[held[twice]], held = np.unique(keys[held[twice]]), True, held[~twice]
            index = pd.Index(np.concatenate([keys[held], shared]))
        self._index, self._held = index, len(held)
        # by position in the index: what each value held there is; then the shared keys' and an absent key's (at -1),
        # which match no value
        never = len(shared) + 1
        self._first = np.concatenate([values.words[held, 0], np.zeros(never, np.uint64)])
        self._counts = np.concatenate([counts[held], np.full(never, 255)]).astype(np.uint8)
        self._positions = np.concatenate([positions[held], np.zeros(never, np.int64)])
        rest, more = values.words[held, 1:], np.maximum(counts[held] - 1, 0)
        # the words after the first, each value's one after the other
        self._rest = np.concatenate([rest[rest != 0], np.zeros(LONG_BYTES // 8, np.uint64)])
        self._rest_starts = np.concatenate([np.cumsum(more) - more, np.zeros(never, np.int64)])
        self._by_bytes: dict[tuple[int, bytes], int] = {}
        for row in np.flatnonzero(odd)[::-1].tolist():  # from the last: a value there twice keeps its first row
            self._by_bytes[int(columns[row]), values.value(row)] = int(positions[row])
        self._index.get_indexer(keys[:1])  # the hash table, built now rather than at the first look-up
        # the index's keys sorted, for a few values: a binary search of each costs less than get_indexer's own checks
        order = np.argsort(self._index.to_numpy())
        self._sorted_keys, self._sorted_at = self._index.to_numpy()[order], order

    def positions(self, values: TextWords, names: Sequence[str], each: int | np.ndarray, first: int = 0,
                  absent: int = -1, missing: int = -1) -> np.ndarray:
        """Each value's position in the vocabulary of its column, plus ``first``; ``absent`` where it is not there,
        ``missing`` where it is missing (int64). ``values`` are those of the columns ``names``, one after the other:
        ``each[k]`` of the k-th (one number: as many of each)."""
        numbers, seeds = self._columns(tuple(names))
        keys, counts = _keys(values.words, np.repeat(seeds, each))
        searched = _SEARCHED[len(self._sorted_keys) <= _CACHED_KEYS]
        at = self._searched(keys) if len(keys) <= searched else self._index.get_indexer(keys)
        same = (self._counts[at] == counts) & (self._first[at] == values.words[:, 0])
        if values.words.shape[1] > 1:
            starts = self._rest_starts[at]
            for k in range(1, values.words.shape[1]):  # the words of each, up to its count
                same &= (counts <= k) | (self._rest[starts + (k - 1)] == values.words[:, k])
        out = np.where(same, self._positions[at] + first, absent)
        shared = len(self._index) > self._held
        asked = [*values.by_bytes, *(np.flatnonzero(at >= self._held).tolist() if shared else ())]
        if asked:
            columns = np.repeat(numbers, each)
            for row in asked:
                out[row] = self._by_bytes.get((int(columns[row]), values.value(row)), absent - first) + first
        if values.missing is not None:
            out[values.missing] = missing
        return out

    def tables(self) -> SearchTables:
        """The arrays :meth:`positions` reads, for a search of the same keys elsewhere (on a GPU)."""
        return SearchTables(keys=self._index.to_numpy(), held=self._held, first=self._first, counts=self._counts,
                            positions=self._positions, rest=self._rest, rest_starts=self._rest_starts,
                            seeds={name: self._seeds[k] for name, k in self._number.items()})

    def _searched(self, keys: np.ndarray) -> np.ndarray:
        """The position of each key in the index, -1 where absent (what ``get_indexer`` gives), by binary search."""
        if not len(self._sorted_keys):
            return np.full(len(keys), -1, dtype=np.int64)
        if len(keys) > _SORTED_FIRST:
            # numpy's search then starts each key where the one before ended and reads the sorted keys from one end
            # to the other rather than at random (about half the time)
            order = np.argsort(keys)
            found = np.empty(len(keys), dtype=np.int64)
            found[order] = np.searchsorted(self._sorted_keys, keys[order])
        else:
            found = np.searchsorted(self._sorted_keys, keys)
        np.minimum(found, len(self._sorted_keys) - 1, out=found)
        return np.where(self._sorted_keys[found] == keys, self._sorted_at[found], -1)

    def _columns(self, names: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
        """The numbers of the columns ``names`` and their keys' seeds (kept: a request's columns come in one order)."""
        found = self._runs.get(names)
        if found is None:
            numbers = np.array([self._number[name] for name in names], dtype=np.int64)
            found = self._runs[names] = (numbers, self._seeds[numbers])
        return found


def _keys(words: np.ndarray, seeds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 64-bit key of each row of words (its column's seed, its first word and each further nonzero word folded
    in), and the count of its nonzero words."""
    keys = _mix(seeds ^ words[:, 0])
    counts = (words[:, 0] != 0).astype(np.int64)
    for k in range(1, words.shape[1]):
        word = words[:, k]
        present = word != 0
        counts += present
        keys = np.where(present, _mix(keys ^ word), keys)
    return keys, counts


MIX = 0x9E3779B97F4A7C15
"""The odd multiplier of :func:`_mix`."""


def _mix(x: np.ndarray) -> np.ndarray:
    """A bijection of 64-bit words (an odd multiplier, then the high half folded into the low): keys that differ
    stay apart, and their low bits, which the hash table reads first, depend on every bit."""
    x = x * np.uint64(MIX)
    return x ^ (x >> np.uint64(32))
