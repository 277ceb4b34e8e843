"""The server launcher on a one-model repository (numpy only, so it starts in seconds): ports, the
PID check, the models' environment, and no leftovers when the starting process is killed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from export.environment import find_models_env, find_server
from export.server import SHM_DIR, ServerError, TritonServer, _listens_on

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
    except FileNotFoundError:
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
        with pytest.raises(ServerError, match=f"port {server.http_port} on 127.0.0.1 is already in use"):
            TritonServer(repository, http_port=server.http_port, grpc_port=0).start()
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
