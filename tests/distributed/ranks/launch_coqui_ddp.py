"""One rank of the real coqui Trainer under DDP (run by ``python -m trainer.distribute``
from test_launch_coqui_ddp.py): the tiny GPT as a coqui ``TrainerModel``, rank 1's loss NaN
on one batch, ``Trainer.fit()`` for one epoch; writes ``<out>/rank<R>.pt`` (parameters,
the guard's counters).

    launch_coqui_ddp.py --out=DIR --port=N [--xtts=DIR] [--plain]  (plus distribute's)

``--xtts=DIR``: the real XTTS ``GPTTrainer`` of the tiny XTTS files in DIR
(demo/xtts_tiny.py) instead of the tiny GPT, its text embedding output NaN for rank 1's
second batch; a training seed per rank so that each rank draws its own clips.

coqui's DDP needs CUDA (``init_distributed`` asserts it, ``setup_torch_training_env``
counts GPUs, ``DistributedDataParallel`` gets ``device_ids=[rank]``): this machine has no
GPU, so those three stand in for it, over gloo, with everything else coqui's own.
``--plain``: without ``import patches.auto`` (the feature-off run).
"""

from __future__ import annotations

import sys

if "--plain" not in sys.argv:
    import patches.auto  # noqa: F401  (the one line, first)

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import trainer.trainer as coqui
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from trainer import Trainer, TrainerArgs, TrainerConfig, TrainerModel

from tiny_gpt import TinyGPT, batch, loss_of

POISON = 5  # the sample whose loss is NaN, on rank 1 only
SAMPLES = 16
OPTIONS = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in sys.argv if a.startswith("--")
           and "=" in a}


# -- the GPU stand-ins ---------------------------------------------------------------------
def _environment(*args, **kwargs) -> tuple[bool, int]:
    torch.manual_seed(kwargs.get("training_seed", 54321))
    return False, len(os.environ["CUDA_VISIBLE_DEVICES"].split(","))  # set by distribute


def _init_distributed(rank: int, num_gpus: int, group_name: str, backend: str, url: str) -> None:
    dist.init_process_group("gloo", init_method=url, world_size=num_gpus, rank=rank)


coqui.setup_torch_training_env = _environment
coqui.init_distributed = _init_distributed
_ddp = coqui.DDP_th  # the patched binding when the patches are on: keep it in the chain
coqui.DDP_th = lambda module, device_ids=None, output_device=None: _ddp(module)


# -- the model -----------------------------------------------------------------------------
class Tokens(Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(7)
        self.items = [batch(generator, size=1)[0] for _ in range(SAMPLES)]

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor]:
        return index, self.items[index]


def collate(items: list) -> dict[str, torch.Tensor]:
    return {"index": torch.tensor([i for i, _ in items]),
            "tokens": torch.stack([t for _, t in items])}


@dataclass
class TinyConfig(TrainerConfig):
    pass


class TinyCoqui(TrainerModel):
    def __init__(self) -> None:
        super().__init__()
        self.gpt = TinyGPT()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.gpt(tokens)

    def train_step(self, batch: dict, criterion: object) -> tuple[dict, dict]:
        loss = loss_of(self.gpt, batch["tokens"])
        if int(os.environ["RANK"]) == 1 and POISON in batch["index"].tolist():
            loss = loss * float("nan")  # a bad sample, seen by rank 1 alone
        return {}, {"loss": loss}

    def get_data_loader(self, config, assets=None, is_eval=False, samples=None,
                        verbose=True, num_gpus=1, rank=0, **kwargs) -> DataLoader:
        data = Tokens()
        sampler = None
        if dist.is_initialized():  # each rank its own half of the data
            sampler = DistributedSampler(data, shuffle=False)
        return DataLoader(data, batch_size=config.batch_size, sampler=sampler,
                          collate_fn=collate)

    def get_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)

    def get_criterion(self) -> None:
        return None

    def format_batch(self, batch: dict) -> dict:
        return batch


def xtts_trainer(args: TrainerArgs, root: str, out: str) -> tuple[Trainer, torch.nn.Module]:
    """The tiny XTTS GPTTrainer (files made by the test), rank 1's 2nd batch poisoned."""
    from pathlib import Path

    from demo.xtts_tiny import DEFAULT_TEXTS, TinyXtts, vocab_size_of

    root_path = Path(root)
    tiny = TinyXtts(root=root_path, vocab=root_path / "vocab.json", dvae=root_path / "dvae.pth",
                    mel_stats=root_path / "mel_stats.pth", audio_dir=root_path / "wavs",
                    manifest=root_path / "metadata.csv", language="en", texts=DEFAULT_TEXTS,
                    vocab_size=vocab_size_of(root_path / "vocab.json"))
    # XTTSDataset ignores the sampler's index in training: it draws a random clip with
    # Python's `random`, seeded with training_seed when the dataset is built. With one seed
    # every rank would train on the same clips; a seed per rank gives each its own (and
    # makes equal parameters depend on the all-reduce). DDP starts every rank from rank 0's
    # parameters whatever the seed.
    config = tiny.make_config(os.path.join(out, "runs"), epochs=1, grad_clip=1.0,
                              training_seed=1000 + args.rank,
                              distributed_url=f"tcp://127.0.0.1:{OPTIONS['--port']}")
    torch.manual_seed(0)
    model = tiny.make_model(config)
    calls, state = [0], {"poisoned": None, "active": False}
    original = model.train_step

    def train_step(batch, *rest):  # as tests/test_nan_guard_coqui.py poisons a batch
        calls[0] += 1
        if calls[0] == 2 and args.rank == 1:
            state["poisoned"] = id(batch)
        state["active"] = id(batch) == state["poisoned"]  # the guard's replay too
        return original(batch, *rest)

    def nan_output(module, inputs, output):
        return output * float("nan") if state["active"] else output
    model.train_step = train_step
    model.xtts.gpt.text_embedding.register_forward_hook(nan_output)
    fit = Trainer(args, config, config.output_path, model=model,
                  train_samples=tiny.samples(config), parse_command_line_args=False)
    return fit, model


def tiny_trainer(args: TrainerArgs, out: str) -> tuple[Trainer, torch.nn.Module]:
    """The tiny GPT as a coqui TrainerModel, each rank its half of the data."""
    config = TinyConfig(epochs=1, batch_size=2, run_eval=False, print_step=1, plot_step=100,
                        save_step=1000, save_checkpoints=False, grad_clip=1.0,
                        distributed_url=f"tcp://127.0.0.1:{OPTIONS['--port']}",
                        output_path=os.path.join(out, "runs"), run_name="ddp",
                        dashboard_logger="tensorboard")
    torch.manual_seed(0)
    model = TinyCoqui()
    return Trainer(args, config, config.output_path, model=model,
                   train_samples=list(range(SAMPLES)), parse_command_line_args=False), model


if __name__ == "__main__":
    parser = TrainerArgs().init_argparse(arg_prefix="")
    parsed, _ = parser.parse_known_args()
    args = TrainerArgs()
    args.parse_args(parsed)
    out = OPTIONS["--out"]
    if "--xtts" in OPTIONS:
        fit, model = xtts_trainer(args, OPTIONS["--xtts"], out)
    else:
        fit, model = tiny_trainer(args, out)
    fit.fit()
    patches = sys.modules.get("patches")
    stats = patches.stats().get("nan_guard", {}) if patches else {}
    torch.save({"params": [p.detach().clone() for p in model.parameters()],
                "stats": dict(stats), "ddp": fit.use_pt_ddp, "steps": fit.total_steps_done},
               os.path.join(out, f"rank{args.rank}.pt"))
