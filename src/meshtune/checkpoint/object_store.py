"""Checkpoints in an object store (`s3://`, `gs://`, `az://`, any fsspec protocol whose package is installed).

`StorePath` is a key of the store with the part of pathlib's API the checkpoint code uses (names, children,
sizes, reading and writing whole objects), so listing, verifying and the manifest read the same on a file system and
in a bucket. What a store cannot do is done another way, here:
- no rename: a checkpoint is written under its own prefix `checkpoint-N/`, then manifest.json, then `COMPLETE`
  last; a prefix without COMPLETE is never resumed from, listed as complete or exported;
- no atomic deletion: `delete_sealed` writes a `.deleting` marker into the prefix, removes COMPLETE and the manifest,
  then the rest, then the marker; `finish_deletions` completes a prefix a kill left with its marker;
- no listing you can trust from a cache: the filesystem is opened without fsspec's listings cache, as other
  nodes write the same prefix.
The shards themselves are moved by DCP's `FsspecWriter` / `FsspecReader` (torch.distributed.checkpoint).

Credentials and the endpoint come from the store's own client (`CREDENTIALS` names what each reads): for s3,
AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN or a profile, AWS_ENDPOINT_URL for MinIO or another
S3-compatible server.
Imports no torch: `meshtune ckpt list URL` reads manifests without it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshtune.errors import MeshtuneError

# protocol -> (the package that implements it, meshtune's extra that installs it)
PACKAGES = {"s3": ("s3fs", "s3"), "s3a": ("s3fs", "s3"), "gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs"),
            "az": ("adlfs", "azure"), "abfs": ("adlfs", "azure"), "abfss": ("adlfs", "azure")}
# what each store's client reads for its credentials (and endpoint), by extra: named when a node cannot use the store
CREDENTIALS = {
    "s3": "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE, and AWS_ENDPOINT_URL for MinIO or another "
          "S3-compatible server",
    "gcs": "GOOGLE_APPLICATION_CREDENTIALS (a service account's JSON key) or the node's default credentials",
    "azure": "AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY or AZURE_STORAGE_SAS_TOKEN, or "
             "AZURE_STORAGE_CONNECTION_STRING; for a managed identity AZURE_STORAGE_ANON=false",
}
DELETING_MARKER = ".deleting"  # inside a prefix being deleted; see `delete_sealed`
PROBE = ".meshtune-probe"
BLOCK = 8 << 20


class StoreError(MeshtuneError):
    """An object store that cannot be used: its package missing, credentials refused, unreachable."""


def is_url(location: Any) -> bool:
    """A location in an object store: `PROTOCOL://...`, other than `file://` (a local path)."""
    text = str(location)
    return isinstance(location, (str, StorePath)) and "://" in text and not text.startswith("file://")


def location(place: Any) -> Path | StorePath:
    """A checkpoint location as the code handles it: a StorePath for a URL, a Path otherwise (`file://` too)."""
    if isinstance(place, (Path, StorePath)):
        return place
    text = str(place)
    if text.startswith("file://"):
        return Path(text[len("file://"):])
    return open_store(text) if is_url(text) else Path(text)


def storage_options(protocol: str) -> dict[str, Any]:
    """The filesystem's options: no listings cache (other nodes write the same prefixes) and, for s3, the endpoint
    of AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL where set (botocore reads them too; s3fs passes them explicitly)."""
    options: dict[str, Any] = {"use_listings_cache": False, "skip_instance_cache": True}
    if protocol in ("s3", "s3a"):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            options["endpoint_url"] = endpoint
    return options


def open_store(url: str) -> StorePath:
    """The store at `url`; a named error with the pip command when its package is not installed."""
    protocol = url.split("://", 1)[0].lower()
    package, extra = PACKAGES.get(protocol, (None, None))
    if package and importlib.util.find_spec(package) is None:
        raise StoreError(f"checkpoint_dir {url} needs the {package} package for {protocol}://, which is not "
                         f"installed: pip install 'meshtune[{extra}]' (or pip install {package})")
    import fsspec

    try:
        fs = fsspec.filesystem(protocol, **storage_options(protocol))
    except (ImportError, ValueError) as error:
        raise StoreError(f"checkpoint_dir {url}: fsspec has no usable filesystem for {protocol}:// ({error}); "
                         f"install the package that implements it") from error
    return StorePath(fs, protocol, fs._strip_protocol(url).rstrip("/"))


@dataclass(frozen=True)
class _Stat:
    st_size: int


class StorePath:
    """A key (an object, or a prefix that holds objects) in an fsspec filesystem, with pathlib's names."""

    def __init__(self, fs: Any, protocol: str, key: str):
        self.fs, self.protocol, self.key = fs, protocol, key.rstrip("/")

    def __str__(self) -> str:
        return f"{self.protocol}://{self.key}"

    def __repr__(self) -> str:
        return f"StorePath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StorePath) and str(other) == str(self)

    def __hash__(self) -> int:
        return hash(str(self))

    def __truediv__(self, name: str) -> StorePath:
        return StorePath(self.fs, self.protocol, f"{self.key}/{name}")

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    @property
    def parent(self) -> StorePath:
        return StorePath(self.fs, self.protocol, self.key.rsplit("/", 1)[0])

    def with_name(self, name: str) -> StorePath:
        return self.parent / name

    @property
    def storage_options(self) -> dict[str, Any]:
        return storage_options(self.protocol)

    def exists(self) -> bool:
        return self.fs.exists(self.key)

    def is_file(self) -> bool:
        return self.fs.isfile(self.key)

    def is_dir(self) -> bool:
        return self.fs.isdir(self.key)

    def iterdir(self) -> Iterator[StorePath]:
        for entry in self.fs.ls(self.key, detail=False):
            yield StorePath(self.fs, self.protocol, entry)

    def files(self) -> set[str]:
        """Every object under this prefix, by its name relative to it."""
        return {key[len(self.key) + 1:] for key in self.fs.find(self.key) if key.startswith(self.key + "/")}

    def stat(self) -> _Stat:
        return _Stat(int(self.fs.size(self.key)))

    def read_bytes(self) -> bytes:
        return self.fs.cat_file(self.key)

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def write_bytes(self, data: bytes) -> None:
        self.fs.pipe_file(self.key, data)

    def write_text(self, text: str) -> None:
        self.write_bytes(text.encode())

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Prefixes exist by holding objects; a bucket is made where it is missing and the store allows it."""
        self.fs.makedirs(self.key, exist_ok=True)

    def unlink(self, missing_ok: bool = False) -> None:
        if missing_ok and not self.fs.exists(self.key):
            return
        self.fs.rm_file(self.key)

    def checksum(self) -> tuple[int, str]:
        """Size and sha256 of the object, read back from the store in blocks."""
        digest, size = hashlib.sha256(), 0
        with self.fs.open(self.key, "rb", block_size=BLOCK) as stream:
            while block := stream.read(BLOCK):
                digest.update(block)
                size += len(block)
        return size, digest.hexdigest()

    def get(self, target: Path) -> None:
        """This object into local file `target` (replaced)."""
        self.fs.get_file(self.key, str(target))

    def upload(self, directory: Path, last: str | None = None) -> None:
        """Every file under local `directory` to this prefix; `last` (a name in it: the COMPLETE marker) after
        all the others, so the prefix is sealed only once whole."""
        names = sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())
        for name in [n for n in names if n != last] + [n for n in names if n == last]:
            self.fs.put_file(str(directory / name), f"{self.key}/{name}")

    def download(self, directory: Path) -> Path:
        """Every object under this prefix into local `directory` (made), with the same names."""
        for name in sorted(self.files()):
            target = directory / name
            target.parent.mkdir(parents=True, exist_ok=True)
            (self / name).get(target)
        return directory

    def copy_to(self, target: StorePath) -> StorePath:
        """Every object under this prefix copied to `target` (in the store: a store has no rename)."""
        for name in sorted(self.files()):
            self.fs.copy(f"{self.key}/{name}", f"{target.key}/{name}")
        return target


def delete_sealed(prefix: StorePath, seals: tuple[str, ...]) -> None:
    """Delete a checkpoint's prefix so that a kill at any point leaves it unusable and recognised: the `.deleting`
    marker first, then `seals` in order (COMPLETE, then the manifest: from here on it is never resumed from), every
    other object, the marker last."""
    (prefix / DELETING_MARKER).write_text("being deleted\n")
    for name in seals:
        (prefix / name).unlink(missing_ok=True)
    rest = [f"{prefix.key}/{name}" for name in sorted(prefix.files()) if name != DELETING_MARKER]
    if rest:
        prefix.fs.rm(rest)
    (prefix / DELETING_MARKER).unlink(missing_ok=True)


def finish_deletions(root: StorePath, seals: tuple[str, ...]) -> list[StorePath]:
    """The prefixes under `root` that a kill left half-deleted (their `.deleting` marker still there), deleted."""
    done = []
    for child in sorted(root.iterdir(), key=str):
        if (child / DELETING_MARKER).is_file():
            delete_sealed(child, seals)
            done.append(child)
    return done


def probe(url: str) -> str | None:
    """Whether this node can use the store at `url` with the credentials it has: list the prefix, write a probe
    object, read it back, delete it. None when all four work, else what failed with the store's own error."""
    step = "open"
    try:
        root = open_store(url)
        step = "list"
        if root.exists():
            list(root.iterdir())
        step = "write"
        target = root / f"{PROBE}-{socket.gethostname()}-{os.getpid()}"
        payload = os.urandom(16).hex()
        target.write_text(payload)
        step = "read back"
        if target.read_text() != payload:
            return f"the probe object {target} read back other bytes than were written"
        step = "delete"
        target.unlink()
    except StoreError as error:
        return str(error)
    except Exception as error:  # the store's client raises its own kinds (botocore, aiohttp, ...)
        return f"cannot {step} under {url}: {type(error).__name__}: {error}"
    return None


def credentials_hint(url: str) -> str:
    """What the client of `url`'s store reads for its credentials and endpoint, for an error to name."""
    protocol = url.split("://", 1)[0].lower()
    _, extra = PACKAGES.get(protocol, (None, None))
    return CREDENTIALS.get(extra, f"the settings {protocol}://'s fsspec package reads")


def check_store(url: str, node: str = "") -> None:
    """`probe`, as an error naming the node and what to do; before any process group exists."""
    problem = probe(url)
    if problem:
        raise StoreError(f"checkpoint_dir {url}{node}: {problem}. Check the store's credentials and endpoint "
                         f"({credentials_hint(url)}) and that the bucket exists")
