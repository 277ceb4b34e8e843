"""Start, check and stop a real Triton Inference Server on a model repository.

The server binds 127.0.0.1 unless asked otherwise, on free ports, with metrics off. It is ready
when ``/v2/health/ready`` answers 200 *and* the process we started is still alive (a second
server on taken ports dies after a few seconds while the first one answers the poll). Its python
backend's shared-memory regions carry a prefix of their own, so that stopping removes exactly
this server's leftovers in ``/dev/shm``, also after a crash. It is stopped by its PID (SIGTERM,
then SIGKILL to its process group), never by name; if the Python process that started it dies
without stopping it (even by SIGKILL), the kernel sends it SIGTERM (Linux's parent-death signal;
so start servers from a thread that lives as long as they should, e.g. the main thread).

Triton's HTTP port is not exposed as it is: one JSON body nested deep enough crashes it. With request
limits (as :func:`start_server` sets them from the serve settings) the public HTTP port is an
:class:`~export.guard.HttpGuard` in this process, which forwards requests within the limits to
Triton's HTTP port on 127.0.0.1. :meth:`TritonServer.restart` starts a server that died again on the
same ports, the guard's public port staying open meanwhile.

Example::

    with TritonServer("data/synthetic/export") as server:
        print(server.http_url, server.grpc_url)   # 127.0.0.1:PORT each (Triton's own)

    if server_problem(ServeConfig()) is None:       # from the serve settings, HTTP through the guard
        server = start_server("data/synthetic/export", ServeConfig())
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
import weakref
from pathlib import Path

from export.config import ServeConfig
from export.environment import ModelsEnv, ServerBinary, find_models_env, find_server, make_backend_dir, server_env
from export.guard import HttpGuard, RequestLimits
from export.instance import process_identity
from pipeline.errors import UserError

SHM_DIR = Path("/dev/shm")
_RESTRICTED = "shared-memory,model-repository,trace,logging"
_ADMIN_HEADER = "pipeline-admin"
_NOISE = ("CudaDriverHelper", "pinned memory", "NVML", "DCGM", "unable to create stream")


def _meaningful(line: str) -> bool:
    return not any(noise in line for noise in _NOISE)


class ServerError(UserError):
    """The server could not start, or died; the message ends with the tail of its log."""


def free_port(host: str = "127.0.0.1", other_than: int = 0) -> int:
    """A TCP port free on ``host`` right now, and not ``other_than``: two ports picked one after the other may be the
    same one, free again once the first probe closed (Triton refuses HTTP and gRPC on one port)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if port != other_than:
            return port


LOG_ROTATE_BYTES = 16 << 20
"""A server log over this size is moved to ``<name>.1`` before the next server starts on it."""


def _open_log(path: Path, what: str) -> int:
    """Start a server's part of the log at ``path``: appended after a line naming it (another server may be writing
    the file: it is never cut short), the file first moved aside when over :data:`LOG_ROTATE_BYTES`; where this part
    starts."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_file() and path.stat().st_size > LOG_ROTATE_BYTES:
        path.replace(path.with_name(path.name + ".1"))
    with open(path, "ab") as log:
        start = log.tell()
        log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {what}\n".encode())
    return start


def _is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _instance_processes(parent: int) -> list[int]:
    """The python backend stubs that process ``parent`` started."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent and \
                    b"triton_python_backend_stub" in Path(f"/proc/{entry}/cmdline").read_bytes():
                found.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _listens_on(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds the listening socket of ``port`` (True where /proc can't tell).

    A readiness answer may come from another server on the same port; this tells ours apart.
    """
    try:
        inodes = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
        listening = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            try:
                lines = Path(table).read_text().splitlines()[1:]
            except OSError:
                continue
            for line in lines:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    listening.add(fields[9])
    except OSError:
        return True
    return bool(inodes & listening)


class TritonServer:
    """One ``tritonserver`` process serving ``repository``.

    ``binary`` and ``models_env`` default to :func:`find_server` and :func:`find_models_env`.
    Ports 0 mean free ones. ``startup_timeout`` bounds the wait for readiness. With ``limits``, the
    HTTP port is an :class:`~export.guard.HttpGuard` that forwards what is within them to Triton's
    own HTTP port on 127.0.0.1 (``triton_http_port``). The log is ``log_path`` (default: in the
    server's working folder, removed on stop), emptied on start and kept through restarts.
    """

    def __init__(
        self,
        repository: str | Path,
        *,
        host: str = "127.0.0.1",
        http_port: int = 0,
        grpc_port: int = 0,
        binary: str = "",
        models_env: str | Path | None = None,
        startup_timeout: float = 180.0,
        log_verbose: int = 0,
        limits: RequestLimits | None = None,
        log_path: str | Path | None = None,
    ) -> None:
        self.repository = Path(repository).resolve()
        if not self.repository.is_dir():
            raise UserError(f"no model repository at {self.repository}: run `python -m pipeline run export` first")
        self.host = host
        self._ports = (http_port, grpc_port)
        self.models_env: ModelsEnv = find_models_env(models_env)
        server = find_server(binary, self.models_env)
        if server is None:
            raise UserError("no Triton server found: run `make serve-env` (it installs the one bundled with "
                            "nvidia-pytriton), or put `tritonserver` on PATH")
        self.binary: ServerBinary = server
        self.startup_timeout = startup_timeout
        self.log_verbose = log_verbose
        self.shm_prefix = f"pipeline_{os.getpid()}_{uuid.uuid4().hex[:8]}_"
        self._instances: dict[int, str | None] = {}
        self._admin_secret = secrets.token_hex(16)
        self._workdir = Path(tempfile.mkdtemp(prefix="pipeline-triton-"))
        self._remove_workdir = weakref.finalize(self, shutil.rmtree, self._workdir, True)
        self.log_path = Path(log_path) if log_path else self._workdir / "tritonserver.log"
        self._log_start = 0
        self.limits = limits
        self.guard: HttpGuard | None = None
        self.process: subprocess.Popen | None = None
        self.http_port = self.grpc_port = self.triton_http_port = 0
        self._finalizer: weakref.finalize | None = None

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def _triton_http_host(self) -> str:
        return "127.0.0.1" if self.limits is not None else self.host

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def is_alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> TritonServer:
        """Start the server (and the guard) and wait until it is ready; retries on a port taken meanwhile."""
        for kind, port in zip(("http", "grpc"), self._ports):
            if port and not _is_free(self.host, port):
                raise ServerError(f"serve.{kind}_port: port {port} on {self.host} is already in use: choose another "
                                  "or 0 for a free one")
        self._log_start = _open_log(self.log_path, f"tritonserver for {self.repository}, started by process "
                                                   f"{os.getpid()}")
        if self.limits is not None:
            try:
                self.guard = HttpGuard(self.host, self._ports[0], self.limits)
            except OSError as err:
                raise ServerError(f"the HTTP port {self._ports[0]} on {self.host} cannot be bound ({err}): "
                                  "choose another or 0 for a free one") from None
        try:
            self._start_triton()
        except BaseException:
            self._stop_guard()
            raise
        if self.guard is not None:
            self.guard.start()
        return self

    def _start_triton(self) -> None:
        triton_http = 0 if self.guard else self._ports[0]
        attempts = 1 if triton_http and self._ports[1] else 3
        for attempt in range(attempts):
            self.triton_http_port = triton_http or free_port(self._triton_http_host)
            self.grpc_port = self._ports[1] or free_port(self.host, other_than=self.triton_http_port)
            if self.guard is None:
                self.http_port = self.triton_http_port
            else:
                self.http_port = self.guard.port
                self.guard.upstream = (self._triton_http_host, self.triton_http_port)
            self._launch()
            try:
                self._wait_ready()
                return
            except ServerError:
                log = self.log_tail()
                self._end_process()
                if attempt + 1 == attempts or "already in use" not in log:
                    raise

    def lost_instances(self) -> list[int]:
        """The model instance processes (python backend stubs) of the ready server that have ended since (or whose
        pid another process took): Triton does not start them again, and every request its scheduler gives one of
        them fails."""
        return [pid for pid, identity in self._instances.items() if process_identity(pid) != identity]

    def restart(self) -> None:
        """Start the server again on the same ports (after it died) and wait until it is ready; the
        guard keeps the public HTTP port meanwhile, answering 503."""
        self._end_process()
        self._launch()
        try:
            self._wait_ready()
        except ServerError:
            self._end_process()
            raise

    def exit_description(self) -> str:
        """How the process ended: "killed by SIGKILL", "exited with code 1", or "running"."""
        code = self.process.poll() if self.process else None
        if code is None:
            return "running"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exited with code {code}"

    def _launch(self) -> None:
        backend_dir = make_backend_dir(self.binary, self.models_env, self._workdir / "backends")
        cmd = [
            str(self.binary.executable),
            f"--model-repository={self.repository}",
            f"--http-address={self._triton_http_host}",
            f"--http-port={self.triton_http_port}",
            f"--grpc-address={self.host}",
            f"--grpc-port={self.grpc_port}",
            "--allow-metrics=false",
            f"--log-verbose={self.log_verbose}",
            "--exit-timeout-secs=10",
            # every config.pbtxt is complete as written: no python stub is started per model just to complete it
            "--disable-auto-complete-config",
            # an instance is chosen by its executions x priority: a light load keeps to a model's first instances
            # (export.pbtxt.instance_groups)
            "--rate-limit=execution_count",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            # what no client of a served model needs, and what let one crash the server (registering the python
            # backend's own shared memory as an output region) or change its logging, answers only a request
            # carrying a secret header that this process alone knows
            f"--http-restricted-api={_RESTRICTED}:{_ADMIN_HEADER}={self._admin_secret}",
            f"--grpc-restricted-protocol={_RESTRICTED}:{_ADMIN_HEADER}={self._admin_secret}",
        ]
        if backend_dir is not None:
            cmd.append(f"--backend-directory={backend_dir}")
        with open(self.log_path, "ab") as log:
            # preexec_fn only calls prctl (the parent-death signal), safe with threads
            self.process = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=server_env(self.models_env), start_new_session=True,
                preexec_fn=_die_with_parent,  # noqa: PLW1509
            )
        self._finalizer = weakref.finalize(self, _terminate, self.process, self.shm_prefix)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        url = f"http://{self._triton_http_host}:{self.triton_http_port}/v2/health/ready"
        while time.monotonic() < deadline:
            if not self.is_alive():
                raise ServerError(f"tritonserver exited with code {self.process.returncode} before it was ready:\n"
                                  + self.log_tail())
            try:
                with urllib.request.urlopen(url, timeout=1) as reply:
                    if reply.status == 200 and self.is_alive() and _listens_on(self.process.pid, self.triton_http_port):
                        self._instances = {pid: process_identity(pid) for pid in _instance_processes(self.process.pid)}
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.1)
        raise ServerError(f"tritonserver was not ready after {self.startup_timeout:.0f} s:\n" + self.log_tail())

    def stop(self, timeout: float = 30.0) -> int | None:
        """Stops the guard; SIGTERM by PID, SIGKILL to its process group after ``timeout``; removes its /dev/shm
        regions and its working folder (the log with it, unless ``log_path`` was given: read :meth:`log_tail`
        before)."""
        self._stop_guard()
        code = self._end_process(timeout)
        _prune_instance_stats(self.repository)
        self._remove_workdir()
        return code

    def _stop_guard(self) -> None:
        if self.guard is not None:
            self.guard.stop()
            self.guard = None

    def _end_process(self, timeout: float = 30.0) -> int | None:
        code = None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if self.process is not None:
            code = _terminate(self.process, self.shm_prefix, timeout)
        return code

    def log_tail(self, chars: int = 4000) -> str:
        """The server's error lines (model load failures first), then the end of its log."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self._log_start)
                text = log.read().decode(errors="replace")
        except OSError:
            return ""
        errors = [line[:1500] for line in text.splitlines() if line.startswith("E") and _meaningful(line)]
        return "\n".join(errors[:10] + ["..."] + [text[-chars:]]) if errors else text[-chars:]

    def shm_regions(self) -> list[Path]:
        """This server's python-backend regions in /dev/shm (empty once stopped)."""
        return sorted(SHM_DIR.glob(f"{self.shm_prefix}*")) if SHM_DIR.is_dir() else []

    def __enter__(self) -> TritonServer:  # noqa: PYI034
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.is_alive() else "stopped"
        return f"TritonServer({self.repository}, http={self.http_url}, grpc={self.grpc_url}, {state})"


def server_problem(serve: ServeConfig) -> str | None:
    """``None`` when a Triton server and the models' environment are available, else what is missing."""
    try:
        env = find_models_env(serve.models_env or None)
        if find_server(serve.binary, env) is None:
            return "no Triton server: run `make serve-env` or put tritonserver on PATH"
    except UserError as err:
        return str(err)
    return None


def start_server(repository: str | Path, serve: ServeConfig, log_path: str | Path | None = None) -> TritonServer:
    """A started server on ``repository``, with the host, ports, binary, environment and request limits of
    ``serve`` (its HTTP port is guarded), logging to ``log_path`` when given."""
    limits = RequestLimits(max_body_bytes=int(serve.max_request_mb * 2**20), max_json_depth=serve.max_json_depth)
    return TritonServer(repository, host=serve.host, http_port=serve.http_port, grpc_port=serve.grpc_port,
                        binary=serve.binary, models_env=serve.models_env or None,
                        startup_timeout=serve.startup_timeout, limits=limits, log_path=log_path).start()


def _terminate(process: subprocess.Popen, shm_prefix: str, timeout: float = 30.0) -> int | None:
    if process.poll() is None:
        try:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            _kill_group(process.pid)
            process.wait(10)
    _kill_group(process.pid)  # stubs left behind by a crashed server
    if SHM_DIR.is_dir():
        for region in SHM_DIR.glob(f"{shm_prefix}*"):
            region.unlink(missing_ok=True)
    return process.returncode


def _prune_instance_stats(repository: str | Path) -> None:
    """Remove the counters files of the repository's model instances that no longer run: an instance removes its
    own when it finalizes, but one killed on the way out (a server past its exit timeout) leaves it behind."""
    from export.instance import STATS_FOLDER, live_stats

    for stats in Path(repository).glob(f"*/{STATS_FOLDER}"):
        live_stats(stats.parent, prune=True)


def _die_with_parent() -> None:
    """In the child: SIGTERM when the process that started the server dies (even by SIGKILL), Linux only."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
