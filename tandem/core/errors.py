"""Typed errors: one base, each carrying the field, the value and the fix.

The CLI turns any TandemError into one line on stderr and a non-zero exit.
"""

from __future__ import annotations


class TandemError(Exception):
    """Base of every error tandem raises on purpose.

    ``field`` names what was wrong (a spec key, a flag, a path), ``value`` what it
    held, ``fix`` what to do about it. ``str()`` gives the one-line message.
    """

    exit_code = 2

    def __init__(self, message: str, *, field: str | None = None, value: object = None,
                 fix: str | None = None):
        self.message = message
        self.field = field
        self.value = value
        self.fix = fix
        super().__init__(self.__str__())

    def __str__(self) -> str:
        head = f"{self.field}: {self.message}" if self.field else self.message
        if self.value is not None and str(self.value) not in head:
            head += f" (got {self.value!r})"
        return f"{head}. Fix: {self.fix}" if self.fix else head


class ConfigError(TandemError):
    """The job spec or a command-line value is invalid (caught before any process starts)."""


class LaunchError(TandemError):
    """The launcher could not start or join the job (ports, rendezvous, master)."""


class CheckpointError(TandemError):
    """A checkpoint is missing, incomplete, or does not match the model."""


class DataError(TandemError):
    """A data set could not be found or read."""


class WorkerFailure(TandemError):
    """One or more workers exited non-zero; the summary names the root cause."""

    exit_code = 1


class JobStopped(TandemError):
    """The job was told to stop (SIGTERM, SIGINT): exit as the signal would, 128 + its number."""

    def __init__(self, message: str, *, signum: int, fix: str | None = None):
        super().__init__(message, fix=fix)
        self.exit_code = 128 + signum
