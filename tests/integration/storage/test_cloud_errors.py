"""How ``gs://`` and ``az://`` classify the services' answers that the emulators cannot produce
(429 / 503 throttling, 401 / 403 on GCS): the client libraries' own exception classes, built as
the libraries build them from a response, go through each backend's translation and then the
retry layer's decision (``storage.retry.is_transient``). No server: the backends are created
against an endpoint that is never contacted (in tests/integration: building an Azure client starts a
subprocess, which the unit tier's process guard refuses)."""

from __future__ import annotations

import errno

import pytest

from unickpt.errors import StorageError, TransientStorageError
from unickpt.storage import StorageOptions
from unickpt.storage.retry import is_transient


@pytest.fixture
def gcs(monkeypatch):
    pytest.importorskip("google.cloud.storage")
    from unickpt.storage.gcs import GcsStorage

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9")
    return GcsStorage("bkt/ck", StorageOptions())


@pytest.fixture
def azure():
    pytest.importorskip("azure.storage.blob")
    from unickpt.storage.azure import AzureBlobStorage

    cs = "DefaultEndpointsProtocol=http;AccountName=a;AccountKey=QUFBQQ==;BlobEndpoint=http://127.0.0.1:9/a;"
    return AzureBlobStorage("cont/ck", StorageOptions(client_options={"connection_string": cs}))


@pytest.mark.parametrize(
    "kind,transient,code",
    [
        ("TooManyRequests", True, errno.EIO),
        ("ServiceUnavailable", True, errno.EIO),
        ("InternalServerError", True, errno.EIO),
        ("GatewayTimeout", True, errno.EIO),
        ("Forbidden", False, errno.EACCES),
        ("Unauthorized", False, errno.EACCES),
        ("BadRequest", False, errno.EPROTO),
    ],
)
def test_issue42_gcs_http_answers_are_classified(gcs, kind, transient, code):
    from google.api_core import exceptions as gx

    err = gcs._translate("download", "x", getattr(gx, kind)("from the service"))
    assert isinstance(err, StorageError) and err.errno == code and "gs://bkt/ck/x" in str(err)
    assert isinstance(err, TransientStorageError) == transient == is_transient(err)


def test_issue42_gcs_connection_reset_is_transient(gcs):
    import requests

    err = gcs._translate("download", "x", requests.exceptions.ConnectionError("reset by peer"))
    assert isinstance(err, TransientStorageError) and err.errno == errno.ECONNRESET and is_transient(err)


@pytest.mark.parametrize(
    "status,code,transient,want",
    [
        (429, "", True, errno.EIO),
        (503, "ServerBusy", True, errno.EIO),
        (500, "InternalError", True, errno.EIO),
        (403, "AuthorizationPermissionMismatch", False, errno.EACCES),
        (404, "ContainerNotFound", False, errno.ENOENT),
        (400, "InvalidHeaderValue", False, errno.EPROTO),
    ],
)
def test_issue42_azure_http_answers_are_classified(azure, status, code, transient, want):
    from azure.core.exceptions import HttpResponseError

    e = HttpResponseError(message="from the service")
    e.status_code, e.error_code = status, code
    err = azure._translate("Get Blob", "x", e)
    assert err.errno == want and "az://cont/ck/x" in str(err)
    assert isinstance(err, TransientStorageError) == transient == is_transient(err)


def test_issue42_azure_connection_failure_is_transient(azure):
    from azure.core.exceptions import ServiceRequestError

    err = azure._translate("Get Blob", "x", ServiceRequestError("connection reset"))
    assert isinstance(err, TransientStorageError) and err.errno == errno.ECONNRESET and is_transient(err)
