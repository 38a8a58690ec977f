"""What is refused before any work is done: who may listen without a key, what a browser may
reach, and request fields that no route can honour.

- Bind: an empty or wildcard host listens on every interface, so it is not loopback, and a
  daemon without an API key refuses to start there (unless --insecure-no-auth).
- Browsers: a web page can make the browser send requests to a loopback daemon. A request whose
  `Host` is neither an IP literal, `localhost`, the bound host, nor a name in --allowed-hosts is
  refused (DNS rebinding: an attacker's name resolving to 127.0.0.1); a request carrying an
  `Origin` other than the daemon's own is refused unless --allowed-origins names it; a POST with
  a body must say `application/json` (a cross-site form can only send text/plain, urlencoded or
  multipart without asking first).
- Fields: a session id must be printable, single-line and short (it goes back in a response
  header and into the records); a seed must fit 64 signed bits; tools / tool_choice may nest
  only so deep (walking deeper JSON recursed out of the stack).

Every generating route calls these; this module knows nothing of sessions, engines or models.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

MAX_SESSION_ID = 256
MAX_NESTING = 64
SEED_RANGE = (-(2**63), 2**63 - 1)
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]", "*")


class Refused(Exception):
    """A request refused before any work: status, message, OpenAI error type, param, code."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None, type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_


# -- bind ---------------------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    """True only for addresses no other machine can reach; "" and wildcards bind everything."""
    if host in WILDCARD_HOSTS:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# -- browsers -----------------------------------------------------------------------------


def _names(value: str) -> set[str]:
    return {name.strip().lower() for name in value.split(",") if name.strip()}


def _hostname(netloc: str) -> str:
    """"name:port" or "[v6]:port" -> the host part, lower case."""
    return (urlsplit("//" + netloc).hostname or "").lower()


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def host_allowed(host_header: str, bound_host: str, allowed_hosts: str) -> bool:
    allowed = _names(allowed_hosts)
    if "*" in allowed:
        return True
    name = _hostname(host_header)
    # an IP literal cannot be rebound: the page that sent it has that very origin
    return bool(name) and (_is_ip(name) or name == "localhost" or name == bound_host.lower() or name in allowed)


def origin_allowed(origin: str, host_header: str, allowed_origins: str) -> bool:
    allowed = _names(allowed_origins)
    if "*" in allowed or origin.lower().rstrip("/") in allowed:
        return True
    parts = urlsplit(origin)
    return parts.scheme in ("http", "https") and parts.netloc.lower() == host_header.lower()  # same origin


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def browser_refusal(scope: dict, config) -> Refused | None:
    """The refusal for an HTTP request a browser could have been made to send, or None."""
    headers = {}
    for key, value in scope.get("headers", ()):
        headers.setdefault(key.decode("latin-1").lower(), value.decode("latin-1"))
    host = headers.get("host")
    if host is not None and not host_allowed(host, config.host, config.allowed_hosts):
        return Refused(403, f"Host {host!r} is not this server's: add it with --allowed-hosts", code="host_not_allowed")
    origin = headers.get("origin")
    if origin is not None and not origin_allowed(origin, host or "", config.allowed_origins):
        return Refused(403, f"requests from {origin!r} are not allowed: add it with --allowed-origins", code="origin_not_allowed")
    if scope.get("method") == "POST":
        content_type = headers.get("content-type")
        has_body = headers.get("content-length", "0") not in ("0", "") or "transfer-encoding" in headers
        if (content_type is not None or has_body) and not _is_json(content_type or ""):
            return Refused(415, "the body must be JSON, sent as Content-Type: application/json", code="unsupported_media_type")
    return None


# -- fields -------------------------------------------------------------------------------


def session_id_problem(session_id: str) -> str | None:
    """Why `session_id` cannot be used (it is echoed in a header and recorded), or None."""
    if len(session_id) > MAX_SESSION_ID:
        return f"session ids are at most {MAX_SESSION_ID} characters"
    if not session_id.isascii() or not session_id.isprintable() or session_id != session_id.strip():
        return "session ids are printable ASCII without leading or trailing spaces"
    return None


def nesting_problem(value, limit: int = MAX_NESTING) -> str | None:
    """Why `value` (decoded JSON) nests too deep, or None; iterative, so any depth is safe."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return f"nested more than {limit} levels deep"
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return None
