"""Who may talk to the server, and in what form: checked on every request before any route runs.

Without --api-key, any web page the user visits can reach a server on localhost: it can POST a
"simple" cross-origin request (text/plain: no CORS preflight), and DNS rebinding can point a name
the page controls at 127.0.0.1 so that even reading the answers is same-origin. So, like Ollama,
a server without an API key answers only requests whose Host names this machine (localhost and
*.localhost, 127.0.0.1, ::1, or the --host address it listens on) and, when a browser sends an
Origin, whose Origin names such a host too (403 otherwise); --allowed-hosts adds names, '*' any.
With --api-key the key is the gate (a page cannot know it) and the Host/Origin checks are off.

A POST body must be declared `Content-Type: application/json` (415 otherwise): a browser cannot send
that cross-origin without a preflight, which this server never grants. --any-content-type turns
this check off for clients that omit the header (`curl -d` sends form encoding).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from urllib.parse import urlsplit

from minfer_jax.server.openai_format import error_body

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARD_ADDRESSES = frozenset({"", "0.0.0.0", "::"})  # --host values that name no one address
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def host_name(value: str) -> str:
    """'LocalHost.:8080' -> 'localhost', '[::1]:80' -> '::1': the name a Host or Origin gives."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    if value.count(":") == 1:  # name:port (a bare IPv6 address has more colons)
        value = value.split(":")[0]
    return value.rstrip(".")


@dataclasses.dataclass(frozen=True)
class AccessPolicy:
    allowed_hosts: frozenset[str] | None = LOOPBACK_NAMES  # None: any Host and Origin
    json_only: bool = True  # POST bodies must be application/json

    @classmethod
    def build(
        cls,
        *,
        api_key: str | None,
        listen_host: str,
        extra_hosts: Iterable[str] = (),
        any_content_type: bool = False,
    ) -> AccessPolicy:
        extra = {host_name(h) for h in extra_hosts if h.strip()}
        if api_key is not None or "*" in extra:
            return cls(allowed_hosts=None, json_only=not any_content_type)
        listen = host_name(listen_host)
        own = set() if listen in WILDCARD_ADDRESSES else {listen}
        return cls(
            allowed_hosts=frozenset(LOOPBACK_NAMES | own | extra), json_only=not any_content_type
        )

    def _host_allowed(self, name: str) -> bool:
        return (
            self.allowed_hosts is None or name in self.allowed_hosts or name.endswith(".localhost")
        )

    def refusal(self, method: str, headers: dict[str, str]) -> tuple[int, str, str] | None:
        """(status, message, error type) for a request this policy refuses; None to let it
        through."""
        host = headers.get("host")
        if host is not None and not self._host_allowed(host_name(host)):
            return (
                403,
                (
                    f"Host {host!r} is not allowed: without --api-key this server answers only "
                    "requests addressed to this machine by a loopback name or its --host address "
                    "(--allowed-hosts adds names)"
                ),
                "permission_error",
            )
        origin = headers.get("origin")
        if (
            origin is not None
            and self.allowed_hosts is not None
            and not self._host_allowed(_origin_host(origin))
        ):
            return (
                403,
                (
                    f"Origin {origin!r} is not allowed: without --api-key this server answers "
                    "only pages served from this machine (--allowed-hosts adds names)"
                ),
                "permission_error",
            )
        if self.json_only and method in BODY_METHODS:
            kind = headers.get("content-type", "").split(";")[0].strip().lower()
            if kind != "application/json":
                return (
                    415,
                    (
                        f"Content-Type must be application/json, got {kind or 'none'!r} (send the "
                        "header 'Content-Type: application/json'; --any-content-type accepts any)"
                    ),
                    "invalid_request_error",
                )
        return None


def _origin_host(origin: str) -> str:
    try:
        return host_name(urlsplit(origin).netloc) if origin.strip().lower() != "null" else "null"
    except ValueError:
        return ""


class AccessGuard:
    """ASGI middleware applying an AccessPolicy before the app sees the request."""

    def __init__(self, app, policy: AccessPolicy):
        self.app, self.policy = app, policy

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = {
                k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]
            }
            refused = self.policy.refusal(scope["method"], headers)
            if refused is not None:
                status, message, kind = refused
                body = json.dumps(error_body(message, kind)).encode()
                await send(
                    {
                        "type": "http.response.start",
                        "status": status,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
