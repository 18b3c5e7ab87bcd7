"""Single-process multi-device data parallelism (lamp's ``dataParallelModels``, d2l's
multi-GPU chapter): one process holds a replica of the model per device, splits each batch
across them, sums the gradients onto the primary replica (the optimizer's), steps, and
copies the new parameters back to the others.

No process group and no control channel: useful on one machine with several GPUs when
separate processes are not wanted, and on CPU "devices" for tests. Per-device work is
enqueued one device after another; on CUDA the kernels run concurrently anyway, since the
host only queues them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch


class Replicas:
    """Replicas of ``model`` on ``devices`` (the first is the primary, where the optimizer lives).

    ``step(x, y)`` is equivalent to one optimizer step of the primary model on the whole
    batch with a mean-reduced loss: each shard's loss is weighted by its share of the batch.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        devices: Sequence[str | torch.device],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    ) -> None:
        if not devices:
            raise ValueError("Replicas needs at least one device")
        self.devices = [torch.device(d) for d in devices]
        self.primary = model.to(self.devices[0])
        self.replicas = [self.primary] + [copy.deepcopy(model).to(d) for d in self.devices[1:]]
        self.loss_fn = loss_fn
        self.optimizer = optimizer(list(self.primary.parameters()))

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Train on one batch split across the devices; return the batch's mean loss."""
        n = min(len(self.replicas), len(x))
        xs, ys = x.tensor_split(n), y.tensor_split(n)
        for replica in self.replicas:
            replica.train()
            replica.zero_grad(set_to_none=True)
        total = 0.0
        for replica, device, xi, yi in zip(self.replicas, self.devices, xs, ys, strict=False):
            loss = self.loss_fn(replica(xi.to(device)), yi.to(device)) * (len(xi) / len(x))
            loss.backward()
            total += float(loss.detach())
        self._sum_gradients(n)
        self.optimizer.step()
        self._broadcast_parameters()
        return total

    def _sum_gradients(self, used: int) -> None:
        for params in zip(*(r.parameters() for r in self.replicas[:used]), strict=True):
            primary, others = params[0], params[1:]
            for other in others:
                if other.grad is None:
                    continue
                grad = other.grad.to(primary.device)
                primary.grad = grad if primary.grad is None else primary.grad.add_(grad)

    @torch.no_grad()
    def _broadcast_parameters(self) -> None:
        state = self.primary.state_dict()
        for replica in self.replicas[1:]:
            replica.load_state_dict(state)

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor) -> torch.Tensor:
        """Forward a batch split across the devices; outputs gathered on the primary device."""
        n = min(len(self.replicas), len(x))
        outs = []
        for replica, device, xi in zip(self.replicas, self.devices, x.tensor_split(n), strict=False):
            replica.eval()
            outs.append(replica(xi.to(device)).to(self.devices[0]))
        return torch.cat(outs)
