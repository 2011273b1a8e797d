"""Errors a user can act on: each names the field, file or URL and what to do."""


class MemfitError(Exception):
    """Base of errors the CLI prints as one short message (no traceback) with a non-zero exit."""

    exit_code = 2


class ConfigError(MemfitError):
    """The config (a YAML file, an override or a flow parameter) is invalid."""


class DataError(MemfitError):
    """The training data is missing, empty or unreadable."""


class ModelLoadError(MemfitError):
    """The model or tokenizer could not be loaded."""


class MemoryBudgetError(ConfigError):
    """No optimisation stack fits the memory budget (the message says what would)."""


class StorageError(MemfitError):
    """An object store (local folder, S3) could not be read or written."""


class CheckpointError(MemfitError):
    """A training checkpoint is missing, incomplete or fails verification."""


class ExportError(MemfitError):
    """An export could not be written or failed verification."""


class OnnxExportFailed(ExportError):
    """Everything of a run is done and recorded except a verified ONNX file; `summary` holds the rest."""

    def __init__(self, message: str, summary: object = None) -> None:
        super().__init__(message)
        self.summary = summary


class TrackingError(MemfitError):
    """The experiment tracker could not be reached."""


class Preempted(MemfitError):
    """Training stopped on a preemption signal after saving a training checkpoint."""

    exit_code = 75  # EX_TEMPFAIL: run the same command again to resume


class DistributedError(MemfitError):
    """A multi-process training run failed: a rank crashed, or torchrun could not start the ranks."""


class MemoryLimitError(MemfitError):
    """Training stopped at the memory limit (monitor.stop_at_fraction), or ran out of memory."""

    exit_code = 76  # distinct from a preemption (75): rerunning unchanged would hit the same limit
