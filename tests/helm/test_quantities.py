"""Kubernetes quantities in values: the schema's grammar is the API server's, and requests
stay within limits, compared by value (templates/_helpers.tpl, tandem.quantityNanos)."""

from __future__ import annotations

import json
import re
import shutil
from decimal import ROUND_CEILING, Decimal, localcontext
from pathlib import Path

import pytest
import yaml
from support.helm import CHART, render, run_helm, template_args

# Strings the API server parses (resource.ParseQuantity): sign, digits with an optional
# point, then a binary or decimal suffix or a decimal exponent with a signed integer.
GOOD = [
    "0", "2", "+1", "1.", ".5", "0.25", "500m", "100n", "250u", "1k", "1.5Gi", "512Mi",
    "1Ei", "7E", "2e3", "2E-3", "1e+06", "00012.50k", "1.e3",
]  # fmt: skip
# The old pattern ([0-9.]+ then an exponent and a suffix) took most of these.
BAD = [
    "1.2.3", "..5", "1e3Mi", "1e3.5", "1.5.Gi", "1K", "1kb", "1gi", "1Gb", "2 Gi",
    "e3", "1e", "0x10", "1,5", "++1", "-1", "", "1Gi ",
]  # fmt: skip


def _template(helm: str, tmp_path: Path, values: dict) -> tuple[int, str]:
    path = tmp_path / "values.json"  # JSON: a string stays a string ("2e3" is no float)
    path.write_text(json.dumps(values))
    result = run_helm(helm, *template_args(CHART, values=[path]))
    return result.returncode, result.stderr


def _limit(quantity: object) -> dict:
    """A limit alone (no request to compare with), so only the schema judges it."""
    return {"gateway": {"resources": {"limits": {"ephemeral-storage": quantity}}}}


@pytest.mark.parametrize("quantity", GOOD)
def test_the_schema_takes_what_the_api_server_parses(helm, tmp_path, quantity):
    code, stderr = _template(helm, tmp_path, _limit(quantity))
    assert code == 0, stderr


@pytest.mark.parametrize("quantity", BAD)
def test_the_schema_refuses_what_the_api_server_refuses(helm, tmp_path, quantity):
    code, stderr = _template(helm, tmp_path, _limit(quantity))
    assert code != 0, f"{quantity!r} was accepted"
    assert "at '/gateway/resources/limits/ephemeral-storage'" in stderr, stderr


def test_every_resource_block_uses_the_grammar(helm):
    for component in ("operator", "gateway", "redis", "tests"):
        for kind in ("requests", "limits"):
            sets = [f"{component}.resources.{kind}.cpu=1.2.3"]
            result = run_helm(helm, *template_args(CHART, sets=sets))
            assert f"at '/{component}/resources/{kind}/cpu'" in result.stderr, sets


def test_numbers_are_quantities(helm, tmp_path):
    code, stderr = _template(helm, tmp_path, _limit(0.5))
    assert code == 0, stderr
    code, stderr = _template(helm, tmp_path, _limit(-1))
    assert code != 0 and "minimum: got -1, want 0" in stderr


@pytest.mark.parametrize("size", ["16Gi", "1.5Ti", "500M", "+1Gi", "0.5Gi", "10"])
def test_claim_sizes_take_positive_quantities(helm, size):
    manifests = render(helm, sets=[f"redis.persistence.size={size}"])
    (redis,) = [m for m in manifests if m["kind"] == "StatefulSet"]
    storage = redis["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]
    assert str(storage["storage"]) == size


@pytest.mark.parametrize("size", ["0", "0Gi", "0.0", "-1Gi", "1.2.3Gi", "8GB", "8gi", "8 Gi"])
def test_claim_sizes_the_api_server_refuses_are_refused(helm, size):
    # A claim of 0 is refused ("must be greater than zero"), and so is bad grammar.
    result = run_helm(helm, *template_args(CHART, sets=[f"redis.persistence.size={size}"]))
    assert result.returncode != 0, f"{size!r} was accepted"
    assert "at '/redis/persistence/size'" in result.stderr, result.stderr


def test_helm_lint_refuses_a_bad_quantity(helm):
    result = run_helm(helm, "lint", str(CHART), "--set", "redis.resources.limits.memory=1e3Mi")
    assert result.returncode != 0
    assert "at '/redis/resources/limits/memory'" in result.stdout + result.stderr


@pytest.mark.parametrize(
    "name", ["memroy", "cpus", "gpu", "nvidia.com/", "/gpu", "Nvidia.com/gpu", "hugepages-"]
)
def test_a_resource_name_the_api_server_refuses_is_refused_by_name(helm, name):
    # A misspelt key was taken and its value ignored: a pod without the memory limit meant.
    escaped = name.replace(".", "\\.")
    for component in ("operator", "gateway", "redis", "tests"):
        for kind in ("requests", "limits"):
            sets = [f"{component}.resources.{kind}.{escaped}=1"]
            result = run_helm(helm, *template_args(CHART, sets=sets))
            where = f"at '/{component}/resources/{kind}': additional properties '{name}'"
            assert where in result.stderr, (sets, result.stderr)


@pytest.mark.parametrize(
    "name", ["ephemeral-storage", "hugepages-2Mi", "hugepages-1Gi", "nvidia.com/gpu", "amd.com/gpu"]
)
def test_resource_names_the_api_server_takes_pass(helm, name):
    escaped = name.replace(".", "\\.")
    sets = [f"gateway.resources.{kind}.{escaped}=1" for kind in ("requests", "limits")]
    assert _gateway_resources(helm, sets)["limits"][name] == 1


# ------------------------------------------------------------- requests within limits

# (--set assignments, the request and the limit the message names).
REFUSED = [
    (["gateway.resources.requests.cpu=3"], "gateway", "cpu", "3", "2"),
    (["gateway.resources.requests.memory=1025Mi"], "gateway", "memory", "1025Mi", "1Gi"),
    (["operator.resources.limits.cpu=99m"], "operator", "cpu", "100m", "99m"),
    (["redis.resources.requests.memory=1.5Gi"], "redis", "memory", "1.5Gi", "1Gi"),
    (["tests.resources.requests.cpu=0.20001"], "tests", "cpu", "0.20001", "200m"),
    (
        [
            "gateway.resources.requests.ephemeral-storage=2G",
            "gateway.resources.limits.ephemeral-storage=1Gi",
        ],
        "gateway",
        "ephemeral-storage",
        "2G",
        "1Gi",
    ),
]


@pytest.mark.parametrize(
    ("sets", "component", "resource", "asked", "limit"), REFUSED, ids=[s[0][0] for s in REFUSED]
)
def test_a_request_above_its_limit_is_refused_by_name(
    helm, sets, component, resource, asked, limit
):
    where = f"{component}.resources"
    message = (
        f"{where}.requests.{resource} ({asked}) is more than {where}.limits.{resource} ({limit})"
    )
    result = run_helm(helm, *template_args(CHART, sets=sets))
    assert result.returncode != 0, f"{sets} was accepted"
    assert message in result.stderr, result.stderr
    assert "Lower the request or raise the limit" in result.stderr


@pytest.mark.parametrize(
    "sets",
    [
        # Equal by value in other notations (the API server takes these).
        ["gateway.resources.requests.cpu=2000m"],
        ["gateway.resources.requests.memory=1024Mi"],
        ["gateway.resources.requests.cpu=0.7", "gateway.resources.limits.cpu=700m"],
        ["gateway.resources.requests.cpu=700m", "gateway.resources.limits.cpu=0.7"],
        ["gateway.resources.requests.memory=1073741824", "gateway.resources.limits.memory=1Gi"],
        ["gateway.resources.requests.memory=1.5Gi", "gateway.resources.limits.memory=1536Mi"],
        # Both above 2^63-1 bytes: the API server caps both there, so they are equal.
        ["gateway.resources.requests.memory=9Ei", "gateway.resources.limits.memory=8Ei"],
        # No Redis pod without Redis.
        [
            "redis.enabled=false",
            "redis.external.url=redis://r.db.svc",
            "redis.resources.requests.cpu=5",
        ],
    ],
)
def test_requests_equal_to_limits_by_value_pass(helm, sets):
    render(helm, sets=sets)


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (
            ["gateway.resources.requests.example\\.com/dongle=1"],
            "gateway.resources.requests.example.com/dongle (1) has no limit",
        ),
        (
            [
                "gateway.resources.requests.example\\.com/dongle=1",
                "gateway.resources.limits.example\\.com/dongle=2",
            ],
            "gateway.resources.requests.example.com/dongle (1) differs from "
            "gateway.resources.limits.example.com/dongle (2)",
        ),
        (
            [
                "redis.resources.requests.hugepages-2Mi=2Mi",
                "redis.resources.limits.hugepages-2Mi=4Mi",
            ],
            "redis.resources.requests.hugepages-2Mi (2Mi) differs from",
        ),
    ],
)
def test_a_resource_that_cannot_be_overcommitted_needs_its_request_equal_to_its_limit(
    helm, sets, message
):
    # Extended resources and huge pages: the API server wants request == limit.
    result = run_helm(helm, *template_args(CHART, sets=sets))
    assert result.returncode != 0, f"{sets} was accepted"
    assert message in result.stderr, result.stderr


def _gateway_resources(helm, sets: list[str]) -> dict:
    manifests = render(helm, sets=sets)
    (gateway,) = [
        m
        for m in manifests
        if m["kind"] == "Deployment" and m["metadata"]["name"].endswith("gateway")
    ]
    return gateway["spec"]["template"]["spec"]["containers"][0]["resources"]


def test_an_extended_resource_equal_to_its_limit_or_a_limit_alone_passes(helm):
    dongle = "example\\.com/dongle"
    equal = [f"gateway.resources.requests.{dongle}=1", f"gateway.resources.limits.{dongle}=1000m"]
    resources = _gateway_resources(helm, equal)
    assert resources["requests"]["example.com/dongle"] == 1
    assert resources["limits"]["example.com/dongle"] == "1000m"
    # A limit alone: the API server sets the request to it.
    resources = _gateway_resources(helm, [f"gateway.resources.limits.{dongle}=1"])
    assert resources["limits"]["example.com/dongle"] == 1
    # kubernetes.io names (and its subdomains') are native, overcommitted as cpu is: a
    # request alone, or below its limit, is fine.
    native = ["gateway.resources.requests.kubernetes\\.io/anything=1"]
    assert _gateway_resources(helm, native)["requests"]["kubernetes.io/anything"] == 1
    sub = "node\\.kubernetes\\.io/x"
    below = [f"gateway.resources.requests.{sub}=1", f"gateway.resources.limits.{sub}=2"]
    assert _gateway_resources(helm, below)["limits"]["node.kubernetes.io/x"] == 2


# ------------------------------------------------- the helper against exact arithmetic

QUANTITY = re.compile(
    r"^([+-]?)([0-9]*)(?:\.([0-9]*))?(?:([KMGTPE]i|[numkMGTPE])|[eE]([+-]?[0-9]+))?$"
)
DECIMAL = dict(
    zip(["n", "u", "m", "", "k", "M", "G", "T", "P", "E"], range(-9, 19, 3), strict=True)
)


def exact_nanos(quantity: str) -> Decimal:
    """What the API server makes of a quantity, in nano-units: exact, rounded up to a whole
    nano-unit, capped at 2^63-1 units (resource.ParseQuantity)."""
    match = QUANTITY.match(quantity)
    assert match, quantity
    sign, whole, fraction, suffix, exponent = match.groups()
    with localcontext() as context:
        context.prec = 100
        value = Decimal(f"{whole or 0}.{fraction or 0}")
        if exponent is not None:  # past +-60 it is past the cap or below one nano-unit
            value = value.scaleb(max(-60, min(60, int(exponent))))
        elif suffix and suffix.endswith("i"):
            value *= Decimal(1024) ** ("KMGTPE".index(suffix[0]) + 1)
        else:
            value = value.scaleb(DECIMAL[suffix or ""])
        nanos = value.scaleb(9).to_integral_value(ROUND_CEILING)
        nanos = min(nanos, Decimal(2**63 - 1).scaleb(9))
        return -nanos if sign == "-" else nanos


PROBES = [
    *GOOD, "-500m", "0.7", "700m", "0.3", "300m", "1536Mi", "8Ei", "9Ei", "1e30",
    "1e99999", "1e-99999", "1n", "0.1n", "2e-12", "1e-45", "1e010", "1.000000001",
    "1000000001n", "3.14159265358979e5", "7.5e-7", "123456789012345678901234567890",
    "0.0000000000000000000000000000000000000000000000001E60",
]  # fmt: skip


@pytest.fixture(scope="module")
def nanos(helm: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, float]:
    """tandem.quantityNanos of every probe (strings) and of YAML numbers (ints, floats)."""
    chart = tmp_path_factory.mktemp("probe") / "tandem"
    shutil.copytree(CHART, chart)
    (chart / "values.schema.json").unlink()  # the probe list is not a chart value
    (chart / "templates" / "probe.yaml").write_text(
        "{{- range .Values.probe }}\n"
        '{{ toJson . | quote }}: {{ include "tandem.quantityNanos" . | quote }}\n'
        "{{- end }}\n"
    )
    values = chart / "probe.json"  # JSON: every string stays a string
    values.write_text(json.dumps({"probe": [*PROBES, 2, 0.7, 1.5, 1000000]}))
    result = run_helm(
        helm, "template", "t", str(chart), "-f", str(values), "--show-only", "templates/probe.yaml"
    )
    assert result.returncode == 0, result.stderr
    return {key: float(value) for key, value in yaml.safe_load(result.stdout).items()}


@pytest.mark.parametrize("quantity", PROBES)
def test_the_helper_values_quantities_as_the_api_server_does(nanos, quantity):
    assert nanos[f'"{quantity}"'] == float(exact_nanos(quantity))


def test_the_helper_takes_numbers(nanos):
    assert nanos["2"] == 2e9 and nanos["0.7"] == 7e8 and nanos["1.5"] == 1.5e9
    assert nanos["1000000"] == 1e15


def test_the_helper_orders_as_the_api_server_does(nanos):
    # Rounding never turns a <= b into a > b: no valid pair is refused.
    for a in PROBES:
        for b in PROBES:
            if exact_nanos(a) <= exact_nanos(b):
                assert nanos[f'"{a}"'] <= nanos[f'"{b}"'], (a, b)


@pytest.mark.parametrize(
    ("sets", "shown"),
    [
        (["redis.maxmemory=1gb"], "redis.maxmemory (1gb)"),  # 1 GiB, the default limit
        (["redis.maxmemory=2g"], "redis.maxmemory (2g)"),
        (["redis.maxmemory=768mb", "redis.resources.limits.memory=512Mi"], "(512Mi)"),
        (["redis.maxmemory=2000000000"], "redis.maxmemory (2000000000)"),
    ],
)
def test_a_redis_cap_at_or_above_its_memory_limit_is_refused(helm, sets, shown):
    result = run_helm(helm, *template_args(CHART, sets=sets))
    assert result.returncode != 0, f"{sets} was accepted"
    assert shown in result.stderr and "is not below redis.resources.limits.memory" in result.stderr


@pytest.mark.parametrize(
    "sets",
    [
        [],  # 768mb against 1Gi
        ["redis.maxmemory=0"],  # no cap
        ["redis.maxmemory=1000m"],  # 10^9 bytes, under 1 GiB
        ["redis.maxmemory=1gb", "redis.resources.limits.memory=2Gi"],
        [
            "redis.maxmemory=4gb",
            "redis.enabled=false",
            "redis.external.url=redis://r.db.svc:6379/0",
        ],
    ],
)
def test_a_redis_cap_below_its_limit_passes(helm, sets):
    result = run_helm(helm, *template_args(CHART, sets=sets))
    assert result.returncode == 0, result.stderr
