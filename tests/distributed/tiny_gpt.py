"""The tiny GPT of the many-process tests: a text embedding and a text head of ``VOCAB``
rows around one residual MLP block, the row layout the vocabulary rules care about."""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 80
BASE = 64  # base-vocabulary rows (frozen under TRAINING_PATCHES_BASE_VOCAB)
DIM = 32


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = DIM) -> None:
        super().__init__()
        self.text_embedding = nn.Embedding(vocab, dim)
        self.block = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.text_head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.text_embedding(tokens)
        return self.text_head(hidden + self.block(hidden))


def batch(generator: torch.Generator, size: int = 8, length: int = 12,
          vocab: int = VOCAB) -> torch.Tensor:
    """Token ids that use every part of the vocabulary (base and new rows)."""
    return torch.randint(0, vocab, (size, length), generator=generator)


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                       tokens[:, 1:].reshape(-1))


def shard(model: TinyGPT) -> TinyGPT:
    """``model`` under FSDP2 as the tests shard it: each of its three parts, then the whole."""
    from torch.distributed.fsdp import fully_shard

    for module in (model.text_embedding, model.block, model.text_head):
        fully_shard(module)
    fully_shard(model)
    return model


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of ``model`` whole (an FSDP2 shard gathered), by its name without a
    DDP ``module.`` prefix: what a rank compares against another run's or another rank's."""
    state = {}
    for name, param in model.named_parameters():
        value = param.full_tensor() if hasattr(param, "full_tensor") else param
        state[name.removeprefix("module.")] = value.detach().clone()
    return state


def read_events(folder: str) -> list[dict]:
    """The NaN guard's records a rank wrote into ``folder`` (its nonfinite_events files)."""
    import glob
    import json
    import os

    events = []
    for path in sorted(glob.glob(os.path.join(folder, "nonfinite_events*.jsonl"))):
        with open(path, encoding="utf-8") as handle:
            events += [json.loads(line) for line in handle if line.strip()]
    return events


def end_job(scope: dict, code: int = 0) -> None:
    """The end of a rank script: drop its models, optimizers and tensors, then wait for
    every rank and destroy the process group. An FSDP2 model (DTensor parameters, a device
    mesh holding the group) still alive when the interpreter exits after
    ``destroy_process_group`` made gloo abort now and then at exit (torch 2.14.1: "terminate
    called without an active exception", SIGABRT, after every check had passed)."""
    import gc

    import torch.distributed as dist

    for name, value in list(scope.items()):
        if not name.startswith("__") and isinstance(
                value, (nn.Module, torch.optim.Optimizer, torch.Tensor, dict, list, tuple)):
            del scope[name]
    gc.collect()
    dist.barrier()  # no rank tears gloo down while a peer still talks to it
    dist.destroy_process_group()
    from processes import exit_after_atexit

    exit_after_atexit(code)  # the process ends here, with ``code``
