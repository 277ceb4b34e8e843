"""The server launcher on a one-model repository (numpy only, so it starts in seconds): ports, the
PID check, the models' environment, no leftovers when the starting process is killed, the HTTP
guard's limits and framing checks in front of a real server, and restarting a server that died."""

from __future__ import annotations

import contextlib
import gzip
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from export.config import ServeConfig
from export.environment import find_models_env, find_server
from export.guard import RequestLimits, json_depth
from export.server import SHM_DIR, ServerError, TritonServer, _listens_on
from pipeline.errors import UserError
from pipeline.stages.serve import supervise

CONFIG = """
name: "twice"
backend: "python"
max_batch_size: 8
input [ { name: "X", data_type: TYPE_FP32, dims: [ 2 ] } ]
output [ { name: "Y", data_type: TYPE_FP32, dims: [ 2 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""
MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", (2 * x).astype(np.float32))]))
        return out
"""


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    root = tmp_path_factory.mktemp("repo")
    (root / "twice" / "1").mkdir(parents=True)
    (root / "twice" / "config.pbtxt").write_text(CONFIG)
    (root / "twice" / "1" / "model.py").write_text(MODEL)
    return root


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):  # gone; or going while read (ESRCH)
        return False
    return "State:\tZ" not in state


def test_the_server_binary_comes_with_the_models_environment():
    import shutil

    if shutil.which("tritonserver"):
        pytest.skip("a tritonserver on PATH takes precedence here")
    env = find_models_env()
    server = find_server("", env)
    assert server is not None and server.executable.is_relative_to(env.path), server
    assert (server.bundled_root / "python_backend_stubs" / env.python_version).is_dir()


def test_a_models_environment_that_does_not_work_is_named_on_one_line(tmp_path):
    import venv

    venv.create(tmp_path / "bare", with_pip=False)  # a Python without numpy
    with pytest.raises(UserError) as caught:
        find_models_env(tmp_path / "bare")
    message = str(caught.value)
    assert "No module named 'numpy'" in message and "make serve-env" in message and "\n" not in message, message


def test_a_free_port_is_never_the_one_already_picked(monkeypatch):
    """Two ports picked one after the other may be the same one (the first probe's socket closed): the gRPC port is
    picked other than Triton's HTTP port, which refuses to share it."""
    import export.server

    handed = iter([7001, 7001, 7001, 7002])

    class Probe:
        def __init__(self, *args) -> None:
            self.port = next(handed)

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            pass

        def bind(self, address) -> None:
            pass

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(export.server.socket, "socket", Probe)
    assert export.server.free_port() == 7001
    assert export.server.free_port(other_than=7001) == 7002


def test_ports_pid_check_and_the_models_environment(repository):
    from tritonclient import http

    with TritonServer(repository) as server:
        assert server.host == "127.0.0.1" and server.http_port != server.grpc_port
        assert _listens_on(server.pid, server.http_port) and not _listens_on(os.getpid(), server.http_port)
        client = http.InferenceServerClient(server.http_url)
        x = http.InferInput("X", [3, 2], "FP32")
        x.set_data_from_numpy(np.arange(6, dtype=np.float32).reshape(3, 2))
        # the numpy<2 models' environment gets the inputs intact (numpy 2 there would give zeros)
        np.testing.assert_array_equal(client.infer("twice", [x]).as_numpy("Y"), 2 * np.arange(6).reshape(3, 2))
        for kind, port in (("http", server.http_port), ("grpc", server.grpc_port)):
            with pytest.raises(ServerError, match=f"serve.{kind}_port: port {port} on 127.0.0.1 is already in use"):
                TritonServer(repository, **{f"{kind}_port": port}).start()
        pid, regions = server.pid, server.shm_regions()
        assert regions
    assert not _alive(pid)
    assert not any(r.exists() for r in regions)


def test_a_server_dies_with_the_process_that_started_it(repository):
    script = textwrap.dedent(f"""
        import os, signal
        from export.server import TritonServer
        server = TritonServer({str(repository)!r}).start()
        print(server.pid, server.shm_prefix, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    done = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=180)
    assert done.returncode == -9, done.stderr
    pid_text, prefix = done.stdout.split()
    pid = int(pid_text)
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(pid), "the server outlived the process that started it"
    assert list(SHM_DIR.glob(f"{prefix}*")) == []


def test_a_server_that_cannot_start_says_why(tmp_path):
    (tmp_path / "broken" / "1").mkdir(parents=True)
    (tmp_path / "broken" / "config.pbtxt").write_text(CONFIG.replace("twice", "broken"))
    (tmp_path / "broken" / "1" / "model.py").write_text("raise ImportError('this model is broken on purpose')\n")
    with pytest.raises(ServerError, match="broken on purpose"):
        TritonServer(tmp_path).start()


def test_a_stopped_or_dropped_server_leaves_no_working_folder(repository):
    import gc

    with TritonServer(repository) as server:
        folder = server.log_path.parent
        assert folder.is_dir() and folder.name.startswith("pipeline-triton-")
    assert not folder.exists()
    never_started = TritonServer(repository)
    folder = never_started.log_path.parent
    assert folder.is_dir()
    del never_started
    gc.collect()
    assert not folder.exists()


LIMITS = RequestLimits(max_body_bytes=1 << 20, max_json_depth=16)
INFER = "/v2/models/twice/infer"


@pytest.fixture(scope="module")
def guarded(repository):
    with TritonServer(repository, limits=LIMITS) as server:
        yield server


def _exchange(server: TritonServer, request: bytes) -> tuple[int, dict, bytes]:
    """Send raw bytes on a new connection; the status, headers and body of the one answer."""
    host, port = server.http_url.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(request)
        reply = http.client.HTTPResponse(sock)
        reply.begin()
        return reply.status, dict(reply.getheaders()), reply.read()


def _post(body: bytes, **headers: str) -> bytes:
    lines = [f"POST {INFER} HTTP/1.1", "Host: x", *(f"{k.replace('_', '-')}: {v}" for k, v in headers.items())]
    if "Transfer_Encoding" not in headers and "Content_Length" not in headers:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def _chunked(body: bytes, size: int = 1000) -> bytes:
    parts = [b"%x\r\n%s\r\n" % (len(body[i:i + size]), body[i:i + size]) for i in range(0, len(body), size)]
    return b"".join(parts) + b"0\r\n\r\n"


def _infer_json(x: list[list[float]], nesting: int = 0) -> bytes:
    """An inference request of ``x``, with a key Triton ignores holding arrays nested ``nesting`` deep."""
    extra = b'"ignored": ' + b"[" * nesting + b"]" * nesting + b", " if nesting else b""
    tensor = {"name": "X", "shape": [len(x), 2], "datatype": "FP32", "data": x}
    return b"{" + extra + json.dumps({"inputs": [tensor]}).encode()[1:]


def test_json_depth_counts_brackets_outside_strings():
    assert json_depth(b"3") == 0 and json_depth(b"") == 0
    assert json_depth(b'{"a": [[1], [2]], "b": {"c": []}}') == 3
    assert json_depth(b'["[[[{{", "\\"[[[", "\\\\", []]') == 2  # brackets in strings, escaped quotes
    assert json_depth(b'[1, "[[[[ never closed') == 1
    assert json_depth(b"[" * 3_000_000) == 3_000_000  # past one block of the scan
    assert json_depth(b"[]" * 2_000_000) == 1


def test_the_guard_refuses_what_is_over_its_limits_and_forwards_the_rest(guarded):
    good, deep = _infer_json([[1, 2]]), _infer_json([[1, 2]], nesting=16)
    refused = [
        ("JSON one level too deep", _post(deep), 400, "nests 17 levels deep, more than the 16 allowed"),
        ("JSON 200,000 levels deep", _post(b"[" * 200_000 + b"]" * 200_000), 400, "200000 levels deep"),
        ("a length over the limit, body not sent", _post(b"", Content_Length=str((1 << 20) + 1)), 413,
         "more than the 1048576 allowed (serve.max_request_mb)"),
        ("a chunked body over the limit", _post(_chunked(b" " * ((1 << 20) + 1), 1 << 16),
                                                Transfer_Encoding="chunked"), 413, "serve.max_request_mb"),
        ("gzip over the limit once decompressed", _post(gzip.compress(b" " * (8 << 20)), Content_Encoding="gzip"),
         413, "decompressed request body is over"),
        ("gzip of deep JSON", _post(gzip.compress(deep), Content_Encoding="gzip"), 400, "17 levels deep"),
        ("not gzip at all", _post(good, Content_Encoding="gzip"), 400, "not the gzip / deflate data"),
        ("gzip cut short", _post(gzip.compress(good)[:-10], Content_Encoding="gzip"), 400, "ends early"),
        ("an unknown encoding", _post(good, Content_Encoding="br"), 415, "'br' is not supported"),
        ("gzip twice", _post(gzip.compress(gzip.compress(good)), Content_Encoding="gzip, gzip"), 415, "one of"),
        ("a length that is not a number", _post(good, Content_Length="0x10"), 400, "bad Content-Length"),
        ("two different lengths", _post(good, Content_Length="3\r\nContent-Length: 4"), 400, "bad Content-Length"),
        ("length and chunked", _post(_chunked(good), Content_Length="3", Transfer_Encoding="chunked"), 400,
         "both Content-Length and Transfer-Encoding"),
        ("a chunk size that is not hex", _post(b"zz\r\n", Transfer_Encoding="chunked"), 400, "bad chunk size"),
        ("a chunk longer than it says", _post(b"2\r\nabc\r\n0\r\n\r\n", Transfer_Encoding="chunked"), 400,
         "does not end where its size says"),
        ("another transfer encoding", _post(good, Transfer_Encoding="gzip, chunked"), 501, "only chunked"),
        ("a JSON header longer than the body", _post(good, Inference_Header_Content_Length="9999"), 400,
         "bad Inference-Header-Content-Length"),
        ("a header line over 64 KiB", _post(good, X_Long="x" * 70_000), 431, "Line too long"),
        ("a folded header line", _post(good, X_Folded="a\r\n b"), 400, "runs over several lines"),
        ("not HTTP at all (TLS)", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", 400, "Bad request syntax"),
        # Triton's JSON reader allocates a tensor's declared bytes before reading its data: this one aborted it
        ("a shape of more values than the body holds", _post(json.dumps({"inputs": [
            {"name": "X", "datatype": "FP32", "shape": [2, 1 << 40], "data": [0]}]}).encode()), 400,
         "declares shape [2,1099511627776] (2,199,023,255,552 values), more than the request's"),
    ]
    for what, request, status, fragment in refused:
        got, headers, body = _exchange(guarded, request)
        assert got == status and fragment in json.loads(body)["error"], f"{what}: {got} {body!r}"
        assert headers["Content-Type"] == "application/json", what
    forwarded = [
        ("plain JSON", _post(good)),
        ("chunked", _post(_chunked(good, 7), Transfer_Encoding="chunked")),
        ("gzip", _post(gzip.compress(good), Content_Encoding="gzip")),
        ("100-continue", _post(good, Expect="100-continue")),
        ("JSON at the depth limit", _post(_infer_json([[1, 2]], nesting=15))),
    ]
    for what, request in forwarded:
        got, _, body = _exchange(guarded, request)
        assert got == 200 and json.loads(body)["outputs"][0]["data"] == [2, 4], f"{what}: {body!r}"
    assert guarded.is_alive()


def test_a_body_declared_over_the_limit_is_refused_before_it_is_invited(guarded):
    """``Expect: 100-continue`` with a length over ``serve.max_request_mb``: the guard answered ``100 Continue``
    (send the body) and then 413; now 413 comes first, and a length within it is invited."""
    host, port = guarded.http_url.rsplit(":", 1)
    for length, first in ((1 << 40, b"HTTP/1.1 413 "), (10, b"HTTP/1.1 100 ")):
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(_post(b"", Content_Length=str(length), Expect="100-continue"))
            assert sock.recv(64).startswith(first), length


def test_a_request_whose_json_triton_cannot_read_gets_400_and_the_next_one_its_answer(guarded):
    """Triton answers these with 500 (its JSON reader's errors are INTERNAL); they are the request's fault."""
    def tensor(**changed):
        return json.dumps({"inputs": [{"name": "X", "shape": [1, 2], "datatype": "FP32", "data": [1, 2], **changed}]})

    unreadable = [
        ("text in a number tensor", tensor(data=["a", "b"]), "Unable to parse 'data'"),
        ("null for a number", tensor(data=[None, 1]), "Unable to parse 'data'"),
        ("fewer values than the shape", tensor(data=[1]), "does not match true shape"),
        ("a negative dimension", tensor(shape=[-1, 2]), "Unable to parse 'shape'"),
        ("no inputs", json.dumps({"outputs": []}), "Unable to parse 'inputs'"),
        ("a number beyond float64", tensor().replace("[1, 2]", "[1e400, 2]"), "Number too big"),
        ("a lone surrogate escape", tensor(name="\ud800"), "surrogate"),
        ("not JSON", "{inputs: []}", "failed to parse the request JSON buffer"),
    ]
    host, port = guarded.http_url.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    for what, body, fragment in unreadable:
        connection.request("POST", INFER, body.encode())
        reply = connection.getresponse()
        text = reply.read()
        assert reply.status == 400 and fragment in json.loads(text)["error"], f"{what}: {reply.status} {text!r}"
        connection.request("POST", INFER, _infer_json([[1, 2]]))
        reply = connection.getresponse()
        assert reply.status == 200 and json.loads(reply.read())["outputs"][0]["data"] == [2, 4], what
    connection.request("POST", "/v2/models/absent/infer", _infer_json([[1, 2]]))
    reply = connection.getresponse()
    assert reply.status == 404, reply.read()  # Triton's other statuses pass as they are
    reply.read()
    connection.close()
    assert guarded.is_alive()


def test_clients_keep_their_connection_and_binary_data_is_not_scanned(guarded):
    from tritonclient import http as triton

    client = triton.InferenceServerClient(guarded.http_url)
    brackets = np.frombuffer(b"[" * 4 * 16, np.float32).reshape(8, 2)  # raw bytes '[' after the JSON header
    x = triton.InferInput("X", [8, 2], "FP32")
    x.set_data_from_numpy(brackets)
    np.testing.assert_array_equal(client.infer("twice", [x]).as_numpy("Y"), 2 * brackets)
    for compression in ("gzip", "deflate"):
        got = client.infer("twice", [x], request_compression_algorithm=compression).as_numpy("Y")
        np.testing.assert_array_equal(got, 2 * brackets)
    host, port = guarded.http_url.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    for body, status in ((_infer_json([[1, 2]]), 200), (b"[" * 100 + b"]" * 100, 400), (_infer_json([[3, 4]]), 200)):
        connection.request("POST", INFER, body)
        reply = connection.getresponse()
        assert reply.status == status and reply.getheader("Connection") != "close", reply.read()
        reply.read()
    first = connection.sock
    connection.request("GET", "/v2/health/ready")
    assert connection.getresponse().status == 200 and connection.sock is first  # one connection throughout
    connection.close()


def test_a_server_that_dies_is_restarted_behind_the_guard_then_given_up(repository, capsys):
    server = TritonServer(repository, limits=LIMITS).start()
    seen: dict[str, object] = {}
    given_up = threading.Event()

    def kill_twice():
        try:
            first = seen["first"] = server.pid
            os.kill(first, signal.SIGKILL)
            while _alive(first):
                time.sleep(0.01)
            seen["during"] = _exchange(server, _post(_infer_json([[1, 2]])))
            deadline = time.monotonic() + 60
            while _exchange(server, b"GET /v2/health/ready HTTP/1.1\r\n\r\n")[0] != 200 and time.monotonic() < deadline:
                time.sleep(0.05)
            seen["after"] = _exchange(server, _post(_infer_json([[1, 2]])))
            seen["second"] = server.pid
        except Exception as err:
            seen["error"] = repr(err)
            raise
        finally:  # the second death; repeated until supervise gives up, also should a step above fail
            while not given_up.wait(0.2):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(server.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_twice)
    urls, restarts = (server.http_url, server.grpc_url), []
    try:
        killer.start()
        with pytest.raises(UserError, match=r"killed by SIGKILL, after 1 restarts within serve.restart_window_s=60 "
                                            r"s: gave up \(its log: .*tritonserver.log\)"):
            supervise(server, ServeConfig(max_restarts=1, restart_window_s=60), restarts)
        given_up.set()
        killer.join(30)
        assert len(restarts) == 1 and (server.http_url, server.grpc_url) == urls
        assert "error" not in seen, f"the requests around the restart failed: {seen['error']}"
        status, headers, body = seen["during"]
        assert status == 503 and headers["Retry-After"] == "1" and "retry shortly" in json.loads(body)["error"]
        status, _, body = seen["after"]
        assert status == 200 and json.loads(body)["outputs"][0]["data"] == [2, 4]
        out = capsys.readouterr().out
        assert "killed by SIGKILL; restarting it on the same ports (restart 1 of at most 1 within 60 s" in out
        assert seen["second"] != seen["first"]
    finally:
        given_up.set()
        server.stop()


def test_a_model_instance_process_that_dies_restarts_the_server(repository, capsys):
    """Triton does not start a python backend stub again: the requests given to a killed one (as the OOM killer
    would kill it) failed with 500 while the server answered ready."""
    server = TritonServer(repository, limits=LIMITS).start()
    seen: dict[str, object] = {}
    given_up = threading.Event()

    def kill_an_instance_then_the_server():
        try:
            first, stubs = server.pid, list(server._instances)
            seen["stubs"] = list(stubs)
            os.kill(stubs[0], signal.SIGKILL)
            deadline = time.monotonic() + 60
            while (server.pid == first or _exchange(server, b"GET /v2/health/ready HTTP/1.1\r\n\r\n")[0] != 200) \
                    and time.monotonic() < deadline:
                time.sleep(0.05)
            seen["after"] = _exchange(server, _post(_infer_json([[1, 2]])))
        except Exception as err:
            seen["error"] = repr(err)
            raise
        finally:
            while not given_up.wait(0.2):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(server.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_an_instance_then_the_server)
    restarts = []
    try:
        killer.start()
        with pytest.raises(UserError, match="killed by SIGKILL, after 1 restarts"):
            supervise(server, ServeConfig(max_restarts=1, restart_window_s=60), restarts)
        given_up.set()
        killer.join(30)
        assert "error" not in seen, seen["error"]
        assert len(seen["stubs"]) == 1 and len(restarts) == 1
        status, _, body = seen["after"]
        assert status == 200 and json.loads(body)["outputs"][0]["data"] == [2, 4]
        assert f"lost the model instance process(es) [{seen['stubs'][0]}]; restarting it" in capsys.readouterr().out
    finally:
        given_up.set()
        server.stop()


def test_idle_connections_are_dropped_and_capped(repository, monkeypatch):
    """A client that connected and sent nothing held a thread and a file forever: 3000 of them were all open 80 s
    later, and at the process's limit of files the guard answered no one and spun a core."""
    from export import guard

    monkeypatch.setattr(guard, "CLIENT_TIMEOUT_S", 1.0)
    monkeypatch.setattr(guard, "MAX_CONNECTIONS", 20)
    with TritonServer(repository, limits=LIMITS) as server:
        host, port = server.http_url.rsplit(":", 1)
        idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(20)]
        time.sleep(0.3)
        assert _exchange(server, b"GET /v2/health/ready HTTP/1.1\r\n\r\n")[0] == 503  # over the cap
        for sock in idle:  # dropped after CLIENT_TIMEOUT_S without a byte
            assert sock.recv(1) == b""
            sock.close()
        status, _, body = _exchange(server, _post(_infer_json([[1, 2]])))
        assert status == 200 and json.loads(body)["outputs"][0]["data"] == [2, 4]


def test_a_second_server_on_one_log_appends_and_never_cuts_the_first_ones(tmp_path, monkeypatch):
    """A second `run serve` of one dataset emptied the log the running server was writing (its crash trace gone)."""
    from export import server as server_module

    log = tmp_path / "serve" / "tritonserver.log"
    first = server_module._open_log(log, "tritonserver for A")
    with open(log, "ab") as running:  # the first server writes on
        running.write(b"E1201 first server's error\n")
    second = server_module._open_log(log, "tritonserver for B")
    text = log.read_text()
    assert first == 0 and second > first and "first server's error" in text and text.count("--- ") == 2
    monkeypatch.setattr(server_module, "LOG_ROTATE_BYTES", 10)
    third = server_module._open_log(log, "tritonserver for C")
    assert third == 0 and "first server's error" in (tmp_path / "serve" / "tritonserver.log.1").read_text()
