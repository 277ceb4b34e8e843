"""A small client of the served ensemble: raw rows in, click probabilities out, over HTTP or gRPC.

Rows may be a pandas DataFrame, a dict of columns (name -> values), a list of dicts (column ->
value), or TSV lines (label first, optional; then the columns in the layout's order, Criteo's I1..I13
and C1..C26; empty fields are missing). Missing values may be ``None`` / NaN or absent columns, and a number
sent as text may be a word the data stage reads as missing (``NA``, ``NULL``, ``nan``...); the
server applies the workflow's missing handling, and unseen categories get the out-of-vocabulary
index. A label column is ignored; any other column the model does not take is an error (a misspelt
name would otherwise read as missing). The rows become one tensor per kind of raw column
(:mod:`export.request`), each column placed by name where the ensemble's own ``layout`` parameter
says, so nothing is repeated here.

Over gRPC the client speaks through Triton's generated stub (``tritonclient.grpc.service_pb2_grpc``):
each tensor travels as its raw bytes, text at a fixed width (:mod:`export.request`). Over HTTP it uses
``tritonclient.http`` (binary tensors). Rows whose text would be mostly padding at one width (a value far longer
than the others) go as several requests, answered in order.

Example::

    with Client("127.0.0.1:8001", protocol="grpc") as client:
        client.predict([{"I1": 3, "C1": "68fd1e64"}, {"I1": None}])     # numpy [2] probabilities
        client.predict({"I1": [3, None], "C1": ["68fd1e64", "unseen"]})
        client.predict(open("day_0.tsv").readlines()[:100])
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from export.request import LAYOUT_PARAMETER, RequestLayout
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
        scheme, _, address = url.rpartition("://")
        if scheme not in ("", "http", "grpc"):
            raise ValueError(f"url: {url!r}: the server speaks plain HTTP and gRPC, not {scheme}: give host:port "
                             "(an http:// or grpc:// before it is taken off)")
        url = address
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

    @property
    def layout(self) -> RequestLayout:
        """The raw columns of each request tensor, in order: the served ensemble's ``layout`` parameter."""
        return self._served[0]

    @functools.cached_property
    def _served(self) -> tuple[RequestLayout, int]:
        """The served model's request layout and ``max_batch_size`` (0: no limit), read from its config once."""
        if self.protocol == "grpc":
            config = self._call(self._stub.ModelConfig, self._messages.ModelConfigRequest(name=self.model))
            params = {k: v.string_value for k, v in config.config.parameters.items()}
            max_batch = int(config.config.max_batch_size)
        else:
            config = self._call(self._client.get_model_config, self.model)
            params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
            max_batch = int(config.get("max_batch_size", 0))
        if LAYOUT_PARAMETER not in params:
            raise ServingError(f"{self.model} at {self.url} declares no request layout (its config has no "
                               f"parameter {LAYOUT_PARAMETER!r}): export the model again "
                               "(python -m pipeline run export) and restart the server")
        return RequestLayout.from_json(params[LAYOUT_PARAMETER]), max_batch

    def predict(self, rows: Any) -> np.ndarray:
        """Probabilities ``[B]`` for raw rows (a DataFrame, a dict of columns, a list of dicts, or TSV lines), sent in
        as many requests as the served model and the server take."""
        requests = self.layout.requests(rows, ignore=self.ignore_columns)
        if not len(next(iter(requests[0].values()))):
            raise BadInputError("empty batch: expected at least one row")
        return np.concatenate([self._infer_within_limit(part) for tensors in requests
                               for part in self._within_max_batch(tensors)])

    def _infer_within_limit(self, tensors: dict[str, np.ndarray]) -> np.ndarray:
        """:meth:`infer`, the rows cut in halves while the server refuses them as too large (HTTP 413: a body over
        its ``serve.max_request_mb``, which the client does not know); one row too large is the server's error."""
        try:
            return self.infer(tensors)
        except ServingError as err:
            rows = len(next(iter(tensors.values())))
            if err.status != "413" or rows < 2:
                raise
        halves = [{name: array[start:end] for name, array in tensors.items()}
                  for start, end in ((0, rows // 2), (rows // 2, rows))]
        return np.concatenate([self._infer_within_limit(half) for half in halves])

    def _within_max_batch(self, tensors: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        """``tensors`` in requests of at most the model's ``max_batch_size`` rows (the server refuses larger)."""
        rows = len(next(iter(tensors.values())))
        step = self._served[1] or rows
        return [{name: array[start:start + step] for name, array in tensors.items()} for start in range(0, rows, step)]

    def tensors(self, rows: Any) -> dict[str, np.ndarray]:
        """The request tensors for ``rows`` (one per kind of raw column, :mod:`export.request`), without sending:
        one request's (:meth:`RequestLayout.tensors`)."""
        return self.layout.tensors(rows, ignore=self.ignore_columns)

    def infer(self, tensors: dict[str, np.ndarray]) -> np.ndarray:
        """Send exactly these tensors (name -> array; dtype gives the Triton type) and return ``[B]``."""
        if self.protocol == "grpc":
            return self._infer_grpc(tensors)
        request = []
        for name, array in tensors.items():
            array = np.asarray(array)
            tensor = self._triton.InferInput(name, list(array.shape), self._triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            request.append(tensor)
        result = self._call(self._client.infer, self.model, request,
                            outputs=[self._triton.InferRequestedOutput(PREDICTION)])
        return result.as_numpy(PREDICTION).reshape(-1)

    def _infer_grpc(self, tensors: dict[str, np.ndarray]) -> np.ndarray:
        from tritonclient.utils import triton_to_np_dtype

        request = self._messages.ModelInferRequest(model_name=self.model)
        for name, array in tensors.items():
            array = np.asarray(array)
            request.inputs.add(name=name, datatype=self._triton_dtype(array.dtype), shape=array.shape)
            request.raw_input_contents.append(_raw(array))
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
        except OSError as err:  # no server there, or the connection lost: as gRPC says "failed to connect"
            raise ServingError(f"{self.model} at {self.url} (http): {err.strerror or err}") from err

    @staticmethod
    def _triton_dtype(dtype: np.dtype) -> str:
        from tritonclient.utils import np_to_triton_dtype

        return np_to_triton_dtype(dtype)


def _raw(array: np.ndarray) -> bytes:
    """A tensor's bytes on the wire: as they are; strings (no tensor of the request format) in Triton's ``BYTES``
    form, so that the server names what it expects instead."""
    if array.dtype.kind in "OSU":
        from tritonclient.utils import serialize_byte_tensor

        return serialize_byte_tensor(array).item()
    return array.tobytes()
