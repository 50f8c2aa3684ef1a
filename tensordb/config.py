"""Where a store lives and how it behaves; read once at ``connect``."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from storage_engine import shm_root
from tensordb.errors import InvalidInput

__all__ = ["Config", "TOKEN_FILE_ENV", "env_token", "read_token_file"]

#: a file holding the cluster's token (read instead of $TENSORDB_TOKEN when that is unset):
#: a token in a file does not show in /proc/PID/cmdline or the environment of the process
TOKEN_FILE_ENV = "TENSORDB_TOKEN_FILE"


def read_token_file(path: str | os.PathLike[str]) -> str:
    """The token in the file at ``path``: its text without the surrounding whitespace
    (a final newline). InvalidInput when it cannot be read or is empty."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise InvalidInput(f"cannot read the token file {os.fspath(path)!r}: {reason}") \
            from None
    token = text.strip()
    if not token:
        raise InvalidInput(f"the token file {os.fspath(path)!r} is empty")
    return token


def env_token() -> str | None:
    """The token the environment gives: $TENSORDB_TOKEN, else the file
    $TENSORDB_TOKEN_FILE names, else None (an empty variable counts as unset)."""
    token = os.environ.get("TENSORDB_TOKEN")
    if token:
        return token
    path = os.environ.get(TOKEN_FILE_ENV)
    return read_token_file(path) if path else None


def _env_int(name: str, default: int | None) -> int | None:
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else default


@dataclass(frozen=True, slots=True)
class Config:
    """Settings of one store. ``Config.resolve`` fills defaults from the environment.

    home          the embedded store's directory ($TENSORDB_HOME, else ./.tensordb)
    catalog_url   SQLAlchemy URL of the catalog (default: SQLite in home)
    node          this host's node name ("local" for the embedded store)
    data_dir      the disk tier's directory (default: home/data)
    shm_dir       the host tier's directory in /dev/shm, named after the store
    default_tier  where commits write unless told otherwise: "host" or "disk"
    host_capacity bytes the host tier may hold (None: what /dev/shm allows)
    spare_bytes   size of the pre-faulted spare a writing process keeps (0: none until
                  ``prefault`` asks for one)
    pool_bytes    bytes of freed host-tier files kept for later writes, shared by the
                  store's processes (None: a quarter of the host's memory, at most
                  host_capacity; 0: none) ($TENSORDB_POOL_BYTES)
    lease_ttl     seconds after which a lease held on another host lapses without renewal
    sqlite_synchronous  SQLite's synchronous pragma for the catalog (FULL: a commit
                  survives power loss)
    gpu_device    the CUDA ordinal this process writes GPU-tier segments to (None: the
                  GPU tier is only read, opened when a row points at it)
    gpu_capacity  bytes the GPU tier may hold on this host (None: what the device has)
    token         the cluster's token, sent to other nodes ($TENSORDB_TOKEN, else the
                  file $TENSORDB_TOKEN_FILE names)
    tls_ca        the CA bundle (PEM file) this process trusts for nodes that serve TLS;
                  given, every node is reached over TLS ($TENSORDB_TLS_CA, else none:
                  clear text)
    node_timeout  seconds a dead or silent node may take to fail a request
                  ($TENSORDB_NODE_TIMEOUT, else 5)
    scrub_interval  the least seconds between the starts of two rounds of the store's
                  background scrub, which one process per host runs (0: no background
                  scrub) ($TENSORDB_SCRUB_INTERVAL, else 60)
    scrub_rate    bytes a second a scrub reads at most ($TENSORDB_SCRUB_RATE, else 256 MB)
    scrub_cpu     the share of one core the background scrub may use (0: no background
                  scrub) ($TENSORDB_SCRUB_CPU, else 0.05)
    """

    home: Path
    catalog_url: str
    node: str = "local"
    data_dir: Path = field(default=Path())
    shm_dir: Path = field(default=Path())
    default_tier: str = "host"
    host_capacity: int | None = None
    spare_bytes: int = 0
    pool_bytes: int | None = None
    lease_ttl: float = 300.0
    sqlite_synchronous: str = "FULL"
    gpu_device: int | None = None
    gpu_capacity: int | None = None
    token: str | None = None
    tls_ca: Path | None = None
    node_timeout: float = 5.0
    scrub_interval: float = 60.0
    scrub_rate: int = 256_000_000
    scrub_cpu: float = 0.05

    @classmethod
    def resolve(cls, url: str | None = None, *, home: str | os.PathLike[str] | None = None,
                node: str | None = None, data_dir: str | os.PathLike[str] | None = None,
                **overrides: object) -> Config:
        home_p = Path(home or os.environ.get("TENSORDB_HOME") or ".tensordb").resolve()
        if data_dir is not None:
            data_p = Path(data_dir).resolve()
        else:
            data_p = home_p / "data"
        if url is None:
            url = f"sqlite:///{home_p / 'catalog.db'}"
        # name the shared-memory area after the store: its directory and its catalog
        ident = hashlib.blake2b(f"{data_p}|{url}".encode(), digest_size=6).hexdigest()
        shm = shm_root() / f"tensordb-{home_p.name.strip('.') or 'store'}-{ident}"
        kw: dict[str, object] = {
            "host_capacity": _env_int("TENSORDB_HOST_CAPACITY", None),
            "spare_bytes": _env_int("TENSORDB_SPARE_BYTES", 0),
            "pool_bytes": _env_int("TENSORDB_POOL_BYTES", None),
            "default_tier": os.environ.get("TENSORDB_DEFAULT_TIER", "host"),
            "gpu_device": _env_int("TENSORDB_GPU_DEVICE", None),
            "gpu_capacity": _env_int("TENSORDB_GPU_CAPACITY", None),
            # a token given wins: a broken $TENSORDB_TOKEN_FILE must not fail it
            "token": overrides["token"] if "token" in overrides else env_token(),
            "tls_ca": Path(os.environ["TENSORDB_TLS_CA"]).resolve()
            if os.environ.get("TENSORDB_TLS_CA") else None,
            "node_timeout": float(os.environ.get("TENSORDB_NODE_TIMEOUT") or 5.0),
            "scrub_interval": float(os.environ.get("TENSORDB_SCRUB_INTERVAL") or 60.0),
            "scrub_rate": _env_int("TENSORDB_SCRUB_RATE", 256_000_000),
            "scrub_cpu": float(os.environ.get("TENSORDB_SCRUB_CPU") or 0.05),
        }
        kw.update(overrides)
        return cls(home=home_p, catalog_url=url, node=node or "local", data_dir=data_p,
                   shm_dir=shm, **kw)  # type: ignore[arg-type]
