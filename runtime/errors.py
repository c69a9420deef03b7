"""Errors meant for users: the CLI prints them as one paragraph, without a traceback."""


class UserError(Exception):
    """Bad input from the user (a file, a flag, a checkpoint). The message says what, where and how to fix."""

    exit_code = 1


class ConfigError(UserError):
    """An invalid YAML / parallel configuration."""

    exit_code = 2
