"""The adapter store (torch-free): adapter files kept by content, one blob per fingerprint,
where every node can read them, so that a worker on another machine serves what a gateway
stored.

- `registry.store_url` says where: `s3://bucket/prefix` (any S3-compatible service),
  `file:///path` (one node, or a ReadWriteMany volume every node mounts), or unset:
  `registry.store_dir` itself, as a one-machine `loraplex serve` has always kept them.
- `registry.store_dir` is each node's local cache: `fetch` copies a blob there and returns
  the copy's path. Every blob carries the SHA-256 of its bytes, recorded when it was stored
  (the S3 object's metadata; a `.sha256` file beside it in a directory) and copied next to
  the cached copy; a copy is used only while its bytes match it, so a partial or corrupt
  download is fetched again, never served. (A worker then checks the adapter's fingerprint
  once loaded: that needs the base model.)
- Blobs are named by the adapter's fingerprint: `Fingerprint` (worker/contract/identity.py)
  is a hex string, taken here as `str` because this layer lies below the contract.

Why boto3: S3's request signing, retries, multipart uploads and the standard AWS
configuration (`AWS_ENDPOINT_URL` for MinIO, Ceph or another S3-compatible store, the
credentials, `AWS_DEFAULT_REGION`, profiles, instance roles) come with the client AWS keeps,
which every S3-compatible service tests against; a hand-written signer would get each of
them wrong in its own way. That configuration is read by boto3 when `open_blob_store` builds
the client, as any AWS tool reads it; tests pass their own client.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import unquote, urlsplit

import boto3
from boto3.exceptions import Boto3Error
from botocore.exceptions import BotoCoreError, ClientError

log = logging.getLogger(__name__)
BLOB_SUFFIX, DIGEST_SUFFIX = ".gguf", ".sha256"
DEFAULT_CACHE_DIR = "~/.cache/loraplex/adapters"
COPY_CHUNK_BYTES = 1 << 20
_FINGERPRINT = re.compile(r"^[0-9a-f]{16,128}$")  # a hex digest: also safe as a file name and an object key
_S3_MISSING = {"404", "NoSuchKey", "NotFound"}
_S3_ERRORS = (ClientError, BotoCoreError, Boto3Error)  # S3's answers, the transport's, boto3's transfers' (uploads)


class BlobStoreError(RuntimeError):
    """The store could not be read or written; the message names the blob and says why."""


class BlobNotFound(BlobStoreError, LookupError):
    """No blob under this fingerprint in the store."""


class BlobCorrupt(BlobStoreError):
    """A blob's bytes do not match the SHA-256 recorded when it was stored."""


@dataclass(frozen=True)
class BlobStoreConfig:
    """Where adapter blobs live (`url`; None: `cache_dir` is the store) and this node's cache of them."""

    url: str | None = None  # s3://bucket/prefix or file:///path
    cache_dir: str = DEFAULT_CACHE_DIR

    def __post_init__(self) -> None:
        if self.url is not None:
            parse_store_url(self.url)


def parse_store_url(url: str) -> tuple[str, str, str]:
    """(scheme, bucket, prefix) of `s3://bucket/prefix`, ("file", "", path) of `file:///path`."""
    parts = urlsplit(url)
    if parts.scheme == "s3":
        if not parts.netloc:
            raise ValueError(f"store_url {url!r}: s3:// needs a bucket (s3://bucket/prefix)")
        return "s3", parts.netloc, parts.path.strip("/")
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise ValueError(f"store_url {url!r}: file:// needs an absolute path (file:///path)")
        return "file", "", unquote(parts.path)
    raise ValueError(f"store_url {url!r}: expected s3://bucket/prefix or file:///path")


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(COPY_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def _checked(fingerprint: str) -> str:
    if not _FINGERPRINT.match(fingerprint):
        raise ValueError(f"{fingerprint[:80]!r} is not an adapter fingerprint (hex)")
    return fingerprint


def _write_atomically(target: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}-", suffix=".part")
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(text)
    os.replace(tmp, target)  # readers see the whole file or none


def _matches_digest(copy: Path, digest_file: Path) -> bool:
    """Whether `copy`'s bytes are those `digest_file` records (a missing or unreadable one: no)."""
    try:
        if not (copy.is_file() and digest_file.is_file()):
            return False
        if sha256_of(copy) == digest_file.read_text(encoding="ascii").strip():
            return True
    except OSError as e:
        log.warning("cached adapter %s could not be read (%s): fetching it again", copy.name, e)
        return False
    log.warning("cached adapter %s does not match its digest: fetching it again", copy.name)
    return False


class _Hashing:
    """A file being written, and the SHA-256 of what was written to it."""

    def __init__(self, out: BinaryIO) -> None:
        self.out, self.sha256 = out, hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        return self.out.write(data)


class BlobStore(ABC):
    """Adapter files by fingerprint, and this node's verified copies of them in `directory`."""

    is_local = False  # True: `directory` is the store itself (its files are no copies, and are never dropped here)

    def __init__(self, directory: Path, url: str) -> None:
        self.directory, self.url = directory, url
        directory.mkdir(parents=True, exist_ok=True)

    def copies(self) -> dict[str, tuple[int, float]]:
        """This node's copies of a store elsewhere: fingerprint -> (bytes, when last modified); none for a local store."""
        if self.is_local:
            return {}
        found = {}
        for copy in self.directory.glob(f"*{BLOB_SUFFIX}"):
            try:
                stat = copy.stat()
            except FileNotFoundError:
                continue
            found[copy.name.removesuffix(BLOB_SUFFIX)] = (stat.st_size, stat.st_mtime)
        return found

    def drop_copy(self, fingerprint: str) -> None:
        """Delete this node's copy (a worker's disk budget); the store keeps the blob. A local store: nothing."""
        if not self.is_local:
            self._forget_copy(fingerprint)

    def path(self, fingerprint: str) -> Path:
        """Where this node's copy of the blob is (or would be)."""
        return self.directory / f"{_checked(fingerprint)}{BLOB_SUFFIX}"

    def _digest_path(self, fingerprint: str) -> Path:
        return self.directory / f"{_checked(fingerprint)}{DIGEST_SUFFIX}"

    def fetch(self, fingerprint: str) -> Path:
        """This node's copy of the blob, whose bytes match the digest recorded when it was stored:
        the cached one, else one fetched now. BlobNotFound, BlobCorrupt or BlobStoreError."""
        cached, digest_file = self.path(fingerprint), self._digest_path(fingerprint)
        if _matches_digest(cached, digest_file):
            return cached
        try:
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{fingerprint[:16]}-", suffix=".part")
            try:
                with os.fdopen(fd, "wb") as out:
                    hashing = _Hashing(out)
                    recorded = self._read_into(fingerprint, hashing)
                if hashing.sha256.hexdigest() != recorded:
                    raise BlobCorrupt(f"adapter blob {fingerprint}: the bytes read do not match the SHA-256 recorded "
                                      "when it was stored (corrupt in the store)")
                _write_atomically(digest_file, recorded)
                os.replace(tmp, cached)  # a copy appears whole, after its digest
            finally:
                Path(tmp).unlink(missing_ok=True)
        except OSError as e:  # this node's disk (the store's own errors are BlobStoreErrors)
            raise BlobStoreError(f"adapter blob {fingerprint} could not be copied to this node's cache: "
                                 f"{e.strerror or e}") from e
        return cached

    @abstractmethod
    def put(self, source: Path, fingerprint: str) -> None:
        """Store the file `source` under `fingerprint` (a blob already there with the same bytes stays);
        returns once the blob is stored. BlobStoreError when it cannot be."""

    @abstractmethod
    def exists(self, fingerprint: str) -> bool: ...

    @abstractmethod
    def delete(self, fingerprint: str) -> None:
        """Remove the blob from the store and this node's copy (a missing one is no error)."""

    @abstractmethod
    def list_blobs(self) -> dict[str, float]:
        """Every stored blob: fingerprint -> when it was stored (wall-clock seconds)."""

    @abstractmethod
    def _read_into(self, fingerprint: str, out: _Hashing) -> str:
        """Write the blob's bytes to `out`; returns the SHA-256 recorded when it was stored."""

    def _forget_copy(self, fingerprint: str) -> None:
        self.path(fingerprint).unlink(missing_ok=True)
        self._digest_path(fingerprint).unlink(missing_ok=True)


class DirectoryBlobStore(BlobStore):
    """Blobs as files in `root` (`<fingerprint>.gguf`, its digest in `<fingerprint>.sha256`).
    When `root` is the cache directory itself (no store_url), a blob is its own cached copy."""

    def __init__(self, root: Path, directory: Path) -> None:
        super().__init__(directory, root.as_uri() if root.is_absolute() else str(root))
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.is_local = root.resolve() == directory.resolve()

    def _blob(self, fingerprint: str) -> Path:
        return self.root / f"{_checked(fingerprint)}{BLOB_SUFFIX}"

    def _digest(self, fingerprint: str) -> Path:
        return self.root / f"{_checked(fingerprint)}{DIGEST_SUFFIX}"

    def fetch(self, fingerprint: str) -> Path:
        if not self.is_local:
            return super().fetch(fingerprint)
        blob, digest = self._blob(fingerprint), self._digest(fingerprint)
        if not blob.is_file():
            raise BlobNotFound(f"adapter blob {fingerprint} is not in the adapter store")
        if digest.is_file() and sha256_of(blob) != digest.read_text(encoding="ascii").strip():  # no digest: an older store's file
            raise BlobCorrupt(f"adapter blob {fingerprint} does not match the SHA-256 recorded when it was stored")
        return blob

    def put(self, source: Path, fingerprint: str) -> None:
        blob, digest_file = self._blob(fingerprint), self._digest(fingerprint)
        try:
            digest = sha256_of(source)
            if blob.is_file() and digest_file.is_file() and digest_file.read_text(encoding="ascii").strip() == digest:
                os.utime(blob)  # stored again: as new as a fresh copy to any gateway's garbage collection
                return
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=f".{fingerprint[:16]}-", suffix=".part")
            os.close(fd)
            try:
                shutil.copyfile(source, tmp)
                os.replace(tmp, blob)
            finally:
                Path(tmp).unlink(missing_ok=True)
            _write_atomically(digest_file, digest)  # last: a blob counts as stored once its digest is there
        except OSError as e:
            raise BlobStoreError(f"adapter blob {fingerprint} could not be stored: {e.strerror or e}") from e

    def exists(self, fingerprint: str) -> bool:
        return self._blob(fingerprint).is_file()

    def delete(self, fingerprint: str) -> None:
        self._blob(fingerprint).unlink(missing_ok=True)
        self._digest(fingerprint).unlink(missing_ok=True)
        self._forget_copy(fingerprint)

    def list_blobs(self) -> dict[str, float]:
        stored = {}
        for blob in self.root.glob(f"*{BLOB_SUFFIX}"):
            try:
                stored[blob.name.removesuffix(BLOB_SUFFIX)] = blob.stat().st_mtime
            except FileNotFoundError:  # deleted meanwhile (by another gateway's collection)
                continue
        return stored

    def _read_into(self, fingerprint: str, out: _Hashing) -> str:
        try:
            recorded = self._digest(fingerprint).read_text(encoding="ascii").strip()
            with open(self._blob(fingerprint), "rb") as f:
                shutil.copyfileobj(f, out, COPY_CHUNK_BYTES)
        except FileNotFoundError as e:
            raise BlobNotFound(f"adapter blob {fingerprint} is not in the adapter store") from e
        except OSError as e:
            raise BlobStoreError(f"adapter blob {fingerprint} could not be read: {e.strerror or e}") from e
        return recorded


class S3BlobStore(BlobStore):
    """Blobs as objects `prefix/<fingerprint>.gguf` in an S3 bucket, each with its SHA-256 in
    the object's metadata (`x-amz-meta-sha256`): an object and its metadata are written at once."""

    def __init__(self, bucket: str, prefix: str, directory: Path, client: Any) -> None:
        super().__init__(directory, f"s3://{bucket}/{prefix}".rstrip("/"))
        self.bucket, self.prefix, self.client = bucket, prefix.strip("/"), client

    def _key(self, fingerprint: str) -> str:
        name = f"{_checked(fingerprint)}{BLOB_SUFFIX}"
        return f"{self.prefix}/{name}" if self.prefix else name

    def _failed(self, fingerprint: str, doing: str, e: Exception) -> BlobStoreError:
        """The error to raise: what failed and S3's code (the endpoint and bucket go to the log only)."""
        code = e.response.get("Error", {}).get("Code", "?") if isinstance(e, ClientError) else type(e).__name__
        if code in _S3_MISSING:
            return BlobNotFound(f"adapter blob {fingerprint} is not in the adapter store")
        log.warning("adapter store %s: %s %s failed: %s", self.url, doing, fingerprint[:16], e)
        return BlobStoreError(f"adapter blob {fingerprint}: {doing} failed in the adapter store ({code})")

    def _recorded_sha256(self, fingerprint: str) -> str | None:
        """The digest stored with the object; None when there is no object."""
        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self._key(fingerprint))
        except _S3_ERRORS as e:
            error = self._failed(fingerprint, "looking up", e)
            if isinstance(error, BlobNotFound):
                return None
            raise error from e
        return head.get("Metadata", {}).get("sha256", "")

    def put(self, source: Path, fingerprint: str) -> None:
        try:
            digest = sha256_of(source)
        except OSError as e:
            raise BlobStoreError(f"adapter blob {fingerprint}: cannot read {source.name}: {e.strerror or e}") from e
        if self._recorded_sha256(fingerprint) == digest:
            return
        try:  # multipart for big files; the metadata goes with the object
            self.client.upload_file(str(source), self.bucket, self._key(fingerprint), ExtraArgs={"Metadata": {"sha256": digest}})
        except _S3_ERRORS as e:
            raise self._failed(fingerprint, "storing", e) from e
        except OSError as e:
            raise BlobStoreError(f"adapter blob {fingerprint}: cannot read {source.name}: {e.strerror or e}") from e

    def exists(self, fingerprint: str) -> bool:
        return self._recorded_sha256(fingerprint) is not None

    def delete(self, fingerprint: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._key(fingerprint))
        except _S3_ERRORS as e:
            raise self._failed(fingerprint, "deleting", e) from e
        self._forget_copy(fingerprint)

    def list_blobs(self) -> dict[str, float]:
        stored = {}
        prefix = f"{self.prefix}/" if self.prefix else ""
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
                for item in page.get("Contents", ()):
                    name = item["Key"].removeprefix(prefix)
                    fingerprint = name.removesuffix(BLOB_SUFFIX)
                    if name.endswith(BLOB_SUFFIX) and "/" not in name and _FINGERPRINT.match(fingerprint):
                        stored[fingerprint] = item["LastModified"].timestamp()
        except _S3_ERRORS as e:
            log.warning("adapter store %s: listing failed: %s", self.url, e)
            raise BlobStoreError(f"the adapter store could not be listed ({type(e).__name__})") from e
        return stored

    def _read_into(self, fingerprint: str, out: _Hashing) -> str:
        try:  # the bytes and their recorded digest from one response: one version of the object
            got = self.client.get_object(Bucket=self.bucket, Key=self._key(fingerprint))
            for chunk in got["Body"].iter_chunks(COPY_CHUNK_BYTES):
                out.write(chunk)
        except _S3_ERRORS as e:
            raise self._failed(fingerprint, "reading", e) from e
        recorded = got.get("Metadata", {}).get("sha256")
        if not recorded:
            raise BlobCorrupt(f"adapter blob {fingerprint} has no SHA-256 recorded with it (not stored by loraplex)")
        return recorded


def open_blob_store(config: BlobStoreConfig, s3_client: Any = None) -> BlobStore:
    """The store `config` names, with its cache in `config.cache_dir`. For s3://, `s3_client` or
    boto3's default client (the AWS variables: endpoint, credentials, region)."""
    directory = Path(config.cache_dir).expanduser()
    if config.url is None:
        return DirectoryBlobStore(directory, directory)
    scheme, bucket, location = parse_store_url(config.url)
    if scheme == "file":
        return DirectoryBlobStore(Path(location), directory)
    return S3BlobStore(bucket, location, directory, s3_client or boto3.client("s3"))
