"""The Python environment the served models run in, and the server binary that runs them.

The python-backend stub bundled with ``nvidia-pytriton`` is built against numpy 1.x: with numpy 2
in the models' environment the models load, but their inputs arrive as zeros, without any error.
So the models run in their own virtual environment, ``.venv-triton`` at the repository root
(``make serve-env`` builds it from this repository's files: numpy<2, pandas 2.2, pyarrow, torch,
this project installed without dependencies, and nvidia-pytriton for the server binary itself).
Clients may use numpy 2.

The stub finds its environment through ``python3`` on ``PATH``; :func:`server_env` puts the
environment's ``bin`` first there, and its interpreter's library folder first on
``LD_LIBRARY_PATH``, so that the stub links the same libpython. It also sets glibc's memory
thresholds (:data:`MALLOC`), so that the models reuse their buffers from one request to the next.

Example::

    env = find_models_env()            # checks numpy<2 there, or raises UserError
    env.python_version                 # "3.11"
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import UserError

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODELS_ENV = REPO_ROOT / ".venv-triton"
ENV_VARIABLE = "PIPELINE_TRITON_ENV"

_PROBE = """
import json, sys, sysconfig, numpy
try:
    import export
    project = ""
except Exception as err:
    project = f"{type(err).__name__}: {err}"
print(json.dumps({"version": "%d.%d" % sys.version_info[:2], "libdir": sysconfig.get_config_var("LIBDIR"),
                  "numpy": numpy.__version__, "project": project}))
"""


@dataclass(frozen=True)
class ModelsEnv:
    """A virtual environment the python-backend models can run in."""

    path: Path
    python_version: str
    libdir: str

    @property
    def bin(self) -> Path:
        return self.path / "bin"


def find_models_env(path: str | Path | None = None) -> ModelsEnv:
    """The models' environment: ``path``, else ``$PIPELINE_TRITON_ENV``, else ``<repo>/.venv-triton``.

    Raises :class:`UserError` when it is missing or has numpy 2 (which corrupts inputs silently).
    """
    chosen = Path(path or os.environ.get(ENV_VARIABLE) or DEFAULT_MODELS_ENV).resolve()
    return _inspect(chosen)


@functools.cache
def _inspect(path: Path) -> ModelsEnv:
    python = path / "bin" / "python"
    if not python.exists():
        raise UserError(
            f"no Python environment for the served models at {path}: run `make serve-env` "
            f"(or set serve.models_env / ${ENV_VARIABLE} to a venv with numpy<2, pandas, pyarrow, torch and this project)"
        )
    # as the served models see it: the python-backend stub does not read PYTHONPATH, so neither does the probe
    # (a PYTHONPATH holding numpy 2 would fail a sound environment), and from a folder that holds no package
    done = subprocess.run([str(python), "-c", _PROBE], check=False, capture_output=True, text=True, timeout=60,
                          env=_python_env(os.environ), cwd=path)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()  # a traceback: its last line says what failed
        why = lines[-1][:300] if lines else f"its python exited with code {done.returncode}"
        raise UserError(f"the models' environment {path} does not work ({why}): run `make serve-env` (or set "
                        f"serve.models_env / ${ENV_VARIABLE} to a venv with numpy<2, pandas, pyarrow, torch and this "
                        "project)")
    info = json.loads(done.stdout.strip().splitlines()[-1])
    if int(info["numpy"].split(".")[0]) >= 2:
        raise UserError(
            f"the models' environment {path} has numpy {info['numpy']}, expected numpy<2: the Triton python "
            "backend stub is built against numpy 1.x and would receive zeros. Rebuild it with `make serve-env`."
        )
    if info["project"]:
        raise UserError(f"the models' environment {path} cannot import this project ({info['project'][:300]}): run "
                        f"`make serve-env` (or set serve.models_env / ${ENV_VARIABLE} to a venv with numpy<2, pandas, "
                        "pyarrow, torch and this project)")
    return ModelsEnv(path, info["version"], info["libdir"])


def _python_env(environ) -> dict[str, str]:
    """``environ`` for a Python of the models' environment: no PYTHONPATH or PYTHONHOME of the caller's, no user
    site-packages."""
    out = {k: v for k, v in environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    out["PYTHONNOUSERSITE"] = "1"
    return out


@dataclass(frozen=True)
class ServerBinary:
    """A ``tritonserver`` executable and, for the PyPI-bundled one, where its python backend lies."""

    executable: Path
    bundled_root: Path | None
    """``pytriton/tritonserver`` when the binary is the one bundled with nvidia-pytriton."""

    @property
    def name(self) -> str:
        return "nvidia-pytriton bundled tritonserver" if self.bundled_root else f"tritonserver at {self.executable}"


def find_server(binary: str = "", env: ModelsEnv | None = None) -> ServerBinary | None:
    """``binary`` when given; else a ``tritonserver`` on PATH (an NGC container); else the one bundled
    with nvidia-pytriton in the models' environment ``env`` (``make serve-env`` installs it there),
    else in this Python's."""
    if binary:
        exe = Path(binary)
        if not exe.is_file():
            raise UserError(f"serve.binary: no tritonserver at {exe}")
        return ServerBinary(exe, _bundled_root_of(exe))
    on_path = shutil.which("tritonserver")
    if on_path:
        return ServerBinary(Path(on_path), _bundled_root_of(Path(on_path)))
    candidates = []
    if env is not None:
        candidates += sorted(env.path.glob("lib/python3*/site-packages/pytriton/tritonserver"))
    try:
        import pytriton

        candidates.append(Path(pytriton.__file__).parent / "tritonserver")
    except ImportError:
        pass
    for root in candidates:
        if (root / "bin" / "tritonserver").is_file():
            return ServerBinary(root / "bin" / "tritonserver", root)
    return None


def _bundled_root_of(exe: Path) -> Path | None:
    root = exe.resolve().parent.parent
    return root if (root / "python_backend_stubs").is_dir() else None


def make_backend_dir(server: ServerBinary, env: ModelsEnv, where: Path) -> Path | None:
    """For the bundled server: ``where/python/`` with symlinks to the backend and the stub of ``env``'s Python.

    Symlinks (not copies) keep the binaries' built-in library paths working. ``None`` for a
    ``tritonserver`` that brings its own backends.
    """
    if server.bundled_root is None:
        return None
    stub = server.bundled_root / "python_backend_stubs" / env.python_version / "triton_python_backend_stub"
    if not stub.is_file():
        raise UserError(f"the bundled tritonserver has no python-backend stub for Python {env.python_version}")
    target = where / "python"
    target.mkdir(parents=True, exist_ok=True)
    backend = server.bundled_root / "backends" / "python"
    for source in (backend / "libtriton_python.so", backend / "triton_python_backend_utils.py", stub):
        link = target / source.name
        if not link.is_symlink():
            link.symlink_to(source)
    return where


MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(64 << 20), "MALLOC_TRIM_THRESHOLD_": str(256 << 20)}
"""glibc's ``mallopt`` settings of the server and its models: glibc
gives a freed buffer over 128 KiB back to the kernel at once, so every request of a few hundred rows
faulted its buffers' pages in again (about 500 page faults at 300 rows, 1,000 and 3 ms of the model's
time at 1,024). Buffers under 64 MiB now come from the heap, which keeps up to 256 MiB free for the
next request."""


def server_env(env: ModelsEnv) -> dict[str, str]:
    """The server's process environment: the models' venv first on PATH, its libpython first to link, and
    the memory settings of :data:`MALLOC`, over any the process has: Dask's nanny sets
    ``MALLOC_TRIM_THRESHOLD_=65536`` in the environment of a process that started a local cluster (the ETL
    of ``run all``), which would make the models fault their buffers in again at every request. No PYTHONPATH:
    the stub does not read it, the models' environment holds all the models import."""
    out = {**os.environ, **MALLOC}
    out["PATH"] = f"{env.bin}{os.pathsep}{out.get('PATH', '')}"
    libs = [env.libdir] + [p for p in out.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    out["LD_LIBRARY_PATH"] = os.pathsep.join(libs)
    out["VIRTUAL_ENV"] = str(env.path)
    return _python_env(out)


@functools.cache
def cuda_problem(env: ModelsEnv) -> str | None:
    """``None`` when torch in the models' environment can use a CUDA GPU, else why not."""
    probe = "import torch; print(torch.cuda.is_available() and torch.cuda.device_count() > 0)"
    done = subprocess.run([str(env.bin / "python"), "-c", probe], check=False, capture_output=True, text=True,
                          timeout=120, env=_python_env(os.environ), cwd=env.path)
    if done.returncode != 0:
        return f"torch does not import in {env.path}: {done.stderr.strip()[-300:]}"
    if done.stdout.strip().splitlines()[-1:] != ["True"]:
        return f"torch in {env.path} sees no CUDA GPU (a CPU build, or no driver)"
    return None

