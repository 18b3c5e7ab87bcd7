"""Single-process multi-device mode equals one model trained on the whole batch."""

import pytest
import torch

from dataparallel.train.replicas import Replicas


def make_model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))


@pytest.mark.parametrize("n_devices, batch", [(1, 8), (2, 8), (3, 10), (4, 3)])
def test_replicas_step_equals_single_model_on_the_whole_batch(n_devices, batch):
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(batch, 6, generator=g), torch.randint(0, 3, (batch,), generator=g)) for _ in range(5)]
    reference = make_model()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    reference_losses = []
    for x, y in data:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(reference(x), y)
        loss.backward()
        opt.step()
        reference_losses.append(float(loss.detach()))

    replicas = Replicas(
        make_model(),
        ["cpu"] * n_devices,
        torch.nn.functional.cross_entropy,
        lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    )
    losses = [replicas.step(x, y) for x, y in data]
    for ours, ref in zip(replicas.primary.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    for replica in replicas.replicas[1:]:  # every replica holds the new parameters
        for a, b in zip(replica.parameters(), replicas.primary.parameters(), strict=True):
            assert torch.equal(a, b)
    assert losses == pytest.approx(reference_losses, rel=1e-5)
    assert replicas.evaluate(data[0][0]).shape == (batch, 3)
