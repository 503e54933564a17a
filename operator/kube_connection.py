"""Where the API server is and how to authenticate to it: in-cluster, kubeconfig, or a test URL.

The `kubernetes` package finds the credentials (service-account token, CA,
kubeconfig contexts, exec plugins, client certificates written to temp files);
the operator only keeps its Configuration and asks it for a fresh bearer token
on every request: its refresh hooks re-read rotated service-account tokens
and re-run exec plugins when their credentials expire. kopf authenticates
from the same Connection (main.py), so both talk to the same server as the
same identity.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Connection:
    """An API server endpoint and its credentials."""

    server: str
    ca_path: str | None = None
    insecure: bool = False
    cert_path: str | None = None
    key_path: str | None = None
    # Returns "Bearer <token>" (or None): called per request so rotated tokens are used.
    authorization: Callable[[], str | None] = field(default=lambda: None)
    # Re-reads credentials after a 401 (a new kubeconfig load); a no-op by default.
    reload: Callable[[], Connection] | None = None

    def headers(self) -> Mapping[str, str]:
        value = self.authorization()
        return {"Authorization": value} if value else {}

    def refresh(self) -> None:
        """Pick up new credentials after the server said 401."""
        if self.reload is None:
            return
        fresh = self.reload()
        self.ca_path, self.insecure = fresh.ca_path, fresh.insecure
        self.cert_path, self.key_path = fresh.cert_path, fresh.key_path
        self.authorization = fresh.authorization

    def ssl_context(self) -> ssl.SSLContext | bool:
        if not self.server.startswith("https://"):
            return False
        if self.insecure:
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        else:
            context = ssl.create_default_context(cafile=self.ca_path)
        if self.cert_path is not None:
            context.load_cert_chain(self.cert_path, self.key_path)
        return context

    @property
    def token(self) -> tuple[str | None, str | None]:
        """(scheme, token) of the current Authorization value, as kopf wants them."""
        value = self.authorization()
        if not value:
            return None, None
        scheme, _, token = value.partition(" ")
        return (scheme, token) if token else (None, scheme)

    @classmethod
    def discover(cls) -> Connection:
        """In-cluster service account if there is one, else the current kubeconfig context."""
        import kubernetes.client
        import kubernetes.config

        config = kubernetes.client.Configuration()
        try:
            kubernetes.config.load_incluster_config(client_configuration=config)
        except kubernetes.config.ConfigException:
            try:
                kubernetes.config.load_kube_config(client_configuration=config)
            except kubernetes.config.ConfigException as error:
                raise RuntimeError(
                    "no Kubernetes credentials: not in a pod with a service account, "
                    f"and no usable kubeconfig ({error})"
                ) from None
        return cls._from_configuration(config)

    @classmethod
    def _from_configuration(cls, config: Any) -> Connection:
        def authorization() -> str | None:
            # kubernetes >= 36 keeps the token under BearerToken, older ones under authorization;
            # either call runs the refresh hook of in-cluster and exec credentials.
            return config.get_api_key_with_prefix("BearerToken") or config.get_api_key_with_prefix(
                "authorization"
            )

        return cls(
            server=config.host,
            ca_path=config.ssl_ca_cert,
            insecure=not config.verify_ssl,
            cert_path=config.cert_file,
            key_path=config.key_file,
            authorization=authorization,
            reload=cls.discover,
        )
