"""What the training builds, as plain data (``model.json``), and the trained model read back.

A spec lists the model kind, its sizes, the embedding optimizer and dtype, the seed, the tables and
the schema: everything :func:`model_from_spec` needs to build the same (untrained) model again.
A run's folder (:mod:`pipeline.train.runs`) holds ``model.json`` (the spec) and ``model.pt`` (the final ``state_dict``, as
one process holds it), which :func:`load_trained` reads.

Example::

    spec = model_spec(cfg.train, schema, "cpu", seed=0)
    model = model_from_spec(spec)
    model, schema = load_trained("data/synthetic/train/latest")   # for export: model.embedding, model.dense_forward
"""

from __future__ import annotations

import pickle
from dataclasses import asdict
from pathlib import Path

import torch

from pipeline.errors import UserError
from pipeline.files import DamagedFileError, read_json
from pipeline.modules.configs import EmbeddingOptimizerConfig, TableConfig
from pipeline.modules.models import DCNv2, ModelSizes, RecModel, build_model, model_tables
from pipeline.schema import Schema
from pipeline.train.config import TrainConfig

MODEL_SPEC_VERSION = 1


def model_spec(cfg: TrainConfig, schema: Schema, device_kind: str, seed: int = 0) -> dict:
    """What to build for ``cfg`` on ``schema``, as plain data (sizes of preset ``auto`` follow ``device_kind``)."""
    sizes = ModelSizes.from_train_config(cfg, device_kind)
    optimizer = EmbeddingOptimizerConfig(cfg.embedding_optimizer, lr=cfg.table_lr, weight_decay=cfg.weight_decay,
                                         master_weights=cfg.embedding_master_weights,
                                         stochastic_rounding=cfg.embedding_stochastic_rounding)
    tables = model_tables(cfg.model, schema, sizes, cfg.admit_after)
    output_dim = sum(table.dim * len(table.features) for table in tables)
    cross_width = DCNv2.x0_width(sizes, schema)
    if cfg.model == "dcnv2":
        sizes = sizes.for_width(cross_width, rank_set=bool(cfg.cross_rank))
    _check_sizes(cfg, sizes, ModelSizes.preset_name(cfg.preset, device_kind), len(schema.continuous), cross_width)
    return {
        "version": MODEL_SPEC_VERSION,
        "model": cfg.model,
        "sizes": asdict(sizes),
        "embedding_optimizer": asdict(optimizer),
        "embedding_dtype": cfg.embedding_dtype,
        "seed": seed,
        "admit_after": cfg.admit_after,
        "feature_names": list(schema.sparse),
        "tables": [asdict(table) for table in tables],
        "embedding_output_dim": output_dim,
        "num_dense": len(schema.continuous),
        "schema": schema.to_dict(),
        "loop": {name: getattr(cfg, name) for name in LOOP_SETTINGS},
    }


LOOP_SETTINGS = ("epochs", "max_steps", "batch_size", "eval_every", "optimizer", "lr", "weight_decay", "warmup_fraction",
                 "warmup_steps", "decay", "decay_start", "min_lr_ratio", "amp", "early_stopping")
"""The ``train.*`` settings of the loop (beside the model's) that decide the steps a run takes: a resumed run keeps
them (:func:`check_same_model`), but for those of :data:`SAID_SETTINGS`."""
SAID_SETTINGS = ("epochs", "max_steps", "eval_every")
"""Of :data:`LOOP_SETTINGS`, those a resumed run may change (to train on longer or stop sooner, or to evaluate more
or less often): said, not refused."""


def _check_sizes(cfg: TrainConfig, sizes: ModelSizes, preset: str, num_dense: int, cross_width: int) -> None:
    """Refuse sizes the model of ``cfg`` cannot be built with (or only larger and no better), naming the
    settings or the preset that set them."""
    if cfg.model == "dlrm" and num_dense and sizes.bottom_mlp[-1] != sizes.embedding_dim:
        dim_from = "train.embedding_dim" if cfg.embedding_dim else f"the {preset} preset's"
        raise UserError(f"train.bottom_mlp={sizes.bottom_mlp}: DLRM's bottom MLP must end in the embedding dim "
                        f"({sizes.embedding_dim}, {dim_from}), as its output meets the embeddings in dot products; "
                        f"end it in {sizes.embedding_dim}, or set train.embedding_dim={sizes.bottom_mlp[-1]}")
    if cfg.model == "dcnv2" and sizes.cross_rank > cross_width:
        rank_from = "train.cross_rank" if cfg.cross_rank else f"train.cross_rank (0: the {preset} preset's)"
        raise UserError(f"{rank_from}={sizes.cross_rank} is larger than the width of the cross layers, {cross_width}, "
                        f"where a full-rank layer is smaller and as expressive; set train.cross_rank={cross_width} or "
                        "less")


def model_from_spec(spec: dict, backend: str = "auto") -> RecModel:
    """The (untrained) model a spec describes."""
    if spec.get("version") != MODEL_SPEC_VERSION:
        raise UserError(f"model.json version {spec.get('version')} is not supported (expected {MODEL_SPEC_VERSION})")
    schema = Schema.from_dict(spec["schema"])
    model = build_model(spec["model"], schema, ModelSizes(**spec["sizes"]),
                        EmbeddingOptimizerConfig(**spec["embedding_optimizer"]), weights_dtype=spec["embedding_dtype"],
                        backend=backend, seed=spec["seed"], admit_after=spec.get("admit_after", 1))
    built = [asdict(t) for t in model.embedding.tables]
    if built != _tables(spec):
        raise UserError("model.json lists other tables than its schema builds; retrain the model")
    return model


def _tables(spec: dict) -> list[dict]:
    """The spec's tables with every field (one the spec leaves out takes its default)."""
    return [asdict(TableConfig(**t)) for t in spec["tables"]]


def check_same_model(spec: dict, folder: str | Path) -> list[str]:
    """Refuse to resume the checkpoints of ``folder`` when its ``model.json`` describes another model, or a loop of
    other settings; the changes to say of those it may change (:data:`SAID_SETTINGS`)."""
    folder = Path(folder)
    previous = folder / "model.json"
    if not previous.is_file():
        return []
    old = read_json(previous, "rerun without train.resume")
    if not isinstance(old, dict) or not isinstance(old.get("tables"), list):
        raise UserError(f"{previous} is not the record of a model (no list of tables): rerun without "
                        "train.resume, or restore the file")
    old["tables"] = _tables(old)
    trained = {t["admit_after"] for t in old["tables"] if t["dynamic"]}
    now = {t["admit_after"] for t in spec["tables"] if t["dynamic"]}
    if trained and now and trained != now:
        raise UserError(f"train.resume=true, but the checkpoints in {folder / 'checkpoints'} were trained with "
                        f"train.admit_after={min(trained)}, not {min(now)}: resume with train.admit_after={min(trained)}, "
                        "or rerun without train.resume")
    differ = [k for k in ("model", "sizes", "embedding_optimizer", "embedding_dtype", "tables", "feature_names",
                          "num_dense") if old.get(k) != spec.get(k)]
    fitted = old.get("schema", {}).get("workflow"), spec["schema"].get("workflow")
    if all(fitted) and fitted[0] != fitted[1]:
        differ.append("ETL workflow: it was fitted again, so its ids and statistics are others")
    if differ:
        raise UserError(f"train.resume=true, but the checkpoints in {folder / 'checkpoints'} are of another model "
                        f"(different {', '.join(differ)}); rerun without train.resume, or with the settings and the "
                        "ETL output the run was trained with")
    loop, now_loop = old.get("loop") or {}, spec.get("loop", {})
    changed = [name for name in loop if name in now_loop and loop[name] != now_loop[name]]
    said = [name for name in changed if name in SAID_SETTINGS]
    # another optimizer changes the lrs chosen for it too: it alone is named
    refused = ["optimizer"] if "optimizer" in changed else [n for n in changed if n not in SAID_SETTINGS]
    if refused:
        trained = " ".join(f"train.{name}={_setting_text(loop[name])}" for name in refused)
        given = " ".join(f"train.{name}={_setting_text(now_loop[name])}" for name in refused)
        raise UserError(f"train.resume=true, but the run in {folder} was trained with {trained}, and this command "
                        f"gives {given}: resume it with the run's settings (the command that started it, with "
                        "train.resume=true train.run=...), or start another run")
    return [f"train.{name}={_setting_text(now_loop[name])} where the run was started with "
            f"train.{name}={_setting_text(loop[name])}" + (": its schedule follows the new length" if name != "eval_every"
                                                           else "") for name in said]


def _setting_text(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else f"{value:g}" if isinstance(value, float) else str(value)


def load_trained(folder: str | Path, device: str | torch.device = "cpu",
                 backend: str = "auto") -> tuple[RecModel, Schema]:
    """The model trained into ``folder`` (in eval mode, on ``device``) and the schema it was trained with.

    Example::

        model, schema = load_trained(cfg.paths.train / "latest")
        pooled = model.embedding(kjt)                  # the embedding part (one Triton model)
        logits = model.dense_forward(dense, pooled)    # the dense part (another)
        model.embedding.table_weight("t_C1")           # a table's [rows, dim] weights
    """
    folder = Path(folder)
    spec_path, weights_path = folder / "model.json", folder / "model.pt"
    if not spec_path.is_file() or not weights_path.is_file():
        raise UserError(f"no trained model in {folder}: run `python -m pipeline run train` first")
    again = "train again (`python -m pipeline run train`), or export another run (export.run=NAME)"
    spec = read_json(spec_path, again)
    model = model_from_spec(spec, backend=backend)
    try:
        weights = torch.load(weights_path, map_location="cpu", weights_only=True)
    except PermissionError:
        raise
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError) as err:  # torch's zip reader: OSError EINVAL
        raise DamagedFileError(f"{weights_path} does not read as saved weights ({err}): it was cut short or "
                               f"changed by hand; {again}") from err
    model.load_state_dict(weights)
    return model.to(device).eval(), Schema.from_dict(spec["schema"])
