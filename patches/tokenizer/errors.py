"""The one error the tokenizer tools raise for bad input: its message is one paragraph."""

from __future__ import annotations


class TokenizerToolError(ValueError):
    """A file or an option the tokenizer tools cannot use. The message names the file, what
    was found, what was expected and what to do; the CLI prints it and exits 2."""


__all__ = ["TokenizerToolError"]
