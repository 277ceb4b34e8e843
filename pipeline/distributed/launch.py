"""Start N training processes on this node through torchrun's own machinery, or run in those torchrun started.

``python -m pipeline run train --nproc 2 ...`` calls :func:`relaunch`, which runs
``torchrun --standalone --nproc-per-node 2 -m pipeline run train ...`` in-process through
``torch.distributed.run`` (elastic launch: a local rendezvous, workers restarted on failure if asked,
the first worker error reported with its traceback). The same works by hand, and across nodes with
torchrun's rendezvous flags, one launcher per node (README.md, "Training")::

    torchrun --nproc-per-node 2 -m pipeline run train train.batch_size=65536
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 \\
        --rdzv-id job1 -m pipeline run train workdir=/shared/pipeline    # the same command on each node

A process torchrun started (:func:`under_torchrun`) spawns nothing: it joins the world torchrun
describes (:meth:`pipeline.distributed.world.World.from_env`), whatever ``--nproc`` says.

Example::

    relaunch(["run", "train", "--nproc", "2", "train.epochs=1"], nproc=2)
    launched_processes()        # 4 in each rank of the two-node command above, 1 outside torchrun
"""

from __future__ import annotations

import os
import signal


def strip_nproc(argv: list[str]) -> list[str]:
    """``argv`` without ``--nproc N`` / ``--nproc=N`` (the workers must not launch again)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--nproc":
            skip = True
            continue
        if a.startswith("--nproc="):
            continue
        out.append(a)
    return out


def under_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def launched_processes() -> int:
    """How many processes torchrun started together with this one, over every node (1 outside torchrun)."""
    return int(os.environ["WORLD_SIZE"]) if under_torchrun() else 1


def relaunch(argv: list[str], nproc: int, torchrun_args: list[str] | None = None, module: str = "pipeline") -> int:
    """Run ``python -m <module> <argv>`` as ``nproc`` workers under torchrun on this node; 0 on success, 2 where every
    failed worker refused what it was given (its ``error:`` line is above), 128 + the signal on Ctrl-C or SIGTERM."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    if nproc < 1:
        raise ValueError(f"--nproc: expected at least 1, got {nproc}")
    args = get_args_parser().parse_args(["--standalone", f"--nproc-per-node={nproc}", *(torchrun_args or []),
                                         "--module", module, *strip_nproc(argv)])
    try:
        run(args)
    except SignalException as err:  # the workers were stopped too, and said how their run continues
        return 128 + int(err.sigval)
    except ChildFailedError as err:
        # torch stops the other workers with SIGTERM once one fails: those are not failures of their own (one that had
        # refused already exited with 2, one still running is counted among the stopped)
        failed = {r: f for r, f in err.failures.items() if f.exitcode != -signal.SIGTERM} or err.failures
        rank = min(failed, key=lambda r: (failed[r].timestamp, r))
        failure = failed[rank]
        # a worker's own message is its error: line above; torch's stands in for it with a pointer to its docs
        said = failure.message if os.path.isfile(failure.error_file) else f"rank {rank} exited with code {failure.exitcode}"
        print(f"error: {len(failed)} of {nproc} training processes failed; first: {said} (its error is above)",
              flush=True)
        return 2 if all(f.exitcode == 2 for f in failed.values()) else 1
    return 0
