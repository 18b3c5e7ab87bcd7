"""``train_charlm_torchrun.py`` ported to Lightning Fabric, every feature kept: the yardstick
for the ``dp.fit`` port (``train_charlm.py``); ``python -m benchmarks --only ports`` counts the
lines each changed. Needs ``pip install lightning``.

    torchrun --nproc-per-node 2 examples/train_charlm_fabric.py --snapshot snap.pt

bf16 autocast, gradient clipping, a warm-up then cosine learning rate stepped every optimizer
step, a log line every 20 steps, a snapshot every 2 epochs that the next run resumes.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from charlm_model import TinyGPT, adamw, datasets, schedule_steps, warmup_cosine
from lightning.fabric import Fabric
from torch.nn import functional
from torch.utils.data import DataLoader


class Trainer:
    def __init__(self, fabric, model, train_set, val_set, optimizer, scheduler, batch, snapshot):
        self.fabric, self.rank = fabric, fabric.global_rank
        self.model, self.optimizer = fabric.setup(model, optimizer)
        self.train_loader = fabric.setup_dataloaders(DataLoader(train_set, batch_size=batch, shuffle=True))
        self.val_loader = fabric.setup_dataloaders(DataLoader(val_set, batch_size=batch))
        self.scheduler = scheduler
        self.snapshot, self.epochs_run, self.step = snapshot, 0, 0
        if snapshot and Path(snapshot).exists():
            self._load_snapshot()

    def _load_snapshot(self):
        state = {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler}
        rest = self.fabric.load(self.snapshot, state)
        self.epochs_run, self.step = rest["epochs_run"], rest["step"]
        print(f"rank {self.rank}: resuming from epoch {self.epochs_run}", flush=True)

    def _save_snapshot(self, epoch):
        state = {
            "model": self.model,
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "epochs_run": epoch + 1,
            "step": self.step,
        }
        self.fabric.save(self.snapshot, state)

    def _run_batch(self, inputs, targets):
        logits, _ = self.model(inputs)
        loss = functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        self.optimizer.zero_grad(set_to_none=True)
        self.fabric.backward(loss)
        self.fabric.clip_gradients(self.model, self.optimizer, max_norm=1.0)
        self.optimizer.step()
        self.scheduler.step()
        return loss.item()

    def _run_epoch(self, epoch):
        self.model.train()
        self.train_loader.sampler.set_epoch(epoch)
        total, batches = 0.0, 0
        for inputs, targets in self.train_loader:
            loss = self._run_batch(inputs, targets)
            total, batches, self.step = total + loss, batches + 1, self.step + 1
            if self.rank == 0 and self.step % 20 == 0:
                lr = self.scheduler.get_last_lr()[0]
                print(f"epoch {epoch} step {self.step}: loss {loss:.3f} lr {lr:.2e}", flush=True)
        return total / batches, batches

    @torch.no_grad()
    def _validate(self):
        self.model.eval()
        sums = torch.zeros(2)
        for inputs, targets in self.val_loader:
            logits, _ = self.model(inputs)
            loss = functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
            sums += torch.tensor([loss.item(), targets.numel()])
        sums = self.fabric.all_reduce(sums, reduce_op="sum")
        return (sums[0] / sums[1]).item()

    def train(self, epochs):
        val_loss = None
        for epoch in range(self.epochs_run, epochs):
            train_loss, batches = self._run_epoch(epoch)
            val_loss = self._validate()
            if self.rank == 0:
                print(
                    f"epoch {epoch}  train loss {train_loss:.3f}  val loss {val_loss:.3f}  batches {batches}",
                    flush=True,
                )
            if self.snapshot and (epoch + 1) % 2 == 0:  # every rank: fabric.save synchronises them
                self._save_snapshot(epoch)
        return val_loss


def main(epochs, snapshot, result):
    fabric = Fabric(
        accelerator="cpu", strategy="ddp", devices=int(os.environ["LOCAL_WORLD_SIZE"]), precision="bf16-mixed"
    )
    fabric.launch()
    torch.manual_seed(0)
    train_set, val_set, vocab = datasets()
    batch = 32
    model = TinyGPT(vocab)
    optimizer = adamw(model, lr=3e-3)
    scheduler = warmup_cosine(optimizer, warmup=10, total=schedule_steps(train_set, batch, fabric.world_size))
    trainer = Trainer(fabric, model, train_set, val_set, optimizer, scheduler, batch, snapshot)
    val_loss = trainer.train(epochs)
    if fabric.global_rank == 0:
        print(f"driver: final validation loss {val_loss:.4f}", flush=True)
        if result:
            Path(result).write_text(json.dumps({"val_loss": val_loss, "epochs": epochs}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--snapshot", default=None, help="snapshot file, written every 2 epochs and resumed")
    parser.add_argument("--result", default=None, help="write the final validation loss here (JSON)")
    args = parser.parse_args()
    main(args.epochs, args.snapshot, args.result)
