"""API-key check shared by the HTTP and gRPC front doors: `Authorization: Bearer <key>`.

Keys are compared in constant time (hmac.compare_digest against every configured key, so neither the
match position nor which key matched shows in the timing). Keys and the header are never logged or
echoed in an error message.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

BEARER = "Bearer "


def is_authorized(authorization: str | None, api_keys: Sequence[str]) -> bool:
    """Whether the Authorization value carries one of `api_keys` (always True when no key is configured)."""
    if not api_keys:
        return True
    if not authorization or not authorization.startswith(BEARER):
        return False
    given = authorization[len(BEARER):].strip().encode("utf-8", "surrogateescape")
    matched = False
    for key in api_keys:  # no early exit: every key is compared
        matched |= hmac.compare_digest(given, key.encode("utf-8", "surrogateescape"))
    return matched
