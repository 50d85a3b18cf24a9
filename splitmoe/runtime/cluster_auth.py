"""Who may call the services, and how their links are protected: the cluster secret and TLS.

Every RPC of the attention and expert services carries the cluster secret in its metadata
(`authorization: Bearer <secret>`): clients get channels that add it to every call, and a server
interceptor compares it in constant time, answering UNAUTHENTICATED otherwise. One method is open:
the standard health `Check`, because Docker, Kubernetes and `splitmoe healthcheck` probe it and
cannot carry a secret, and it tells only SERVING or not (llama-server keeps /health open the same
way). `Watch`, a stream that holds a server thread for as long as the caller likes, is not open.

A service with no secret admits every caller, so it may listen on loopback only
(`check_listen`); `splitmoe up` always hands its children one.

TLS is optional, for links that cross hosts: a server given a certificate and key listens with TLS
only; a client given a CA verifies servers against it (and presents its own certificate, when it
has one); a server given a CA also requires clients to present a certificate signed by it.

No torch here: the gateway imports this module.
"""
from __future__ import annotations

import collections
import hmac
import ipaddress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import grpc

METADATA_KEY = "authorization"
OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check"})
MIN_TOKEN_CHARS = 16
REFUSED = "missing or wrong cluster secret (SPLITMOE_CLUSTER_TOKEN or --cluster-token-file)"
ChannelOptions = Sequence[tuple[str, object]]


def read_secret_file(path: Path, what: str) -> str:
    """A secret kept in a file (one line; surrounding whitespace dropped), or one clear error."""
    try:
        text = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{what} {path}: {getattr(e, 'strerror', None) or e}") from None
    if not text:
        raise ValueError(f"{what} {path}: the file is empty")
    return text


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name, or 0.0.0.0 / :: (every interface)


@dataclass(frozen=True, slots=True)
class ClusterSecurity:
    """The cluster secret and TLS material of one process, loaded at the edge (`load`)."""

    token: str = field(default="", repr=False)        # empty: no secret (loopback only)
    tls_cert: bytes = field(default=b"", repr=False)  # PEM: this process's certificate chain
    tls_key: bytes = field(default=b"", repr=False)   # PEM: its private key
    tls_ca: bytes = field(default=b"", repr=False)    # PEM: the CA that signs the cluster's certificates

    def __post_init__(self) -> None:
        if self.token and len(self.token) < MIN_TOKEN_CHARS:
            raise ValueError(f"the cluster secret has {len(self.token)} characters: use at least "
                             f"{MIN_TOKEN_CHARS} (e.g. `openssl rand -hex 32`)")
        if self.token and not all(" " < c <= "~" for c in self.token):
            raise ValueError("the cluster secret must be printable ASCII without spaces (it travels in gRPC metadata)")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")

    @classmethod
    def load(cls, env_token: str = "", token_file: Path | None = None, tls_cert: Path | None = None,
             tls_key: Path | None = None, tls_ca: Path | None = None) -> "ClusterSecurity":
        """From the command line's files, else the environment's secret."""
        token = read_secret_file(token_file, "--cluster-token-file") if token_file else env_token.strip()
        return cls(token, _read_pem(tls_cert, "--tls-cert"), _read_pem(tls_key, "--tls-key"),
                   _read_pem(tls_ca, "--tls-ca"))

    def describe_server(self) -> str:
        """One line for a server's log: what its callers must present (never the secret itself)."""
        secret = "the cluster secret required" if self.token else "no cluster secret (every local user may call)"
        tls = ("TLS with client certificates" if self.tls_ca else "TLS") if self.tls_cert else "plaintext"
        return f"{secret}, {tls}"

    # ---- servers --------------------------------------------------------------------------------

    def check_listen(self, host: str) -> None:
        """Without a secret a service admits every caller: only ones on this host, then."""
        if not self.token and not is_loopback(host):
            raise ValueError(f"--host {host}: listening beyond loopback needs the cluster secret "
                             "(set SPLITMOE_CLUSTER_TOKEN or --cluster-token-file)")

    def server_interceptors(self) -> list[grpc.ServerInterceptor]:
        return [_RequireToken(self.token)] if self.token else []

    def aio_server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [_AioRequireToken(self.token)] if self.token else []

    def add_port(self, server, address: str) -> int:
        """Listen on `address` (TLS when this process has a certificate); the bound port, 0 on failure."""
        if not self.tls_cert:
            return server.add_insecure_port(address)
        credentials = grpc.ssl_server_credentials([(self.tls_key, self.tls_cert)],
                                                  root_certificates=self.tls_ca or None,
                                                  require_client_auth=bool(self.tls_ca))
        return server.add_secure_port(address, credentials)

    # ---- clients --------------------------------------------------------------------------------

    def channel(self, address: str, options: ChannelOptions = (), server_name: str = "") -> grpc.Channel:
        """A channel whose every call carries the secret; TLS when this process has a CA.

        server_name: the name the server's certificate must carry, when it is not the host dialed
        (a service name resolved to one address per replica)."""
        options = self._options(options, server_name)
        if self.tls_ca:
            channel = grpc.secure_channel(address, self._channel_credentials(), options=options)
        else:
            channel = grpc.insecure_channel(address, options=options)
        return grpc.intercept_channel(channel, _SendToken(self.token)) if self.token else channel

    def aio_channel(self, address: str, options: ChannelOptions = ()) -> grpc.aio.Channel:
        """`channel` for asyncio clients; open it inside the event loop that will use it."""
        interceptors = _aio_send_token(self.token) if self.token else None
        options = self._options(options, "")
        if self.tls_ca:
            return grpc.aio.secure_channel(address, self._channel_credentials(), options=options,
                                           interceptors=interceptors)
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)

    def _options(self, options: ChannelOptions, server_name: str) -> list[tuple[str, object]]:
        options = list(options)
        if self.tls_ca and server_name:
            options.append(("grpc.ssl_target_name_override", server_name))
        return options

    def _channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.tls_ca, private_key=self.tls_key or None,
                                            certificate_chain=self.tls_cert or None)


def _read_pem(path: Path | None, flag: str) -> bytes:
    if path is None:
        return b""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"{flag} {path}: {e.strerror}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{flag} {path}: not a PEM file")
    return data


# ---- the server side: one check, for the thread-pool and the asyncio servers ------------------------

class _TokenCheck:
    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    def allows(self, details: grpc.HandlerCallDetails) -> bool:
        if details.method in OPEN_METHODS:
            return True
        presented = next((v for k, v in details.invocation_metadata or () if k == METADATA_KEY), "")
        presented = presented.encode() if isinstance(presented, str) else presented
        return hmac.compare_digest(presented, self._expected)


def _refusing(handler: grpc.RpcMethodHandler, refuse) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED before reading anything."""
    codecs = dict(request_deserializer=handler.request_deserializer,
                  response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse, **codecs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, **codecs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse, **codecs)
    return grpc.unary_unary_rpc_method_handler(refuse, **codecs)


def _refuse(request, context: grpc.ServicerContext):
    context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSED)


async def _aio_refuse(request, context: grpc.aio.ServicerContext):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSED)


class _RequireToken(grpc.ServerInterceptor):
    def __init__(self, token: str):
        self._check = _TokenCheck(token)

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or self._check.allows(details):
            return handler
        return _refusing(handler, _refuse)


class _AioRequireToken(grpc.aio.ServerInterceptor):
    def __init__(self, token: str):
        self._check = _TokenCheck(token)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or self._check.allows(details):
            return handler
        return _refusing(handler, _aio_refuse)


# ---- the client side: the secret added to every call ----------------------------------------------

class _CallDetails(collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials",
                                                           "wait_for_ready", "compression")),
                   grpc.ClientCallDetails):
    pass


class _SendToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                 grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str):
        self._header = (METADATA_KEY, f"Bearer {token}")

    def _with_token(self, d: grpc.ClientCallDetails) -> _CallDetails:
        return _CallDetails(d.method, d.timeout, (*(d.metadata or ()), self._header), d.credentials,
                            d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._with_token(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._with_token(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._with_token(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._with_token(client_call_details), request_iterator)


class _AioWithToken:
    """asyncio channels file an interceptor under the first call kind it implements, so each
    kind gets its own class (made below); they share this."""

    def __init__(self, token: str):
        self._header = (METADATA_KEY, f"Bearer {token}")

    def _with_token(self, d: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(d.metadata or ()), self._header)
        return grpc.aio.ClientCallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready)

    async def _intercept(self, continuation, client_call_details, request_or_iterator):
        return await continuation(self._with_token(client_call_details), request_or_iterator)


_AIO_KINDS = tuple(
    type(f"_Aio{kind}", (_AioWithToken, getattr(grpc.aio, f"{kind}ClientInterceptor")),
         {f"intercept_{method}": _AioWithToken._intercept})
    for kind, method in (("UnaryUnary", "unary_unary"), ("UnaryStream", "unary_stream"),
                         ("StreamUnary", "stream_unary"), ("StreamStream", "stream_stream")))


def _aio_send_token(token: str) -> list[_AioWithToken]:
    return [kind(token) for kind in _AIO_KINDS]
