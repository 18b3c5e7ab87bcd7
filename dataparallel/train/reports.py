"""What training says as it goes: the driver's progress bar during an epoch, its line per
epoch (text, or a JSON object under ``log_format = "json"``), the step lines of
``log_every``, the step callbacks; and the epoch's metrics, aggregated from every rank's
report."""

from __future__ import annotations

import json
import sys
from collections.abc import Sized
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch

from .options import EpochMetrics, StepInfo

if TYPE_CHECKING:
    from .trainer import Trainer


class Reports:
    """One rank's output (the driver's, mostly)."""

    def __init__(self, trainer: Trainer, log_format: str) -> None:
        self.t = trainer
        # Output to a log, not a terminal: no progress bar, only the epoch's line ("text", or
        # "json" as `dataparallel launch --log-format json` asks). None: a bar, then the line.
        self.lines: str | None = "json" if log_format == "json" else None
        if self.lines is None and not sys.stderr.isatty():
            self.lines = "text"
        self.bar: Any = None  # the driver's progress bar during an epoch

    def open_bar(self, epoch: int, batches: Any) -> Any:
        """The driver's bar for ``epoch`` on a terminal (``batches``: its length where it has
        one), else None."""
        t = self.t
        bar = None
        if t.rank == 0 and t.opts.progress and self.lines is None:
            from tqdm import tqdm

            total = len(batches) if isinstance(batches, Sized) else None
            bar = tqdm(total=total, desc=f"epoch {epoch}", unit="batch", leave=False)
        self.bar = bar
        return bar

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.bar = None

    def stepped(self, epoch: int, batch: int, loss: torch.Tensor, lr: float) -> None:
        """After an optimizer step (``global_step`` counts it): the step callbacks, the log line."""
        t = self.t
        every = t.opts.log_every
        log_now = every is not None and t.rank == 0 and t.global_step % every == 0
        if not (t.spec.step_callbacks or log_now):
            return
        info = StepInfo(epoch, t.global_step, batch, float(loss.detach()), lr, t.rank)
        for callback in t.spec.step_callbacks:
            callback(info)
        if log_now:
            line = f"epoch {epoch} step {info.step} loss {info.loss:.4f} lr {lr:.3g}"
            if self.lines == "json":
                line = json.dumps({"event": "step", **asdict(info)})
            if self.bar is not None:
                self.bar.write(line)
            else:
                print(line, flush=True)

    def metrics(self, epoch: int, parsed: list[dict[str, Any]], lr: float, stamps: list[float]) -> EpochMetrics:
        """``epoch``'s metrics from every rank's report (``parsed``) and the driver's times
        (``stamps``: started, commanded, trained, validated, reported)."""
        started, command, trained, validated, reported = stamps
        t_loss, t_n, t_b = (sum(p["train"][i] for p in parsed) for i in range(3))
        v_loss, v_n, v_correct, v_classified = (sum(p["val"][i] for p in parsed) for i in range(4))
        staleness, held_back = self.t.strategy.figures()
        return EpochMetrics(
            epoch=epoch,
            train_loss=t_loss / max(t_n, 1),
            train_samples=t_n,
            train_batches=t_b,
            train_batches_per_rank=[p["train"][2] for p in parsed],
            world_size=self.t.world,
            staleness=staleness,
            held_back=held_back,
            val_loss=v_loss / v_n if v_n else None,
            val_samples=v_n,
            val_accuracy=v_correct / v_classified if v_classified else None,
            lr=lr,
            seconds=reported - started,
            train_seconds=trained - command,
            val_seconds=validated - trained,
            control_seconds=(command - started) + (reported - validated),
        )

    def print_epoch(self, m: EpochMetrics) -> None:
        """The epoch's one line (JSON under ``log_format = "json"``): on a terminal where the
        epoch's bar was (it leaves none), in a log in its place (a file would get every redraw)."""
        if self.lines == "json":
            print(json.dumps({"event": "epoch", **asdict(m)}), flush=True)
        elif self.t.opts.progress:
            val = "" if m.val_loss is None else f", val loss {m.val_loss:.4f}"
            accuracy = "" if m.val_accuracy is None else f", val accuracy {m.val_accuracy:.1%}"
            print(
                f"epoch {m.epoch}: train loss {m.train_loss:.4f}{val}{accuracy}, {m.train_samples} samples "
                f"on {m.world_size} ranks, {m.seconds:.1f}s",
                flush=True,
            )
