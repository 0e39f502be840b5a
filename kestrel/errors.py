"""Errors a user can cause. Each carries a one-line message naming the cause and the fix; the CLI and the
server print the message, never a traceback."""


class KestrelError(Exception):
    """Base of every error caused by user input (checkpoint, config, request, prompt)."""


class ConfigError(KestrelError):
    """A config.json value Kestrel does not support or cannot read."""


class CheckpointError(KestrelError):
    """A checkpoint tensor that is missing, unexpected, truncated or of the wrong shape."""


class RequestError(KestrelError):
    """A bad request: empty prompt, out-of-range sampling parameter, prompt too long."""
