"""User-facing errors: the CLI prints their message as one line and exits non-zero."""


class HvdtrainError(Exception):
    """A problem the user can fix; the message names it and the fix."""


class ConfigError(HvdtrainError):
    """A bad config value, type, key or file."""


class CheckpointError(HvdtrainError):
    """A checkpoint that is missing, corrupt or incompatible."""


class DataError(HvdtrainError):
    """A data path that does not exist or holds no usable data."""


class EnvironmentProblem(HvdtrainError):
    """Horovod missing or built without what we need."""


class TrainingStopped(HvdtrainError):
    """Training stopped on purpose (e.g. too many non-finite steps in a row), on every rank together."""


class PeerLost(Exception):
    """A collective outside Horovod (the direct gradient paths) failed because another rank exited,
    hung past the timeout or lost its connection: reported like Horovod's own shutdown."""
