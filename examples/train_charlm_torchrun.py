"""The character-level language model trained the way a torchrun DDP script does it, with
nothing of this library: the script a user has before porting it (``train_charlm.py`` is its
``dp.fit`` port, ``train_charlm_fabric.py`` its Lightning Fabric port).

    torchrun --nproc-per-node 2 examples/train_charlm_torchrun.py --snapshot snap.pt

bf16 autocast, gradient clipping, a warm-up then cosine learning rate stepped every optimizer
step, a log line every 20 steps, a snapshot every 2 epochs that the next run resumes.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from charlm_model import TinyGPT, adamw, datasets, schedule_steps, warmup_cosine
from torch.nn import functional
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


class Trainer:
    def __init__(self, model, train_set, val_set, optimizer, scheduler, batch, snapshot):
        self.rank = int(os.environ["RANK"])
        self.model = DistributedDataParallel(model)
        self.sampler = DistributedSampler(train_set, seed=0)
        self.train_loader = DataLoader(train_set, batch_size=batch, sampler=self.sampler)
        self.val_loader = DataLoader(val_set, batch_size=batch, sampler=DistributedSampler(val_set, shuffle=False))
        self.optimizer, self.scheduler = optimizer, scheduler
        self.snapshot, self.epochs_run, self.step = snapshot, 0, 0
        if snapshot and Path(snapshot).exists():
            self._load_snapshot()

    def _load_snapshot(self):
        state = torch.load(self.snapshot, weights_only=False)
        self.model.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.epochs_run, self.step = state["epochs_run"], state["step"]
        print(f"rank {self.rank}: resuming from epoch {self.epochs_run}", flush=True)

    def _save_snapshot(self, epoch):
        state = {
            "model": self.model.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "epochs_run": epoch + 1,
            "step": self.step,
        }
        torch.save(state, self.snapshot + ".tmp")
        os.replace(self.snapshot + ".tmp", self.snapshot)

    def _run_batch(self, inputs, targets):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits, _ = self.model(inputs)
        loss = functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.scheduler.step()
        return loss.item()

    def _run_epoch(self, epoch):
        self.model.train()
        self.sampler.set_epoch(epoch)
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
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits, _ = self.model.module(inputs)
            loss = functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
            sums += torch.tensor([loss.item(), targets.numel()])
        dist.all_reduce(sums)
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
                if self.snapshot and (epoch + 1) % 2 == 0:
                    self._save_snapshot(epoch)
        return val_loss


def main(epochs, snapshot, result):
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    train_set, val_set, vocab = datasets()
    batch = 32
    model = TinyGPT(vocab)
    optimizer = adamw(model, lr=3e-3)
    scheduler = warmup_cosine(optimizer, warmup=10, total=schedule_steps(train_set, batch, dist.get_world_size()))
    trainer = Trainer(model, train_set, val_set, optimizer, scheduler, batch, snapshot)
    val_loss = trainer.train(epochs)
    if dist.get_rank() == 0:
        print(f"driver: final validation loss {val_loss:.4f}", flush=True)
        if result:
            Path(result).write_text(json.dumps({"val_loss": val_loss, "epochs": epochs}))
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--snapshot", default=None, help="snapshot file, written every 2 epochs and resumed")
    parser.add_argument("--result", default=None, help="write the final validation loss here (JSON)")
    args = parser.parse_args()
    main(args.epochs, args.snapshot, args.result)
