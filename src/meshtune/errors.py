"""Errors a user can act on. The CLI catches `MeshtuneError` once and prints its message without a trace."""

import errno


class MeshtuneError(Exception):
    """Base class: the message says what is wrong and what to do."""


class ConfigError(MeshtuneError):
    """A bad key or value in the YAML or on the command line."""


class DataError(MeshtuneError):
    """A dataset file, record or field that cannot be used."""


class ModelError(MeshtuneError):
    """A model directory that is missing, incomplete or unsupported."""


class MemoryFitError(MeshtuneError):
    """A training step that does not fit the GPU memory it may take, measured before training."""


EXIT_RETRYABLE = 75  # EX_TEMPFAIL: the same command, run again once the cause has passed, goes on


class NodesLostError(MeshtuneError):
    """This node lost the others mid-run (a network partition, or they died) and they did not meet again within
    rdzv_timeout: the job is sound, the network or the nodes are not. Exits EXIT_RETRYABLE, for a scheduler to
    requeue it."""

    exit_code = EXIT_RETRYABLE


class StorageError(MeshtuneError):
    """A directory meshtune must write to that it cannot: missing, read-only, full, or not a directory."""


# storage failures a restart cannot fix, and what each means to a user
STORAGE_CAUSES = {errno.EACCES: "no permission to write there", errno.EPERM: "no permission to write there",
                  errno.EROFS: "the file system is read-only", errno.ENOSPC: "the storage is full",
                  errno.EDQUOT: "the disk quota is used up",
                  errno.ENOTDIR: "a part of the path is a file, not a directory",
                  errno.ENOENT: "a part of the path cannot be created there"}
LASTING = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT}


def lasting_storage_error(error: OSError) -> StorageError | None:
    """A StorageError for an OSError that every restart would meet again (read-only, full, no permission), so the
    job stops at once with the cause as its last line instead of burning its restarts; None for other errors."""
    if error.errno not in LASTING:
        return None
    where = f"{error.filename}: " if error.filename else ""
    return StorageError(f"{where}{STORAGE_CAUSES[error.errno]} ({error.strerror}); a restart cannot fix this: fix "
                        f"the storage (or point output_dir elsewhere) and run the same command again to resume")
