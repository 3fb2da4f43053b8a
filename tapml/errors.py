"""Errors that tapml reports to a user instead of a traceback."""


class TapmlError(Exception):
    """Bad usage or bad input: the CLI prints the message and exits with code 2.

    The message should say what to fix, not only what went wrong.
    """


class Unsupported(Exception):
    """A platform cannot run an op or program (missing feature, dtype, device limit).

    Becomes an ``unsupported`` verdict with the message as the reason.
    """


class PlatformError(Exception):
    """The platform failed while compiling or running (shader compile error, runtime failure).

    Becomes an ``error`` verdict.
    """


class DeviceLost(PlatformError):
    """The device (remote server, browser page, GPU) went away during a call."""

    def __init__(self, message: str = "device lost"):
        super().__init__(message if message.startswith("device lost") else f"device lost: {message}")
