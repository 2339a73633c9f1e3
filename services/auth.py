"""Bearer-token authentication mapped to roles, with a per-RPC allow-list.

Tokens are compared in constant time: each known token is kept as its SHA-256 digest and a presented
token's digest is compared with every one of them by `hmac.compare_digest`, so neither the position
of the first wrong byte nor which token matched shows in the time a refusal takes.
"""

import hashlib
import hmac
import pathlib
from collections.abc import Sequence

import grpc
import yaml

from services.config import AuthConfig


class Denied(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class Authorizer:
    """Decides whether a call may proceed. Roles come from tokens; the allow-list maps RPCs to roles.

    Rule lookup: the full method ('/pkg.Service/Method'), then the service ('pkg.Service'), then '*'.
    A method with no rule is open to every authenticated caller.
    """

    def __init__(self, config: AuthConfig):
        tokens = dict(config.tokens)
        if config.tokens_file:
            extra = yaml.safe_load(pathlib.Path(config.tokens_file).read_text()) or {}
            tokens.update({str(k): str(v) for k, v in extra.items()})
        self._digests = [(_digest(token), role) for token, role in tokens.items()]
        self.allow = {key: set(roles) for key, roles in config.allow.items()}
        self.open_methods = set(config.open_methods)

    def role_of(self, token: str) -> str | None:
        """The role of `token`, or None; every known token is compared, in constant time each."""
        presented = _digest(token)
        role = None
        for digest, candidate in self._digests:
            if hmac.compare_digest(digest, presented):
                role = candidate
        return role

    def roles_for(self, method: str) -> set[str] | None:
        service = method.lstrip("/").rpartition("/")[0]
        for key in (method, service, "*"):
            if key in self.allow:
                return self.allow[key]
        return None

    def check(self, method: str, metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
        """Return the caller's role (None for an open method); raise Denied otherwise."""
        if method in self.open_methods:
            return None
        header = next((v for k, v in metadata or () if k == "authorization"), None)
        if header is None:
            raise Denied(grpc.StatusCode.UNAUTHENTICATED, "missing 'authorization: Bearer <token>' metadata")
        header = header.decode() if isinstance(header, bytes) else header
        scheme, _, token = header.partition(" ")
        role = self.role_of(token)
        if scheme.lower() != "bearer" or role is None:
            raise Denied(grpc.StatusCode.UNAUTHENTICATED, "invalid bearer token")
        allowed = self.roles_for(method)
        if allowed is not None and role not in allowed:
            raise Denied(
                grpc.StatusCode.PERMISSION_DENIED,
                f"role '{role}' may not call {method} (allowed: {', '.join(sorted(allowed))})",
            )
        return role


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()
