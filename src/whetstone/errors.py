"""The exception types users see: the CLI prints their message and exits 2, no traceback."""


class WhetstoneError(Exception):
    """Bad input or a failed precondition, with a message naming what is wrong."""


class ConfigError(WhetstoneError):
    """A config file or override that does not validate."""


class CheckpointError(WhetstoneError):
    """A checkpoint that is missing, corrupt, or does not fit the model config."""


class AccessDeniedError(PermissionError):
    """The store refused a request for lack of permission (S3's AccessDenied, a 403, credentials it
    does not accept, none at all): a configuration problem to fix where the store is set up. A
    `PermissionError`, as a local store's unreadable folder raises, and not a `WhetstoneError`:
    callers take those for missing or invalid content (a version rejected as corrupt, a pointer
    replaced as unreadable), which a refused request says nothing about. `bucket` and `key` name
    what was refused (`key`: a prefix for a listing, None for the bucket itself)."""

    def __init__(self, message: str, bucket: str | None = None, key: str | None = None):
        super().__init__(message)
        self.bucket = bucket
        self.key = key
