"""``bench train --dynamic``: our DLRM with dynamic tables of the static ones' shape, trained on the same ids (each
row's as a 64-bit id of its own) as the training stage trains it: each batch's ids placed in the tables while the
batch before trains, its new rows started at its lookup."""

from __future__ import annotations


class DynamicTraining:
    """Our DLRM with dynamic tables (admitted after ``admit_after`` occurrences), trained on the ``raw`` ids of
    stretches of the run's ``stream`` of ``StepBatch``, one step each, through the training stage's
    :class:`~pipeline.distributed.train_pipeline.PrefetchPipeline`
    (:class:`~pipeline.bench.train_models.PipelinedSteps`), and the figures of its tables."""

    def __init__(self, args, sizes, device, amp: bool, compiled: str, admit_after: int, stream: list):
        from pipeline.bench.train_models import PipelinedSteps, our_dlrm, our_step
        from pipeline.schema import DYNAMIC_ROWS

        self.capacity = -(-args.rows // DYNAMIC_ROWS) * DYNAMIC_ROWS  # whole buckets of the hash table
        self.admit_after = admit_after
        self.model = our_dlrm(args, sizes, device, capacity=self.capacity, admit_after=admit_after)
        self._steps = PipelinedSteps(self.model, our_step(self.model, amp, compiled), device, stream, lambda b: b.raw)
        self._placed_before_timing = 0

    def __call__(self, batches) -> None:
        self._steps(batches)

    def start_timing(self) -> None:
        self._placed_before_timing = self._placed()

    def figures(self, batches) -> dict:
        """Capacity, admission, distinct ids per table in ``batches``, ids held, evicted and admission
        candidates now, and the ids placed since :meth:`start_timing`."""
        import torch

        tables = list(self.model.embedding.dynamic.tables.values())
        stats = [table.stats() for table in tables]
        distinct = [torch.unique(torch.cat([b.ids[:, t] for b in batches])).numel() for t in range(len(tables))]
        return {
            "capacity": self.capacity,
            "admit_after": self.admit_after,
            "hashtable_backend": tables[0].ids.backend,
            "distinct_ids_per_table": sum(distinct) / len(distinct),
            "ids": sum(s["ids"] for s in stats),
            "evictions": sum(s["evictions"] for s in stats),
            "candidates": sum(s["candidates"] for s in stats),
            "placed_while_timed": self._placed() - self._placed_before_timing,
        }

    def _placed(self) -> int:
        """How many ids the tables have placed so far (each took an empty row or evicted an id)."""
        return sum(t.stats()["ids"] + t.stats()["evictions"] for t in self.model.embedding.dynamic.tables.values())


def print_dynamic_tables(tables: dict, count: int) -> None:
    print(f"  dynamic tables (hash table backend {tables['hashtable_backend']}, train.admit_after="
          f"{tables['admit_after']}): {tables['distinct_ids_per_table']:,.0f} distinct ids per table in the batches; "
          f"in the {count} tables, {tables['ids']:,} ids held, {tables['evictions']:,} evicted, "
          f"{tables['placed_while_timed']:,} placed during the timed steps")
