"""Opening shard urls, the bottom of ``mmpretrain.data``: local paths, ``file://``, ``pipe:COMMAND`` and
remote fsspec urls (``s3://``, ``https://``, ``gs://``, ``hf://`` ...), with timeouts, retries with
backoff, and the count of retries. Every other module of the package reads its bytes through here;
this one imports none of them.

At 1,000+ shards streamed for hours, transient network errors are certain. :func:`read_tar`
(mmpretrain/data/tar.py) retries a remote shard that fails to open or breaks mid-read: it re-opens
the shard at the byte offset of the first sample not yet delivered (a range request; fsspec's files
seek), or, where the stream cannot seek (gzipped shards), re-reads it and skips the samples already
delivered -- so each sample is delivered once and the stream's position stays exact. Each retry is
logged (url, attempt, error) and counted (:func:`take_retries`); a shard that still fails after
``retries`` attempts raises, and the stream counts it ``unreadable_shard`` with the url and error in
the log. Malformed tar data (bad header fields) is not retried: reading it again gives the same bytes.

The options are an argument (``remote``: a :class:`~mmpretrain.config.base.RemoteConfig`, the one type of
them): the trainer passes ``data.remote`` to the sources, which carry it to every read of their shards,
sidecars, keep-lists and teacher rows; evaluation and ``data_tools`` read with the defaults.
Local paths and ``pipe:`` commands are read as before, without retries.
"""

from __future__ import annotations

import logging
import time
from typing import IO, Any

from webdataset.gopen import gopen

from mmpretrain.config.base import RemoteConfig

log = logging.getLogger(__name__)


class MalformedTar(ValueError):
    """Header fields that do not parse: the bytes are wrong, reading them again gives the same (never
    retried)."""


def is_local(path: str) -> bool:
    return "://" not in path


def shard_path(url: str) -> str:
    """The path part a ``sizes.json`` (or a sidecar) is looked up beside: the url, the last word of a
    ``pipe:`` command, without ``file://``."""
    if url.startswith("pipe:"):
        return url[5:].split()[-1]
    return url.removeprefix("file://")


def open_url(url: str, remote: RemoteConfig | None = None) -> IO[bytes]:
    """A binary stream for a shard url (local, file://, pipe:, or any fsspec url; ``remote``: the
    options a remote one is opened with, default :data:`DEFAULT_REMOTE`)."""
    if url.startswith("pipe:") or is_local(url.removeprefix("file://")):
        return gopen(url.removeprefix("file://"), "rb")
    return open_remote(url, remote)  # data.remote's timeouts and storage options


# what evaluation and data_tools read with; the trainer passes data.remote
DEFAULT_REMOTE = RemoteConfig()
_retries = 0


def take_retries() -> int:
    """Retries made in this process since the last call (the stream adds them to its ``io`` counts)."""
    global _retries
    n, _retries = _retries, 0
    return n


def is_remote(url: str) -> bool:
    return not url.startswith(("pipe:", "file://")) and "://" in url


def fs_kwargs(url: str, opts: RemoteConfig | None = None) -> dict[str, Any]:
    """fsspec keyword arguments for ``url``: the timeout in each filesystem's own spelling, and the
    filesystem's own retries off where it has them (botocore's), so that retries are ours: counted,
    logged, with one backoff."""
    opts = opts or DEFAULT_REMOTE
    protocol = url.split("://", 1)[0]
    kw: dict[str, Any] = {}
    if protocol in ("http", "https"):
        import aiohttp

        kw["client_kwargs"] = {"timeout": aiohttp.ClientTimeout(total=None, sock_connect=opts.timeout,
                                                                sock_read=opts.timeout)}
    elif protocol in ("s3", "s3a"):
        kw["config_kwargs"] = {"connect_timeout": opts.timeout, "read_timeout": opts.timeout,
                               "retries": {"max_attempts": 1, "mode": "standard"}}
    for k, v in opts.storage_options.items():
        if isinstance(v, dict) and isinstance(kw.get(k), dict):
            kw[k] = {**kw[k], **v}
        else:
            kw[k] = v
    return kw


def open_remote(url: str, opts: RemoteConfig | None = None) -> IO[bytes]:
    import fsspec

    try:
        of = fsspec.open(url, "rb", **fs_kwargs(url, opts))
        if hasattr(of.fs, "retries") and "s3" in of.fs.protocol:
            of.fs.retries = 1  # s3fs's own silent retry loop off: retries are ours (counted, logged)
        return of.open()
    except ImportError as e:  # fsspec names the missing package (s3fs, gcsfs, aiohttp...)
        raise ImportError(f"{url}: {e} (s3:// and https:// need pip install 'simpretrain[remote]')") from None


def _chain(e: BaseException):
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _error_code(link: BaseException) -> str | None:
    """botocore's error code (``e.response["Error"]["Code"]``); None for errors without one (the
    ``response`` of other libraries' errors is an object, not botocore's dict)."""
    response = getattr(link, "response", None)
    return response.get("Error", {}).get("Code") if isinstance(response, dict) else None


def missing_object(e: BaseException) -> bool:
    """The object is not there: HTTP 404/410, S3 NoSuchKey/NoSuchBucket, or a FileNotFoundError that no
    network error caused (fsspec's HTTP filesystem reports *any* failed HEAD-then-GET, a 503 too, as
    FileNotFoundError, so the cause decides)."""
    for link in _chain(e):
        status = getattr(link, "status", None)
        code = _error_code(link)
        if status in (404, 410) or code in ("NoSuchKey", "NoSuchBucket", "404"):
            return True
        if isinstance(status, int) or code is not None:
            return False  # another HTTP status: transient (503, 500, 429 ...)
    causes = list(_chain(e))[1:]
    if isinstance(e, FileNotFoundError):
        return not causes or all(isinstance(c, FileNotFoundError) for c in causes)
    return False


def retryable(e: BaseException) -> bool:
    """Transient: everything a network read raises (OSError, timeouts, the HTTP client's and botocore's
    errors, 5xx answers, a stream cut short); not malformed tar data, which is the same when re-read,
    a missing object, refused credentials or a missing filesystem package."""
    if not isinstance(e, Exception) or isinstance(e, (MalformedTar, PermissionError, ImportError)):
        return False
    return not (missing_object(e) or _refused(e))


# credentials that are absent or rejected: a retry gets the same answer
_CREDENTIAL_ERRORS = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"}
_REFUSED_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "403", "401"}


def _refused(e: BaseException) -> bool:
    for link in _chain(e):
        if type(link).__name__ in _CREDENTIAL_ERRORS or getattr(link, "status", None) in (401, 403):
            return True
        if _error_code(link) in _REFUSED_CODES:
            return True
    return False


def describe(e: BaseException) -> str:
    """The error and what caused it, in one line (fsspec wraps an HTTP 503 in a FileNotFoundError)."""
    parts = []
    for link in list(_chain(e))[:3]:
        text = f"{type(link).__name__}: {link}".strip().rstrip(":")
        if not parts or str(link) not in parts[-1]:
            parts.append(text)
    return " <- ".join(parts)[:500]


def retry_wait(url: str, attempt: int, error: BaseException, opts: RemoteConfig) -> None:
    global _retries
    _retries += 1
    wait = opts.delay(attempt)
    log.warning("%s: %s; retry %d/%d in %.1f s", url, describe(error), attempt, opts.retries, wait)
    time.sleep(wait)
