"""Bounded retries of remote storage requests (object stores and other fsspec filesystems).

Object stores fail in passing: 500/503 answers, ``SlowDown`` throttling, reset connections,
requests that hang. Clients retry some of that themselves (s3fs and botocore do, with their
own counts); what they cannot give is a bound on a request that hangs, an error that names
the checkpoint file, and a retry of a request that failed after their own retries. Every
remote operation of :class:`~ckpt_integration.storage.filesystem.Storage` goes through
:func:`call`:

* each attempt has a deadline (``CKPT_INTEGRATION_IO_TIMEOUT`` seconds, default 120; enforced
  for asynchronous fsspec filesystems such as s3fs, gcsfs, adlfs, whose request is cancelled);
* transient failures (timeouts, connection errors, throttling, 5xx answers) are retried up to
  ``CKPT_INTEGRATION_IO_ATTEMPTS`` attempts in all (default 4), waiting a random time up to
  ``CKPT_INTEGRATION_IO_BACKOFF`` seconds (default 1) doubled after every attempt, at most 30 s;
* then :class:`CheckpointWriteError` / :class:`CheckpointReadError` names the object, the
  number of attempts and the time spent. Permanent failures (missing object, access denied,
  invalid request) are not retried.

Only idempotent whole-object requests are retried (read a range, list, stat, put a whole
object, delete): repeating them cannot change the outcome. A write that timed out may still
take effect at the server later; the commit protocol tolerates that (a late data object is
not part of any commit; a late ``metadata.json`` of a failed save names files that the
manifest check finds missing, so the directory loads as damaged, never as wrong data).
"""

from __future__ import annotations

import errno as _errno
import logging
import os
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar

from ..errors import CheckpointingException, CheckpointReadError, CheckpointWriteError

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

logger = logging.getLogger(__name__)

ATTEMPTS_ENV = "CKPT_INTEGRATION_IO_ATTEMPTS"
TIMEOUT_ENV = "CKPT_INTEGRATION_IO_TIMEOUT"
BACKOFF_ENV = "CKPT_INTEGRATION_IO_BACKOFF"
MAX_BACKOFF_S = 30.0

T = TypeVar("T")

# errnos of transient failures (s3fs: SlowDown / ServiceUnavailable -> EBUSY, InternalError -> EREMOTEIO)
_TRANSIENT_ERRNOS = {_errno.EBUSY, _errno.EAGAIN, _errno.ETIMEDOUT, _errno.ECONNRESET, _errno.ECONNABORTED,
                     _errno.ECONNREFUSED, _errno.EPIPE, _errno.EHOSTUNREACH, _errno.ENETUNREACH,
                     getattr(_errno, "EREMOTEIO", 121)}
_TRANSIENT_WORDS = ("slowdown", "slow down", "reduce your request rate", "throttl", "serviceunavailable",
                    "service unavailable", "internalerror", "internal error", "timed out", "timeout",
                    "connection reset", "connection aborted", "server disconnected", "connection closed",
                    "broken pipe", "too many requests", "requesttimeout")


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long a remote request is tried (see the module doc for the defaults)."""

    attempts: int = 4
    timeout: float = 120.0
    backoff: float = 1.0

    @staticmethod
    def from_env() -> "RetryPolicy":
        def number(name: str, default: float, cast: Callable[[str], Any]) -> Any:
            raw = os.environ.get(name, "").strip()
            if not raw:
                return default
            try:
                value = cast(raw)
            except ValueError:
                raise CheckpointingException(f"{name}={raw!r} is not a number") from None
            if value < (1 if cast is int else 0):
                raise CheckpointingException(f"{name}={raw!r} is out of range")
            return value

        return RetryPolicy(number(ATTEMPTS_ENV, 4, int), number(TIMEOUT_ENV, 120.0, float),
                           number(BACKOFF_ENV, 1.0, float))

    def wait(self, attempt: int) -> float:
        """Seconds to wait after failed attempt ``attempt`` (1-based): full jitter, exponential, capped."""
        return random.uniform(0, min(MAX_BACKOFF_S, self.backoff * 2 ** (attempt - 1)))


def _chain(e: BaseException):
    seen = 0
    while e is not None and seen < 16:
        yield e
        e = e.__cause__ or e.__context__
        seen += 1


def is_transient(e: BaseException) -> bool:
    """Whether a failed request may succeed when repeated (timeout, connection, throttling, 5xx)."""
    if isinstance(e, (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError,
                      CheckpointingException)):
        return False
    for x in _chain(e):
        if isinstance(x, (TimeoutError, ConnectionError)):
            return True
        response = getattr(x, "response", None)  # botocore ClientError
        if isinstance(response, dict):
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            code = str((response.get("Error") or {}).get("Code", ""))
            if (isinstance(status, int) and (status >= 500 or status == 429)) or "Throttl" in code or code in (
                    "SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable"):
                return True
        if isinstance(x, OSError) and x.errno in _TRANSIENT_ERRNOS:
            return True
        name = type(x).__name__
        if name in ("ClientConnectionError", "ClientOSError", "ServerDisconnectedError", "ClientPayloadError",
                    "ConnectionClosedError", "EndpointConnectionError", "ReadTimeoutError", "ConnectTimeoutError",
                    "ResponseStreamingError", "IncompleteRead", "ServerTimeoutError"):
            return True
        text = str(x).lower()
        if any(w in text for w in _TRANSIENT_WORDS):
            return True
    return False


def _supports_timeout(fs: AbstractFileSystem, fn: Callable[..., object]) -> bool:
    """The blocking methods that fsspec derives from an asynchronous filesystem's coroutines
    (s3fs, gcsfs, adlfs ...) take ``timeout=`` (the coroutine is cancelled when it passes)."""
    import inspect

    return not getattr(fs, "asynchronous", False) and inspect.iscoroutinefunction(getattr(fn, "__wrapped__", None))


def call(fs: AbstractFileSystem, method: str, path: str, *args: object, write: bool = False, what: str = "",
         **kwargs: object) -> Any:
    """``getattr(fs, method)(path, *args, **kwargs)`` with per-attempt deadlines and bounded retries.

    ``write`` picks the error type (:class:`CheckpointWriteError` or :class:`CheckpointReadError`)
    raised when the attempts are spent; ``what`` says what the object is, for the message.
    """
    policy = RetryPolicy.from_env()
    fn = getattr(fs, method)
    if policy.timeout > 0 and _supports_timeout(fs, fn):
        kwargs["timeout"] = policy.timeout
    start = time.monotonic()
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn(path, *args, **kwargs)
        except Exception as e:  # noqa: BLE001 - classified below
            if not is_transient(e):
                raise
            if attempt >= policy.attempts:
                raise gave_up(e, path, attempt, time.monotonic() - start, write, what) from e
            delay = policy.wait(attempt)
            logger.warning("%s %s failed (attempt %d of %d): %s; retrying in %.1fs", method, path, attempt,
                           policy.attempts, _reason(e), delay)
            time.sleep(delay)


def _reason(e: BaseException) -> str:
    if type(e).__name__ == "FSTimeoutError" or (isinstance(e, TimeoutError) and not str(e)):
        return "no answer within the deadline (timed out)"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def gave_up(e: BaseException, path: str, attempts: int, seconds: float, write: bool,
            what: str = "") -> CheckpointingException:
    """The error raised when every attempt of a request to ``path`` failed."""
    cls = CheckpointWriteError if write else CheckpointReadError
    verb = "writing" if write else "reading"
    label = f"{what} " if what else ""
    out = cls(f"{verb} {label}{path} failed after {attempts} attempt(s) in {seconds:.1f}s "
              f"({ATTEMPTS_ENV}, {TIMEOUT_ENV}): {_reason(e)}")
    out.errno = getattr(e, "errno", None) or _errno.EIO
    out.path = path
    return out


def stream_failed(e: BaseException, path: str) -> CheckpointingException:
    """The error raised when a streamed (multipart) upload of ``path`` failed: its parts are
    retried by the storage client (s3fs, botocore: their own retry settings), not here."""
    out = CheckpointWriteError(f"writing {path} failed (a streamed multipart upload, whose parts the storage "
                               f"client retries by its own settings; the upload was aborted): {_reason(e)}")
    out.errno = getattr(e, "errno", None) or _errno.EIO
    out.path = path
    return out


__all__ = ["RetryPolicy", "call", "gave_up", "stream_failed", "is_transient", "ATTEMPTS_ENV", "TIMEOUT_ENV", "BACKOFF_ENV"]
