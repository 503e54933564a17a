"""The operator's settings: flags of `tandem operator`, each with an environment-variable default.

Light on purpose: `tandem --help` builds every subcommand's parser, so this
module imports nothing beyond the standard library (no kopf, no Kubernetes
client, no pydantic). Precedence: flag, then TANDEM_OPERATOR_<NAME>, then the
built-in default, so a Helm chart can set everything through `env:`.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tandem import __version__
from tandem.redaction import check_redis_url

ENV_PREFIX = "TANDEM_OPERATOR_"
DEFAULT_ENGINE_IMAGE = f"ghcr.io/tandem-serving/engine:{__version__}"
DEFAULT_REDIS_URL = "redis://tandem-redis:6379/0"
# HPA's sync period: the cadence the scaling rules (docs/autoscaling.md) are tuned for.
DEFAULT_SCRAPE_INTERVAL_S = 15.0
DEFAULT_PEERING_NAME = "tandem-operator"
# The user the engine image runs as (engine_image/Dockerfile).
DEFAULT_ENGINE_RUN_AS_USER = 10001
# --engine-run-as-user's spelling of "set no user": the platform assigns one (OpenShift).
NO_USER = "none"
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# A Secret's name is a DNS-1123 subdomain. Here (standard library only) so that the
# spec's imagePullSecrets (spec.py) and the operator's default share one rule.
SECRET_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
SECRET_NAME_RULE = (
    "a Secret name (a DNS-1123 subdomain) has at most 253 lowercase letters, digits, "
    "'-' and '.', and each part between dots starts and ends with a letter or digit"
)


@dataclass(frozen=True)
class OperatorSettings:
    """Everything the operator reads from its command line and environment."""

    # Engine image for ModelDeployments that leave spec.image out.
    engine_image: str = DEFAULT_ENGINE_IMAGE
    # docker-registry Secrets the engine pods pull with, for ModelDeployments that leave
    # spec.imagePullSecrets out; looked up in each model's own namespace.
    engine_image_pull_secrets: tuple[str, ...] = ()
    # User, group and fsGroup of the engine pods; None: none set, so that a platform that
    # assigns them (OpenShift's restricted-v2 SCC, which refuses ids outside the
    # namespace's range) may. runAsNonRoot stays either way.
    engine_run_as_user: int | None = DEFAULT_ENGINE_RUN_AS_USER
    # Redis for ModelDeployments that leave spec.redis out; also where the
    # autoscaler reads queue depths from.
    redis_url: str = DEFAULT_REDIS_URL
    # Redis key prefix the engines and the gateway share (`--key-prefix`).
    key_prefix: str = "tandem"
    # Namespaces served; empty: every namespace (cluster-wide).
    namespaces: tuple[str, ...] = ()
    # Seconds between autoscaler evaluations (and full resyncs) of each ModelDeployment.
    scrape_interval_s: float = DEFAULT_SCRAPE_INTERVAL_S
    # Seconds one engine's /metrics may take before it counts as unreadable.
    scrape_timeout_s: float = 2.0
    # kopf peering object: replicas sharing it elect one active operator.
    peering_name: str = DEFAULT_PEERING_NAME
    # Higher wins; a replica with a lower priority stands by until the higher is gone.
    priority: int = 0
    # Without peering (one replica only, or local development).
    standalone: bool = False
    # e.g. http://0.0.0.0:8080/healthz for the pod's liveness probe; None: no endpoint.
    liveness_endpoint: str | None = None

    def __post_init__(self) -> None:
        if not self.engine_image:
            raise ValueError("engine image must not be empty")
        for i, name in enumerate(self.engine_image_pull_secrets):
            if not is_secret_name(name):
                raise ValueError(
                    f"engine image pull secret {name!r} is not a Secret name: {SECRET_NAME_RULE}"
                )
            if name in self.engine_image_pull_secrets[:i]:
                raise ValueError(f"engine image pull secret {name!r} is given twice")
        if self.engine_run_as_user is not None:
            _check_user_id(self.engine_run_as_user)
        check_redis_url(self.redis_url, "the operator's Redis URL (--redis-url)")
        for namespace in self.namespaces:
            if not _NAMESPACE.fullmatch(namespace) or len(namespace) > 63:
                raise ValueError(f"not a namespace name: {namespace!r}")
        if not self.scrape_interval_s > 0:
            raise ValueError(f"scrape interval must be > 0 seconds, got {self.scrape_interval_s}")
        if not self.scrape_timeout_s > 0:
            raise ValueError(f"scrape timeout must be > 0 seconds, got {self.scrape_timeout_s}")
        if not self.standalone and not self.peering_name:
            raise ValueError("a peering name is needed unless the operator runs standalone")

    @property
    def clusterwide(self) -> bool:
        return not self.namespaces


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `tandem operator` flags. Defaults are None: `from_args` applies env and built-ins."""

    def flag(name: str, field: str, text: str, **kwargs: Any) -> None:
        parser.add_argument(name, dest=field, help=f"{text} [{env_name(field)}]", **kwargs)

    flag(
        "--engine-image",
        "engine_image",
        f"engine image of specs without spec.image (default {DEFAULT_ENGINE_IMAGE})",
    )
    flag(
        "--engine-image-pull-secret",
        "engine_image_pull_secrets",
        "Secret (in each model's namespace) the engine pods pull with when spec.imagePullSecrets "
        "is unset; repeat for more, comma-separated in the variable (default: none)",
        action="append",
    )
    flag(
        "--engine-run-as-user",
        "engine_run_as_user",
        "user id (also group and fsGroup) of the engine pods, never 0; "
        f"{NO_USER!r}: set none, the platform picks one, as OpenShift does "
        f"(default {DEFAULT_ENGINE_RUN_AS_USER})",
    )
    flag(
        "--redis-url",
        "redis_url",
        f"Redis of specs without spec.redis (default {DEFAULT_REDIS_URL})",
    )
    flag(
        "--key-prefix",
        "key_prefix",
        "Redis key prefix shared with engines and gateway (default tandem)",
    )
    flag(
        "--namespace",
        "namespaces",
        "serve this namespace; repeat for more, comma-separated "
        "in the variable (default: all namespaces)",
        action="append",
    )
    flag(
        "--scrape-interval",
        "scrape_interval_s",
        f"seconds between autoscaler evaluations (default {DEFAULT_SCRAPE_INTERVAL_S:g})",
        type=float,
    )
    flag(
        "--scrape-timeout",
        "scrape_timeout_s",
        "seconds one engine's /metrics may take (default 2)",
        type=float,
    )
    flag(
        "--peering-name",
        "peering_name",
        f"kopf peering object the operator replicas share (default {DEFAULT_PEERING_NAME})",
    )
    flag(
        "--priority",
        "priority",
        "peering priority: the highest live replica acts, the others stand by (default 0)",
        type=int,
    )
    flag(
        "--standalone",
        "standalone",
        "no peering: one replica only, or local development",
        action="store_true",
        default=None,
    )
    flag(
        "--liveness",
        "liveness_endpoint",
        "serve a liveness probe at this URL, e.g. http://0.0.0.0:8080/healthz",
    )
    parser.add_argument("--verbose", action="store_true", help="debug logging")


def from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> OperatorSettings:
    """Settings from parsed flags, falling back to TANDEM_OPERATOR_* variables, then defaults."""
    env = os.environ if env is None else env
    values: dict[str, object] = {}
    for name, convert in _FIELDS.items():
        flag = getattr(args, name, None)
        variable = env_name(name)
        raw = env.get(variable)
        if isinstance(flag, str):
            # A flag without an argparse type (its value may be None): read here.
            option = "--" + name.removesuffix("_s").replace("_", "-")
            try:
                values[name] = convert(flag)
            except ValueError as error:
                raise ValueError(f"{option}: {error}") from None
        elif flag is not None:
            values[name] = tuple(flag) if isinstance(flag, list) else flag
        elif raw not in (None, ""):
            try:
                values[name] = convert(raw)
            except ValueError as error:
                raise ValueError(f"{variable}: {error}") from None
    return OperatorSettings(**values)  # type: ignore[arg-type]


def env_name(field: str) -> str:
    """A setting's environment variable: scrape_interval_s -> TANDEM_OPERATOR_SCRAPE_INTERVAL."""
    return ENV_PREFIX + field.upper().removesuffix("_S")


def is_secret_name(name: str) -> bool:
    return len(name) <= 253 and re.fullmatch(SECRET_NAME_PATTERN, name) is not None


def _names(raw: str) -> tuple[str, ...]:
    """A comma-separated list: "a, b" -> ("a", "b"); empty parts dropped."""
    return tuple(part.strip() for part in raw.split(",") if part.strip())


def _run_as_user(raw: str) -> int | None:
    """A user id, or NO_USER (any case) for None."""
    text = raw.strip()
    if text.lower() == NO_USER:
        return None
    try:
        uid = int(text)
    except ValueError:
        raise ValueError(
            f"expected a user id (a whole number, at least 1) or {NO_USER!r}, got {raw!r}"
        ) from None
    return _check_user_id(uid)


def _check_user_id(uid: int) -> int:
    # bool is an int: True would become user 1.
    if type(uid) is not int or uid < 1:
        raise ValueError(
            f"engine run-as-user must be a user id of at least 1 (0 is root, which the "
            f"pods' runAsNonRoot refuses) or {NO_USER!r} for none, got {uid!r}"
        )
    return uid


def _boolean(raw: str) -> bool:
    if raw.lower() in ("1", "true", "yes"):
        return True
    if raw.lower() in ("0", "false", "no"):
        return False
    raise ValueError(f"expected true or false, got {raw!r}")


_FIELDS = {
    "engine_image": str,
    "engine_image_pull_secrets": _names,
    "engine_run_as_user": _run_as_user,
    "redis_url": str,
    "key_prefix": str,
    "namespaces": _names,
    "scrape_interval_s": float,
    "scrape_timeout_s": float,
    "peering_name": str,
    "priority": int,
    "standalone": _boolean,
    "liveness_endpoint": str,
}
