"""The one exception type users see: the CLI prints its message and exits 2, no traceback."""


class WhetstoneError(Exception):
    """Bad input or a failed precondition, with a message naming what is wrong."""


class ConfigError(WhetstoneError):
    """A config file or override that does not validate."""


class CheckpointError(WhetstoneError):
    """A checkpoint that is missing, corrupt, or does not fit the model config."""
