"""S3 fixtures for the storage tests: a real SeaweedFS server per test process (see s3server.py)."""

from tests.fixtures.s3server import s3_bucket, s3_server

__all__ = ["s3_bucket", "s3_server"]
