"""``strategy="ddp"``: gradients averaged every optimizer step (DistributedDataParallel)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..data import to_device
from .synchronous import SynchronousSteps


class DDP(SynchronousSteps):
    """Every optimizer step all-reduces the gradients; ranks with different batch counts
    train under ``Join``. Each rank trains its shard of the default sampler's order, so an
    epoch can go on mid-way on another number of ranks."""

    name = "ddp"

    def wrap(self) -> None:
        super().wrap()
        self._lay_out_buckets()

    def reshards(self) -> bool:
        return True

    def _lay_out_buckets(self) -> None:
        """One training step's forward and backward through DDP before training, changing
        nothing, so that every step of a run uses the same gradient buckets. DDP lays its
        buckets out again after its first backward (in the order the gradients became ready),
        and an all-reduce over three or more ranks adds each element in an order that depends
        on its place in its bucket: a resumed run (or a regrouped one), whose first step would
        use the first layout where the uninterrupted run used the second, would differ in the
        last bits. Train mode (every parameter a step uses gets its gradient), the RNG states
        and the buffers (batch-norm statistics) restored, the gradients dropped, no optimizer
        step; skipped on every rank unless every rank has a first batch."""
        t = self.t
        module = t.ddp.module
        buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
        with torch.random.fork_rng(devices=[t.device] if t.device.type == "cuda" else []):
            try:
                first = next(iter(t.batches(t.train_data, 0, train=True)), None)
                everyone = torch.tensor([0 if first is None else 1], device=t.device)
                dist.all_reduce(everyone, op=dist.ReduceOp.MIN, group=t.pg)
                if first is None or not everyone.item():
                    return
                x, y = to_device(first[0], t.device), to_device(first[1], t.device)
                with t.autocast():
                    loss = t.loss_fn(t.ddp(x), y)
                loss.float().backward()
            finally:
                t.ddp.zero_grad(set_to_none=True)
                with torch.no_grad():
                    for name, b in module.named_buffers():
                        b.copy_(buffers[name])
