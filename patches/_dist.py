"""Rank, world size and DTensor helpers: the one home of what the patches ask about
``torch.distributed`` (torch only, importing it starts nothing).

Without an initialized process group the answers come from the launcher's ``RANK`` and
``WORLD_SIZE`` variables (torchrun, ``trainer.distribute``, accelerate set them before
the group exists), else rank 0 of 1.
"""

from __future__ import annotations

import os
import sys

import torch


def _group() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized()


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def rank() -> int:
    """This process's global rank (0 without a process group or launcher)."""
    return torch.distributed.get_rank() if _group() else _env_int("RANK", 0)


def world_size() -> int:
    """The number of ranks (1 without a process group or launcher)."""
    return torch.distributed.get_world_size() if _group() else _env_int("WORLD_SIZE", 1)


def collectives() -> bool:
    """True when a process group of more than one rank is initialized (collectives run)."""
    return _group() and torch.distributed.get_world_size() > 1


def is_dtensor(tensor: object) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (FSDP2 parameters and gradients)."""
    # No DTensor exists before its module is imported: then this costs a dict lookup.
    module = sys.modules.get("torch.distributed.tensor")
    cls = getattr(module, "DTensor", None)
    return cls is not None and isinstance(tensor, cls)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (``to_local()``: no communication, shares storage), else the
    tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor
