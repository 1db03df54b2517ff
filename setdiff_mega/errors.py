"""The user-facing errors: each carries one line that names the file, field or request and the fix.

Defined here, at the bottom of the import graph, so that the entry points' error handling
(:func:`setdiff_mega.cli.run_cli`) imports nothing heavy; each layer re-exports its own (``DataError`` from
``data.indexed``, ``CheckpointError`` from ``checkpoint.io``, ...), which is where code raises them from.
"""


class ConfigError(ValueError):
    """A configuration problem; the message names the field and the fix."""


class DataError(ValueError):
    """Bad or mismatched data; the message names the file and the fix."""


class CheckpointError(ValueError):
    """A missing, incomplete or mismatched checkpoint; the message names the file."""


class OutputError(ValueError):
    """An output path that would destroy or replace something it must not; the message names the path and
    the fix."""


class RequestError(ValueError):
    """A generation request that cannot be served; the message says why."""


class TrainingError(RuntimeError):
    """Training cannot continue (a non-finite loss or gradient, too many skipped steps); says what to change."""


USER_ERRORS = (ConfigError, DataError, CheckpointError, OutputError, RequestError, TrainingError)

__all__ = ["ConfigError", "DataError", "CheckpointError", "OutputError", "RequestError", "TrainingError",
           "USER_ERRORS"]
