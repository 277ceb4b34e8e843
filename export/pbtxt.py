"""Every ``config.pbtxt`` of the repository, generated from one description of the tensors.

:class:`EnsembleSpec` is built once from the raw columns and the schema; each model's config, and
the ensemble's wiring, take their names, dtypes and dims from it, so no two configs can disagree
about a tensor (the INT32-vs-INT64 drift Merlin's users met).

Example::

    spec = EnsembleSpec.build(raw_columns, schema, embedding_dim_total=416)
    configs = model_configs(spec, ModelOptions(max_batch_size=1024))
    print(configs["ensemble"])
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from export.dense import padded_batch
from export.preprocess import CATEGORICAL_IDS, DENSE, MULTIHOT_IDS, MULTIHOT_LENGTHS, RawColumns
from export.request import LAYOUT_PARAMETER, RequestLayout
from pipeline.errors import UserError
from pipeline.schema import Schema

ENTRY = "ensemble"
"""The model clients call: the one python model of a fused export (``export.fuse=all``), else the Triton ensemble of
the chain."""
PREDICTION = "PREDICTION"
EMBEDDINGS = "EMBEDDINGS"
PRIORITY_BASE = 20
MAX_PRIORITY = 2**31
"""The rate-limiter priority of a model's k-th instance is ``PRIORITY_BASE ** k``, at most ``MAX_PRIORITY`` (Triton's is
32 bits)."""


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str  # Triton's TYPE_* name without the prefix: FP32, INT64, STRING, ...
    dims: tuple[int, ...]

    def pbtxt(self) -> str:
        return f'{{ name: "{self.name}" data_type: TYPE_{self.dtype} dims: [ {", ".join(map(str, self.dims))} ] }}'


@dataclass
class EnsembleSpec:
    """The tensors between the models: raw inputs, preprocess outputs, pooled embeddings, prediction."""

    raw: list[Tensor]
    features: list[Tensor]
    embeddings: Tensor
    layout: RequestLayout
    """Which raw columns the raw tensors hold, in order: the ensemble's ``layout`` parameter, read by clients."""
    prediction: Tensor = field(default_factory=lambda: Tensor(PREDICTION, "FP32", (1,)))

    @property
    def embedding_inputs(self) -> list[Tensor]:
        return [t for t in self.features if t.name != DENSE]

    @property
    def dense_input(self) -> Tensor | None:
        """``DENSE``, or None when the schema has no continuous feature (the tensor is left out)."""
        return next((t for t in self.features if t.name == DENSE), None)

    @property
    def dense_inputs(self) -> list[Tensor]:
        """What the dense model takes: ``DENSE`` (when the schema has continuous features), then ``EMBEDDINGS``."""
        return [t for t in (self.dense_input, self.embeddings) if t is not None]

    @classmethod
    def build(cls, raw: RawColumns, schema: Schema, embedding_dim_total: int) -> EnsembleSpec:
        """A tensor whose kind of feature the schema lacks is left out of every config (no ``dims: [ 0 ]``)."""
        multihot = set(schema.multihot)
        onehot = [c for c in schema.sparse if c not in multihot]
        if not schema.sparse:
            raise UserError("export needs at least one categorical or multi-hot feature (the models embed them); "
                            "the schema has none")
        layout = raw.layout
        tensors = [Tensor(t.name, t.datatype, t.dims) for t in layout.inputs]
        features = []
        if schema.continuous:
            features.append(Tensor(DENSE, "FP32", (len(schema.continuous),)))
        if onehot:
            features.append(Tensor(CATEGORICAL_IDS, "INT64", (len(onehot),)))
        if multihot:
            features += [Tensor(MULTIHOT_IDS, "INT64", (-1,)), Tensor(MULTIHOT_LENGTHS, "INT64", (len(multihot),))]
        return cls(tensors, features, Tensor(EMBEDDINGS, "FP32", (embedding_dim_total,)), layout)


@dataclass
class ModelOptions:
    """Serving options that change the configs (see ExportConfig for their meaning)."""

    max_batch_size: int = 1024
    instance_kind: str = "cpu"  # cpu | gpu
    instances: int = 1
    dynamic_batching: bool = True
    max_queue_delay_us: int = 0
    dense_backend: str = "python"  # python | pytorch
    cache_policy: str = "lru"
    cache_fraction: float = 0.25
    gpu_whole_tables_mb: float = 1024.0
    dense_threads: int = 1
    cuda_graphs: bool = True
    preprocess_on_gpu: bool = True
    pin_instances: bool = False
    fused: bool | None = None
    """One python model (raw rows -> probabilities), served as ``ensemble`` itself, in place of the Triton ensemble of
    ``preprocess``, ``embedding`` and ``dense``; None: wherever it can, with the python dense backend (measured faster
    than the chain on CPU and on GPU instances, docs/BENCHMARKS.md)."""

    def __post_init__(self) -> None:
        if self.fused is None:
            self.fused = self.dense_backend == "python"


def model_configs(spec: EnsembleSpec, options: ModelOptions) -> dict[str, str]:
    """Model name -> the text of its ``config.pbtxt``."""
    cache = {"cache_policy": options.cache_policy, "cache_fraction": str(options.cache_fraction),
             "gpu_whole_tables_mb": str(options.gpu_whole_tables_mb)}
    if options.fused:
        if options.dense_backend != "python":
            raise UserError("export.fuse=all runs the dense part in the python backend: "
                            "it needs export.dense_backend=python (or export.fuse=none)")
        # the entry clients call, with nothing in front of it: a Triton ensemble of this one step would add a hop (its
        # scheduler's hand-over of each request and answer, docs/BENCHMARKS.md)
        return {ENTRY: _python_model(ENTRY, spec.raw, [spec.prediction], options, graphs=True, parameters={
            **cache, **_dense_parameters(options), "preprocess_on_gpu": str(options.preprocess_on_gpu).lower(),
            LAYOUT_PARAMETER: spec.layout.to_json()})}
    return {
        "preprocess": _python_model("preprocess", spec.raw, spec.features, options, kind="cpu"),
        "embedding": _python_model("embedding", spec.embedding_inputs, [spec.embeddings], options,
                                   parameters=cache),
        "dense": _dense(spec, options),
        ENTRY: _ensemble(spec, options),
    }


def _dense_parameters(options: ModelOptions) -> dict[str, str]:
    return {"intra_op_threads": str(options.dense_threads), "cuda_graphs": str(options.cuda_graphs).lower()}


def _io(inputs: list[Tensor], outputs: list[Tensor]) -> str:
    return ("input [\n  " + ",\n  ".join(t.pbtxt() for t in inputs) + "\n]\n"
            + "output [\n  " + ",\n  ".join(t.pbtxt() for t in outputs) + "\n]\n")


def instance_groups(kind: str, count: int) -> str:
    """The ``instance_group`` of ``count`` instances of ``kind`` (``cpu``, ``gpu``: on each GPU), one group each, the
    k-th of rate-limiter priority :data:`PRIORITY_BASE` to the k (the server runs with
    ``--rate-limit=execution_count``).

    Triton hands a request to the free instance of the lowest executions x priority: so a light load goes to the first
    instance, the others taking one request in :data:`PRIORITY_BASE` each after the one before, and a heavy one to
    every instance that is free. Without priorities the instances take requests in turn, and each of a python model's
    processes finds its code and data gone from the CPU's caches by the time its turn comes (docs/BENCHMARKS.md,
    Serving)."""
    if count <= 1:
        return f"instance_group [ {{ kind: KIND_{kind.upper()} count: {count} }} ]\n"
    groups = ",\n  ".join(f"{{ kind: KIND_{kind.upper()} count: 1 rate_limiter {{ priority: "
                          f"{min(PRIORITY_BASE ** k, MAX_PRIORITY)} }} }}" for k in range(count))
    return f"instance_group [\n  {groups}\n]\n"


def regrouped(config: str, count: int, by_priority: bool = True) -> str:
    """A model's ``config.pbtxt`` with ``count`` instances of the kind it has in place of its instance groups: as the
    export writes them (:func:`instance_groups`), or in one group (``by_priority=False``: Triton's default, the
    instances taking requests in turn)."""
    groups = re.search(r"instance_group \[.*?\]\n", config, re.DOTALL).group(0)
    kind = re.search(r"KIND_(\w+)", groups).group(1)
    laid = (instance_groups(kind.lower(), count) if by_priority
            else f"instance_group [ {{ kind: KIND_{kind} count: {count} }} ]\n")
    return config.replace(groups, laid)


def _scheduling(options: ModelOptions, kind: str | None = None) -> str:
    text = instance_groups(kind or options.instance_kind, options.instances)
    if options.dynamic_batching:
        text += f"dynamic_batching {{ max_queue_delay_microseconds: {options.max_queue_delay_us} }}\n"
    return text


def _parameters(values: dict[str, str]) -> str:
    return "".join(f'parameters {{ key: "{k}" value: {{ string_value: "{_quoted(v)}" }} }}\n'
                   for k, v in values.items())


def _quoted(text: str) -> str:
    """``text`` inside a protobuf text-format string: its backslashes and double quotes escaped."""
    return text.replace("\\", "\\\\").replace('"', '\\"')


def _python_model(name: str, inputs: list[Tensor], outputs: list[Tensor], options: ModelOptions,
                  kind: str | None = None, parameters: dict[str, str] | None = None, graphs: bool = False) -> str:
    """``graphs``: the model runs a dense part, so its GPU instances replay CUDA graphs (warmed up at load)."""
    pinned = {"pin_cores": "true"} if options.pin_instances else {}  # export.instance.pin_to_core
    warm = graphs and options.cuda_graphs and (kind or options.instance_kind) == "gpu"
    return (f'name: "{name}"\nbackend: "python"\nmax_batch_size: {options.max_batch_size}\n'
            + _io(inputs, outputs) + _scheduling(options, kind) + _parameters({**(parameters or {}), **pinned})
            + (warmup(inputs, options.max_batch_size) if warm else ""))


def warmup(inputs: list[Tensor], max_batch: int) -> str:
    """Triton's ``model_warmup``: before an instance takes requests, a request of zeros (numbers 0, text and lists
    empty: missing) at each batch size a CUDA graph serves (what :func:`export.dense.padded_batch` pads a batch to:
    the powers of two up to ``max_batch``, and ``max_batch``), so each instance has captured its graphs by then. The
    instances a light load leaves idle (:func:`instance_groups`) would otherwise capture them in the middle of the
    first burst."""
    sizes = sorted({padded_batch(rows, max_batch) for rows in range(1, max_batch + 1)})
    entries = []
    for size in sizes:
        tensors = " ".join(f'inputs {{ key: "{t.name}" value: {{ data_type: TYPE_{t.dtype} dims: [ '
                           f'{", ".join(str(d if d > 0 else 1) for d in t.dims)} ] zero_data: true }} }}'
                           for t in inputs)
        entries.append(f'{{ name: "zeros of {size} rows" batch_size: {size} {tensors} }}')
    return "model_warmup [\n  " + ",\n  ".join(entries) + "\n]\n"


def _dense(spec: EnsembleSpec, options: ModelOptions) -> str:
    inputs = spec.dense_inputs
    if options.dense_backend == "python":
        # On GPU instances the pooled embeddings of ``embedding`` stay in GPU memory (the python backend moves
        # every input to the host unless told not to).
        on_gpu = {"FORCE_CPU_ONLY_INPUT_TENSORS": "no"} if options.instance_kind == "gpu" else {}
        return _python_model("dense", inputs, [spec.prediction], options,
                             parameters={**_dense_parameters(options), **on_gpu}, graphs=True)
    if options.dense_backend != "pytorch":
        raise UserError(f"export.dense_backend: expected python or pytorch, got {options.dense_backend!r}")
    renamed_in = [Tensor(f"INPUT__{i}", t.dtype, t.dims) for i, t in enumerate(inputs)]
    renamed_out = [Tensor("OUTPUT__0", spec.prediction.dtype, spec.prediction.dims)]
    return (f'name: "dense"\nplatform: "pytorch_libtorch"\nmax_batch_size: {options.max_batch_size}\n'
            + _io(renamed_in, renamed_out) + _scheduling(options))


def dense_tensor_names(spec: EnsembleSpec, options: ModelOptions) -> tuple[list[str], str]:
    """The dense model's own input names and output name, for the ensemble's maps."""
    if options.dense_backend == "pytorch":
        return [f"INPUT__{i}" for i in range(len(spec.dense_inputs))], "OUTPUT__0"
    return [t.name for t in spec.dense_inputs], PREDICTION


def _step(model: str, inputs: dict[str, str], outputs: dict[str, str]) -> str:
    maps = "".join(f'      input_map {{ key: "{k}" value: "{v}" }}\n' for k, v in inputs.items())
    maps += "".join(f'      output_map {{ key: "{k}" value: "{v}" }}\n' for k, v in outputs.items())
    return f'    {{\n      model_name: "{model}"\n      model_version: -1\n{maps}    }}'


def _ensemble(spec: EnsembleSpec, options: ModelOptions) -> str:
    """The Triton ensemble of the chain: ``preprocess`` -> ``embedding`` -> ``dense``."""
    dense_inputs, dense_output = dense_tensor_names(spec, options)
    steps = [
        _step("preprocess", {t.name: t.name for t in spec.raw}, {t.name: t.name for t in spec.features}),
        _step("embedding", {t.name: t.name for t in spec.embedding_inputs}, {EMBEDDINGS: EMBEDDINGS}),
        _step("dense", dict(zip(dense_inputs, [t.name for t in spec.dense_inputs])), {dense_output: PREDICTION}),
    ]
    return (f'name: "{ENTRY}"\nplatform: "ensemble"\nmax_batch_size: {options.max_batch_size}\n'
            + _io(spec.raw, [spec.prediction])
            + "ensemble_scheduling {\n  step [\n" + ",\n".join(steps) + "\n  ]\n}\n"
            + _parameters({LAYOUT_PARAMETER: spec.layout.to_json()}))
