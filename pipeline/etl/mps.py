"""A CUDA MPS control daemon for the ETL's local GPU workers (``etl.gpu_mps``).

Worker processes sharing a GPU (``etl.workers_per_gpu``) each hold a CUDA context of their own, and the GPU runs one
context at a time, switching between them in time slices: a worker that waits for its copies (the parquet writer
waits once a column chunk) waits for the other's slice as well. As clients of one MPS server the workers' kernels
and copies run on the GPU together (docs/BENCHMARKS.md, "Workers sharing a GPU through MPS").

:func:`mps_daemon` starts ``nvidia-cuda-mps-control`` in the foreground as a child of this process, with its pipe
and log folders in a temporary folder of its own, so that only the processes given :func:`mps_daemon`'s environment
connect to it (this process, the user's other CUDA programs and any MPS daemon of the machine are left alone), and
quits it when the cluster is closed. A CUDA program is its first client (:data:`CLIENT_CHECK`), so that a daemon
that cannot serve here is found before the workers start. A daemon left by a process that was killed dies with it
(Linux: it is sent SIGTERM when the thread that started it ends); a worker that finds no daemon runs without MPS, as
CUDA falls back.

Example::

    with mps_daemon("auto", shared=True) as environ:   # {} where MPS is off or not available
        start_workers(environment=environ)
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from pipeline.errors import UserError

CONTROL = "nvidia-cuda-mps-control"
"""The MPS control program, installed with the NVIDIA driver's utilities."""

SYSTEM_PIPE = Path("/tmp/nvidia-mps")
"""Where CUDA looks for an MPS daemon when ``CUDA_MPS_PIPE_DIRECTORY`` is not set: a daemon there serves every CUDA
process of the machine already."""

START_S = 10.0
"""Seconds the daemon may take to open its control socket."""

STOP_S = 10.0
"""Seconds the daemon may take to quit (its servers wait for their clients, the workers, to end) before it is
terminated."""

log = logging.getLogger(__name__)


def mps_wanted(mode: str, shared: bool) -> bool:
    """Whether ``etl.gpu_mps=mode`` starts a daemon for a cluster whose workers do (``shared``) or do not share GPUs.

    ``auto``: where workers share a GPU, the control program is on PATH and no MPS daemon serves this process's CUDA
    programs already. ``on``: always; without the control program, a UserError that says what to do.
    """
    if mode == "off":
        return False
    if mode == "on":
        if shutil.which(CONTROL) is None:
            raise UserError(f"etl.gpu_mps=on: {CONTROL} (CUDA MPS, with the NVIDIA driver's utilities) is not on "
                            "PATH here; install the driver's utilities or add their folder to PATH, or set "
                            "etl.gpu_mps=auto")
        return True
    return shared and shutil.which(CONTROL) is not None and not mps_in_use()


def mps_in_use() -> bool:
    """Whether this process's CUDA programs are clients of an MPS daemon already (one named by
    ``CUDA_MPS_PIPE_DIRECTORY``, or the machine's at :data:`SYSTEM_PIPE`)."""
    return bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")) or (SYSTEM_PIPE / "control").exists()


@contextlib.contextmanager
def mps_daemon(mode: str, shared: bool) -> Iterator[dict[str, str]]:
    """An MPS control daemon of its own while the enclosed work runs, if :func:`mps_wanted`; yields the environment
    that makes a process its client (``{}`` without a daemon).

    A daemon that does not start, or that a CUDA program cannot use (:data:`CLIENT_CHECK`), is an error with
    ``etl.gpu_mps=on`` and a warning with ``auto`` (the workers then run without MPS)."""
    if not mps_wanted(mode, shared):
        yield {}
        return
    with tempfile.TemporaryDirectory(prefix="pipeline-mps-") as folder:
        environ = {"CUDA_MPS_PIPE_DIRECTORY": f"{folder}/pipe", "CUDA_MPS_LOG_DIRECTORY": f"{folder}/log"}
        for path in environ.values():
            Path(path).mkdir()
        journal = Path(folder) / "daemon.log"
        try:
            daemon = _start(environ, journal)
        except OSError as err:
            yield _unavailable(mode, f"{CONTROL} did not start ({err})")
            return
        try:
            _check_client(environ, journal)
        except OSError as err:
            _stop(daemon, environ)
            yield _unavailable(mode, f"a CUDA program could not run as a client of {CONTROL} ({err})")
            return
        try:
            yield environ
        finally:
            _stop(daemon, environ)


def _unavailable(mode: str, why: str) -> dict[str, str]:
    """No daemon after all: a UserError with ``etl.gpu_mps=on``, else a warning and no environment."""
    if mode == "on":
        raise UserError(f"etl.gpu_mps=on: {why}; set etl.gpu_mps=off to run the workers without MPS")
    log.warning("%s: the GPU workers run without MPS (etl.gpu_mps=off leaves it out)", why)
    return {}


CLIENT_CHECK = [sys.executable, "-c", """
import ctypes, sys
cuda = ctypes.CDLL("libcuda.so.1")
device, context = ctypes.c_int(), ctypes.c_void_p()
for name, args in (("cuInit", (0,)), ("cuDeviceGet", (ctypes.byref(device), 0)),
                   ("cuDevicePrimaryCtxRetain", (ctypes.byref(context), device))):
    status = getattr(cuda, name)(*args)
    if status:
        sys.exit(f"{name}: CUDA error {status}")
"""]
"""A CUDA program run as the daemon's first client before any worker starts: it makes a context on the first GPU
through the daemon (which starts its server for it) and ends. Where the daemon cannot serve (no permission for its
server, the GPU taken), it fails here with CUDA's error rather than every worker at its start."""

CLIENT_CHECK_S = 60.0
"""Seconds the check may take (the MPS server starting included)."""


def _check_client(environ: dict[str, str], journal: Path) -> None:
    """Run :data:`CLIENT_CHECK` as a client of the daemon; an OSError with what went wrong if it fails."""
    try:
        done = subprocess.run(CLIENT_CHECK, env={**os.environ, **environ}, capture_output=True, text=True,
                              timeout=CLIENT_CHECK_S, check=False)
    except subprocess.TimeoutExpired:
        raise OSError(f"no answer in {CLIENT_CHECK_S:g} s") from None
    if done.returncode:
        said = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        daemon_said = journal.read_text(errors="replace").strip().splitlines()
        raise OSError(said + (f"; the daemon: {daemon_said[-1]}" if daemon_said else ""))


def _start(environ: dict[str, str], journal: Path) -> subprocess.Popen:
    """The daemon started in the foreground (its messages to ``journal``), once its control socket is open; an
    OSError if it cannot run, ends or does not open the socket in :data:`START_S` seconds."""
    with open(journal, "wb") as out:
        daemon = subprocess.Popen([shutil.which(CONTROL) or CONTROL, "-f"], env={**os.environ, **environ},
                                  stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                  preexec_fn=_ended_with_parent())  # noqa: PLW1509 (a system call, nothing else)
    socket = Path(environ["CUDA_MPS_PIPE_DIRECTORY"]) / "control"
    deadline = time.monotonic() + START_S
    while not socket.exists():
        if daemon.poll() is not None or time.monotonic() > deadline:
            _end(daemon)
            said = journal.read_text(errors="replace").strip().splitlines()
            raise OSError(f"exit status {daemon.returncode}" + (f": {said[-1]}" if said else ""))
        time.sleep(0.02)
    return daemon


def _stop(daemon: subprocess.Popen, environ: dict[str, str]) -> None:
    """Ask the daemon to quit (its servers end once their clients have), then end it if it has not in
    :data:`STOP_S` seconds."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run([shutil.which(CONTROL) or CONTROL], input=b"quit\n", env={**os.environ, **environ},
                       capture_output=True, timeout=STOP_S, check=False)
    with contextlib.suppress(subprocess.TimeoutExpired):
        daemon.wait(STOP_S)
    _end(daemon)


def _end(daemon: subprocess.Popen) -> None:
    if daemon.poll() is None:
        daemon.terminate()
        try:
            daemon.wait(STOP_S)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()


PR_SET_PDEATHSIG = 1


def _ended_with_parent():
    """What the daemon's process runs before the program: on Linux, ask for SIGTERM when the thread that started it
    ends (the C function is looked up here, before the fork: the child makes that one call and nothing else)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
