"""The adapter store (cache/blobs.py) over a real S3-compatible server (moto_server, reached by
boto3 through AWS_ENDPOINT_URL), a file:// directory, and the local directory alone: put,
fetch into a node's cache, verification, deletion, and the errors."""

from __future__ import annotations

import hashlib
from pathlib import Path

import boto3
import pytest
from botocore.config import Config

from cache.blobs import (
    BlobCorrupt,
    BlobNotFound,
    BlobStore,
    BlobStoreConfig,
    BlobStoreError,
    S3BlobStore,
    open_blob_store,
    parse_store_url,
)
from tests.redis_server import free_port
from tests.s3_server import bucket_name, running_s3

FP_A, FP_B = "a1" * 32, "b2" * 32


@pytest.fixture(scope="module")
def s3():
    with running_s3() as server:
        yield server


def make_store(kind: str, tmp_path: Path, cache: str = "cache") -> BlobStore:
    """A store of `kind` whose node cache is tmp_path/cache (the store's own place is shared by every cache)."""
    if kind == "s3":
        bucket = bucket_name()
        boto3.client("s3").create_bucket(Bucket=bucket)
        url = f"s3://{bucket}/adapters"
    elif kind == "file":
        url = (tmp_path / "volume").as_uri()
    else:
        url, cache = None, "local"
    return open_blob_store(BlobStoreConfig(url, str(tmp_path / cache)))


def blob_file(path: Path, size_bytes: int = 300_000, seed: int = 0) -> Path:
    path.write_bytes(hashlib.sha256(str(seed).encode()).digest() * (size_bytes // 32))
    return path


KINDS = ["s3", "file", "local"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_stored_blob_is_fetched_listed_and_deleted(kind, s3, tmp_path) -> None:
    store = make_store(kind, tmp_path)
    source = blob_file(tmp_path / "a.gguf")
    assert not store.exists(FP_A) and store.list_blobs() == {}
    store.put(source, FP_A)
    store.put(source, FP_A)  # the same content again: stored once
    assert store.exists(FP_A) and list(store.list_blobs()) == [FP_A]
    copy = store.fetch(FP_A)
    assert copy == store.path(FP_A) and copy.read_bytes() == source.read_bytes()
    assert store.fetch(FP_A) == copy  # a verified cached copy is used as it is
    store.delete(FP_A)
    assert not store.exists(FP_A) and store.list_blobs() == {} and not copy.exists()
    store.delete(FP_A)  # already gone: no error


@pytest.mark.parametrize("kind", ["s3", "file"])
def test_another_nodes_cache_fetches_what_one_node_stored(kind, s3, tmp_path) -> None:
    gateway = make_store(kind, tmp_path, cache="gateway-cache")
    worker = open_blob_store(BlobStoreConfig(gateway.url, str(tmp_path / "worker-cache")))
    source = blob_file(tmp_path / "a.gguf")
    gateway.put(source, FP_A)
    assert not gateway.path(FP_A).exists()  # storing does not fill the storing node's cache
    copy = worker.fetch(FP_A)
    assert copy.parent == tmp_path / "worker-cache" and copy.read_bytes() == source.read_bytes()
    assert [p.name for p in (tmp_path / "worker-cache").iterdir() if p.name.endswith(".part")] == []


@pytest.mark.parametrize("kind", ["s3", "file"])
@pytest.mark.parametrize("damage", ["flipped", "truncated", "no-digest"])
def test_a_damaged_cached_copy_is_fetched_again_never_served(kind, damage, s3, tmp_path) -> None:
    store = make_store(kind, tmp_path)
    source = blob_file(tmp_path / "a.gguf")
    store.put(source, FP_A)
    copy = store.fetch(FP_A)
    data = bytearray(copy.read_bytes())
    if damage == "flipped":
        data[1000] ^= 0xFF
        copy.write_bytes(bytes(data))
    elif damage == "truncated":  # a partial download
        copy.write_bytes(bytes(data[: len(data) // 2]))
    else:
        (store.directory / f"{FP_A}.sha256").unlink()
    assert store.fetch(FP_A).read_bytes() == source.read_bytes()


def test_a_blob_corrupt_in_the_store_is_refused_and_leaves_nothing_in_the_cache(s3, tmp_path) -> None:
    store = make_store("s3", tmp_path)
    assert isinstance(store, S3BlobStore)
    source = blob_file(tmp_path / "a.gguf")
    wrong = hashlib.sha256(b"other bytes").hexdigest()
    store.client.put_object(Bucket=store.bucket, Key=f"adapters/{FP_A}.gguf", Body=source.read_bytes(),
                            Metadata={"sha256": wrong})
    with pytest.raises(BlobCorrupt, match=FP_A):
        store.fetch(FP_A)
    assert list(store.directory.iterdir()) == []
    store.put(source, FP_A)  # stored again with its true digest: repaired
    assert store.fetch(FP_A).read_bytes() == source.read_bytes()


def test_a_local_blob_that_no_longer_matches_its_digest_is_an_error(tmp_path) -> None:
    store = make_store("local", tmp_path)
    store.put(blob_file(tmp_path / "a.gguf"), FP_A)
    store.path(FP_A).write_bytes(b"rotten")
    with pytest.raises(BlobCorrupt, match=FP_A):
        store.fetch(FP_A)


@pytest.mark.parametrize("kind", KINDS)
def test_a_missing_blob_is_an_error_naming_its_fingerprint(kind, s3, tmp_path) -> None:
    store = make_store(kind, tmp_path)
    with pytest.raises(BlobNotFound, match=FP_B) as e:
        store.fetch(FP_B)
    assert isinstance(e.value, BlobStoreError) and isinstance(e.value, LookupError)
    assert "127.0.0.1" not in str(e.value) and str(tmp_path) not in str(e.value)  # nothing internal: it may reach a client


def test_an_unreachable_store_is_a_store_error_not_a_crash(tmp_path) -> None:
    client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{free_port()}", region_name="us-east-1",
                          aws_access_key_id="x", aws_secret_access_key="x",
                          config=Config(retries={"max_attempts": 1}, connect_timeout=1))
    store = open_blob_store(BlobStoreConfig("s3://nowhere/p", str(tmp_path / "cache")), s3_client=client)
    for call in (lambda: store.fetch(FP_A), lambda: store.put(blob_file(tmp_path / "a.gguf"), FP_A), store.list_blobs):
        with pytest.raises(BlobStoreError) as e:
            call()
        assert not isinstance(e.value, BlobNotFound) and "127.0.0.1" not in str(e.value)


def test_a_bucket_that_does_not_exist_is_a_store_error_on_every_call(s3, tmp_path) -> None:
    store = open_blob_store(BlobStoreConfig(f"s3://{bucket_name('missing')}/p", str(tmp_path / "cache")))
    with pytest.raises(BlobStoreError, match=f"{FP_A}: storing failed"):  # boto3's upload error, not a crash
        store.put(blob_file(tmp_path / "a.gguf"), FP_A)
    with pytest.raises(BlobStoreError, match="could not be listed"):
        store.list_blobs()
    with pytest.raises(BlobStoreError, match=FP_A):
        store.fetch(FP_A)


def test_fingerprints_are_hex_so_they_cannot_name_another_file(tmp_path) -> None:
    store = make_store("local", tmp_path)
    for bad in ("../etc/passwd", "A1" * 32, ""):
        with pytest.raises(ValueError, match="not an adapter fingerprint"):
            store.fetch(bad)


@pytest.mark.parametrize(("url", "parsed"), [
    ("s3://bucket/some/prefix/", ("s3", "bucket", "some/prefix")),
    ("s3://bucket", ("s3", "bucket", "")),
    ("file:///mnt/adapters", ("file", "", "/mnt/adapters")),
])
def test_store_urls(url, parsed) -> None:
    assert parse_store_url(url) == parsed


@pytest.mark.parametrize("url", ["s3:///prefix", "file://relative/path", "http://host/x", "/plain/path"])
def test_bad_store_urls_are_refused_saying_what_is_expected(url) -> None:
    with pytest.raises(ValueError, match="store_url"):
        BlobStoreConfig(url)
