"""The model, data and optimizer shared by the three versions of the character-level language
model script: ``train_charlm_torchrun.py`` (plain DDP under torchrun, the script a user has),
``train_charlm.py`` (its ``dp.fit`` port) and ``train_charlm_fabric.py`` (its Lightning Fabric
port). What differs between them is the training program; ``python -m benchmarks --only ports``
counts the lines each port changed."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional
from torch.utils.data import Dataset

TEXT = """\
Alice was beginning to get very tired of sitting by her sister on the bank, and of having
nothing to do: once or twice she had peeped into the book her sister was reading, but it had
no pictures or conversations in it, and what is the use of a book, thought Alice, without
pictures or conversations? So she was considering in her own mind (as well as she could, for
the hot day made her feel very sleepy and stupid), whether the pleasure of making a
daisy-chain would be worth the trouble of getting up and picking the daisies, when suddenly a
White Rabbit with pink eyes ran close by her. There was nothing so very remarkable in that;
nor did Alice think it so very much out of the way to hear the Rabbit say to itself, Oh dear!
Oh dear! I shall be late! But when the Rabbit actually took a watch out of its
waistcoat-pocket, and looked at it, and then hurried on, Alice started to her feet, for it
flashed across her mind that she had never before seen a rabbit with either a
waistcoat-pocket, or a watch to take out of it, and burning with curiosity, she ran across the
field after it, and fortunately was just in time to see it pop down a large rabbit-hole under
the hedge. In another moment down went Alice after it, never once considering how in the
world she was to get out again. The rabbit-hole went straight on like a tunnel for some way,
and then dipped suddenly down, so suddenly that Alice had not a moment to think about
stopping herself before she found herself falling down a very deep well.
"""

BLOCK = 32  # characters of context
SCHEDULE_EPOCHS = 8  # the learning-rate schedule spans this many epochs, however many a run trains


class Windows(Dataset):
    """Every ``BLOCK``-character window of ``ids`` and the same window shifted by one."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids) - BLOCK

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.ids[i : i + BLOCK + 1]
        return chunk[:-1], chunk[1:]


class TinyGPT(nn.Module):
    """Token and position embeddings, two causal transformer blocks, a linear head. Like
    minGPT's, ``forward(idx, targets=None)`` returns ``(logits, loss)`` (loss None without
    targets)."""

    def __init__(self, vocab: int, width: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(BLOCK, width)
        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.1, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(BLOCK), persistent=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        n = idx.shape[1]
        h = self.tokens(idx) + self.positions(torch.arange(n, device=idx.device))
        logits = self.head(self.norm(self.blocks(h, mask=self.mask[:n, :n], is_causal=True)))
        loss = None if targets is None else functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


def adamw(model: TinyGPT, lr: float) -> torch.optim.Optimizer:
    """minGPT's grouping: weight decay on the weights of linear layers, none on biases,
    norms and embeddings."""
    decay, no_decay = [], []
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            wants = name.endswith("weight") and isinstance(module, nn.Linear)
            (decay if wants else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup: int, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def datasets() -> tuple[Windows, Windows, int]:
    """Training and validation windows (the last tenth of the text) and the vocabulary size."""
    chars = sorted(set(TEXT))
    ids = torch.tensor([chars.index(c) for c in TEXT])
    cut = int(0.9 * len(ids))
    return Windows(ids[:cut]), Windows(ids[cut - BLOCK :]), len(chars)


def schedule_steps(train_set: Windows, batch: int, world_size: int) -> int:
    """Optimizer steps in ``SCHEDULE_EPOCHS`` epochs of ``batch`` per rank."""
    return SCHEDULE_EPOCHS * math.ceil(len(train_set) / (batch * world_size))
