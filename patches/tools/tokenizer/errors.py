"""The one error the tokenizer tools raise for bad input: its message is one paragraph."""

from __future__ import annotations

from pathlib import Path


class TokenizerToolError(ValueError):
    """A file or an option the tokenizer tools cannot use. The message names the file, what
    was found, what was expected and what to do; the CLI prints it and exits 2."""


class FrontEndError(TokenizerToolError):
    """The user's ``--g2p`` function or the language's cleaner raised on a text. ``stage``
    names it, ``text`` is the text, ``cause`` the exception; the commands add where the
    text came from (:meth:`at`)."""

    def __init__(self, stage: str, text: str, cause: BaseException) -> None:
        self.stage, self.text, self.cause = stage, text, cause
        super().__init__(self.at(f"the text {text[:60]!r}"))

    def at(self, where: str) -> str:
        """The one-paragraph message, the failing text described as ``where``."""
        return (f"{self.stage} failed on {where}: {type(self.cause).__name__}: {self.cause}. "
                f"Nothing was written. Fix the function, or that text.")


def require_file(path: Path, what: str, expected: str) -> None:
    """Raise the one "not found" paragraph of the tokenizer tools unless ``path`` is a file:
    ``the {what} {path} was not found. Expected {expected}. Check the path.``"""
    if not path.is_file():
        raise TokenizerToolError(f"the {what} {path} was not found. Expected {expected}. "
                                 f"Check the path.")


__all__ = ["TokenizerToolError", "FrontEndError", "require_file"]
