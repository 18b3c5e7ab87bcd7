"""One rank of a training job for tests/test_loop.py: ``python tests/loop_worker.py CONFIG_JSON``.

Trains a small MLP (with dropout, so RNG state matters) on fixed synthetic regression data
and saves the final parameters and metrics to ``out`` (rank 0)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

import dataparallel as dp

#: The optimiser and schedule every job uses (tests rebuild them for their references).
LR, MOMENTUM, GAMMA = 0.05, 0.9, 0.9


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(96, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(96, 1, generator=g)
    return TensorDataset(x, y)


def model(dropout: float, norm: bool = False) -> torch.nn.Module:
    """The MLP; ``norm``: with batch normalisation after the first layer (buffers: running
    statistics, a batch count)."""
    torch.manual_seed(7)
    layers = [torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Dropout(dropout), torch.nn.Linear(16, 1)]
    if norm:
        layers.insert(1, torch.nn.BatchNorm1d(16))
    return torch.nn.Sequential(*layers)


def uneven_batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank r's batches in the uneven case: 2 + 2r batches of 8, different counts per rank."""
    x, y = data().tensors
    return [(x[i : i + 8], y[i : i + 8]) for i in range(0, 16 * (1 + rank), 8)]


def batch_source(cfg: dict):
    """A per-rank batch source instead of a Dataset, for the uneven and slow cases."""
    full = data()
    x, y = full.tensors
    if cfg.get("uneven"):
        return lambda epoch, rank, world: uneven_batches(rank)
    if cfg.get("slow"):

        def slow(epoch, rank, world):
            for i in range(0, 96, 8):
                time.sleep(0.2)
                yield x[i : i + 8], y[i : i + 8]

        return slow
    return None


class Stalling(torch.utils.data.Dataset):
    """``inner``, whose ``at``-th item read (counted from 1) waits until the file ``release``
    exists (at most a minute): a rank whose data loading stalls mid-epoch. It makes the file
    ``RELEASE.stalled`` as it begins to wait."""

    def __init__(self, inner: torch.utils.data.Dataset, at: int, release: str) -> None:
        self.inner, self.at, self.release, self.reads = inner, at, release, 0

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        self.reads += 1
        if self.reads == self.at:
            Path(f"{self.release}.stalled").touch()
        deadline = time.monotonic() + 60
        while self.reads == self.at and not Path(self.release).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.inner[i]


class FirstHalf(torch.utils.data.DistributedSampler):
    """A user's sampler: the first half of each rank's shard (``uneven``: all of it on rank 0)."""

    uneven = False

    def __iter__(self):
        indices = list(super().__iter__())
        keep = len(indices) if self.uneven and self.rank == 0 else len(indices) // 2
        return iter(indices[:keep])

    def __len__(self) -> int:
        full = super().__len__()
        return full if self.uneven and self.rank == 0 else full // 2


class UnevenHalf(FirstHalf):
    uneven = True


class TupleOutput(torch.nn.Module):
    """``net`` returning ``(prediction, {"norm": ...})`` instead of a tensor."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
        out = self.net(x)
        return out, {"norm": out.detach().norm()}


def main(cfg: dict) -> None:
    if cfg.get("connecting"):  # a file made just before connecting (a newcomer is on its way)
        Path(cfg["connecting"]).touch()
    if cfg.get("launched"):  # by `dataparallel launch`: everything from its variables
        ch = dp.connect(timeout=60)
        cfg["rank"] = ch.rank
    else:
        ch = dp.connect(
            cfg["url"],
            rank=cfg["rank"],
            world_size=cfg["world"],
            job=cfg.get("job", "loop"),
            timeout=cfg.get("timeout", 60),
            elastic=cfg.get("elastic", False),
        )
    train = batch_source(cfg) or data()
    if cfg.get("stall_data"):  # [rank, read, path]: that rank's data loading waits at that read for the file
        rank_at, read_at, release = cfg["stall_data"]
        if ch.rank == rank_at:
            train = Stalling(train, read_at, release)
    options = dp.TrainOptions(
        epochs=cfg.get("epochs", 3),
        batch_size=cfg.get("batch", 8),
        grad_accum=cfg.get("accum", 1),
        amp=cfg.get("amp"),
        shuffle=cfg.get("shuffle", True),
        checkpoint=cfg.get("checkpoint"),
        resume=cfg.get("resume", False),
        clip_grad_norm=cfg.get("clip"),
        patience=cfg.get("patience"),
        progress=False,
        collective_timeout=cfg.get("collective_timeout", 60),
        stall_timeout=cfg.get("stall_timeout"),
        status_http=cfg.get("status_http"),
        checkpoint_every=cfg.get("checkpoint_every", 1),
        scheduler_interval=cfg.get("scheduler_interval", "epoch"),
        log_every=cfg.get("log_every"),
        loader_options={"collate_fn": counted_collate} if cfg.get("features") else {},
        sampler={"half": FirstHalf, "uneven": UnevenHalf}.get(cfg.get("sampler")),
        elastic=cfg.get("elastic"),
        min_world_size=cfg.get("min_world", 1),
        max_world_size=cfg.get("max_world"),
        keep_global_batch=cfg.get("keep_global", False),
        snapshot_every=cfg.get("snapshot_every"),
        strategy=cfg.get("strategy", "ddp"),
        sync_every=cfg.get("sync_every", 8),
        ps_ranks=cfg.get("ps_ranks", 1),
        max_staleness=cfg.get("max_staleness"),
    )
    net = model(cfg.get("dropout", 0.0), cfg.get("norm", False))
    if cfg.get("rank_seed"):  # each rank its own RNG stream from here (dropout masks differ by rank)
        torch.manual_seed(100 + (ch.rank if ch.rank is not None else 99))
    loss_fn = torch.nn.functional.mse_loss
    trained = net
    if cfg.get("tuple"):  # the shape of a language model's forward: (prediction, extra)
        trained, loss_fn = TupleOutput(net), lambda out, y: torch.nn.functional.mse_loss(out[0], y)
    if cfg.get("broken_loss"):
        loss_fn = lambda out, y: out.no_such_method()  # noqa: E731
    optimizer = lambda params: torch.optim.SGD(params, lr=cfg.get("lr", LR), momentum=MOMENTUM)  # noqa: E731
    seen: dict = {"steps": [], "saves": 0, "loaded": None}
    hooks = {}
    if cfg.get("features"):
        # Parameter groups by module, from the model: the output layer learns at half the rate.
        def optimizer(model):
            groups = [{"params": model[0].parameters()}, {"params": model[3].parameters(), "lr": LR / 2}]
            return torch.optim.SGD(groups, lr=LR, momentum=MOMENTUM)

        def save_extra():  # during the save: the rank's status says so
            seen["saves"] += 1
            return {"saves": seen["saves"], "tag": "mine", "phase": ch.status.phase_name}

        hooks = {
            "step_callbacks": [lambda info: seen["steps"].append([info.epoch, info.step, info.batch, info.rank])],
            "extra_state": (save_extra, lambda value: seen.update(loaded=value)),
        }
    if cfg.get("started"):  # a file per rank, made at its first step: the job is training
        marker = Path(f"{cfg['started']}.{cfg['rank']}")
        hooks.setdefault("step_callbacks", []).append(lambda info: marker.exists() or marker.touch())
    if cfg.get("hold"):  # [epoch, path]: every rank waits at that epoch's first step until the file exists
        epoch, release = cfg["hold"]

        def hold(info: dp.StepInfo) -> None:
            if info.epoch == epoch:  # PATH.held.RANK: this rank waits there (the epoch before has ended)
                held = Path(f"{release}.held.{info.rank}")
                held.exists() or held.touch()
            deadline = time.monotonic() + 60
            while info.epoch == epoch and not Path(release).exists() and time.monotonic() < deadline:
                time.sleep(0.05)

        hooks.setdefault("step_callbacks", []).append(hold)
    if cfg.get("term_step"):  # [rank, step]: SIGTERM to that rank after that optimizer step (of the whole run)
        rank_at, step_at = cfg["term_step"]
        hooks.setdefault("step_callbacks", []).append(
            lambda info: info.rank == rank_at and info.step == step_at and os.kill(os.getpid(), signal.SIGTERM)
        )
    if cfg.get("step_sleep"):  # slow steps (seconds each, every rank; a number per rank: each its own)
        pause = cfg["step_sleep"]
        hooks.setdefault("step_callbacks", []).append(
            lambda info: time.sleep(pause[info.rank] if isinstance(pause, list) else pause)
        )
    if cfg.get("die") or cfg.get("freeze") or cfg.get("term"):
        # [rank, epoch, batch]: that rank is killed (frozen, sent SIGTERM) there, mid-epoch
        kinds = (("die", signal.SIGKILL), ("freeze", signal.SIGSTOP), ("term", signal.SIGTERM))
        at, sig = next((cfg[key], sig) for key, sig in kinds if cfg.get(key))

        def die(info: dp.StepInfo) -> None:
            if [ch.rank, info.epoch, info.batch] == at:
                for _ in range(2 if cfg.get("twice") else 1):  # twice: as srun and a launcher both deliver it
                    os.kill(os.getpid(), sig)

        hooks.setdefault("step_callbacks", []).append(die)
    if cfg.get("raise_at"):  # [rank, step]: that rank's step callback raises there (the script's own error)
        rank_at, step_at = cfg["raise_at"]

        def fail(info: dp.StepInfo) -> None:
            if info.rank == rank_at and info.step >= step_at:
                raise RuntimeError(f"rank {rank_at} fails on purpose at step {info.step}")

        hooks.setdefault("step_callbacks", []).append(fail)
    try:
        result = dp.fit(
            ch,
            trained,
            loss_fn,
            optimizer,
            train,
            data(),
            options=options,
            scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=GAMMA),
            **hooks,
        )
    except BaseException:
        if cfg.get("raise_at"):  # as `with dp.connect() as ch:` does: the channel closed, cleanly
            ch.close()
        raise
    if result.rank == 0:  # the driver at the end
        summary = {
            "epochs": [vars(m) for m in result.epochs],
            "stopped_early": result.stopped_early,
            "regroups": [vars(r) for r in result.regroups],
        }
        torch.save({**summary, "state": net.state_dict()}, cfg["out"])
    if cfg.get("replicas"):  # every rank's own parameters, to compare the replicas
        torch.save(net.state_dict(), f"{cfg['out']}.rank{ch.rank}.pt")
    if cfg.get("features"):
        seen["collated"] = COLLATED[0]
        Path(f"{cfg['out']}.rank{ch.rank}.json").write_text(json.dumps(seen))
    ch.close()


COLLATED = [0]


def counted_collate(batch):
    COLLATED[0] += 1
    return torch.utils.data.default_collate(batch)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
