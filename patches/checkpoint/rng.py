"""RNG states (torch, CUDA, numpy, python) in types ``torch.load(weights_only=True)`` accepts."""

from __future__ import annotations

import logging
import random
from typing import Any, Mapping, Sequence

import torch

logger = logging.getLogger("training_patches")


def capture_rng_state() -> dict[str, Any]:
    """torch, CUDA, numpy and python RNG states in types ``weights_only`` accepts."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(),
                             "python": _to_plain(random.getstate())}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np  # lazy: numpy is optional (ImportError handled)
    except ImportError:  # numpy is optional for the library
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")),
                      "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}
    return state


def _to_plain(value: Any) -> Any:
    return [_to_plain(v) for v in value] if isinstance(value, tuple) else value


def _to_tuple(value: Any) -> Any:
    return tuple(_to_tuple(v) for v in value) if isinstance(value, list) else value


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Undo :func:`capture_rng_state` (parts that are absent are left alone)."""
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "python" in state:
        random.setstate(_to_tuple(state["python"]))
    if "numpy" in state:
        import numpy as np  # lazy: numpy is optional, only for a state holding numpy's

        saved = state["numpy"]
        if isinstance(saved, (tuple, list)):  # a trainer's own np.random.get_state()
            np.random.set_state(tuple(saved))
        else:
            np.random.set_state((saved["kind"], saved["keys"].numpy().astype("uint32"),
                                 saved["pos"], saved["has_gauss"], saved["cached"]))


def state_for_rank(states: Sequence[Any], rank: int, world_size: int,
                   where: str) -> Mapping[str, Any] | None:
    """This rank's own saved RNG state out of every rank's (``states[r]`` is rank r's; None
    for a rank that had none saved); with another number of ranks rank 0 logs what was done.
    """
    saved = len(states)
    state = states[rank] if rank < saved and isinstance(states[rank], Mapping) else None
    def span(first: int, last: int) -> str:
        return f"rank {first}" if first == last else f"ranks {first}-{last}"

    if saved != world_size and rank == 0:
        if world_size > saved:
            what = (f"{span(0, saved - 1)} restored its/their own RNG state; "
                    f"{span(saved, world_size - 1)} had none saved and keep(s) its/their current "
                    f"RNG (seed new ranks differently if they must not repeat each other)")
        else:
            what = (f"{span(0, world_size - 1)} restored its/their own RNG state; the state(s) "
                    f"of {span(world_size, saved - 1)} were not used")
        logger.warning("training-patches: %s holds the RNG states of %d rank(s) and this job has "
                       "%d: %s", where, saved, world_size, what)
    return state


__all__ = ["capture_rng_state", "restore_rng_state", "state_for_rank"]
