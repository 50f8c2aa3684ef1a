"""TLS for the node server and its clients: Flight over ``grpc+tls``, the data plane
and the metrics endpoint over TLS sockets, all from one certificate and key.

A server is given a certificate chain and its key (``tensordb serve --tls-cert F
--tls-key F``); a client trusts a CA bundle (``connect(tls_ca=F)``, $TENSORDB_TLS_CA;
a node reaching other nodes trusts the same). The certificate must name the host the
clients dial (the node's advertised address): clients check it as browsers do. A
client that trusts a CA speaks TLS to every node, and a server with a certificate
speaks nothing else: a clear-text client is refused at the handshake.

Runs in the serving process (``ServerTLS``) and in every process that calls a node
(``client_context``, ``read_ca``).
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from pathlib import Path

from tensordb.errors import InvalidInput

__all__ = ["ServerTLS", "client_context", "read_ca"]


def _read(kind: str, path: str | os.PathLike[str]) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise InvalidInput(f"cannot read the TLS {kind} {os.fspath(path)!r}: "
                           f"{exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise InvalidInput(f"the TLS {kind} {os.fspath(path)!r} holds no PEM block")
    return data


def read_ca(path: str | os.PathLike[str]) -> bytes:
    """The PEM bundle of the CA at ``path`` (InvalidInput when it cannot be read or
    holds no certificate a TLS context takes)."""
    pem = _read("CA bundle", path)
    try:
        ssl.create_default_context(cadata=pem.decode("ascii"))
    except (ssl.SSLError, ValueError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"the TLS CA bundle {os.fspath(path)!r} holds no usable "
                           f"certificate: {exc}") from None
    return pem


def client_context(ca_pem: bytes) -> ssl.SSLContext:
    """A client context that trusts ``ca_pem`` only and checks the server's name."""
    ctx = ssl.create_default_context(cadata=ca_pem.decode("ascii"))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


@dataclass(frozen=True, slots=True)
class ServerTLS:
    """A server's certificate chain and key: their files, and their PEM as read (what
    Flight takes); ``load`` reads and checks them."""

    cert_path: Path
    key_path: Path
    cert_pem: bytes
    key_pem: bytes

    @classmethod
    def load(cls, cert: str | os.PathLike[str], key: str | os.PathLike[str]) -> ServerTLS:
        """Read ``cert`` and ``key``; InvalidInput naming the file when either cannot be
        read or the two are no pair."""
        tls = cls(Path(cert), Path(key), _read("certificate", cert), _read("key", key))
        try:
            tls.context()
        except ssl.SSLError as exc:
            raise InvalidInput(f"the TLS certificate {os.fspath(cert)!r} and key "
                               f"{os.fspath(key)!r} are no usable pair: {exc}") from None
        return tls

    def context(self) -> ssl.SSLContext:
        """A server context for the data plane and the metrics endpoint."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert_path, self.key_path)
        return ctx
