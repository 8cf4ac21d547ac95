"""``import patches.auto``: apply the default patch set once (like ``ddtrace.auto``)."""

from ._api import activate

activate()
