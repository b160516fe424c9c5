"""Errors that reach the user as one line, never as a traceback."""


class JaxshardError(Exception):
    """Bad input from the user: a mesh, a config, a data path, a checkpoint.

    Entry points print ``error: <message>`` on stderr and exit with status 2.
    """


class MeshError(JaxshardError):
    """A mesh spec that cannot be parsed or does not fit the devices."""


class ConfigError(JaxshardError):
    """A configuration value out of range or inconsistent with another."""


class DataError(JaxshardError):
    """Missing, empty or incompatible training data."""


class TrainingError(JaxshardError):
    """Training cannot go on (e.g. the loss became NaN)."""
