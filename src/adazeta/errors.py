"""User-facing errors: one line that names the problem and the fix, never a traceback."""


class ConfigError(ValueError):
    """A user's mistake in the configuration or the environment (bad value, missing file).

    The command-line entry point prints its message on one line and exits with status 2.
    """
