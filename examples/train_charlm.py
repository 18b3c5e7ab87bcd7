"""A character-level language model with the shape of a real training script, ported to
``dp.fit`` from ``train_charlm_torchrun.py`` (a plain torchrun DDP script) with every feature
kept: a GPT-style model whose forward returns ``(logits, loss)``, AdamW with weight-decay
groups built from the model, bf16 autocast, gradient clipping, a warm-up then cosine learning
rate stepped every optimizer step, a log line every 20 steps and a snapshot every 2 epochs
that the next run resumes. ``python -m benchmarks --only ports`` counts the lines the port
changed, beside the Lightning Fabric port's (``train_charlm_fabric.py``).

    dataparallel launch --nprocs 2 examples/train_charlm.py         # a local job over zmq
    torchrun --nproc-per-node 2 examples/train_charlm.py            # torchrun's store as the channel

8 epochs take about a minute on 2 CPU cores; validation loss falls from ~3.3 (uniform over the
characters) to ~1.6.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from charlm_model import TinyGPT, adamw, datasets, schedule_steps, warmup_cosine
from torch.nn import functional

import dataparallel as dp


def main(epochs, snapshot, result):
    ch = dp.connect()  # from `dataparallel launch`'s or torchrun's environment
    torch.manual_seed(0)
    train_set, val_set, vocab = datasets()
    batch = 32
    model = TinyGPT(vocab)

    def report(m: dp.EpochMetrics):
        batches = m.train_batches_per_rank
        print(
            f"epoch {m.epoch}  train loss {m.train_loss:.3f}  val loss {m.val_loss:.3f}  batches {batches}", flush=True
        )

    options = dp.TrainOptions(
        epochs=epochs, batch_size=batch, amp="bf16", clip_grad_norm=1.0, scheduler_interval="step",
        log_every=20, checkpoint=snapshot, checkpoint_every=2, resume=snapshot is not None, progress=False,
    )  # fmt: skip
    val_loss = dp.fit(
        ch,
        model,
        lambda out, targets: functional.cross_entropy(out[0].float().flatten(0, 1), targets.flatten()),
        lambda model: adamw(model, lr=3e-3),
        train_set,
        val_set,
        options=options,
        scheduler=lambda opt: warmup_cosine(opt, warmup=10, total=schedule_steps(train_set, batch, ch.world_size)),
        callbacks=[report],
    ).last.val_loss
    if ch.rank == 0:
        print(f"driver: final validation loss {val_loss:.4f}", flush=True)
        if result:
            Path(result).write_text(json.dumps({"val_loss": val_loss, "epochs": epochs, "transport": ch.url.scheme}))
    ch.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--snapshot", default=None, help="snapshot file, written every 2 epochs and resumed")
    parser.add_argument("--result", default=None, help="write the final validation loss here (JSON)")
    args = parser.parse_args()
    main(args.epochs, args.snapshot, args.result)
