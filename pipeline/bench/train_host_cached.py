"""``bench train --embedding-budget-mb``: our DLRM with its tables placed by the planner under a budget of device
memory, as the training stage places them on one process (host-cached where they do not fit), trained as the
stage trains it: each batch's rows prefetched into the caches while the batch before trains."""

from __future__ import annotations


class HostCachedTraining:
    """Our DLRM of ``sizes`` with its tables placed under ``args.embedding_budget_mb`` (the same values as
    :func:`~pipeline.bench.train_models.our_dlrm`'s), trained on the ``kjt`` of stretches of the run's ``stream`` of
    ``StepBatch`` (:class:`~pipeline.bench.train_models.PipelinedSteps`), one step each, and the figures of its
    placement and caches. ``sharding``: the tables' pinned placements (``distributed.sharding``), as the training
    stage takes them."""

    def __init__(self, args, sizes, device, amp: bool, compiled: str, sharding: dict[str, str], stream: list):
        from pipeline.bench.train_models import PipelinedSteps, our_step

        self.budget_mb = args.embedding_budget_mb
        self.model, self._topology = _placed_under_budget(args, sizes, device, sharding)
        self._steps = PipelinedSteps(self.model, our_step(self.model, amp, compiled), device, stream,
                                     lambda b: b.kjt)
        self._found_before_timing: dict = {}

    def __call__(self, batches) -> None:
        self._steps(batches)

    def start_timing(self) -> None:
        self._found_before_timing = dict(self.model.embedding.cache_stats())

    def figures(self) -> dict:
        """The budget against the tables, each host-cached table's cache and its hit rate since
        :meth:`start_timing`."""
        from pipeline.distributed.planner.estimators import bytes_per_row

        embedding = self.model.embedding
        size = sum(t.rows * bytes_per_row(t.dim, self._topology) for t in embedding.tables) / 2**20
        cached = {t.name: t.slots for t in embedding.cache.tables}
        hit_rates = {}
        for name, stats in embedding.cache_stats().items():
            before = self._found_before_timing[name]
            rows = stats.rows - before.rows
            hit_rates[name] = (stats.hits - before.hits) / rows if rows else float("nan")
        return {"embedding_budget_mb": self.budget_mb, "tables_mb": size, "tables_over_budget": size / self.budget_mb,
                "host_cached_tables": {t.name: {"rows": t.rows, "cache_rows": cached[t.name]}
                                       for t in embedding.tables if t.name in cached},
                "tables_in_device_memory": [t.name for t in embedding.tables if t.name not in cached],
                "hit_rates": hit_rates}


def _placed_under_budget(args, sizes, device, sharding: dict[str, str]):
    """Our DLRM with its tables placed by the planner under ``args.embedding_budget_mb`` and the pinned placements
    ``sharding``, as the training stage places them on one process, and the planner's topology."""
    import argparse
    import dataclasses

    import torch

    from pipeline.bench.train_models import our_dlrm
    from pipeline.distributed.config import DistributedConfig
    from pipeline.distributed.model_parallel import make_planner
    from pipeline.errors import UserError
    from pipeline.modules.cached_collection import HostCachedCollection

    # The model built with tables of one row: its dense part is drawn as our_dlrm's (seeded), and the tables, tens of
    # GB at the real size, are drawn once, by the host-cached collection below (with build_model's generator, seed 0).
    model = our_dlrm(argparse.Namespace(**{**vars(args), "rows": 1}), sizes, "cpu")
    ec = model.embedding
    tables = [dataclasses.replace(t, rows=args.rows) for t in ec.tables]
    planner = make_planner(DistributedConfig(memory_per_rank_mb=args.embedding_budget_mb, sharding=dict(sharding)), 1,
                           device,
                           batch_size=args.batch, optimizer=args.optimizer, weight_bytes=4)
    plan = planner.plan(tables)
    cached = {name: p.cache_rows for name, p in plan.tables.items() if p.cache_rows}
    if not cached:
        raise UserError(f"--embedding-budget-mb {args.embedding_budget_mb:g}: every table fits in it, so none is "
                        "host-cached: give a budget below what the tables take")
    model.embedding = HostCachedCollection(tables, ec.feature_names, cached, ec.optimizer, backend=args.backend,
                                           validate_ids=False, generator=torch.Generator().manual_seed(0))
    return model.to(device), planner.topology


def print_placement(figures: dict) -> None:
    cached, resident = figures["host_cached_tables"], figures["tables_in_device_memory"]
    cache_rows = sum(c["cache_rows"] for c in cached.values())
    print(f"  embedding budget {_mib(figures['embedding_budget_mb'])} MiB, tables {_mib(figures['tables_mb'])} MiB "
          f"({figures['tables_over_budget']:.2f}x): {len(resident)} tables in device memory, {len(cached)} host-cached "
          f"behind device caches of {cache_rows:,} rows in all")


def print_hit_rates(figures: dict) -> None:
    cached = figures["host_cached_tables"]
    print("  cache hit rate over the timed steps (the share of a batch's distinct rows found in the cache):")
    for name, rate in figures["hit_rates"].items():
        print(f"    {name}: {rate:6.1%}, a cache of {cached[name]['cache_rows']:,} of its {cached[name]['rows']:,} rows")


def _mib(value: float) -> str:
    return f"{value:,.0f}" if value >= 10 else f"{value:.3g}"
