"""A thin filesystem layer for channels, snapshots and retention.

One class, :class:`FileSystem`, rooted at a URI. Every path argument is relative to that root and uses
``/`` separators. Backends:

* local paths and ``file://`` URIs: :class:`pyarrow.fs.LocalFileSystem`, with real atomic operations
  (``os.replace`` for atomic writes, a hard link for exclusive creation);
* anything :func:`pyarrow.fs.FileSystem.from_uri` understands (``s3://``, ``gs://``, ``hdfs://``,
  ``abfs://``...); Spark's spellings ``s3a://`` and ``s3n://`` are accepted too (a checkpoint URI
  handed to Spark can be opened here as is);
* otherwise any fsspec URI (``memory://``, ``az://``...), wrapped in :class:`pyarrow.fs.PyFileSystem`.

Guarantees differ by backend and are stated per method. On object stores a write is a single PUT, which
is atomic by itself; exclusive creation is exact on local disks, on S3 (a conditional put with
``If-None-Match: *`` through boto3, when boto3 is installed and the endpoint honours the header), and on
fsspec backends that support the ``"xb"`` open mode, and best effort (check, then put) elsewhere.
Channels have one writer each, so the best-effort case is a safety net, not the mechanism. Nothing in
this package renames a folder (object stores have no folder rename); :meth:`FileSystem.move` moves one
file.

S3 settings are the AWS SDK's own, read by pyarrow and boto3 alike from the environment of every
process that touches the storage (the driver and, for channel reads and writes, the executors):
``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` (or a profile, or an instance role), ``AWS_REGION`` /
``AWS_DEFAULT_REGION``, and for an S3-compatible server (MinIO, Ceph, moto) ``AWS_ENDPOINT_URL`` (or
``AWS_ENDPOINT_URL_S3``), e.g. ``http://127.0.0.1:9000``. URIs stay plain: ``s3://bucket/prefix``.

Caveat (not tested here, no cluster): on HDFS
through pyarrow a write is one create, and HDFS shows a file being written to readers, so a reader
racing a write can see it partial; local disks and object stores do not have this problem.

No fsync is done: like Spark's own checkpoint files, durability across a machine crash is left to the
filesystem (use a replicated store such as HDFS or S3 for that).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import posixpath
import uuid
from dataclasses import dataclass
from typing import IO, Any, cast
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.fs as pafs

from airflow_arroyo.core.exceptions import ConfigurationError

__all__ = ["FileEntry", "FileSystem", "arrow_uri"]

log = logging.getLogger(__name__)

# Schemes that Spark (Hadoop) spells differently from pyarrow.
_SPARK_SCHEMES = {"s3": "s3a"}
_ARROW_SCHEMES = {"s3a": "s3", "s3n": "s3"}


def arrow_uri(uri: str) -> str:
    """``uri`` as pyarrow spells it: Hadoop's ``s3a://`` / ``s3n://`` become ``s3://``."""
    scheme, sep, rest = uri.partition("://")
    if sep and scheme.lower() in _ARROW_SCHEMES:
        return f"{_ARROW_SCHEMES[scheme.lower()]}://{rest}"
    return uri


@dataclass(frozen=True)
class FileEntry:
    """One listed file or directory; ``path`` is relative to the filesystem root."""

    path: str
    size: int
    is_dir: bool

    @property
    def name(self) -> str:
        """The last part of the path."""
        return posixpath.basename(self.path)


class FileSystem:
    """A filesystem rooted at ``uri``; all paths are relative to the root.

    Build it with :meth:`from_uri`. Instances pickle as their URI (they are rebuilt on unpickling), so
    they can be shipped to Spark executors.
    """

    def __init__(self, uri: str, arrow_fs: pafs.FileSystem, base: str, *, fsspec_fs: Any = None) -> None:
        self.uri = uri.rstrip("/") if uri not in ("/", "file:///") else uri
        self._fs = arrow_fs
        self._base = base.rstrip("/") if base != "/" else base
        self._fsspec = fsspec_fs
        self.is_local = isinstance(arrow_fs, pafs.LocalFileSystem)
        self.is_s3 = type(arrow_fs).__name__ == "S3FileSystem"

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_uri(cls, uri: str) -> FileSystem:
        """A filesystem rooted at ``uri`` (local path, ``file://``, pyarrow or fsspec URI).

        Raises :class:`~airflow_arroyo.core.exceptions.ConfigurationError` when no backend understands it.
        """
        if not uri or not isinstance(uri, str):
            raise ConfigurationError(f"a filesystem URI must be a non-empty string, got {uri!r}")
        scheme = urlparse(uri).scheme
        if scheme == "" or (len(scheme) == 1 and os.name == "nt"):
            path = os.path.abspath(os.path.expanduser(uri))
            return cls("file://" + path, pafs.LocalFileSystem(), path)
        if scheme == "file":
            parsed = urlparse(uri)
            path = os.path.abspath(parsed.path or "/")
            return cls("file://" + path, pafs.LocalFileSystem(), path)
        try:
            arrow_fs, base = pafs.FileSystem.from_uri(arrow_uri(uri))
            return cls(uri, arrow_fs, base)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError, OSError) as arrow_error:
            try:
                import fsspec.core

                fs, base = fsspec.core.url_to_fs(uri)
            except (ImportError, ValueError, OSError) as fsspec_error:
                raise ConfigurationError(
                    f"no filesystem backend understands {uri!r} (pyarrow: {arrow_error}; fsspec: "
                    f"{fsspec_error}); use a local path or a URI such as s3://bucket/prefix, and install "
                    "the fsspec implementation for its scheme"
                ) from fsspec_error
            return cls(uri, pafs.PyFileSystem(pafs.FSSpecHandler(fs)), base, fsspec_fs=fs)

    @staticmethod
    def shared(uri: str) -> FileSystem:
        """The file system of ``uri``, built once per process (a Spark executor's Python worker reads many
        channel files of one root: an object store's client is not rebuilt for each)."""
        return _shared_file_system(uri)

    @classmethod
    def of(cls, where: str | FileSystem) -> FileSystem:
        """``where`` itself when it is a file system already (resolved once, handed on), else :meth:`from_uri`:
        the one conversion for APIs that also take a URI string (a user's, or one shipped to an executor)."""
        return where if isinstance(where, FileSystem) else cls.from_uri(where)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (FileSystem.from_uri, (self.uri,))

    def __repr__(self) -> str:
        return f"FileSystem({self.uri!r})"

    # ------------------------------------------------------------------ paths
    @staticmethod
    def join(*parts: str) -> str:
        """Join relative path parts with ``/`` (empty parts are skipped)."""
        return posixpath.join(*[p.strip("/") for p in parts if p and p.strip("/")]) if parts else ""

    def _abs(self, path: str) -> str:
        path = path.strip("/")
        if not path:
            return self._base
        if ".." in path.split("/"):
            raise ConfigurationError(f"path {path!r} must stay below the filesystem root {self.uri!r}")
        if self._base in ("", "/"):
            return (self._base + path) if self._base == "/" else path
        return f"{self._base}/{path}"

    def uri_of(self, path: str = "") -> str:
        """The full URI of ``path`` (what another process passes to :meth:`from_uri`)."""
        path = path.strip("/")
        return f"{self.uri}/{path}" if path else self.uri

    def spark_uri_of(self, path: str = "") -> str:
        """The URI of ``path`` as Spark/Hadoop spells it (``s3://`` becomes ``s3a://``)."""
        full = self.uri_of(path)
        scheme, sep, rest = full.partition("://")
        if sep and scheme in _SPARK_SCHEMES:
            return f"{_SPARK_SCHEMES[scheme]}://{rest}"
        return full

    def child(self, path: str) -> FileSystem:
        """A filesystem rooted at ``path`` below this root (shares the backend)."""
        return FileSystem(self.uri_of(path), self._fs, self._abs(path), fsspec_fs=self._fsspec)

    @property
    def arrow_fs(self) -> pafs.FileSystem:
        """The underlying pyarrow filesystem (for :mod:`pyarrow.parquet`); pair it with :meth:`arrow_path`."""
        return self._fs

    def arrow_path(self, path: str) -> str:
        """The backend path of ``path`` for :attr:`arrow_fs`."""
        return self._abs(path)

    # ------------------------------------------------------------------ queries
    def exists(self, path: str) -> bool:
        """True if ``path`` exists (file or folder)."""
        return bool(self._fs.get_file_info(self._abs(path)).type != pafs.FileType.NotFound)

    def is_dir(self, path: str) -> bool:
        """True if ``path`` is a folder."""
        return bool(self._fs.get_file_info(self._abs(path)).type == pafs.FileType.Directory)

    def size(self, path: str) -> int:
        """Size in bytes of a file. Raises :class:`FileNotFoundError` when it does not exist."""
        info = self._fs.get_file_info(self._abs(path))
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(self.uri_of(path))
        return int(info.size or 0)

    def list_dir(self, path: str = "") -> list[FileEntry]:
        """Immediate children of directory ``path``, sorted by name; a missing directory lists as empty."""
        return self._list(path, recursive=False)

    def list_files(self, path: str = "") -> list[FileEntry]:
        """All files (not directories) below ``path``, recursively, sorted by path."""
        return [e for e in self._list(path, recursive=True) if not e.is_dir]

    #: Listings of a tree in which a folder vanished while it was listed (another process finishing a write:
    #: Spark's job commit deletes its ``_temporary`` folder) are taken again, at most this many times.
    LIST_ATTEMPTS = 10

    def _list(self, path: str, *, recursive: bool) -> list[FileEntry]:
        selector = pafs.FileSelector(self._abs(path), allow_not_found=True, recursive=recursive)
        for attempt in range(1, self.LIST_ATTEMPTS + 1):
            try:
                infos = self._fs.get_file_info(selector)
                break
            except NotADirectoryError:
                return []
            except FileNotFoundError:
                # ``allow_not_found`` covers the folder itself; this is a folder below it (or the folder)
                # deleted during the listing (pyarrow's dataset discovery raised so; its local listing with
                # ``allow_not_found`` did not in our tries). An empty answer would be a lie (the files around
                # it still exist): list again, and only a folder that is gone itself lists as empty.
                if not self.is_dir(path):
                    return []
                if attempt == self.LIST_ATTEMPTS:
                    raise
        prefix = self._abs("")
        out = []
        for info in infos:
            rel = info.path
            if prefix not in ("", "/") and rel.startswith(prefix + "/"):
                rel = rel[len(prefix) + 1 :]
            elif prefix == "/":
                rel = rel.lstrip("/")
            out.append(FileEntry(rel, int(info.size or 0), info.type == pafs.FileType.Directory))
        return sorted(out, key=lambda e: e.path)

    # ------------------------------------------------------------------ reads
    def read_bytes(self, path: str) -> bytes:
        """The whole content of a file. Raises :class:`FileNotFoundError` when it does not exist."""
        try:
            with self._fs.open_input_stream(self._abs(path)) as stream:
                return bytes(stream.read())
        except FileNotFoundError:
            raise
        except OSError as exc:
            if not self.exists(path):
                raise FileNotFoundError(self.uri_of(path)) from exc
            raise

    def read_json(self, path: str) -> Any:
        """The JSON document stored at ``path``."""
        return json.loads(self.read_bytes(path))

    def open_input(self, path: str) -> IO[bytes]:
        """A readable, seekable binary file object (close it, or use it as a context manager)."""
        return cast(IO[bytes], self._fs.open_input_file(self._abs(path)))

    # ------------------------------------------------------------------ writes
    def makedirs(self, path: str) -> None:
        """Create folder ``path`` and its parents (no error if it exists)."""
        self._fs.create_dir(self._abs(path), recursive=True)

    def _ensure_parent(self, path: str) -> None:
        parent = posixpath.dirname(path.strip("/"))
        if self.is_local or self._fsspec is not None:
            self._fs.create_dir(self._abs(parent), recursive=True)

    def open_output(self, path: str) -> IO[bytes]:
        """A writable binary stream; the file replaces any previous one when the stream is closed.

        Not atomic on local disks (readers can see a partial file): use :meth:`write_bytes_atomic` for
        anything a concurrent reader may open.
        """
        self._ensure_parent(path)
        return cast(IO[bytes], self._fs.open_output_stream(self._abs(path)))

    def write_bytes_atomic(self, path: str, data: bytes) -> None:
        """Write ``data`` so that readers see either the old file or the whole new one.

        Local: a temporary file in the same directory, then :func:`os.replace`. Object stores: one put.
        """
        self._ensure_parent(path)
        if self.is_local:
            target = self._abs(path)
            tmp = f"{target}.tmp-{uuid.uuid4().hex}"
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                os.replace(tmp, target)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            return
        with self._fs.open_output_stream(self._abs(path)) as stream:
            stream.write(data)

    def write_json_atomic(self, path: str, value: Any) -> None:
        """Write ``value`` as JSON at ``path``, replacing any earlier content whole."""
        self.write_bytes_atomic(path, json.dumps(value, sort_keys=True).encode())

    def create_exclusive(self, path: str, data: bytes) -> bool:
        """Create ``path`` with ``data`` only if it does not exist; True if we created it.

        Local: the content goes to a temporary file that is then hard-linked to ``path`` (the link fails
        when ``path`` exists), so a reader never sees a partial file and exactly one racing creator
        wins. S3: one PUT with ``If-None-Match: *`` (the server refuses it when the key exists), through
        boto3. fsspec backends: the ``"xb"`` open mode where supported. Other backends, and S3 without
        boto3 or against a server that ignores the header: check, then put (not race-free; fine under
        the one-writer-per-path discipline the callers keep).
        """
        self._ensure_parent(path)
        target = self._abs(path)
        if self.is_s3:
            created = _s3_put_if_absent(target, data)
            if created is not None:
                return created
        if self.is_local:
            tmp = f"{target}.tmp-{uuid.uuid4().hex}"
            with open(tmp, "wb") as f:
                f.write(data)
            try:
                os.link(tmp, target)
                return True
            except FileExistsError:
                return False
            except OSError:
                # Filesystems without hard links: O_EXCL creation (content appears after the create).
                try:
                    fd = os.open(target, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                except FileExistsError:
                    return False
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                return True
            finally:
                os.unlink(tmp)
        if self._fsspec is not None:
            try:
                with self._fsspec.open(target, "xb") as f:
                    f.write(data)
                return True
            except FileExistsError:
                return False
            except (NotImplementedError, ValueError):
                pass  # backend without exclusive mode: fall through to check-then-put
        if self.exists(path):
            return False
        with self._fs.open_output_stream(target) as stream:
            stream.write(data)
        return True

    def copy_file(self, src: str, dst: str) -> None:
        """Copy one file within this filesystem (server-side where the backend can)."""
        self._ensure_parent(dst)
        self._fs.copy_file(self._abs(src), self._abs(dst))

    def move(self, src: str, dst: str) -> None:
        """Move one file within this filesystem (a rename on local disks and HDFS; copy + delete on object
        stores, where a reader may briefly see both)."""
        self._ensure_parent(dst)
        self._fs.move(self._abs(src), self._abs(dst))

    # ------------------------------------------------------------------ deletes
    def delete(self, path: str) -> bool:
        """Delete one file; False if it did not exist."""
        try:
            self._fs.delete_file(self._abs(path))
            return True
        except FileNotFoundError:
            return False
        except OSError:
            if not self.exists(path):
                return False
            raise

    def delete_tree(self, path: str) -> None:
        """Delete a directory and everything below it; missing is fine. Refuses the root itself."""
        if not path.strip("/"):
            raise ConfigurationError(f"refusing to delete the whole filesystem root {self.uri!r}")
        info = self._fs.get_file_info(self._abs(path))
        if info.type == pafs.FileType.NotFound:
            return
        if info.type == pafs.FileType.File:
            self._fs.delete_file(self._abs(path))
            return
        try:
            self._fs.delete_dir(self._abs(path))
        except FileNotFoundError:
            return


# --------------------------------------------------------------------------- S3 conditional put


@functools.cache
def _s3_client() -> Any:
    """A boto3 S3 client configured like pyarrow's (both read the AWS SDK environment), or None."""
    try:
        import boto3
    except ImportError:
        log.warning("boto3 is not installed: exclusive creation on S3 is check-then-put (pip install boto3 for "
                    "conditional puts with If-None-Match)")
        return None
    return boto3.client("s3")


def _s3_put_if_absent(bucket_key: str, data: bytes) -> bool | None:
    """PUT ``data`` at ``bucket/key`` unless the key exists: True created, False existed, None when the
    conditional put is not available (no boto3, or a server that does not implement the header)."""
    client = _s3_client()
    if client is None:
        return None
    bucket, _, key = bucket_key.partition("/")
    try:
        client.put_object(Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
        return True
    except Exception as exc:  # botocore's ClientError, imported lazily with boto3
        code = str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))
        if code in ("PreconditionFailed", "ConditionalRequestConflict", "412", "409"):
            return False
        if code in ("NotImplemented", "501"):
            log.warning("the S3 endpoint does not implement If-None-Match; exclusive creation of %s is "
                        "check-then-put", bucket_key)
            return None
        raise


@functools.lru_cache(maxsize=32)
def _shared_file_system(uri: str) -> FileSystem:
    return FileSystem.from_uri(uri)
