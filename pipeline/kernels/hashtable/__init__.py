"""The hash table op family: a fixed-capacity GPU table of 64-bit keys (embedding ids) and float rows.

- ``hashtable.cu``: the CUDA kernels (find, the placement of a writing call's keys, row copies);
- :mod:`.reference`: the layout, the hash and every operation in plain torch (CPU path, test oracle);
- :mod:`.launcher`: the same operations through the kernels;
- :mod:`.table`: :class:`HashTable`, what callers use (kernels on CUDA, else the reference);
- :mod:`.group`: :class:`HashTableGroup`, tables made together in one storage, whose keys one call places.

The layout, the order a call applies its keys in, and the score policies are in ``docs/HASHTABLE.md``.
"""

from pipeline.kernels.hashtable.group import GroupPlacement, HashTableGroup
from pipeline.kernels.hashtable.reference import SLOTS
from pipeline.kernels.hashtable.table import POLICIES, Evicted, FoundOrInserted, HashTable, Inserted

__all__ = ["POLICIES", "SLOTS", "Evicted", "FoundOrInserted", "GroupPlacement", "HashTable", "HashTableGroup",
           "Inserted"]
