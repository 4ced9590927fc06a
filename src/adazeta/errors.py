"""User-facing errors: one line that names the problem and the fix, never a traceback."""


class ConfigError(ValueError):
    """A user's mistake in the configuration or the environment (bad value, missing file).

    The command-line entry point prints its message on one line and exits with status 2.
    """


class PeerError(ConfigError):
    """Rank 0's error as the other ranks of a run on several processes receive it: rank 0 reports it."""
