"""A plain training loop over a shuffled DataLoader that saves with ``loader=`` and resumes
from its checkpoint (tests/test_data_position.py runs it in one process, and
tests/distributed/ranks/data_position_job.py on 2 ranks under torchrun).

Each step records what a user would compare: the epoch, the sample indices of the batch,
the "augmentation" noise each sample drew in ``__getitem__`` (the main process's RNG, or a
worker's), and one draw of the global RNG after the step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from patches.checkpoint import CheckpointManager, load_checkpoint


class NoisyData(torch.utils.data.Dataset):
    """Sample i is (i, a random number drawn when it is read): an augmentation."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor]:
        return index, torch.rand(())


def train(folder: Path, *, epochs: int = 3, stop_after: int | None = None,
          resume: bool = False, workers: int = 0, distributed: bool = False,
          loader_on_resume: bool = True, n: int = 44) -> tuple[list[list[Any]], Any]:
    """(one record per step from the start or the resume, the resume's LoadReport)."""
    torch.manual_seed(0)
    data = NoisyData(n)
    sampler = (torch.utils.data.DistributedSampler(data, shuffle=True, seed=0)
               if distributed else None)
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=sampler is None,
                                         sampler=sampler, num_workers=workers)
    model = torch.nn.Linear(1, 1)
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = CheckpointManager(folder)
    start_epoch, step, report = 0, 0, None
    if resume:
        report = load_checkpoint(manager.resume(), model, opt,
                                 loader=loader if loader_on_resume else None)
        start_epoch, step = report.extra["epoch"], report.step
    seen: list[list[Any]] = []
    for epoch in range(start_epoch, epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        for index, noise in loader:
            step += 1
            loss = (model(noise[:, None]) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            seen.append([epoch, index.tolist(), [round(float(x), 6) for x in noise],
                         round(float(torch.rand(())), 6)])
            if step == stop_after:
                manager.save(step, model, opt, loader=loader, epoch=epoch)
                return seen, report
    return seen, report
