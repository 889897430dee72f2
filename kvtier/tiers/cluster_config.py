"""Configuration of the cluster tier (:class:`~kvtier.tiers.cluster.ClusterTier`).

Validated like every kvtier configuration (frozen, unknown keys rejected, any
invalid value a :class:`~kvtier.errors.ConfigurationError` naming the field).
It lives beside the tier until it is wired into
:class:`~kvtier.config.KVTierConfig`. The password is a
:class:`pydantic.SecretStr`: its ``repr`` and ``str`` are masked, so a logged
or printed configuration never shows it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import ByteSize, Field, SecretStr, field_validator, model_validator

from kvtier.config import Bytes, _Frozen

__all__ = ["ClusterMode", "ClusterTierConfig"]

ClusterMode = Literal["cluster", "single"]

_NODE = r"^[A-Za-z0-9_.\-\[\]:]{1,255}:[0-9]{1,5}$"


class ClusterTierConfig(_Frozen):
    """A tier on a Valkey/Redis cluster (or one server) shared by many instances."""

    nodes: tuple[Annotated[str, Field(pattern=_NODE)], ...] = Field(min_length=1)
    """``"host:port"`` of the servers to start from: any nodes of a cluster (the
    client learns the rest), or the one server with ``mode="single"``."""
    mode: ClusterMode = "cluster"
    """``cluster``: Redis Cluster protocol (slots, MOVED/ASK); ``single``: one
    server, not in cluster mode."""
    tenant_prefix: str = Field(default="kvtier", pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    """First part of every key: separates tenants sharing one cluster. Letters,
    digits, ``_``, ``.``, ``-`` only (never ``{``, ``}`` or ``:``, which would
    change slot hashing or the key layout)."""
    username: str | None = Field(default=None, min_length=1, max_length=256)
    """ACL user (``AUTH username password``); None for the default user."""
    password: SecretStr | None = None
    """Password of the user; never logged (masked in ``repr``)."""
    tls: bool = False
    """Connect with TLS."""
    tls_ca_file: Path | None = None
    """CA bundle that verifies the servers' certificates (system default if None)."""
    tls_cert_file: Path | None = None
    """Client certificate, for servers that require one (``tls-auth-clients``)."""
    tls_key_file: Path | None = None
    """Private key of ``tls_cert_file``."""
    tls_check_hostname: bool = True
    """Check that the certificate names the host connected to."""
    timeout_s: float = Field(default=2.0, gt=0, le=600)
    """Bound on one pipeline (send and replies) and on socket reads: a pipeline
    that takes longer fails its blocks with ``ETIMEDOUT``."""
    connect_timeout_s: float = Field(default=1.0, gt=0, le=600)
    """Bound on opening one connection."""
    max_inflight_bytes: Bytes = Field(default=ByteSize(8 << 20))
    """Value bytes in one pipeline on one connection (at least one block goes):
    pipelines above about 8 MiB per connection slowed SET by 2-4x here."""
    pipelines_per_node: int = Field(default=2, ge=1, le=64)
    """Pipelines in flight at once to one node, each on its own connection."""
    backoff_initial_s: float = Field(default=0.05, gt=0, le=60)
    """First wait before talking again to a node that failed."""
    backoff_max_s: float = Field(default=2.0, gt=0, le=600)
    """Longest wait between tries (the wait doubles per failure up to it)."""
    presence_capacity: int = Field(default=1 << 20, ge=1, le=1 << 30)
    """Keys remembered as present by this instance (least recently used dropped
    first): what :meth:`~kvtier.tiers.cluster.ClusterTier.lookup` answers from."""

    @field_validator("tls_ca_file", "tls_cert_file", "tls_key_file")
    @classmethod
    def _readable(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_file():
            raise ValueError(f"{value} is not a readable file")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ClusterTierConfig:
        if self.mode == "single" and len(self.nodes) != 1:
            raise ValueError('mode="single" takes exactly one node')
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if not self.tls and any(
            f is not None for f in (self.tls_ca_file, self.tls_cert_file, self.tls_key_file)
        ):
            raise ValueError("TLS files are given but tls is false")
        if self.username is not None and self.password is None:
            raise ValueError("username needs a password")
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError("backoff_max_s is below backoff_initial_s")
        return self

    def addresses(self) -> list[tuple[str, int]]:
        """``(host, port)`` of every node in :attr:`nodes`."""
        out = []
        for node in self.nodes:
            host, _, port = node.rpartition(":")
            out.append((host.strip("[]"), int(port)))
        return out
