"""The training loop: steps over epochs, lr schedule, evaluation, metrics, checkpoints, exact resume.

The loop reads the training data through a resumable loader (:class:`pipeline.loader.Loader`, or
anything with ``len``, ``state_dict``, ``load_state_dict`` and one epoch per ``iter``), so a
resumed run asks for the rest of the interrupted epoch and sees exactly the batches the uninterrupted
run would have seen. With the same seed, a run killed after any checkpoint and resumed ends with the
same weights as one that never stopped (the lr schedule is a pure function of the step, and the RNG
states travel in the checkpoint).

The same loop trains one process and N ranks: the :class:`~pipeline.distributed.world.World` says
who writes the files, the model is the plain model or its ``DistributedModelParallel``, and the
checkpoint format (:mod:`pipeline.train.checkpoint`) matches it; the driver may pass a ``pipeline``
that hands out each batch with work of the next one under way (on N ranks its input dist; on one
process its rows prefetched into the caches of host-cached tables, or its ids placed in dynamic tables;
the checkpoints still count the batches trained). :class:`Callback` objects passed to
:meth:`Trainer.fit` see each step, checkpoint and evaluation (tests stop a run through one).
:class:`Timings` (``trainer.timings``) holds the host seconds spent in each part of the loop.

Example::

    trainer = Trainer(model, cfg.train, out_dir, train_loader, World(device=device))
    trainer.start_fresh()                       # or trainer.resume_from(trainer.checkpoints.newest_readable())
    trainer.fit(evaluate_valid=lambda: evaluate(model, valid_loader, device))
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from pipeline.distributed.checkpoint import cpu_copy
from pipeline.distributed.world import World
from pipeline.errors import UserError
from pipeline.modules.models import RecModel
from pipeline.progress import Progress
from pipeline.train.checkpoint import LoopState, PlainCheckpoints, ShardedCheckpoints
from pipeline.train.config import TrainConfig
from pipeline.train.evaluate import autocast
from pipeline.train.schedule import epochs_for, lr_at, warmup_steps


class Callback:
    """What :meth:`Trainer.fit` calls as training goes; override the methods you need.

    ``on_fit_start`` runs once before the first step of a fresh or a resumed run. ``on_step`` runs at
    the end of each step, after that step's evaluation and checkpoint when they are due. An exception
    raised by a callback ends training there, as a crash would.
    """

    def on_fit_start(self, trainer: Trainer) -> None:
        pass

    def on_step(self, trainer: Trainer) -> None:
        pass

    def on_checkpoint(self, trainer: Trainer, path: Path) -> None:
        pass

    def on_evaluation(self, trainer: Trainer, scores: dict) -> None:
        pass


class Timings:
    """Host seconds :meth:`Trainer.fit` spends in each part of training, by region.

    The regions tile the loop: each :meth:`mark` charges the time since the previous one to its
    region, so they add up to the loop's wall time. ``batch wait``: waiting for the next batch (and
    opening an epoch; with a ``pipeline``, also reading and starting the batch after it); ``step``:
    forward, backward and the optimizers (on a GPU, mostly launching kernels that run later);
    ``loss read``: the loss read to the host every ``log_every`` steps (on a GPU, waiting for the steps
    queued before it); ``log``: the metrics line and the progress bar's text; ``progress``: the
    progress bar; ``evaluation``; ``checkpoint``; ``callbacks``.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.last = time.perf_counter()

    def restart(self) -> None:
        """Start timing from now (the time since the last mark is charged nowhere)."""
        self.last = time.perf_counter()

    def mark(self, region: str) -> None:
        now = time.perf_counter()
        self.seconds[region] = self.seconds.get(region, 0.0) + now - self.last
        self.last = now


class AdagradW(torch.optim.Adagrad):
    """Adagrad that decays the weights apart from its gradients, as AdamW does Adam's: each step first scales every
    weight by ``1 - lr * weight_decay``, then takes Adagrad's step of the gradients alone (torch's Adagrad has no such
    option). Added to the gradients, the decay would pass through Adagrad's scaling of each weight's step."""

    def __init__(self, params, lr: float, weight_decay: float) -> None:
        super().__init__(params, lr=lr, weight_decay=0.0)
        self.decoupled_decay = weight_decay

    @torch.no_grad()
    def step(self, closure=None):
        if self.decoupled_decay:
            for group in self.param_groups:
                for param in group["params"]:
                    if param.grad is not None:
                        param.mul_(1.0 - group["lr"] * self.decoupled_decay)
        return super().step(closure)


def dense_optimizer(name: str, params, lr: float, weight_decay: float, device: torch.device,
                    decoupled: bool = False) -> torch.optim.Optimizer:
    """The dense part's optimizer; on a GPU, SGD and Adam take torch's fused kernels (one launch per step
    for all parameters instead of a few per parameter list, which a launch-bound step feels). With ``decoupled``,
    Adam and Adagrad decay the weights apart from their gradients (AdamW, :class:`AdagradW`;
    :attr:`TrainConfig.decoupled_decay`); for SGD the two are the same."""
    fused = {"fused": True} if device.type == "cuda" else {}
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay, **fused)
    if name == "adagrad":
        adagrad = AdagradW if decoupled else torch.optim.Adagrad
        return adagrad(params, lr=lr, weight_decay=weight_decay)
    if name == "adam":
        adam = torch.optim.AdamW if decoupled else torch.optim.Adam
        return adam(params, lr=lr, weight_decay=weight_decay, **fused)
    raise ValueError(f"dense optimizer: expected sgd, adam or adagrad, got {name!r}")


class Trainer:
    """Trains ``model`` under ``cfg`` on ``world`` (default: one process on the CPU); writes to ``out_dir``.

    ``checkpoints`` is the format of the saves (default: :class:`PlainCheckpoints` under
    ``out_dir/checkpoints``; a ``DistributedModelParallel`` takes :class:`ShardedCheckpoints`).
    ``pipeline`` wraps each epoch's batch iterator (a
    :class:`~pipeline.distributed.train_pipeline.SparseDistPipeline`: each batch's input dist started
    a step ahead; a :class:`~pipeline.distributed.train_pipeline.PrefetchPipeline`: each batch prefetched
    while the batch before trains); the loop counts the batches it consumed, not those the loader handed out.
    """

    def __init__(self, model: torch.nn.Module, cfg: TrainConfig, out_dir: str | Path, train_loader,
                 world: World | None = None, checkpoints: PlainCheckpoints | ShardedCheckpoints | None = None,
                 pipeline: Callable[[Iterator], Iterator] | None = None) -> None:
        steps_per_epoch = len(train_loader)
        if steps_per_epoch <= 0:
            raise ValueError(f"expected at least one training batch per epoch, got {steps_per_epoch}")
        self.model = model
        self.cfg = cfg
        self.world = world or World()
        self.device = self.world.device
        self.out_dir = Path(out_dir)
        self.checkpoints = checkpoints or PlainCheckpoints(self.out_dir / "checkpoints", cfg.keep_checkpoints, model)
        self.loader = train_loader
        self.pipeline = pipeline
        self.steps_per_epoch = steps_per_epoch
        self.epochs = epochs_for(steps_per_epoch, cfg.epochs)
        total = self.epochs * steps_per_epoch
        self.total_steps = min(total, cfg.max_steps) if cfg.max_steps > 0 else total
        self.warmup_steps = warmup_steps(self.total_steps, cfg.warmup_fraction, cfg.warmup_steps)
        self.optimizer = dense_optimizer(cfg.optimizer, model.parameters(), cfg.dense_lr, cfg.weight_decay,
                                         self.device, cfg.decoupled_decay)
        self.amp = cfg.amp == "bf16" or (cfg.amp == "auto" and self.device.type == "cuda")
        self.state = LoopState()
        # The best epoch's weights, on the host (each rank its own part of a sharded model's).
        self.keeps_best = cfg.early_stopping > 0
        self.best_weights: dict[str, torch.Tensor] | None = None
        self.timings = Timings()
        # The dense part and the loss compiled as one graph (the embedding lookup stays an eager custom op).
        self._dense_loss = (compiled_dense_loss(model, self.amp, cfg.compile, self.device)
                            if isinstance(model, RecModel) else None)

    @property
    def metrics_path(self) -> Path:
        return self.out_dir / "metrics.jsonl"

    def lrs(self, step: int) -> tuple[float, float]:
        """(dense lr, embedding lr) of ``step``."""
        schedule = self._schedule()
        return lr_at(step, self.cfg.dense_lr, **schedule), lr_at(step, self.cfg.table_lr, **schedule)

    def _schedule(self) -> dict:
        c = self.cfg
        return dict(warmup_steps=self.warmup_steps, total_steps=self.total_steps, decay=c.decay,
                    decay_start=c.decay_start, min_ratio=c.min_lr_ratio)

    def start_fresh(self) -> None:
        """Forget earlier runs' checkpoints and metrics in ``out_dir``."""
        if self.world.is_writer:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self.checkpoints.clear()
            self.metrics_path.write_text("")
        self.world.barrier()

    def resume_from(self, path: str | Path) -> None:
        """Load a checkpoint: weights, optimizer states, loop position, RNG; metrics after it are dropped."""
        self.state, fields = self.checkpoints.load(self, Path(path))
        if self.world.is_writer and self.metrics_path.is_file():
            kept = [line for line in self.metrics_path.read_text(errors="replace").splitlines()
                    if (step := _logged_step(line)) is not None and step <= self.state.step]
            self.metrics_path.write_text("".join(line + "\n" for line in kept))
        self._log({"event": "resume", "step": self.state.step, "checkpoint": str(path), **fields})

    def save(self) -> Path:
        return self.checkpoints.save(self)

    def fit(self, evaluate_valid: Callable[[], dict] | None = None, callbacks: Sequence[Callback] = (),
            progress: str | bool = "auto") -> dict:
        """Train until ``total_steps`` (or an early stop); returns the kept weights' valid scores, which
        epoch was kept (``kept``, None without early stopping) and the throughput (``samples_per_s``, None when
        no step was trained: a run resumed after its last step).

        ``progress`` (a mode of :mod:`pipeline.progress`) shows the steps, loss, lr and samples/s on the
        writer rank."""
        c = self.cfg
        for callback in callbacks:
            callback.on_fit_start(self)
        self.model.train()
        bar = Progress("train", total=self.total_steps, unit="step", initial=self.state.step,
                       mode=progress if self.world.is_writer else "off")
        loss_sum = torch.zeros((), device=self.device)
        window_steps, window_samples, window_time = 0, 0, 0.0
        train_time, train_samples = 0.0, 0
        last_valid: dict = {}
        last_valid_step = -1
        mark = self.timings.mark
        self.timings.restart()
        try:
            while self.state.step < self.total_steps and not self.state.stopped:
                epoch = self.state.epoch
                batches = self._open_epoch(epoch, self.state.batch)
                tick = time.perf_counter()
                for batch in batches:
                    mark("batch wait")
                    loss_sum += self.train_step(batch)
                    self.state.step += 1
                    self.state.batch += 1
                    if self.state.batch >= self.steps_per_epoch:
                        self.state.epoch, self.state.batch = epoch + 1, 0
                    now = time.perf_counter()
                    window_steps += 1
                    window_samples += batch.batch_size
                    window_time += now - tick
                    step = self.state.step
                    mark("step")
                    if step % c.log_every == 0 or step == self.total_steps:
                        loss = float(loss_sum) / window_steps
                        mark("loss read")
                        rate = window_samples / max(window_time, 1e-9)
                        lr, emb_lr = self.lrs(step - 1)
                        self._check_finite(loss, step, lr, emb_lr)
                        self._log({"step": step, "epoch": epoch, "loss": loss, "lr": lr, "embedding_lr": emb_lr,
                                   "samples_per_s": rate})
                        bar.set_fields({"loss": f"{loss:.4f}", "lr": f"{lr:.3g}", "samples/s": f"{rate:,.0f}"})
                        train_time += window_time
                        train_samples += window_samples
                        loss_sum.zero_()
                        window_steps, window_samples, window_time = 0, 0, 0.0
                        mark("log")
                    bar.update(1)
                    mark("progress")
                    epoch_done = self.state.batch == 0
                    due = c.eval_every and step % c.eval_every == 0
                    if evaluate_valid is not None and (due or epoch_done):
                        last_valid, last_valid_step = self._evaluate(evaluate_valid, epoch, callbacks), step
                        if epoch_done:
                            self._judge(last_valid, epoch_end=True)
                        mark("evaluation")
                    if (c.checkpoint_every and step % c.checkpoint_every == 0 and step < self.total_steps
                            and not self.state.stopped):
                        self._save(callbacks)
                        mark("checkpoint")
                    for callback in callbacks:
                        callback.on_step(self)
                    mark("callbacks")
                    if step >= self.total_steps or epoch_done:
                        break
                    tick = time.perf_counter()
                else:
                    if self.state.batch:  # the loader ran out before steps_per_epoch batches
                        self.state.epoch, self.state.batch = epoch + 1, 0
                _close(batches)
        finally:
            bar.close()
        if evaluate_valid is not None and last_valid_step != self.state.step:
            last_valid = self._evaluate(evaluate_valid, self.state.epoch, callbacks)
            self._judge(last_valid, epoch_end=False)
            mark("evaluation")
        self._save(callbacks)
        mark("checkpoint")
        kept = self._restore_best()
        train_time += window_time
        train_samples += window_samples
        return {"steps": self.state.step, "epochs": self.epochs, "valid": kept["valid"] if kept else last_valid,
                "kept": kept,
                "samples_per_s": train_samples / train_time if train_time else None}

    def _judge(self, scores: dict, epoch_end: bool) -> None:
        """Early stopping: keep the weights when ``scores`` beat the best so far; count an epoch without
        improvement otherwise, and stop after ``early_stopping`` of them in a row. An epoch that ends before the
        learning rate has decayed to half its peak does not count (with ``decay=none``: before its warmup ended): the
        model has not trained at its rates yet, and at the peak its valid log loss wanders (a run of 8 epochs stopped
        in its third, its kept model 0.03 AUC below a logistic regression, where it ends above it trained on).

        Scores are compared by log loss, which sees how sure a model is as well as how it ranks: by AUC, a model
        that memorised the rare values of a column of no signal (its valid log loss 0.85 against 0.50 for the
        base rate) was kept, as its AUC wandered up by chance."""
        if not self.keeps_best:
            return
        s = self.state
        loss = scores.get("logloss", float("nan"))
        if math.isfinite(loss) and (s.best_valid is None or loss < s.best_valid["logloss"]):
            s.best_valid, s.best_step, s.best_epoch, s.bad_epochs = dict(scores), s.step, s.epoch, 0
            self.best_weights = cpu_copy(self.model.state_dict())
        elif epoch_end and self._counts_for_stopping(s.step):
            s.bad_epochs += 1
            s.stopped = s.bad_epochs >= self.cfg.early_stopping and s.step < self.total_steps
            if s.stopped:
                self._log({"event": "early_stop", "step": s.step, "epoch": s.epoch, "best_epoch": s.best_epoch,
                           "best_logloss": s.best_valid["logloss"] if s.best_valid else None})

    def _counts_for_stopping(self, step: int) -> bool:
        """Whether an epoch ending at ``step`` without improvement counts toward early stopping (:meth:`_judge`)."""
        if step < self.warmup_steps:
            return False
        return self.cfg.decay == "none" or lr_at(step, 1.0, **self._schedule()) <= 0.5

    def _restore_best(self) -> dict | None:
        """Load the best weights into the model (after the last checkpoint was saved); what was kept."""
        s = self.state
        if not self.keeps_best or self.best_weights is None or s.best_valid is None:
            return None
        if s.best_step != s.step:
            self.model.load_state_dict(self.best_weights)
        return {"epoch": s.best_epoch, "step": s.best_step, "valid": s.best_valid, "last_step": s.step,
                "stopped_early": s.stopped}

    def _open_epoch(self, epoch: int, batch: int) -> Iterable:
        self.loader.load_state_dict({**self.loader.state_dict(), "epoch": epoch, "batches": batch})
        batches = iter(self.loader)
        return self.pipeline(batches) if self.pipeline is not None else batches

    def train_step(self, batch) -> torch.Tensor:
        """One optimizer step on ``batch`` with the lrs of ``state.step``; the loss, detached, left on the
        device (nothing is read back to the host). :meth:`fit` calls it once per step."""
        lr, emb_lr = self.lrs(self.state.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.embedding.set_lr(emb_lr)
        batch = batch.to(self.device, non_blocking=True)
        # A short batch (an epoch's last) runs eagerly: compiled for its own shape, it would cost a second
        # compilation of the whole graph, seconds, for one step.
        if self._dense_loss is not None and batch.batch_size == self.loader.batch_size:
            with autocast(self.device, self.amp):  # the pooled rows come in the dense part's dtype
                pooled = self.model.embedding(batch.sparse)
            loss = self._dense_loss(batch.dense, pooled, batch.label)
        else:
            with autocast(self.device, self.amp):
                logits = self.model(batch.dense, batch.sparse)
            loss = F.binary_cross_entropy_with_logits(logits.float(), batch.label.float())
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def _save(self, callbacks: Sequence[Callback]) -> None:
        path = self.save()
        for callback in callbacks:
            callback.on_checkpoint(self, path)

    def _evaluate(self, evaluate_valid: Callable[[], dict], epoch: int, callbacks: Sequence[Callback]) -> dict:
        start = time.perf_counter()
        result = evaluate_valid()
        self._log({"step": self.state.step, "epoch": epoch, "split": "valid", **result,
                   "seconds": time.perf_counter() - start})
        for callback in callbacks:
            callback.on_evaluation(self, result)
        return result

    def _check_finite(self, loss: float, step: int, lr: float, emb_lr: float) -> None:
        """Stop a run whose loss has diverged (on every rank at the same step: a rank's nan reaches the others'
        weights through the gradient all-reduce a step later, and ranks that stopped apart would wait for
        each other)."""
        finite = math.isfinite(loss)
        if self.world.size > 1:
            finite = all(self.world.gather_objects(finite))
        if not finite:
            raise UserError(
                f"train: the training loss became {loss if not math.isfinite(loss) else 'nan on another rank'} by step "
                f"{step} (train.lr {lr:.3g}, train.embedding_lr {emb_lr:.3g} at that step): the model diverged, and "
                "this run is not kept as trained; rerun with lower learning rates (or train.warmup_steps longer)")

    def _log(self, record: dict) -> None:
        if not self.world.is_writer:
            return
        record = {"time": time.time(), **record}
        self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")


def dense_loss(model: RecModel, amp: bool, dense: torch.Tensor, pooled: torch.Tensor,
                label: torch.Tensor) -> torch.Tensor:
    """The mean log loss of ``model``'s dense part on the pooled embeddings, bf16 autocast when ``amp``."""
    with autocast(dense.device, amp):
        logits = model.dense_forward(dense, pooled)
    return F.binary_cross_entropy_with_logits(logits.float(), label.float())


def compiles(setting: str, device: torch.device) -> bool:
    """Whether a ``train.compile`` setting compiles on ``device`` (``auto``: on a GPU)."""
    return setting != "off" and (setting != "auto" or device.type == "cuda")


def compiled_dense_loss(model: RecModel, amp: bool, setting: str, device: torch.device):
    """:func:`dense_loss` of ``model`` compiled as ``train.compile`` says (``auto``: on a GPU), else None.

    ``max-autotune`` lets Inductor time its own matrix-product kernels, with the element-wise work that
    follows them fused in, against the library's, and keep the fastest (no CUDA graphs: the embedding
    lookup runs eagerly between steps)."""
    if not compiles(setting, device):
        return None
    mode = "max-autotune-no-cudagraphs" if setting == "max-autotune" else None
    return torch.compile(functools.partial(dense_loss, model, amp), dynamic=False, mode=mode)


def _close(batches: Iterable) -> None:
    close = getattr(batches, "close", None)
    if callable(close):
        close()


def _logged_step(line: str) -> int | None:
    """The step of a line of ``metrics.jsonl``; None for a line cut short (a crash or a full disk as it was written)."""
    try:
        record = json.loads(line)
        return int(record["step"])
    except (ValueError, TypeError, KeyError):
        return None
