"""Hub failures as engine errors (a stable code each), and the one place that maps the
huggingface_hub client's exceptions onto them. The client is imported by `hub_errors`, the
first time a Hub call is made: a local merge that names no Hub source never loads it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, TypeVar

from engine.errors import DiskFull, EngineError, is_disk_full

if TYPE_CHECKING:
    from huggingface_hub.errors import HfHubHTTPError


class HubError(EngineError):
    code = "hub_error"
    http_status = 502  # what the API answers when this happens at submit time


class HubRepoNotFound(HubError):
    code = "hub_repo_not_found"
    http_status = 422


class HubRevisionNotFound(HubError):
    code = "hub_revision_not_found"
    http_status = 422


class HubFileMissing(HubError):
    code = "hub_file_missing"
    http_status = 422


class HubGated(HubError):
    code = "hub_gated"
    http_status = 403


class HubUnauthorized(HubError):
    code = "hub_unauthorized"
    http_status = 403


class HubRateLimited(HubError):
    code = "hub_rate_limited"
    http_status = 503


class HubUnavailable(HubError):
    code = "hub_unavailable"
    http_status = 503


class HubTimeout(HubError):
    """The Hub stopped answering a request, or answered it too slowly (core/hub/timeouts.py).
    Not retried: a stuck Hub would only hold the job longer."""

    code = "hub_timeout"
    http_status = 504


class HubRejected(HubError):
    """The Hub refused the request as malformed (HTTP 400, 413, 422): asking again would get the
    same answer, so it is not retried."""

    code = "hub_rejected"
    http_status = 502


class HubNotSafetensors(HubError):
    code = "hub_not_safetensors"
    http_status = 422


class UnknownCredential(HubError):
    code = "unknown_credential"
    http_status = 422


@contextmanager
def hub_errors(what: str) -> Iterator[None]:
    """Translate the client's exceptions raised inside into HubErrors about `what` (a repo, a
    file). The client's messages can be long and name URLs; ours are short and never hold a
    token (the client never puts one in a message)."""
    # huggingface_hub (timeouts.py too): loaded by the first Hub call, not by importers
    from huggingface_hub import errors as hf

    from core.hub.timeouts import HubStalled, install

    install()  # every Hub request goes through here: its session is a bounded one
    unreachable: tuple[type[BaseException], ...] = (OSError, *_transport_errors())
    try:
        yield
    except HubStalled as e:
        raise HubTimeout(f"{what}: {e}") from None
    except hf.GatedRepoError:  # before RepositoryNotFoundError: it is a subclass
        raise HubGated(f"{what}: gated repository; the credential has no access to it") from None
    except hf.RepositoryNotFoundError:
        raise HubRepoNotFound(
            f"{what}: repository not found (or private, and the credential cannot see it)"
        ) from None
    except hf.RevisionNotFoundError:
        raise HubRevisionNotFound(f"{what}: revision not found") from None
    except hf.EntryNotFoundError:
        raise HubFileMissing(f"{what}: file not found in the repository") from None
    except hf.HfHubHTTPError as e:
        raise _http_error(what, e) from None
    except RuntimeError as e:  # how the client reports a failed LFS upload, the cause inside
        cause = e.__cause__
        if cause is None or not isinstance(cause, (hf.HfHubHTTPError, HubStalled, *unreachable)):
            raise
        with hub_errors(f"{what}: {e}".rstrip(".")):
            raise cause from None
    except unreachable as e:
        if is_disk_full(e):  # our disk, not the Hub: retrying would fail the same way
            where = getattr(e, "filename", None) or what
            raise DiskFull.at(where, f"{what} into the Hub cache") from None
        raise HubUnavailable(f"{what}: the Hub is unreachable ({type(e).__name__})") from None


def _http_error(what: str, error: HfHubHTTPError) -> HubError:
    """The HubError for an HTTP error answer (an HfHubHTTPError), by its status."""
    status = error.response.status_code if error.response is not None else None
    if status == 429:
        return HubRateLimited(f"{what}: rate limited by the Hub; try again later")
    if status in (401, 403):
        return HubUnauthorized(f"{what}: the credential is not allowed to do this")
    if status in (400, 413, 422):
        reason = getattr(error, "server_message", None) or "no reason given"
        return HubRejected(f"{what}: the Hub refused it (HTTP {status}: {reason})")
    return HubUnavailable(f"{what}: the Hub answered HTTP {status}")


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The client's HTTP library's errors (httpx2 in huggingface_hub 2.x)."""
    found: list[type[BaseException]] = []
    for module in ("httpx2", "httpx"):
        try:
            found.append(__import__(module).TransportError)
        except (ImportError, AttributeError):
            continue
    return tuple(found)


T = TypeVar("T")
TRIES = 4  # of one Hub step while the Hub rate-limits us or is briefly unreachable
_log = logging.getLogger("layerswap.hub")


def retrying(call: Callable[[], T], *, what: str, first_pause_s: float) -> T:
    """`call`, tried again with exponential backoff (from `first_pause_s`, doubled) while the
    Hub rate-limits (its Retry-After is honoured by the client) or is away."""
    pause = first_pause_s
    for attempt in range(1, TRIES + 1):
        try:
            return call()
        except (HubRateLimited, HubUnavailable) as e:
            if attempt == TRIES:
                raise
            _log.warning("%s: %s; retrying in %.1f s", what, e.message, pause)
            time.sleep(pause)
            pause *= 2
    raise AssertionError("unreachable")
