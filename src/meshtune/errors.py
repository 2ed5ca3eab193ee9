"""Errors a user can act on. The CLI catches `MeshtuneError` once and prints its message without a trace."""


class MeshtuneError(Exception):
    """Base class: the message says what is wrong and what to do."""


class ConfigError(MeshtuneError):
    """A bad key or value in the YAML or on the command line."""


class DataError(MeshtuneError):
    """A dataset file, record or field that cannot be used."""


class ModelError(MeshtuneError):
    """A model directory that is missing, incomplete or unsupported."""
