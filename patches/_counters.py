"""Step counters kept on the device, so that counting adds no host-device sync.

A training step adds flags that are already tensors (an overflow flag, a
non-finite norm flag); only :meth:`DeviceCounters.read`, called when logging or
from ``patches.stats()``, copies them to the host.
"""

from __future__ import annotations

import threading

import torch


class DeviceCounters:
    """Named whole-number counters in one int64 tensor on the device of first use."""

    def __init__(self, *names: str) -> None:
        self.names = names
        self._index = {name: i for i, name in enumerate(names)}
        self._values: torch.Tensor | None = None
        self._host = [0] * len(names)  # counts restored from a checkpoint before first use
        self._lock = threading.Lock()

    def _tensor(self, device: torch.device) -> torch.Tensor:
        if self._values is None:
            with self._lock:
                if self._values is None:
                    self._values = torch.tensor(self._host, dtype=torch.int64, device=device)
        return self._values

    def add(self, name: str, amount: torch.Tensor | int = 1) -> None:
        """Add ``amount`` (a bool/int tensor on any device, or an int) without syncing."""
        if isinstance(amount, torch.Tensor):
            values = self._tensor(amount.device)
            amount = amount.to(device=values.device, non_blocking=True)
        else:
            values = self._tensor(torch.device("cpu"))
        values[self._index[name]].add_(amount)  # a view: one kernel, int64 += bool/int

    def read(self) -> dict[str, int]:
        """The counts as plain ints (one copy to the host)."""
        if self._values is None:
            return dict(zip(self.names, self._host))
        return dict(zip(self.names, self._values.tolist()))

    def load(self, counts: dict[str, int]) -> None:
        """Restore counts, e.g. from a checkpoint; unknown names are ignored."""
        host = [int(counts.get(name, 0)) for name in self.names]
        with self._lock:
            if self._values is None:
                self._host = host
            else:
                self._values.copy_(torch.tensor(host, dtype=torch.int64))

    def reset(self) -> None:
        self.load({})

    def record_step(self, skipped: torch.Tensor) -> None:
        """One optimizer step: ``steps += 1``, ``skipped += flag``, streak reset or extended."""
        values = self._tensor(skipped.device)
        i, j, k = (self._index[name] for name in ("steps", "skipped", "consecutive_skips"))
        flag = skipped.to(device=values.device, dtype=torch.int64).reshape(())  # [1] from FSDP
        values[i] += 1
        values[j] += flag
        values[k] = (values[k] + 1) * flag

    def __getstate__(self) -> dict[str, object]:
        return {"names": self.names, "host": list(self.read().values())}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__(*state["names"])  # type: ignore[misc]
        self._host = list(state["host"])  # type: ignore[arg-type]
