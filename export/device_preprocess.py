"""A GPU instance's preprocess: the saved workflow's operators as torch kernels, one CUDA graph replayed a batch.

On the host, the workflow's work on a request is many numpy steps of a few microseconds each
(:class:`~export.preprocess.Preprocessor`). Here the same operators on the same values run on the instance's GPU,
captured once per padded batch size (:func:`export.dense.padded_batch`) and width of the request's text (8, 16,
32, 64 or 128 bytes), so a batch costs one copy in, one replay, one copy back and one wait. The model's tensors
come back to the host (``DENSE`` and ``CATEGORICAL_IDS``: a few kilobytes), where the embedding cache's index reads
the ids. The request's checks and its numbers' matrix stay the host's (:meth:`Preprocessor.read`), so a bad request
gets the same error.

A workflow is planned (:meth:`DevicePreprocessor.plan`) when its operators are FillMissing, Clip, LogOp, Normalize,
MissingIndicator and Cast on numbers and Categorify on one-hot text columns: the standard workflow
(:mod:`pipeline.etl.defaults`) without ``etl.hash_buckets`` or ``etl.hash_ids``, its categorical columns of the text
type and none multi-hot, and whose vocabularies' tables fit in the device's memory. Any other is served by the host's
preprocess. So is a batch the device would not read as
the host does: text that is not UTF-8 or holds a NUL byte inside a value (the host reads those as Arrow does, which
the host checks before the copy), a value whose key two values of a vocabulary share (the host finds those by their
bytes; the graph says so), text wider than :data:`~pipeline.etl.ops.text_lookup.LONG_BYTES`, and more rows than
the model's largest batch.

The arithmetic is the host's: numbers in float64 with each column's fitted parameters, cast where the host casts
them; categorical values found through the same 64-bit keys of their column and words
(:mod:`pipeline.etl.ops.text_lookup`), by a binary search of the keys sorted, each checked word by word against the
value found. On the CPU (``device="cpu"``) the same operators run as they are, without a graph.

Example (a GPU instance of the fused model)::

    preprocess = DevicePreprocessor.plan(Preprocessor.load(artifacts), "cuda:0", max_batch=1024)  # None: host only
    features = preprocess(request_tensors)     # what Preprocessor gives: {"DENSE": ..., "CATEGORICAL_IDS": ...}
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np
import torch

from export.cache_torch import aligned_spans, torch_dtype
from export.dense import capture, padded_batch
from export.preprocess import CATEGORICAL_IDS, DENSE, STRINGS, Preprocessor, fixed_width_text
from pipeline.etl.ops import Cast, Categorify, Clip, FillMissing, LogOp, MissingIndicator, Normalize
from pipeline.etl.ops.categorify import NULL_INDEX, OOV_INDEX, RESERVED
from pipeline.etl.ops.text_lookup import LONG_BYTES, MIX, SearchTables

_MIX = MIX - (1 << 64)
"""The multiplier's bits as an int64: torch multiplies int64 with wrap-around, as numpy does uint64."""
_TEXT_TYPES = ("string", "large_string")
_WIDTHS = (8, 16, 32, 64, LONG_BYTES)
"""The text widths (bytes) a graph is captured for: a request's width rounds up to the next."""


class Request(NamedTuple):
    """A checked request (:meth:`DevicePreprocessor.checked`): its rows, its numbers ``[column, B]`` float64 (NaN:
    missing), its text ``[B, columns, width]`` uint8."""

    batch: int
    numbers: np.ndarray | None
    text: np.ndarray | None


class _Unsupported(Exception):
    """The workflow holds what the device does not run."""


class _Row:
    """A column's values: row ``k`` of the ``[column, B]`` tensor ``matrix`` (the rows an operator computes
    together stay one tensor, and the next operator takes them as they are: no copy to stack them again)."""

    __slots__ = ("k", "matrix")

    def __init__(self, matrix: torch.Tensor, k: int) -> None:
        self.matrix, self.k = matrix, k


class _Text:
    """A raw text column: the ``k``-th of the request's text (its values' words: ``words[:, k]`` of the batch's
    ``[B, columns, W]``)."""

    __slots__ = ("k", "name")

    def __init__(self, k: int, name: str) -> None:
        self.k, self.name = k, name


def _stacked(values: list[_Row]) -> torch.Tensor:
    """The ``[column, B]`` tensor of the columns ``values``: a view where they are consecutive rows of one matrix."""
    first = values[0]
    if all(v.matrix is first.matrix and v.k == first.k + i for i, v in enumerate(values)):
        return first.matrix[first.k: first.k + len(values)]
    return torch.stack([v.matrix[v.k] for v in values])


def _runs(values: list[_Row]) -> list[tuple[int, torch.Tensor]]:
    """The columns ``values`` as runs of consecutive rows of one matrix: (the first column's place, ``[rows, B]``)."""
    runs: list[tuple[int, torch.Tensor]] = []
    start = 0
    for end in range(1, len(values) + 1):
        if end == len(values) or values[end].matrix is not values[start].matrix \
                or values[end].k != values[end - 1].k + 1:
            runs.append((start, _stacked(values[start:end])))
            start = end
    return runs


class _Vocabulary:
    """A Categorify operator's :class:`SearchTables` on a device, in the order of its keys sorted as the int64
    torch searches: each key's entry (its first word, count of words, code, where its other words start) at its
    place, and after the last an entry that matches no value (the place a key beyond them all is searched to)."""

    def __init__(self, tables: SearchTables, device: torch.device) -> None:
        signed = tables.keys.view(np.int64)
        order = np.argsort(signed, kind="stable")
        never = len(tables.first) - 1  # the tables' entry that matches no value
        at = np.append(order, never)
        self.shared = tables.held < len(tables.keys)

        def on_device(values: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(values)).to(device)

        keys = np.append(signed[order], np.iinfo(np.int64).max)
        self.keys = on_device(keys)
        # by place: what a value found there must match (key, first word, count of words), then its code; one gather
        self.entries = on_device(np.stack([keys, tables.first[at].view(np.int64), tables.counts[at].astype(np.int64),
                                           tables.positions[at].astype(np.int64) + RESERVED], axis=1))
        self.rest_starts = on_device(tables.rest_starts[at].astype(np.int64))
        self.rest = on_device(tables.rest.view(np.int64))
        self.is_shared = on_device(at >= tables.held) if self.shared else None  # the never entry: its key never equal
        self.seeds = {name: int(np.array(seed, np.uint64).view(np.int64)) for name, seed in tables.seeds.items()}


def _mix(x: torch.Tensor) -> torch.Tensor:
    """:func:`pipeline.etl.ops.text_lookup._mix` on int64 (the same bits: the shift made logical by its mask)."""
    x = x * _MIX
    return x ^ ((x >> 32) & 0xFFFFFFFF)


class DevicePreprocessor:
    """A :class:`Preprocessor`'s work on ``device``, for the workflows it plans (:meth:`plan`); the host's
    preprocessor (``host``) answers every batch it does not (counted: ``batches_on_device``, ``batches_on_host``)."""

    def __init__(self, host: Preprocessor, device: str | torch.device, max_batch: int) -> None:
        self.host = host
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.max_batch = max_batch
        self.batches_on_device = self.batches_on_host = 0
        layout = host.layout
        self._continuous = list(host.raw.continuous)
        self._strings = list(layout.strings) if STRINGS in {t.name for t in layout.inputs} else []
        self._outputs = [(DENSE, host.continuous, torch.float32)] * bool(host.continuous) + \
            [(CATEGORICAL_IDS, host.onehot, torch.int64)] * bool(host.onehot)
        self._spec = [(name, len(names), np.dtype(np.float32 if dtype == torch.float32 else np.int64))
                      for name, names, dtype in self._outputs]  # the model's tensors as run() takes its outputs
        self._vocabularies: dict[int, _Vocabulary] = {}
        self._constants: dict[Any, torch.Tensor] = {}
        self._graphs: dict[tuple[int, int], _BatchGraph] = {}

    @property
    def tensor_names(self) -> list[str]:
        """The model's tensors it computes, in the order of :meth:`_forward`'s runs."""
        return [name for name, _, _ in self._outputs]

    @property
    def _flagged(self) -> bool:
        """Whether a batch's answer says if the host must answer it: some vocabulary has values sharing a key."""
        return any(vocab.shared for vocab in self._vocabularies.values())

    @classmethod
    def plan(cls, host: Preprocessor, device: str | torch.device, max_batch: int) -> DevicePreprocessor | None:
        """The device's preprocess for ``host``'s workflow, or None where that workflow holds what it does not run
        (see the module docstring), or where its vocabularies' tables (about 50 bytes a value) do not fit in the
        device's free memory."""
        workflow, raw = host.workflow, host.raw
        if workflow is None or raw.multihot or host.multihot or any(t not in _TEXT_TYPES for t in raw.categorical.values()):
            return None
        planned = cls(host, device, max_batch)
        try:  # every node once, on a batch of one row: what it cannot run says so now
            with torch.inference_mode(), on_device(planned.device):
                planned._forward(planned._zeros((len(planned._continuous), 1), torch.float64),
                                 planned._zeros((1, len(planned._strings), 8), torch.uint8))
        except _Unsupported:
            return None
        except torch.OutOfMemoryError:  # the vocabularies' tables do not fit beside what the device holds already
            planned._vocabularies.clear()
            planned._constants.clear()
            if planned.device.type == "cuda":
                torch.cuda.empty_cache()
            return None
        return planned

    def __call__(self, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """What ``host(tensors)`` gives, computed on the device where it can be."""
        found = None
        request = self.checked(tensors)
        if request is not None:
            with torch.inference_mode(), on_device(self.device):
                found = self.run(request, self._spec, _placed, self._graphs)
        if found is None:
            self.batches_on_host += 1
            return self.host(tensors)
        self.batches_on_device += 1
        return found

    def checked(self, tensors: Mapping[str, np.ndarray]) -> Request | None:
        """A request's tensors as the device reads them, checked as the host checks them (its error where one is
        wrong); None where the host must answer it (see the module docstring)."""
        batch, numbers, text = self.host.read(tensors)
        strings = text.get(STRINGS)
        if batch > self.max_batch or (strings is not None and (strings.dtype.itemsize > LONG_BYTES
                                                               or not fixed_width_text(strings.reshape(-1)))):
            return None
        raw = None if strings is None else np.ascontiguousarray(strings).view(np.uint8).reshape(*strings.shape, -1)
        return Request(batch, numbers, raw)

    def run(self, request: Request, outputs: list[tuple[str, int, np.dtype]], finish: Finish,
            graphs: dict) -> dict[str, np.ndarray] | None:
        """``outputs`` (name, columns, dtype) of a checked request, which ``finish`` computes on the device from the
        model's tensors (in runs, :meth:`_forward`) into a ``[B, columns]`` tensor each; in a CUDA graph kept in
        ``graphs`` per padded batch and text width. None where the batch's answer says the host must answer it."""
        batch, numbers, text = request
        width = next(w for w in _WIDTHS if w >= (0 if text is None else text.shape[2]))
        if self.device.type != "cuda":
            return self._eager(request, width, outputs, finish)
        padded = padded_batch(batch, self.max_batch)
        graph = graphs.get((padded, width))
        if graph is None:
            graph = graphs[padded, width] = _BatchGraph(self, padded, width, outputs, finish)
        return graph(batch, numbers, text)

    def _eager(self, request: Request, width: int, outputs: list[tuple[str, int, np.dtype]],
               finish: Finish) -> dict[str, np.ndarray] | None:
        batch, numbers, text = request
        staged = np.zeros((batch, len(self._strings), width), np.uint8)
        if text is not None:
            staged[:, :, : text.shape[2]] = text
        matrix = np.zeros((0, batch)) if numbers is None else numbers
        runs, flag = self._forward(torch.from_numpy(matrix), torch.from_numpy(staged))
        if flag is not None and flag.item():
            return None
        targets = [torch.empty((batch, columns), dtype=torch_dtype(dtype)) for _, columns, dtype in outputs]
        finish(runs, targets)
        return {name: target.numpy() for (name, _, _), target in zip(outputs, targets)}

    def _forward(self, numbers: torch.Tensor,
                 text: torch.Tensor) -> tuple[list[list[tuple[int, torch.Tensor]]], torch.Tensor | None]:
        """The model's tensors of a batch, each as runs of its columns (:func:`_runs`: where the run's first column
        goes, its rows ``[columns, B]``), and, where some vocabulary has values sharing a key (:attr:`_flagged`),
        whether one of the batch's is one (the host must answer it). ``numbers`` ``[column, B]`` float64 (NaN:
        missing), ``text`` ``[B, columns, width]`` uint8 (each value's bytes, then zeros). Tensor work only, nothing
        the host waits for: what a CUDA graph captures."""
        padded = text.shape[0]
        words = text.view(torch.int64)
        raw: dict[str, Any] = {name: _Row(numbers, k) for k, name in enumerate(self._continuous)}
        raw.update({name: _Text(k, name) for k, name in enumerate(self._strings)})
        for name in self.host.raw.label:
            raw[name] = _Row(self._constant(("zeros", padded), lambda: torch.zeros((1, padded), dtype=torch.float64)), 0)
        shared: list[torch.Tensor] = []
        results: dict[int, dict[str, Any]] = {}
        nodes = self.host.workflow.nodes
        for node in nodes:
            if node.is_selection:
                results[id(node)] = {name: raw[name] for name in node.output_columns}
                continue
            inputs = {name: results[id(parent)][name] for parent in node.parents for name in parent.output_columns}
            results[id(node)] = inputs if node.op is None else self._apply(node.op, inputs, words, shared)
        out = results[id(nodes[-1])]
        outputs = []
        for _, names, _ in self._outputs:
            columns = [out[name] for name in names]
            if any(isinstance(c, _Text) for c in columns):
                raise _Unsupported("a model input of raw text")
            outputs.append(_runs(columns))
        flag = torch.stack(shared).any().to(torch.int64) if shared else None
        return outputs, flag

    def _apply(self, op: Any, inputs: dict[str, Any], words: torch.Tensor,
               shared: list[torch.Tensor]) -> dict[str, Any]:
        names = list(inputs)
        kind = type(op)
        if kind is Categorify:
            texts = list(inputs.values())
            if not all(isinstance(t, _Text) for t in texts) or any(op.multihot.get(name) for name in names):
                raise _Unsupported("Categorify of other than one-hot raw text")
            codes = self._codes(op, texts, words, shared)
            return {name: _Row(codes, k) for k, name in enumerate(op.output_columns(names))}
        if any(isinstance(v, _Text) or not v.matrix.is_floating_point() for v in inputs.values()):
            raise _Unsupported(f"{kind.__name__} of other than numbers")
        rows = _stacked(list(inputs.values())).double()
        step = self._steps().get(kind)
        if kind is Cast:
            dtype = np.dtype(op.dtype)
            if dtype.kind != "f":
                raise _Unsupported(f"Cast to {dtype}")
            out = rows.to(torch_dtype(dtype))
        elif step is not None:
            out = step(op, names, rows)
        else:
            raise _Unsupported(kind.__name__)
        return {name: _Row(out, k) for k, name in enumerate(op.output_columns(names) if kind is not Cast else names)}

    def _steps(self) -> dict[type, Callable[[Any, list[str], torch.Tensor], torch.Tensor]]:
        """Each numeric operator's ``transform_rows`` on a ``[column, row]`` float64 tensor."""
        return {
            FillMissing: lambda op, names, rows: torch.where(
                torch.isnan(rows), self._per_row(op, "fill_of", names, op.fill_of), rows),
            Clip: lambda op, names, rows: torch.clamp(rows, op.min_value, op.max_value),
            LogOp: lambda op, names, rows: op.of(torch, rows),
            Normalize: lambda op, names, rows: ((rows - self._per_row(op, "center", names, op.center))
                                                / self._per_row(op, "divisor", names, op.divisor)).float(),
            MissingIndicator: lambda op, names, rows: torch.isnan(rows).float(),
        }

    def _codes(self, op: Categorify, texts: list[_Text], words: torch.Tensor,
               shared: list[torch.Tensor]) -> torch.Tensor:
        """The codes ``[column, row]`` of the text columns ``texts`` (Categorify's: reserved codes, then each
        value's position in its vocabulary); where the vocabulary has values sharing a key, whether a value of the
        batch has such a key goes to ``shared``."""
        vocab = self._vocabularies.get(id(op))
        if vocab is None:
            vocab = self._vocabularies[id(op)] = _Vocabulary(op.index().tables(), self.device)
        first = texts[0].k
        if [t.k for t in texts] == list(range(first, first + len(texts))):  # the request's columns as they lie
            values = words[:, first: first + len(texts)].transpose(0, 1)
        else:
            values = torch.stack([words[:, t.k] for t in texts])
        seeds = self._constant(("seeds", id(op), tuple(t.name for t in texts)),
                               lambda: torch.tensor([[vocab.seeds[t.name]] for t in texts], dtype=torch.int64))
        head = values[..., 0]
        keys, counts = _mix(seeds ^ head), head != 0
        for k in range(1, values.shape[2]):
            word = values[..., k]
            present = word != 0
            counts = counts + present if k > 1 else counts.long() + present
            keys = torch.where(present, _mix(keys ^ word), keys)
        found = torch.searchsorted(vocab.keys, keys.reshape(-1)).view_as(keys)
        entry = vocab.entries[found]
        same = (entry[..., :3] == torch.stack([keys, head, counts], -1)).all(-1)
        if values.shape[2] > 1:
            starts = vocab.rest_starts[found]
            for k in range(1, values.shape[2]):
                same &= (counts <= k) | (vocab.rest[starts + (k - 1)] == values[..., k])
        if vocab.is_shared is not None:
            shared.append((vocab.is_shared[found] & (entry[..., 0] == keys)).any())
        codes = torch.where(same, entry[..., 3], OOV_INDEX)
        return torch.where(head == 0, NULL_INDEX, codes)

    def _per_row(self, op: Any, what: str, names: list[str], value: Callable[[str], float]) -> torch.Tensor:
        """``value`` of each column as a ``[column, 1]`` float64 tensor on the device, made once."""
        return self._constant((id(op), what, tuple(names)),
                              lambda: torch.tensor([[value(name)] for name in names], dtype=torch.float64))

    def _constant(self, key: Any, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A tensor on the device made at the first run (outside any graph's capture: its copy would break it)."""
        found = self._constants.get(key)
        if found is None:
            found = self._constants[key] = make().to(self.device)
        return found

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)


Finish = Callable[[list, list[torch.Tensor]], None]
"""What a batch's graph computes from the model's tensors (runs of columns, :meth:`DevicePreprocessor._forward`)
into its output tensors."""


def place(target: torch.Tensor, runs: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """``target`` ``[B, columns]`` with each run of columns (:func:`_runs`) copied to its place."""
    for start, rows in runs:
        target[:, start: start + len(rows)].copy_(rows.T)
    return target


def _placed(runs: list[list[tuple[int, torch.Tensor]]], targets: list[torch.Tensor]) -> None:
    """The model's tensors as they are."""
    for target, tensor_runs in zip(targets, runs):
        place(target, tensor_runs)


class _BatchGraph:
    """The device's preprocess and ``finish`` captured for ``batch`` rows of text ``width`` bytes wide: the batch's
    numbers and text lie in one page-locked buffer that goes over in one copy (the rows past the batch zero), and
    ``outputs`` (with the host's flag, where there is one) come back in one."""

    def __init__(self, plan: DevicePreprocessor, batch: int, width: int, outputs: list[tuple[str, int, np.dtype]],
                 finish: Finish) -> None:
        device = plan.device
        specs_in = [((len(plan._continuous), batch), np.float64), ((batch, len(plan._strings), width), np.uint8)]
        specs_out = [((batch, columns), dtype) for _, columns, dtype in outputs] + [((), np.int64)] * plan._flagged
        self._host, self._buffer = _pinned(specs_in, device)
        self._answer, self._out_buffer = _pinned(specs_out, device)
        self._host_in = _views(self._host.numpy(), specs_in)
        device_in = _tensor_views(self._buffer, specs_in)
        self._host_out = _views(self._answer.numpy(), specs_out)
        device_out = _tensor_views(self._out_buffer, specs_out)
        self._names = [name for name, _, _ in outputs]
        self._flagged = plan._flagged

        def forward() -> torch.Tensor:
            runs, flag = plan._forward(*device_in)
            finish(runs, device_out[: len(outputs)])
            if flag is not None:
                device_out[-1].copy_(flag)
            return self._out_buffer

        self.graph, _ = capture(forward, device)
        self._done = torch.cuda.Event()

    def __call__(self, rows: int, numbers: np.ndarray | None, text: np.ndarray | None) -> dict[str, np.ndarray] | None:
        host_numbers, host_text = self._host_in
        if numbers is not None:
            host_numbers[:, :rows] = numbers
        if text is not None:
            host_text[:rows, :, : text.shape[2]] = text
            host_text[:rows, :, text.shape[2]:] = 0
            host_text[rows:] = 0  # rows of an earlier batch: none of their values is looked up for a flag
        self._buffer.copy_(self._host, non_blocking=True)
        self.graph.replay()
        self._answer.copy_(self._out_buffer, non_blocking=True)
        self._done.record()
        self._done.synchronize()
        if self._flagged and self._host_out[-1]:
            return None
        return {name: out[:rows].copy() for name, out in zip(self._names, self._host_out)}


def _pinned(specs: list, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A page-locked host buffer for ``specs`` (:func:`export.cache_torch.aligned_spans`) and its device twin."""
    _, size = aligned_spans(specs)
    size = max(size, 1)
    return torch.zeros(size, dtype=torch.uint8, pin_memory=True), torch.zeros(size, dtype=torch.uint8, device=device)


def _views(buffer: np.ndarray, specs: list) -> list[np.ndarray]:
    spans, _ = aligned_spans(specs)
    return [buffer[start: start + size].view(dtype).reshape(shape) for (start, size), (shape, dtype) in zip(spans, specs)]


def _tensor_views(buffer: torch.Tensor, specs: list) -> list[torch.Tensor]:
    spans, _ = aligned_spans(specs)
    return [buffer[start: start + size].view(torch_dtype(dtype)).view(shape)
            for (start, size), (shape, dtype) in zip(spans, specs)]


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """The device as torch's current one, for a CUDA device; nothing for the CPU."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def for_instance(host: Preprocessor, args: dict, params: dict[str, str]) -> Preprocessor | DevicePreprocessor:
    """The preprocess of a Triton model instance: on its GPU for a ``KIND_GPU`` instance whose workflow it plans,
    unless the model parameter ``preprocess_on_gpu`` is ``false`` (``export.preprocess_on_gpu``); else ``host``."""
    if args.get("model_instance_kind") != "GPU" or params.get("preprocess_on_gpu", "true") != "true":
        return host
    max_batch = json.loads(args["model_config"])["max_batch_size"]
    return DevicePreprocessor.plan(host, f"cuda:{args['model_instance_device_id']}", max_batch) or host
