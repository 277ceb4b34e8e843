"""The MPS daemon of the GPU workers (``etl.gpu_mps``): when one starts, its life beside the cluster's, its end.

The machines of the CPU tests have no NVIDIA driver: a shell script in a folder put first on PATH stands in for
``nvidia-cuda-mps-control`` there (in the foreground it opens ``<pipe>/control`` and runs until told to quit, as the
real one does), and a program that checks it was given the daemon's pipe for the CUDA program that checks the daemon
serves (``mps.CLIENT_CHECK``). The real daemon with a LocalCUDACluster is in tests/test_etl_gpu.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pipeline.errors import UserError
from pipeline.etl import mps
from pipeline.etl.config import EtlConfig

STAND_IN = """\
#!/bin/sh
pipe="$CUDA_MPS_PIPE_DIRECTORY"
if [ "$1" = "-f" ]; then
    echo "started $pipe" >> "$JOURNAL"
    trap 'echo terminated >> "$JOURNAL"; exit 0' TERM
    {start}
    while [ ! -e "$pipe/quit" ]; do sleep 0.05; done
    {on_quit}
    exit 0
fi
read command
echo "asked $command" >> "$JOURNAL"
[ "$command" = quit ] && touch "$pipe/quit"
exit 0
"""


def _stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, start: str = ': > "$pipe/control"',
              on_quit: str = "") -> Path:
    folder = tmp_path / "bin"
    folder.mkdir()
    control = folder / mps.CONTROL
    control.write_text(STAND_IN.format(start=start, on_quit=on_quit))
    control.chmod(0o755)
    journal = tmp_path / "journal"
    journal.touch()
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("JOURNAL", str(journal))
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.setattr(mps, "SYSTEM_PIPE", tmp_path / "no-system-daemon")
    monkeypatch.setattr(mps, "CLIENT_CHECK", CLIENT_CHECK)
    return journal


CLIENT_CHECK = [sys.executable, "-c", ("import os, pathlib, sys; "
                "sys.exit(0 if (pathlib.Path(os.environ['CUDA_MPS_PIPE_DIRECTORY']) / 'control').exists() "
                "else 'no daemon at the pipe')")]


def test_the_setting_takes_auto_on_or_off():
    assert EtlConfig().gpu_mps == "auto"
    with pytest.raises(ValueError, match="etl.gpu_mps"):
        EtlConfig(gpu_mps="yes")


def test_auto_wants_a_daemon_only_for_workers_sharing_a_gpu_with_the_program_there(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no control program
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    assert not mps.mps_wanted("auto", shared=True)
    with pytest.raises(UserError, match=r"etl.gpu_mps=on: nvidia-cuda-mps-control .* not on PATH"):
        mps.mps_wanted("on", shared=False)
    _stand_in(tmp_path, monkeypatch)
    assert mps.mps_wanted("auto", shared=True) and mps.mps_wanted("on", shared=False)
    assert not mps.mps_wanted("auto", shared=False) and not mps.mps_wanted("off", shared=True)


def test_auto_leaves_workers_to_a_daemon_that_serves_this_process_already(tmp_path, monkeypatch):
    _stand_in(tmp_path, monkeypatch)
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "theirs"))
    assert not mps.mps_wanted("auto", shared=True)
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY")
    system = tmp_path / "system-pipe"
    system.mkdir()
    (system / "control").touch()
    monkeypatch.setattr(mps, "SYSTEM_PIPE", system)
    assert not mps.mps_wanted("auto", shared=True)
    assert mps.mps_wanted("on", shared=True)


def test_the_daemon_runs_with_the_enclosed_work_in_a_folder_of_its_own_and_quits_after(tmp_path, monkeypatch):
    journal = _stand_in(tmp_path, monkeypatch)
    with mps.mps_daemon("auto", shared=True) as environ:
        pipe = Path(environ["CUDA_MPS_PIPE_DIRECTORY"])
        assert (pipe / "control").exists() and Path(environ["CUDA_MPS_LOG_DIRECTORY"]).is_dir()
        assert pipe.parent.name.startswith("pipeline-mps-") and "CUDA_MPS_PIPE_DIRECTORY" not in os.environ
        assert journal.read_text().splitlines() == [f"started {pipe}"]
    assert journal.read_text().splitlines() == [f"started {pipe}", "asked quit"]
    assert not pipe.parent.exists()


def test_a_daemon_that_does_not_quit_is_ended(tmp_path, monkeypatch):
    journal = _stand_in(tmp_path, monkeypatch, on_quit="while true; do sleep 0.05; done")
    monkeypatch.setattr(mps, "STOP_S", 0.5)
    started = time.monotonic()
    with mps.mps_daemon("on", shared=True):
        pass
    assert journal.read_text().splitlines()[1:] == ["asked quit", "terminated"]
    assert time.monotonic() - started < 5


def test_a_daemon_that_does_not_start_is_a_warning_on_auto_and_an_error_on_on(tmp_path, monkeypatch, caplog):
    _stand_in(tmp_path, monkeypatch, start='echo "An instance of this daemon is already running" >&2; exit 4')
    with caplog.at_level("WARNING", logger=mps.log.name), mps.mps_daemon("auto", shared=True) as environ:
        assert environ == {}
    assert "did not start (exit status 4: An instance of this daemon is already running)" in caplog.text
    with pytest.raises(UserError, match=r"etl.gpu_mps=on: .* did not start \(exit status 4: An instance"), \
            mps.mps_daemon("on", shared=True):
        pass


def test_a_daemon_that_cuda_programs_cannot_use_is_quit_with_a_warning_on_auto_and_an_error_on_on(
        tmp_path, monkeypatch, caplog):
    journal = _stand_in(tmp_path, monkeypatch)
    monkeypatch.setattr(mps, "CLIENT_CHECK", [sys.executable, "-c", "import sys; sys.exit('cuInit: CUDA error 805')"])
    with caplog.at_level("WARNING", logger=mps.log.name), mps.mps_daemon("auto", shared=True) as environ:
        assert environ == {}
    assert "could not run as a client of nvidia-cuda-mps-control (cuInit: CUDA error 805" in caplog.text
    assert journal.read_text().splitlines()[-1] == "asked quit"
    with pytest.raises(UserError, match=r"etl.gpu_mps=on: a CUDA program could not run .*CUDA error 805"), \
            mps.mps_daemon("on", shared=True):
        pass


def test_a_daemon_without_its_socket_in_time_is_ended_and_reported(tmp_path, monkeypatch):
    journal = _stand_in(tmp_path, monkeypatch, start=":")
    monkeypatch.setattr(mps, "START_S", 0.3)
    with pytest.raises(UserError, match="did not start"), mps.mps_daemon("on", shared=True):
        pass
    assert journal.read_text().splitlines()[-1] == "terminated"


def test_the_daemon_ends_when_the_process_that_started_it_is_killed(tmp_path, monkeypatch):
    journal = _stand_in(tmp_path, monkeypatch)
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the daemon's folder, left behind by the killed process
    script = textwrap.dedent("""
        import os, signal, sys
        from pipeline.etl import mps
        mps.CLIENT_CHECK = [sys.executable, "-c", ""]
        with mps.mps_daemon("on", shared=True):
            print("up", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == -signal.SIGKILL and done.stdout.strip() == "up", done.stderr
    deadline = time.monotonic() + 10
    while "terminated" not in journal.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert journal.read_text().splitlines()[-1] == "terminated"
