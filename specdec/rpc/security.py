"""Transport security and authentication, shared by the three services.

- TLS or mutual TLS from certificate paths (PEM files), for servers and for the
  coordinator's channels to the drafter and the verifier.
- Optional bearer-token auth on the public API: the token comes from an
  environment variable or a file (a Kubernetes Secret mounts as either), and a
  missing or wrong `authorization: Bearer ...` header gets UNAUTHENTICATED.
  Health checks stay open, since probes carry no token.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import pathlib
from dataclasses import dataclass

import grpc

log = logging.getLogger(__name__)

HEALTH_PREFIX = "/grpc.health.v1.Health/"


def _read(path: str | None, what: str) -> bytes | None:
    if not path:
        return None
    try:
        return pathlib.Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {what} {path!r}: {exc.strerror}") from exc


@dataclass(frozen=True)
class ServerTls:
    """A server's certificate and key; with `client_ca`, clients must present a
    certificate signed by it (mutual TLS)."""
    cert: str
    key: str
    client_ca: str | None = None

    def credentials(self) -> grpc.ServerCredentials:
        pair = (_read(self.key, "TLS key"), _read(self.cert, "TLS certificate"))
        ca = _read(self.client_ca, "client CA")
        return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)

    @classmethod
    def from_args(cls, cert: str | None, key: str | None, client_ca: str | None) -> "ServerTls | None":
        if not cert and not key:
            if client_ca:
                raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
            return None
        if not (cert and key):
            raise ValueError("--tls-cert and --tls-key go together")
        return cls(cert, key, client_ca)


@dataclass(frozen=True)
class ClientTls:
    """How to reach a TLS server: the CA that signed it and, for mutual TLS,
    this client's own certificate and key."""
    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca, "CA"), private_key=_read(self.key, "TLS key"),
            certificate_chain=_read(self.cert, "TLS certificate"))

    @classmethod
    def from_args(cls, ca: str | None, cert: str | None, key: str | None) -> "ClientTls | None":
        if bool(cert) != bool(key):
            raise ValueError("a client certificate and its key go together")
        return cls(ca, cert, key) if (ca or cert) else None


def load_token(env: str | None = None, file: str | None = None) -> str | None:
    """The bearer token from the named environment variable or a file, if either is given."""
    if env and file:
        raise ValueError("give the auth token through an environment variable or a file, not both")
    if env:
        token = os.environ.get(env, "")
        source = f"environment variable {env}"
    elif file:
        token = (_read(file, "auth token file") or b"").decode("utf-8")
        source = f"file {file}"
    else:
        return None
    token = token.strip()
    if not token:
        raise ValueError(f"the auth token from {source} is empty")
    return token


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """UNAUTHENTICATED unless the call carries `authorization: Bearer <token>`."""

    def __init__(self, token: str):
        self._expected = token.encode("utf-8")

    def _authorized(self, metadata) -> bool:
        value = next((v for k, v in metadata or () if k == "authorization"), None)
        if not isinstance(value, str) or not value.startswith("Bearer "):
            return False
        return hmac.compare_digest(value[len("Bearer "):].encode("utf-8"), self._expected)

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(HEALTH_PREFIX) or \
                self._authorized(handler_call_details.invocation_metadata):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:
            return None

        def deny(request_or_iterator, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "missing or wrong bearer token: send metadata 'authorization: Bearer <token>'")

        def deny_stream(request_or_iterator, context):
            deny(request_or_iterator, context)
            yield  # never reached: abort raises

        # The same shape as the real handler, so a streaming call is refused as a stream.
        make, fn = ((grpc.unary_unary_rpc_method_handler, deny) if handler.unary_unary else
                    (grpc.unary_stream_rpc_method_handler, deny_stream) if handler.unary_stream else
                    (grpc.stream_unary_rpc_method_handler, deny) if handler.stream_unary else
                    (grpc.stream_stream_rpc_method_handler, deny_stream))
        return make(fn, handler.request_deserializer, handler.response_serializer)


class BearerToken(grpc.AuthMetadataPlugin):
    """Client side: adds the bearer token to every call."""

    def __init__(self, token: str):
        self._token = token

    def __call__(self, context, callback) -> None:
        callback((("authorization", f"Bearer {self._token}"),), None)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def warn_if_token_in_clear(host: str, tls: ServerTls | None, token: str | None, uds: str | None = None) -> None:
    """A bearer token over plaintext off loopback can be read off the network; a
    server off loopback with no authentication at all serves anyone who reaches it."""
    if token is None and (tls is None or tls.client_ca is None) and not uds and not is_loopback(host):
        log.warning("serving %s without authentication: anyone who can reach this address can generate with the "
                    "model. Require a bearer token (--auth-token-env / --auth-token-file, with TLS) or client "
                    "certificates (--tls-client-ca), or bind 127.0.0.1.", host)
    if token is not None and tls is None and not uds and not is_loopback(host):
        log.warning("serving a bearer token over plaintext on %s: anyone on the network path can read it and "
                    "replay it. Serve TLS (--tls-cert, --tls-key) or bind 127.0.0.1 behind a TLS-terminating proxy.",
                    host)


def private_socket_dir(path: str) -> pathlib.Path:
    """The directory a Unix domain socket goes in, created private (0700) if missing.
    Who can enter it can call the service: that is the access control of sidecar mode."""
    directory = pathlib.Path(path).expanduser().resolve().parent
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    return directory


def refuse_if_exposed(service: str, host: str, tls: ServerTls | None, uds: str | None = None,
                      token: str | None = None) -> None:
    """Drafter and verifier are meant for a private Unix socket (sidecar mode) or
    for loopback with the coordinator's bearer token; off loopback they need mutual
    TLS or that token, or they refuse to start (ValueError)."""
    if uds:
        directory = private_socket_dir(uds)
        mode = directory.stat().st_mode & 0o777
        if mode & 0o077:
            log.warning("%s serves unix:%s in %s with mode %o: other local users may reach it and use the model. "
                        "Put the socket in a directory of mode 0700.", service, uds, directory, mode)
        return
    mutual = tls is not None and tls.client_ca is not None
    if not is_loopback(host) and not mutual and token is None:
        raise ValueError(
            f"{service} would bind {host} without mutual TLS or a bearer token: anyone who reaches it could read "
            "sessions and use the model. Serve a Unix socket in a private directory (--uds, sidecar mode), or pass "
            "--tls-cert, --tls-key and --tls-client-ca, or --auth-token-env/--auth-token-file (and the same token "
            "to the coordinator's --backend-auth-token-env/--backend-auth-token-file)")
    if not mutual and token is None:
        log.warning("%s on %s takes calls from any local user (they could start sessions and fill its KV cache): "
                    "pass --auth-token-env (and the coordinator --backend-auth-token-env), or serve --uds in a "
                    "private directory", service, host)


def caller_identity(context: grpc.ServicerContext) -> str:
    """Who a call authenticated as: its client certificate's identity (mutual TLS),
    else a digest of its bearer token, else "" (no authentication: every caller is
    the same one). What one caller may learn of another's requests is scoped by it."""
    peers = context.peer_identities()
    if peers:
        return "x509:" + ",".join(p.decode("utf-8", "replace") for p in peers)
    token = next((v for k, v in context.invocation_metadata() or () if k == "authorization"), None)
    if isinstance(token, str) and token:
        return "bearer:" + hashlib.sha256(token.encode("utf-8")).hexdigest()[:16]
    return ""
