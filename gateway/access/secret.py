"""Key secrets: how they are made, hashed and read from a request.

Only SHA-256 hashes are stored (config, Redis); a presented secret is hashed and looked up
by its hash, so the comparison never touches the secret itself and any timing it leaks
speaks about a hash an attacker cannot invert.
"""

from __future__ import annotations

import hashlib
import secrets

SECRET_PREFIX = "sk-gw-"
MAX_SECRET_BYTES = 512  # longer bearer values are refused unhashed


def hash_secret(secret: str | bytes) -> str:
    """Hex SHA-256 of the secret, as written in ``auth.keys[].sha256``."""
    data = secret.encode() if isinstance(secret, str) else secret
    return hashlib.sha256(data).hexdigest()


def new_secret() -> str:
    """A fresh secret: 256 random bits, URL-safe, recognisable by its prefix."""
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def bearer(authorization: bytes | None) -> bytes | None:
    """The token of an ``Authorization: Bearer TOKEN`` header value, else None."""
    if not authorization or len(authorization) > MAX_SECRET_BYTES + 16:
        return None
    scheme, _, token = authorization.strip().partition(b" ")
    token = token.strip()
    if scheme.lower() != b"bearer" or not token:
        return None
    return token
