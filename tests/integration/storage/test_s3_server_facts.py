"""What s3fs/botocore and SeaweedFS actually do, one fact per test, against the real server.

These pin the behaviour issue 14's S3 backend is built on (docs/notes/s3-seaweedfs.md explains
each): size limits of multipart parts, paging and batch limits, conditional writes (the safe
commit), copy/rename, the exception a retry layer sees for each failure, consistency, and the
s3fs listings cache that hides other writers' keys. Expected values come from the S3 API
contract and from bytes the test itself wrote, never from unickpt.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import io
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from tests.fixtures.s3server import require_s3_clients

require_s3_clients()  # skips this module without s3fs/botocore (fails under UNICKPT_TEST_REQUIRE_S3=1)

import botocore.exceptions  # noqa: E402
from fsspec.asyn import sync  # noqa: E402

MiB = 1 << 20


def _rand(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).bytes(n)


def _code(e: BaseException) -> tuple[str, int]:
    """(S3 error code, HTTP status) of a botocore ClientError, or of the one s3fs wrapped."""
    ce = e if isinstance(e, botocore.exceptions.ClientError) else e.__cause__
    assert isinstance(ce, botocore.exceptions.ClientError), f"no ClientError behind {e!r}"
    return ce.response["Error"]["Code"], ce.response["ResponseMetadata"]["HTTPStatusCode"]


def _run(fs: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """Run a coroutine function on the filesystem's own event loop (what a backend would do)."""

    async def main() -> Any:
        await fs.set_session()
        return await fn(*args)

    return sync(fs.loop, main)


class _CallLog:
    """Records the S3 operations an s3fs instance makes (name, kwargs without bodies)."""

    def __init__(self, fs: Any):
        self.calls: list[tuple[str, dict[str, Any]]] = []
        orig = fs._call_s3

        async def spy(method: str, *a: Any, **kw: Any) -> Any:
            self.calls.append((method, {k: v for k, v in kw.items() if k != "Body"}))
            return await orig(method, *a, **kw)

        fs._call_s3 = spy

    def names(self) -> list[str]:
        return [m for m, _ in self.calls]


# ------------------------------------------------------------------ put / get / multipart


def test_put_get_small_empty_and_200mib(s3_bucket):
    fs = s3_bucket.filesystem()
    b = s3_bucket.name
    small, big = _rand(1000, 1), _rand(200 * MiB, 2)
    fs.pipe_file(f"{b}/small", small)
    fs.pipe_file(f"{b}/empty", b"")
    fs.pipe_file(f"{b}/big", big)  # > 2 x 50 MiB chunksize: s3fs switches to multipart
    assert fs.cat_file(f"{b}/small") == small
    assert fs.cat_file(f"{b}/empty") == b""
    assert fs.info(f"{b}/big")["size"] == len(big)
    assert fs.cat_file(f"{b}/big") == big  # 50 MiB ranged GETs, 10 at a time (s3fs default)


def test_multipart_of_5mib_parts_and_a_short_tail(s3_bucket):
    """Parts of exactly 5 MiB plus a 1-byte last part assemble in part-number order; the ETag
    is the multipart form md5(md5(part1)..md5(partN))-N."""
    c, b = s3_bucket.endpoint.client(), s3_bucket.name
    parts = [_rand(5 * MiB, 10), _rand(5 * MiB, 11), b"!"]
    up = c.create_multipart_upload(Bucket=b, Key="mp")["UploadId"]
    etags = []
    for n in (3, 1, 2):  # uploaded out of order
        r = c.upload_part(Bucket=b, Key="mp", UploadId=up, PartNumber=n, Body=parts[n - 1])
        etags.append({"PartNumber": n, "ETag": r["ETag"]})
    etags.sort(key=lambda p: p["PartNumber"])
    done = c.complete_multipart_upload(Bucket=b, Key="mp", UploadId=up, MultipartUpload={"Parts": etags})
    want_etag = hashlib.md5(b"".join(hashlib.md5(p).digest() for p in parts)).hexdigest() + "-3"
    assert done["ETag"].strip('"') == want_etag
    assert c.get_object(Bucket=b, Key="mp")["Body"].read() == b"".join(parts)


def test_parts_under_5mib_are_rejected_at_complete(s3_bucket):
    """UploadPart accepts a small part; CompleteMultipartUpload refuses (400 EntityTooSmall)
    when any part but the last is < 5 MiB; s3fs maps that to OSError(EINVAL). Nothing is
    written and the upload can still be aborted."""
    c, b = s3_bucket.endpoint.client(), s3_bucket.name
    up = c.create_multipart_upload(Bucket=b, Key="small-parts")["UploadId"]
    etags = [
        {"PartNumber": n, "ETag": c.upload_part(Bucket=b, Key="small-parts", UploadId=up, PartNumber=n, Body=p)["ETag"]}
        for n, p in ((1, _rand(5 * MiB - 1, 20)), (2, _rand(MiB, 21)))
    ]
    with pytest.raises(botocore.exceptions.ClientError) as ei:
        c.complete_multipart_upload(Bucket=b, Key="small-parts", UploadId=up, MultipartUpload={"Parts": etags})
    assert _code(ei.value) == ("EntityTooSmall", 400)
    with pytest.raises(botocore.exceptions.ClientError):
        c.head_object(Bucket=b, Key="small-parts")
    c.abort_multipart_upload(Bucket=b, Key="small-parts", UploadId=up)

    fs = s3_bucket.filesystem()
    with pytest.raises(OSError) as ei2:
        fs.pipe_file(f"{b}/s3fs-small", _rand(3 * MiB, 22), chunksize=MiB)  # 3 parts of 1 MiB
    assert ei2.value.errno == errno.EINVAL and _code(ei2.value) == ("EntityTooSmall", 400)
    assert c.list_multipart_uploads(Bucket=b).get("Uploads", []) == []  # s3fs aborted it


def test_concurrent_uploads_from_one_event_loop(s3_bucket):
    """16 objects (half single PUT, half 2-part multipart) uploaded at once by one s3fs
    instance on its one loop; every object reads back exactly."""
    fs, b = s3_bucket.filesystem(), s3_bucket.name
    blobs = {f"{b}/c/{i:02d}": _rand((i % 2) * 6 * MiB + 4 * MiB + i, 100 + i) for i in range(16)}

    async def upload_all() -> None:
        await asyncio.gather(*(fs._pipe_file(k, v, chunksize=5 * MiB) for k, v in blobs.items()))

    _run(fs, upload_all)
    got = fs.cat(list(blobs))
    assert got == blobs


def test_botocore_bodies_bytes_bytearray_filelike_but_not_memoryview(s3_bucket):
    """A zero-copy upload cannot hand botocore a memoryview: its parameter validation accepts
    bytes, bytearray or a file-like object; a readable wrapper over the memoryview works."""
    c, b = s3_bucket.endpoint.client(), s3_bucket.name
    payload = bytearray(_rand(4096, 30))
    with pytest.raises(botocore.exceptions.ParamValidationError, match="memoryview"):
        c.put_object(Bucket=b, Key="mv", Body=memoryview(payload))
    c.put_object(Bucket=b, Key="ba", Body=payload)
    c.put_object(Bucket=b, Key="fl", Body=_MemoryviewReader(memoryview(payload)[1:]))
    assert c.get_object(Bucket=b, Key="ba")["Body"].read() == bytes(payload)
    assert c.get_object(Bucket=b, Key="fl")["Body"].read() == bytes(payload[1:])


class _MemoryviewReader(io.RawIOBase):
    def __init__(self, view: memoryview):
        self._view, self._pos = view.cast("B"), 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        n = min(len(buf), len(self._view) - self._pos)
        buf[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos


# ------------------------------------------------------------------ ranged reads


def test_ranged_reads_in_parallel_from_one_loop(s3_bucket):
    """cat_ranges and many _cat_file(start, end) gathered on one loop return exactly the
    requested slices (end exclusive); an end past EOF is clamped; a negative start counts from
    the end; a start at/after EOF is 416 InvalidRange -> OSError(EINVAL), which cat_ranges
    returns in place instead of raising (on_error="return" is its default)."""
    fs, b = s3_bucket.filesystem(), s3_bucket.name
    objs = {f"{b}/r{i}": _rand(3 * MiB + 100 + 17 * i, 40 + i) for i in range(3)}
    for k, v in objs.items():
        fs.pipe_file(k, v)
    reqs = [(k, s, s + n) for k in objs for s, n in ((0, 1), (4095, 4097), (MiB - 3, 2 * MiB + 7), (3 * MiB, 17))]
    want = [objs[k][s:e] for k, s, e in reqs]
    assert fs.cat_ranges([k for k, _, _ in reqs], [s for _, s, _ in reqs], [e for _, _, e in reqs]) == want

    async def gathered() -> list[bytes]:
        return await asyncio.gather(*(fs._cat_file(k, start=s, end=e) for k, s, e in reqs))

    assert _run(fs, gathered) == want
    k0, v0 = next(iter(objs.items()))
    assert fs.cat_file(k0, start=len(v0) - 5, end=len(v0) + 100) == v0[-5:]
    assert fs.cat_file(k0, start=-7) == v0[-7:]
    with pytest.raises(OSError) as ei:
        fs.cat_file(k0, start=len(v0), end=len(v0) + 10)
    assert ei.value.errno == errno.EINVAL and _code(ei.value) == ("InvalidRange", 416)
    # cat_ranges does not raise: a failed range comes back as the exception object in its slot
    out = fs.cat_ranges([k0, k0], [0, len(v0)], [3, len(v0) + 1])
    assert out[0] == v0[:3] and isinstance(out[1], OSError) and _code(out[1]) == ("InvalidRange", 416)


# ------------------------------------------------------------------ listing / delete


def _make_keys(fs: Any, prefix: str, n: int) -> list[str]:
    keys = [f"{prefix}/{i:05d}" for i in range(n)]

    async def put_all() -> None:
        sem = asyncio.Semaphore(64)

        async def one(k: str) -> None:
            async with sem:
                await fs._pipe_file(k, b"x")

        await asyncio.gather(*(one(k) for k in keys))

    _run(fs, put_all)
    return keys


def test_listing_pages_at_1000_keys(s3_bucket):
    """ListObjectsV2 returns 1000 keys per page with a continuation token; s3fs's ls/find follow
    it (one call per page). SeaweedFS also honours MaxKeys > 1000 (AWS caps it at 1000)."""
    c, b = s3_bucket.endpoint.client(), s3_bucket.name
    keys = _make_keys(s3_bucket.filesystem(), f"{b}/many", 1234)
    first = c.list_objects_v2(Bucket=b, Prefix="many/")
    assert (first["KeyCount"], first["IsTruncated"], first["MaxKeys"]) == (1000, True, 1000)
    second = c.list_objects_v2(Bucket=b, Prefix="many/", ContinuationToken=first["NextContinuationToken"])
    assert (second["KeyCount"], second["IsTruncated"]) == (234, False)
    assert [f"{b}/{o['Key']}" for o in first["Contents"] + second["Contents"]] == keys
    assert c.list_objects_v2(Bucket=b, Prefix="many/", MaxKeys=5000)["KeyCount"] == 1234

    fs = s3_bucket.filesystem()
    log = _CallLog(fs)
    assert sorted(fs.find(f"{b}/many")) == keys
    assert log.names() == ["list_objects_v2", "list_objects_v2"]


def test_batch_delete_of_many_keys(s3_bucket):
    """s3fs rm of 1234 keys = DeleteObjects batches of 1000 + 234; the server refuses 1001 keys
    in one request (400 InvalidArgument); deleting absent keys succeeds (idempotent)."""
    c, b = s3_bucket.endpoint.client(), s3_bucket.name
    fs = s3_bucket.filesystem()
    keys = _make_keys(fs, f"{b}/del", 1234)
    log = _CallLog(fs)
    fs.rm(keys)
    batches = [(m, len(kw["Delete"]["Objects"])) for m, kw in log.calls]
    assert batches == [("delete_objects", 1000), ("delete_objects", 234)]
    assert c.list_objects_v2(Bucket=b, Prefix="del/")["KeyCount"] == 0
    with pytest.raises(botocore.exceptions.ClientError) as ei:
        c.delete_objects(Bucket=b, Delete={"Objects": [{"Key": f"z{i}"} for i in range(1001)]})
    assert _code(ei.value) == ("InvalidArgument", 400)
    r = c.delete_objects(Bucket=b, Delete={"Objects": [{"Key": "absent"}]})
    assert [d["Key"] for d in r["Deleted"]] == ["absent"] and not r.get("Errors")
    assert c.delete_object(Bucket=b, Key="absent")["ResponseMetadata"]["HTTPStatusCode"] == 204
    fs.rm_file(f"{b}/absent")  # no error either


# ------------------------------------------------------------------ conditional writes


def test_if_none_match_star_refuses_an_existing_key(s3_bucket):
    """PutObject with If-None-Match: * -> 412 PreconditionFailed when the key exists, and the
    old bytes stay. Through s3fs (mode="create") this is OSError(EINVAL), NOT FileExistsError:
    SeaweedFS's error has no <Condition> element, which s3fs needs to pick FileExistsError."""
    c, b = s3_bucket.endpoint.client(), s3_bucket.name
    c.put_object(Bucket=b, Key="k", Body=b"first")
    with pytest.raises(botocore.exceptions.ClientError) as ei:
        c.put_object(Bucket=b, Key="k", Body=b"second", IfNoneMatch="*")
    assert _code(ei.value) == ("PreconditionFailed", 412)
    assert "Condition" not in ei.value.response["Error"]
    created = c.put_object(Bucket=b, Key="fresh", Body=b"new", IfNoneMatch="*")
    assert created["ResponseMetadata"]["HTTPStatusCode"] == 200

    fs = s3_bucket.filesystem()
    with pytest.raises(OSError) as ei2:
        fs.pipe_file(f"{b}/k", b"third", mode="create")
    assert type(ei2.value) is OSError and ei2.value.errno == errno.EINVAL
    assert _code(ei2.value) == ("PreconditionFailed", 412)
    assert c.get_object(Bucket=b, Key="k")["Body"].read() == b"first"


def test_if_none_match_race_has_exactly_one_winner(s3_bucket):
    """16 writers race to create one key with If-None-Match: * -> exactly one succeeds and the
    object holds the winner's bytes (the server re-checks the condition under its per-object
    write lock after receiving the body)."""
    fs, b = s3_bucket.filesystem(), s3_bucket.name

    async def race() -> list[Any]:
        async def one(i: int) -> Any:
            body = f"writer-{i:02d}".encode() + _rand(64 * 1024, 200 + i)
            try:
                await fs._call_s3("put_object", Bucket=b, Key="commit", Body=body, IfNoneMatch="*")
                return i
            except Exception as e:
                return e

        return await asyncio.gather(*(one(i) for i in range(16)))

    results = _run(fs, race)
    winners = [r for r in results if isinstance(r, int)]
    assert len(winners) == 1, results
    assert all(_code(r) == ("PreconditionFailed", 412) for r in results if not isinstance(r, int))
    w = winners[0]
    got = s3_bucket.endpoint.client().get_object(Bucket=b, Key="commit")["Body"].read()
    assert got == f"writer-{w:02d}".encode() + _rand(64 * 1024, 200 + w)


def test_if_none_match_on_complete_multipart(s3_bucket):
    """The condition is checked at CompleteMultipartUpload: over an existing key it fails (412)
    after all parts were sent and the old object stays; s3fs aborts the upload. A new key
    completes normally."""
    fs, c, b = s3_bucket.filesystem(), s3_bucket.endpoint.client(), s3_bucket.name
    data = _rand(11 * MiB, 50)
    fs.pipe_file(f"{b}/mp", b"old")
    with pytest.raises(OSError) as ei:
        fs.pipe_file(f"{b}/mp", data, chunksize=5 * MiB, mode="create")
    assert _code(ei.value) == ("PreconditionFailed", 412)
    assert fs.cat_file(f"{b}/mp") == b"old"
    assert c.list_multipart_uploads(Bucket=b).get("Uploads", []) == []
    fs.pipe_file(f"{b}/mp-new", data, chunksize=5 * MiB, mode="create")
    assert fs.cat_file(f"{b}/mp-new") == data


def test_if_match_etag_guards_overwrite(s3_bucket):
    """If-Match: the right ETag overwrites, a stale ETag or an absent key -> 412."""
    c, b = s3_bucket.endpoint.client(), s3_bucket.name
    etag = c.put_object(Bucket=b, Key="k", Body=b"v1")["ETag"]
    assert etag.strip('"') == hashlib.md5(b"v1").hexdigest()
    etag2 = c.put_object(Bucket=b, Key="k", Body=b"v2", IfMatch=etag)["ETag"]
    for key, tag in (("k", etag), ("absent", etag2)):
        with pytest.raises(botocore.exceptions.ClientError) as ei:
            c.put_object(Bucket=b, Key=key, Body=b"v3", IfMatch=tag)
        assert _code(ei.value) == ("PreconditionFailed", 412)
    assert c.get_object(Bucket=b, Key="k")["Body"].read() == b"v2"


# ------------------------------------------------------------------ copy / rename


def test_copy_object_and_server_side_rename(s3_bucket):
    """CopyObject works (and honours If-None-Match on the destination). SeaweedFS also
    implements RenameObject (botocore rename_object): source gone, destination has the bytes;
    AWS offers it only on directory buckets, so a portable backend cannot rely on it. s3fs's mv
    is copy + delete, never a rename."""
    fs, c, b = s3_bucket.filesystem(), s3_bucket.endpoint.client(), s3_bucket.name
    data = _rand(6 * MiB, 60)
    c.put_object(Bucket=b, Key="src", Body=data)
    c.copy_object(Bucket=b, Key="dst", CopySource={"Bucket": b, "Key": "src"})
    assert c.get_object(Bucket=b, Key="dst")["Body"].read() == data
    with pytest.raises(botocore.exceptions.ClientError) as ei:
        c.copy_object(Bucket=b, Key="dst", CopySource={"Bucket": b, "Key": "src"}, IfNoneMatch="*")
    assert _code(ei.value) == ("PreconditionFailed", 412)

    c.rename_object(Bucket=b, Key="renamed", RenameSource=f"{b}/dst")
    assert c.get_object(Bucket=b, Key="renamed")["Body"].read() == data
    with pytest.raises(botocore.exceptions.ClientError):
        c.head_object(Bucket=b, Key="dst")

    log = _CallLog(fs)
    fs.mv(f"{b}/src", f"{b}/moved")
    assert "copy_object" in log.names() and "delete_objects" in log.names()
    assert fs.cat_file(f"{b}/moved") == data and not fs.exists(f"{b}/src")


# ------------------------------------------------------------------ errors a retry layer sees


def test_missing_key_and_bucket_errors(s3_bucket):
    """Missing key/bucket: s3fs raises FileNotFoundError (cause: NoSuchKey / NoSuchBucket);
    botocore GET -> NoSuchKey 404, HEAD -> code "404" (a HEAD response has no body)."""
    fs, c, b = s3_bucket.filesystem(), s3_bucket.endpoint.client(), s3_bucket.name
    with pytest.raises(FileNotFoundError):
        fs.cat_file(f"{b}/absent", start=0, end=4)
    with pytest.raises(FileNotFoundError):
        fs.info(f"{b}/absent")
    with pytest.raises(FileNotFoundError) as ei:
        fs.cat_file(f"no-such-bucket-{b}/k", start=0, end=1)
    assert _code(ei.value) == ("NoSuchBucket", 404)
    with pytest.raises(c.exceptions.NoSuchKey) as e2:
        c.get_object(Bucket=b, Key="absent")
    assert _code(e2.value) == ("NoSuchKey", 404)
    with pytest.raises(botocore.exceptions.ClientError) as e3:
        c.head_object(Bucket=b, Key="absent")
    assert _code(e3.value) == ("404", 404)


def test_server_503_is_retried_by_botocore_then_surfaces_as_eio(s3_server, s3_bucket):
    """A real 503 from the server (SeaweedFS's circuit breaker with a write limit of 0): botocore
    retries it itself (RetryAttempts = attempts - 1), s3fs does not retry the code
    'ErrTooManyRequest' again and raises OSError(EIO) with the ClientError as cause. Reads are
    not limited meanwhile."""
    b = s3_bucket.name
    s3_bucket.endpoint.client().put_object(Bucket=b, Key="before", Body=b"ok")
    s3_server.shell("s3.circuitBreaker -global -type Count -actions Write -values 0 -apply")
    try:
        with pytest.raises(botocore.exceptions.ClientError) as ei:
            s3_bucket.endpoint.client(attempts=3).put_object(Bucket=b, Key="k", Body=b"x")
        assert _code(ei.value) == ("ErrTooManyRequest", 503)
        meta = ei.value.response["ResponseMetadata"]
        assert meta["RetryAttempts"] == 2 and meta["MaxAttemptsReached"]

        fs = s3_bucket.filesystem(config_kwargs={"retries": {"total_max_attempts": 2, "mode": "standard"}})
        log = _CallLog(fs)
        with pytest.raises(OSError) as e2:
            fs.pipe_file(f"{b}/k", b"x")
        assert type(e2.value) is OSError and e2.value.errno == errno.EIO
        assert _code(e2.value) == ("ErrTooManyRequest", 503)
        assert log.names() == ["put_object"]  # one s3fs-level call (botocore retried inside)
        assert fs.cat_file(f"{b}/before") == b"ok"
    finally:
        s3_server.shell("s3.circuitBreaker -global -disable -apply")
    s3_bucket.filesystem().pipe_file(f"{b}/k", b"x")


def test_connection_refused_is_a_botocore_error_not_oserror():
    """Server gone (SIGKILL): both botocore and s3fs raise botocore's EndpointConnectionError,
    a BotoCoreError that is not an OSError and that s3fs does not translate or retry itself
    (botocore retried it under its own retry policy first)."""
    from tests.fixtures.s3server import SeaweedServer, require_weed

    with SeaweedServer(require_weed()) as server:
        bucket = server.create_bucket()
        fs = bucket.filesystem(config_kwargs={"retries": {"total_max_attempts": 2, "mode": "standard"}})
        fs.pipe_file(f"{bucket.name}/k", b"v")
        server.kill()
        with pytest.raises(botocore.exceptions.EndpointConnectionError) as ei:
            fs.cat_file(f"{bucket.name}/k", start=0, end=1)
        assert not isinstance(ei.value, OSError)
        with pytest.raises(botocore.exceptions.EndpointConnectionError):
            bucket.endpoint.client(attempts=1).get_object(Bucket=bucket.name, Key="k")


# ------------------------------------------------------------------ consistency and caching


def test_read_after_write_for_overwrite_and_list(s3_bucket):
    """Strong read-after-write: each overwrite is visible to the very next GET (other client,
    no cache), and a new key to the very next LIST; a delete to the next GET/LIST."""
    writer, reader, b = s3_bucket.endpoint.client(), s3_bucket.endpoint.client(), s3_bucket.name
    for i in range(20):
        body = f"version-{i}".encode() * (i + 1)
        writer.put_object(Bucket=b, Key="k", Body=body)
        assert reader.get_object(Bucket=b, Key="k")["Body"].read() == body
        writer.put_object(Bucket=b, Key=f"l/{i:02d}", Body=b"x")
        listed = [o["Key"] for o in reader.list_objects_v2(Bucket=b, Prefix="l/").get("Contents", [])]
        assert listed == [f"l/{j:02d}" for j in range(i + 1)]
    writer.delete_object(Bucket=b, Key="l/00")
    assert "l/00" not in [o["Key"] for o in reader.list_objects_v2(Bucket=b, Prefix="l/")["Contents"]]
    with pytest.raises(reader.exceptions.NoSuchKey):
        reader.get_object(Bucket=b, Key="l/00")


def test_s3fs_listing_cache_hides_other_writers_keys(s3_bucket):
    """After an s3fs instance listed a prefix, a key another writer adds there is invisible to
    that instance's exists/info/open/whole-object cat_file (FileNotFoundError) until
    refresh=True / invalidate_cache(); ranged reads go to the server and see it. An instance
    made with use_listings_cache=False sees it at once."""
    b = s3_bucket.name
    fs, other, fresh = s3_bucket.filesystem(), s3_bucket.filesystem(), s3_bucket.filesystem(use_listings_cache=False)
    fs.pipe_file(f"{b}/a", b"A")
    fs.ls(b)
    fresh.ls(b)
    other.pipe_file(f"{b}/new", b"N" * 100)
    assert fs.exists(f"{b}/new") is False
    with pytest.raises(FileNotFoundError):
        fs.info(f"{b}/new")
    with pytest.raises(FileNotFoundError):
        fs.cat_file(f"{b}/new")
    assert fs.cat_file(f"{b}/new", start=0, end=10) == b"N" * 10
    assert f"{b}/new" not in fs.ls(b)
    assert f"{b}/new" in fs.ls(b, refresh=True)
    assert fresh.exists(f"{b}/new") and fresh.cat_file(f"{b}/new") == b"N" * 100


def test_signing_region_is_a_client_side_setting_here(s3_bucket):
    """SeaweedFS accepts a SigV4 signature for any region name, so AWS_DEFAULT_REGION only has
    to be set, not to match anything."""
    from tests.fixtures.s3server import S3Endpoint

    ep = s3_bucket.endpoint
    for region in ("us-east-1", "eu-west-3", "ap-south-2"):
        client = S3Endpoint(ep.url, ep.access_key, ep.secret_key, region).client()
        client.put_object(Bucket=s3_bucket.name, Key=region, Body=os.urandom(8))
        assert client.head_object(Bucket=s3_bucket.name, Key=region)["ContentLength"] == 8


def test_bucket_and_key_name_rules(s3_server, s3_bucket):
    """Bucket names follow AWS's rules (3-63 chars, lowercase, no '_', no leading/trailing '-',
    no IP form, no 'xn--'). Keys: at most 1024 bytes AND at most 255 bytes per '/'-separated
    segment (the filer's file-name limit; AWS has no such per-segment limit) -> KeyTooLongError;
    '.' / '..' segments -> InvalidRequest; an empty segment ('a//b') is stored as 'a/b'."""
    c, b = s3_bucket.endpoint.client(), s3_bucket.name
    for bad in ("ab", "a" * 64, "Abc", "a_b", "-ab", "ab-", "192.168.1.1", "xn--ab"):
        with pytest.raises(botocore.exceptions.ClientError) as ei:
            c.create_bucket(Bucket=bad)
        assert _code(ei.value) == ("InvalidBucketName", 400), bad
    for good in ("abc", "a.b-" + "c" * 59):
        c.create_bucket(Bucket=good)
        s3_server.delete_bucket(good)

    long_ok = "/".join(["s" * 200] * 6)[:1024]
    for key in ("a" * 255, long_ok):
        c.put_object(Bucket=b, Key=key, Body=b"1")
    for key, code in (("a" * 256, "KeyTooLongError"), (long_ok + "x", "KeyTooLongError"), ("p/../q", "InvalidRequest")):
        with pytest.raises(botocore.exceptions.ClientError) as ei:
            c.put_object(Bucket=b, Key=key, Body=b"1")
        assert _code(ei.value)[0] == code, key
    c.put_object(Bucket=b, Key="p/a//b", Body=b"2")
    assert [o["Key"] for o in c.list_objects_v2(Bucket=b, Prefix="p/")["Contents"]] == ["p/a/b"]
    assert c.get_object(Bucket=b, Key="p/a/b")["Body"].read() == b"2"
