"""A small client of the served ensemble: raw rows in, click probabilities out, over HTTP or gRPC.

Rows may be a pandas DataFrame, a list of dicts (column -> value), or Criteo TSV lines (label
first, optional; then the continuous and categorical columns in order; empty fields are missing).
Missing values may be ``None`` / NaN or absent keys; the server applies the workflow's missing
handling, and unseen categories get the out-of-vocabulary index. A label column is ignored; any
other column the model does not take is an error (a misspelt name would otherwise read as missing). The input names, types and order
come from the server's own model metadata, so nothing is repeated here.

Over gRPC the client speaks through Triton's generated stub (``tritonclient.grpc.service_pb2_grpc``):
each tensor travels as raw bytes, string columns encoded by numpy (:func:`export.wire.encode_bytes`)
rather than value by value in Python. Over HTTP it uses ``tritonclient.http``.

Example::

    with Client("127.0.0.1:8001", protocol="grpc") as client:
        client.predict([{"I1": 3, "C1": "68fd1e64"}, {"I1": None}])     # numpy [2] probabilities
        client.predict(open("day_0.tsv").readlines()[:100])
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from export.wire import encode_bytes
from pipeline.errors import BadInputError, UserError

PREDICTION = "PREDICTION"
MAX_GRPC_MESSAGE = 2**31 - 1
"""Triton's own limit on a gRPC message; grpc's default (4 MiB) would refuse a large batch."""


class ServingError(UserError):
    """The server answered a request with an error; the message is the server's, ``status`` its status
    (HTTP ``"400"`` for a bad request, ``"500"`` for a server fault; gRPC ``"StatusCode.INVALID_ARGUMENT"``...)."""

    def __init__(self, message: str, status: str | None = None) -> None:
        super().__init__(message)
        self.status = status


class Client:
    """A connection to a Triton server serving the ensemble ``model``."""

    def __init__(self, url: str, protocol: str = "http", model: str = "ensemble", timeout_s: float = 60.0,
                 ignore_columns: Sequence[str] = ("label",)) -> None:
        if protocol not in ("http", "grpc"):
            raise ValueError(f"protocol: expected http or grpc, got {protocol!r}")
        self.url, self.protocol, self.model, self.timeout_s = url, protocol, model, timeout_s
        self.ignore_columns = set(ignore_columns)
        if protocol == "http":
            import tritonclient.http as triton
            self._client = triton.InferenceServerClient(url, connection_timeout=timeout_s, network_timeout=timeout_s)
            self._triton = triton
        else:
            import grpc
            from tritonclient.grpc import service_pb2, service_pb2_grpc

            self._channel = grpc.insecure_channel(url, options=[("grpc.max_send_message_length", MAX_GRPC_MESSAGE),
                                                                ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE)])
            self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
            self._messages = service_pb2
        self._inputs: list[tuple[str, str]] | None = None
        self._separator = "|"

    @property
    def inputs(self) -> list[tuple[str, str]]:
        """(name, Triton datatype) of every raw input, in the ensemble's order."""
        if self._inputs is None:
            if self.protocol == "grpc":
                meta = self._call(self._stub.ModelMetadata, self._messages.ModelMetadataRequest(name=self.model))
                config = self._call(self._stub.ModelConfig, self._messages.ModelConfigRequest(name=self.model))
                self._inputs = [(i.name, i.datatype) for i in meta.inputs]
                params = {k: v.string_value for k, v in config.config.parameters.items()}
            else:
                meta = self._call(self._client.get_model_metadata, self.model)
                config = self._call(self._client.get_model_config, self.model)
                self._inputs = [(i["name"], i["datatype"]) for i in meta["inputs"]]
                params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
            self._separator = params.get("list_separator", "|")
            if params.get("label"):
                self.ignore_columns.add(params["label"])
        return self._inputs

    def predict(self, rows: Any) -> np.ndarray:
        """Probabilities ``[B]`` for raw rows (DataFrame, list of dicts, or Criteo TSV lines)."""
        columns = self.columns(rows)
        if not len(next(iter(columns.values()))):
            raise BadInputError("empty batch: expected at least one row")
        return self.infer(columns)

    def columns(self, rows: Any) -> dict[str, np.ndarray]:
        """The request tensors for ``rows`` (``[B, 1]`` each), without sending them."""
        if isinstance(rows, str):
            rows = rows.splitlines()
        if hasattr(rows, "columns") and hasattr(rows, "iloc"):
            return self._from_frame(rows)
        rows = list(rows)
        if rows and all(isinstance(r, (str, bytes)) for r in rows):
            return self._from_tsv(rows)
        if all(isinstance(r, dict) for r in rows):
            return self._from_dicts(rows)
        raise BadInputError("rows: expected a DataFrame, a list of dicts or TSV lines, got "
                            f"{type(rows[0]).__name__ if rows else 'an empty list'}")

    def infer(self, columns: dict[str, np.ndarray]) -> np.ndarray:
        """Send exactly these tensors (name -> array; dtype gives the Triton type) and return ``[B]``."""
        if self.protocol == "grpc":
            return self._infer_grpc(columns)
        request = []
        for name, array in columns.items():
            array = np.asarray(array)
            datatype = "BYTES" if array.dtype.kind in "OSU" else self._triton_dtype(array.dtype)
            tensor = self._triton.InferInput(name, list(array.shape), datatype)
            tensor.set_data_from_numpy(array.astype(object) if datatype == "BYTES" else array)
            request.append(tensor)
        result = self._call(self._client.infer, self.model, request,
                            outputs=[self._triton.InferRequestedOutput(PREDICTION)])
        return result.as_numpy(PREDICTION).reshape(-1)

    def _infer_grpc(self, columns: dict[str, np.ndarray]) -> np.ndarray:
        from tritonclient.utils import triton_to_np_dtype

        arrays = {name: np.asarray(array) for name, array in columns.items()}
        strings = [name for name, array in arrays.items() if array.dtype.kind in "OSU"]
        contents = dict(zip(strings, encode_bytes([arrays[name] for name in strings])))
        request = self._messages.ModelInferRequest(model_name=self.model)
        for name, array in arrays.items():
            datatype = "BYTES" if name in contents else self._triton_dtype(array.dtype)
            request.inputs.add(name=name, datatype=datatype, shape=array.shape)
            request.raw_input_contents.append(contents[name] if name in contents else array.tobytes())
        request.outputs.add(name=PREDICTION)
        reply = self._call(self._stub.ModelInfer, request, timeout=self.timeout_s)
        output = reply.outputs[0]
        return np.frombuffer(reply.raw_output_contents[0], dtype=triton_to_np_dtype(output.datatype)).copy()

    def inference_statistics(self) -> dict:
        """Every model's counters and cumulative times (Triton's statistics extension), as JSON data."""
        if self.protocol == "grpc":
            from google.protobuf.json_format import MessageToDict

            reply = self._call(self._stub.ModelStatistics, self._messages.ModelStatisticsRequest())
            return MessageToDict(reply, preserving_proto_field_name=True)
        return self._call(self._client.get_inference_statistics)

    def close(self) -> None:
        if self.protocol == "grpc":
            self._channel.close()
        else:
            self._client.close()

    def __enter__(self) -> Client:  # noqa: PYI034
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, fn, *args, **kwargs):
        if self.protocol == "grpc":
            import grpc

            try:
                return fn(*args, **kwargs)
            except grpc.RpcError as err:
                raise ServingError(f"{self.model} at {self.url} (grpc): {err.details()}", str(err.code())) from err
        from tritonclient.utils import InferenceServerException

        try:
            return fn(*args, **kwargs)
        except InferenceServerException as err:
            raise ServingError(f"{self.model} at {self.url} (http): {err.message()}", err.status()) from err

    @staticmethod
    def _triton_dtype(dtype: np.dtype) -> str:
        from tritonclient.utils import np_to_triton_dtype

        return np_to_triton_dtype(dtype)

    def _from_frame(self, frame) -> dict[str, np.ndarray]:
        names = {n for n, _ in self.inputs}
        unknown = sorted(set(map(str, frame.columns)) - names - self.ignore_columns)
        if unknown:
            raise BadInputError(f"unknown columns {unknown}; the model takes {[n for n, _ in self.inputs]}")
        out = {}
        for name, datatype in self.inputs:
            values = frame[name].tolist() if name in frame.columns else [None] * len(frame)
            out[name] = self._encode(values, name, datatype)
        return out

    def _from_dicts(self, rows: list[dict]) -> dict[str, np.ndarray]:
        names = {n for n, _ in self.inputs}
        unknown = sorted({k for r in rows for k in r} - names - self.ignore_columns)
        if unknown:
            raise BadInputError(f"unknown columns {unknown}; the model takes {[n for n, _ in self.inputs]}")
        return {name: self._encode([r.get(name) for r in rows], name, datatype) for name, datatype in self.inputs}

    def _from_tsv(self, lines: list[str | bytes]) -> dict[str, np.ndarray]:
        n = len(self.inputs)
        fields = []
        for number, line in enumerate(lines, 1):
            text = line.decode() if isinstance(line, bytes) else line
            parts = text.rstrip("\r\n").split("\t")
            if len(parts) == n + 1:
                parts = parts[1:]
            elif len(parts) != n:
                raise BadInputError(f"TSV line {number}: expected {n} fields (or {n + 1} with the label first), "
                                    f"found {len(parts)}")
            fields.append(parts)
        return {name: self._encode([f[k] if f[k] != "" else None for f in fields], name, datatype)
                for k, (name, datatype) in enumerate(self.inputs)}

    def _encode(self, values: list, name: str, datatype: str) -> np.ndarray:
        if datatype == "FP64":
            out = np.empty(len(values), dtype=np.float64)
            for i, v in enumerate(values):
                try:
                    out[i] = math.nan if _is_missing(v) else float(v)
                except (TypeError, ValueError):
                    raise BadInputError(f"column {name}, row {i}: expected a number or missing, got {v!r}") from None
            return out.reshape(-1, 1)
        encoded = [b"" if _is_missing(v) else _to_bytes(v, self._separator) for v in values]
        return np.array(encoded, dtype=object).reshape(-1, 1)


def _is_missing(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, float) and math.isnan(value):
        return True
    try:
        import pandas as pd

        return value is pd.NA or value is pd.NaT
    except ImportError:  # pragma: no cover
        return False


def _to_bytes(value: Any, separator: str) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, Iterable):
        return separator.join(str(v) for v in value).encode()
    return str(value).encode()
