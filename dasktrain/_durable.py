"""Durable, atomic writes to local paths and to fsspec URLs (object storage).

Local files are written to a temporary sibling, flushed and renamed into place, and the
directory is flushed after the rename. Object stores have no rename, but a single PUT of a
whole object is atomic (readers see the old object or the new one, never a part), so an
object is uploaded in one piece and never streamed into its final key. Filesystems behind
other URL schemes (SFTP, HDFS...) get a temporary key renamed into place.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any

__all__ = [
    "StorageOptions",
    "check_storage_options",
    "fsync_directory",
    "is_url",
    "join",
    "local_path",
    "read_bytes",
    "remove",
    "storage_errors",
    "strip_url",
    "url_filesystem",
    "write_bytes_atomic",
]

StorageOptions = dict[str, Any]

#: Schemes whose single PUT is atomic per object: the object is written as one upload.
_ATOMIC_PUT = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "memory"}
#: Packages whose exceptions mean "the storage said no or could not be reached".
_STORAGE_PACKAGES = {"botocore", "aiobotocore", "aiohttp", "s3fs", "gcsfs", "google", "adlfs",
                     "azure", "requests", "urllib3", "fsspec", "paramiko"}


def check_storage_options(value: Any) -> StorageOptions | None:
    """``value`` if it can be fsspec's storage options (a dict or None), else a
    ``TypeError`` saying what to pass."""
    if value is not None and not isinstance(value, dict):
        raise TypeError(f"storage_options must be a dict of fsspec options (e.g. "
                        f"{{'anon': True}}) or None, got {type(value).__name__}")
    return value


def is_url(path: str | os.PathLike) -> bool:
    """Whether ``path`` names remote storage (``s3://...``); ``file://`` URLs are local."""
    text = os.fspath(path)
    return "://" in text and not text.startswith("file://")


def local_path(path: str | os.PathLike) -> str:
    """A local path, or a ``file://`` URL as one."""
    return os.fspath(path).removeprefix("file://")


def strip_url(url: str) -> str:
    """``url`` without trailing slashes (``s3://`` itself stays as it is)."""
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{rest.rstrip('/')}"


def join(base: str | os.PathLike, name: str) -> str:
    """``base/name`` for a local path or a URL (``pathlib`` would mangle ``s3://``)."""
    text = os.fspath(base)
    return f"{strip_url(text)}/{name}" if is_url(text) else os.path.join(local_path(text), name)


@contextlib.contextmanager
def storage_errors(url: str) -> Iterator[None]:
    """Turn failures of the storage libraries (unreachable endpoint, refused credentials,
    a missing filesystem package) into ``OSError``/``ValueError`` naming ``url``.

    Our own bugs raise other exceptions and pass through untouched.
    """
    try:
        yield
    except ImportError as exc:
        scheme = url.split("://", 1)[0]
        extra = ' (pip install "dasktrain[s3]")' if scheme in ("s3", "s3a") else ""
        raise ValueError(f"cannot use {url}: the filesystem package for {scheme}:// is not "
                         f"installed{extra}: {exc}") from exc
    except OSError:
        raise
    except Exception as exc:
        package = type(exc).__module__.split(".", 1)[0]
        if package not in _STORAGE_PACKAGES:
            raise
        raise OSError(f"cannot reach {url}: {type(exc).__name__}: {exc}") from exc


def url_filesystem(url: str, storage_options: StorageOptions | None = None
                   ) -> tuple[Any, str]:
    """The (synchronous) fsspec filesystem of ``url`` and the path within it."""
    import fsspec.core

    with storage_errors(url):
        try:
            fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
        except TypeError as exc:  # an option the filesystem does not take
            raise ValueError(f"storage options {sorted(storage_options or {})} are not "
                             f"accepted for {url}: {exc}") from exc
    if not path.strip("/"):
        raise ValueError(f"{url} names no bucket or path")
    return fs, path.rstrip("/")


def write_bytes_atomic(target: str | os.PathLike, data: bytes,
                       storage_options: StorageOptions | None = None) -> None:
    """Write ``data`` as the whole of ``target``: readers see the old content or the new,
    and an interrupted write leaves the old content (or nothing) in place."""
    if is_url(target):
        url = os.fspath(target)
        fs, path = url_filesystem(url, storage_options)
        with storage_errors(url):
            if _protocol(fs) & _ATOMIC_PUT:
                fs.pipe_file(path, data)
                return
            tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
            fs.pipe_file(tmp, data)
            try:
                fs.mv(tmp, path)
            except BaseException:
                with contextlib.suppress(Exception):
                    fs.rm(tmp)
                raise
        return
    target = local_path(target)
    directory = os.path.dirname(os.path.abspath(target))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=".tmp",
                               dir=directory)
    try:
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the file from other readers
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_directory(directory)


def read_bytes(source: str | os.PathLike, storage_options: StorageOptions | None = None
               ) -> bytes:
    """The whole content of a local file or an object; ``FileNotFoundError`` if absent."""
    if not is_url(source):
        with open(local_path(source), "rb") as f:
            return f.read()
    url = os.fspath(source)
    fs, path = url_filesystem(url, storage_options)
    with storage_errors(url):
        fs.invalidate_cache(path)  # another process may have written it since a listing
        return fs.cat_file(path)


def remove(target: str | os.PathLike, storage_options: StorageOptions | None = None) -> None:
    """Delete a file or object if it is there."""
    if not is_url(target):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(local_path(target))
        return
    url = os.fspath(target)
    fs, path = url_filesystem(url, storage_options)
    with storage_errors(url), contextlib.suppress(FileNotFoundError):
        fs.rm_file(path)


def _protocol(fs: Any) -> set[str]:
    protocol = fs.protocol
    return {protocol} if isinstance(protocol, str) else set(protocol)


def fsync_directory(path: str | os.PathLike) -> None:
    """Flush a directory's entries (renames, new files) to disk, where the system allows.

    A file renamed into place is durable only once its directory is: after a power cut the
    directory may otherwise still list the older file, or none.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # e.g. Windows, where directories cannot be opened
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on directories
        pass
    finally:
        os.close(fd)
