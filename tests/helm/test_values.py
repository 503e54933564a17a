"""values.yaml and values.schema.json: helm refuses bad values naming the key; a comment per key."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from typing import Any

import pytest
import yaml
from support.crd_schema import api_server_errors
from support.helm import CHART, named, render, run_helm, template_args

from tandem.operator import crd
from tandem.operator.validation import validate_spec

SCHEMA = json.loads((CHART / "values.schema.json").read_text())
VALUES_TEXT = (CHART / "values.yaml").read_text()

# (--set assignments, what helm's error must say). The schema's messages name the key
# as a JSON pointer; the chart's own checks (templates/_helpers.tpl) name it in words.
BAD_VALUES = [
    (["gateway.replicas=-1"], "at '/gateway/replicas': minimum: got -1, want 0"),
    (["operator.replicas=-2"], "at '/operator/replicas': minimum: got -2, want 0"),
    (["operator.replicas=two"], "at '/operator/replicas': got string, want integer"),
    (["gateway.maxQueue=lots"], "at '/gateway/maxQueue': got string, want integer"),
    # 0 answers 429 to every request (a model sheds when waiting >= --max-queue).
    (["gateway.maxQueue=0"], "at '/gateway/maxQueue': minimum: got 0, want 1"),
    (["gateway.auth.enabled=maybe"], "at '/gateway/auth/enabled': got string, want boolean"),
    (["gateway.replicaCount=3"], "at '/gateway': additional properties 'replicaCount' not allowed"),
    (["replicas=3"], "at '': additional properties 'replicas' not allowed"),
    (["redis.persistance.enabled=false"], "at '/redis': additional properties 'persistance'"),
    (["operator.scope=everywhere"], "at '/operator/scope': value must be one of"),
    (["operator.scrapeInterval=0"], "at '/operator/scrapeInterval'"),
    (["gateway.port=70000"], "at '/gateway/port': maximum: got 70,000, want 65,535"),
    (["redis.runAsUser=0"], "at '/redis/runAsUser': minimum: got 0, want 1"),
    (["operator.runAsUser=0"], "at '/operator/runAsUser'"),
    (["gateway.runAsUser=0"], "at '/gateway/runAsUser'"),
    (["operator.healthPort=70000"], "at '/operator/healthPort'"),
    (["operator.scrapeTimeout=0"], "at '/operator/scrapeTimeout'"),
    (["gateway.service.type=Internal"], "at '/gateway/service/type'"),
    (
        [
            "gateway.auth.keys[0].name=a",
            "gateway.auth.keys[0].key=k",
            "gateway.auth.keys[0].prefix_cache=private",
        ],
        "at '/gateway/auth/keys/0/prefix_cache'",
    ),
    (["redis.auth.password=p@ss/word"], "at '/redis/auth/password'"),
    (["redis.external.url=http://redis:6379"], "at '/redis/external/url'"),
    (["gateway.resources.limits=null"], "at '/gateway/resources': missing property 'limits'"),
    (["operator.namespaces={Team_A}"], "at '/operator/namespaces/0'"),
    (["monitoring.interval=30"], "at '/monitoring/interval'"),
    # A page's URL is not its origin: the gateway refuses it at start (a crash loop).
    (["gateway.allowedOrigins={https://a.example.com/app}"], "at '/gateway/allowedOrigins/0'"),
    # A digest where a tag goes, or in the repository, made an image reference no
    # runtime pulls (repo:sha256:..., repo@sha256:...:0.1.0): it has its own key.
    ([f"gateway.image.tag=sha256:{'a' * 64}"], "at '/gateway/image/tag'"),
    ([f"redis.image.repository=redis@sha256:{'a' * 64}"], "at '/redis/image/repository'"),
    (["operator.engineImage.digest=sha256:abc"], "at '/operator/engineImage/digest'"),
    # A path in capitals (a GitHub org's name, say) is no image a runtime pulls: its pods
    # sat in InvalidImageName, and the engines' too.
    (["gateway.image.repository=ghcr.io/MyOrg/gateway"], "at '/gateway/image/repository'"),
    (["operator.engineImage.repository=ghcr.io/MyOrg/e"], "at '/operator/engineImage/repository'"),
    (["gateway.auth.keys[0].key=sk-1"], "at '/gateway/auth/keys/0': missing property 'name'"),
    (
        ["gateway.auth.bootstrapKey=false"],
        "gateway.auth: no API key source",
    ),
    (["redis.enabled=false"], "redis: with redis.enabled=false set redis.external.url"),
    (["operator.namespaces={team-a}"], "operator.namespaces is for operator.scope=namespace"),
    # Left empty in a values file (or --set to null), a block or a leaf used to
    # render a nil-pointer error or a flag with no value.
    (["networkPolicy.gateway=null"], "at '/networkPolicy': missing property 'gateway'"),
    (["gateway.shutdownTimeout=null"], "at '/gateway': missing property 'shutdownTimeout'"),
    (["fullnameOverride=a.b"], "at '/fullnameOverride'"),
    # Keys the gateway refuses at start (a crash loop): neither form of the key, or "*"
    # in a list of models.
    (["gateway.auth.keys[0].name=a"], "at '/gateway/auth/keys/0': 'oneOf' failed"),
    (
        [
            "gateway.auth.keys[0].name=a",
            "gateway.auth.keys[0].key=k",
            "gateway.auth.keys[0].models={*,m}",
        ],
        "at '/gateway/auth/keys/0/models/0': 'not' failed",
    ),
    # Key names the gateway refuses at start: twice, or the bootstrap key's env-1.
    (
        [
            "gateway.auth.keys[0].name=a",
            "gateway.auth.keys[0].key=k1",
            "gateway.auth.keys[1].name=a",
            "gateway.auth.keys[1].key=k2",
        ],
        'gateway.auth.keys: the name "a" is used twice',
    ),
    (
        [
            "gateway.auth.bootstrapKey=true",  # auto makes none beside keys of one's own
            "gateway.auth.keys[0].name=env-1",
            "gateway.auth.keys[0].key=k",
        ],
        'the name "env-1" is the bootstrap key\'s',
    ),
    # One key twice, which the gateway refuses too: as it compares them, by SHA-256 of the
    # trimmed key, or key_sha256 in any case.
    (
        [
            "gateway.auth.keys[0].name=a",
            "gateway.auth.keys[0].key=sk-1",
            "gateway.auth.keys[1].name=b",
            "gateway.auth.keys[1].key=sk-1 ",
        ],
        'gateway.auth.keys: "a" and "b" hold the same key',
    ),
    (
        [
            "gateway.auth.keys[0].name=a",
            "gateway.auth.keys[0].key_sha256=" + hashlib.sha256(b"sk-1").hexdigest(),
            "gateway.auth.keys[1].name=b",
            "gateway.auth.keys[1].key=sk-2",
            "gateway.auth.keys[2].name=c",
            "gateway.auth.keys[2].key=sk-1",
        ],
        'gateway.auth.keys: "a" and "c" hold the same key',
    ),
    (
        [
            "gateway.auth.keys[0].name=a",
            "gateway.auth.keys[0].key_sha256=" + hashlib.sha256(b"k").hexdigest(),
            "gateway.auth.keys[1].name=b",
            "gateway.auth.keys[1].key_sha256=" + hashlib.sha256(b"k").hexdigest().upper(),
        ],
        'gateway.auth.keys: "a" and "b" hold the same key',
    ),
    # The gateway strips a key and refuses one with nothing left.
    (
        ["gateway.auth.keys[0].name=a", "gateway.auth.keys[0].key=   "],
        "at '/gateway/auth/keys/0/key'",
    ),
    # A key beyond printable ASCII (an en dash pasted from a document) rendered, and
    # every gateway pod then refused it at start: it travels in a header.
    (
        ["gateway.auth.keys[0].name=a", "gateway.auth.keys[0].key=sk\u2013team-a"],
        "at '/gateway/auth/keys/0/key'",
    ),
    # A second app.kubernetes.io/name would break every selector.
    (
        ["commonLabels.app\\.kubernetes\\.io/name=x"],
        "commonLabels: app.kubernetes.io/name is one of the chart's own selector labels",
    ),
    # Labels the API server would refuse on every object the chart makes.
    (["commonLabels.team=a b!"], "at '/commonLabels/team'"),
    (["commonLabels.bad key=x"], "at '/commonLabels': additional properties 'bad key'"),
    # The same for the monitors' and the dashboard's own labels.
    (
        ["monitoring.labels.app\\.kubernetes\\.io/instance=x"],
        "monitoring.labels: app.kubernetes.io/instance is one of the chart's own selector",
    ),
    (["monitoring.labels.release=kube prometheus"], "at '/monitoring/labels/release'"),
    (["monitoring.dashboard.labels.grafana_dashboard=-1-"], "/monitoring/dashboard/labels/"),
    # Alert labels are Prometheus label names; severity is the rules' own (a second
    # key would make the rendered YAML invalid).
    (["monitoring.alerts.ruleLabels.severity=page"], "invalid propertyName 'severity'"),
    (["monitoring.alerts.ruleLabels.team\\.name=ml"], "invalid propertyName 'team.name'"),
    (["redis.nodeSelector.pool=a b"], "at '/redis/nodeSelector/pool'"),
    (["gateway.podDisruptionBudget.maxUnavailable=150%"], "podDisruptionBudget/maxUnavailable"),
    (["operator.podDisruptionBudget.maxUnavailable=-1"], "/operator/podDisruptionBudget/maxUnava"),
    # Root: null (no ids, the platform's) is the way to leave the user out, not 0.
    (["operator.runAsUser=0"], "at '/operator/runAsUser': minimum: got 0, want 1"),
    (["gateway.runAsUser=-1"], "at '/gateway/runAsUser': minimum: got -1, want 1"),
    (["redis.runAsUser=0"], "at '/redis/runAsUser': minimum: got 0, want 1"),
    (["operator.engineRunAsUser=0"], "at '/operator/engineRunAsUser': minimum: got 0, want 1"),
    (["operator.engineRunAsUser=none"], "at '/operator/engineRunAsUser': got string, want"),
    # Names the API server refuses on the pods or the Ingress, for every object at once.
    (["operator.priorityClassName=High_Priority"], "at '/operator/priorityClassName'"),
    (
        ["gateway.ingress.enabled=true", "gateway.ingress.hosts[0].host=https://llm.example.com"],
        "at '/gateway/ingress/hosts/0/host'",
    ),
    (
        [
            "gateway.ingress.tls[0].secretName=t",
            "gateway.ingress.tls[0].hosts[0]=llm.example.com:443",
        ],
        "at '/gateway/ingress/tls/0/hosts/0'",
    ),
    # A short host resolves in each pod's namespace: the engines, in their models'
    # namespaces, reached another Redis or none.
    (
        ["redis.enabled=false", "redis.external.url=redis://my-redis:6379/0"],
        'redis.external.url: host "my-redis" is a short name, which each pod resolves in '
        "its own namespace",
    ),
]


@pytest.mark.parametrize(("sets", "message"), BAD_VALUES, ids=[s[0][0] for s in BAD_VALUES])
def test_helm_template_refuses_bad_values_naming_the_key(helm, sets, message):
    result = run_helm(helm, *template_args(CHART, sets=sets))
    assert result.returncode != 0, f"{sets} was accepted"
    assert message in result.stderr, result.stderr


@pytest.mark.parametrize(
    "sets",
    [
        ["redis.external.url=redis://my-redis.db.svc:6379/0"],
        ["redis.external.url=redis://10.0.0.7:6379/0"],
        ["redis.external.url=redis://[fd00::7]:6379/0"],
        # Engines only in the release namespace: its short names are theirs too.
        ["redis.external.url=redis://my-redis:6379/0", "operator.scope=namespace"],
    ],
    ids=["full-name", "ipv4", "ipv6", "one-namespace"],
)
def test_an_external_redis_every_engine_resolves_alike_is_taken(helm, sets):
    assert render(helm, sets=["redis.enabled=false", *sets])


def test_a_cpu_limit_may_be_left_out(helm):
    # Without a CPU limit a pod is never throttled (CFS quotas): a common choice for a
    # latency-bound gateway. The memory limit stays: Redis' cap is checked against it.
    manifests = render(helm, sets=["gateway.resources.limits.cpu=null"])
    gateway = named(manifests, "Deployment", "tandem-gateway")
    limits = gateway["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert "cpu" not in limits and "memory" in limits
    result = run_helm(helm, *template_args(CHART, sets=["redis.resources.limits.memory=null"]))
    assert "at '/redis/resources/limits': missing property 'memory'" in result.stderr


def test_helm_lint_reports_the_same(helm):
    result = run_helm(helm, "lint", str(CHART), "--set", "gateway.replicas=-1")
    assert result.returncode != 0
    assert "at '/gateway/replicas': minimum: got -1, want 0" in result.stdout + result.stderr


def _properties(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """(dotted path, schema) of every named property, not of free-form maps or list items."""
    found = []
    for name, child in node.get("properties", {}).items():
        found.append((f"{path}{name}", child))
        found += _properties(child, f"{path}{name}.")
    return found


def test_every_schema_property_is_described_and_objects_are_closed():
    for path, node in _properties(SCHEMA):
        assert node.get("description"), f"{path}: no description"
        if node.get("properties"):
            assert node.get("additionalProperties") is False, f"{path}: unknown keys pass"


def _documented_keys(text: str) -> dict[str, bool]:
    """Dotted path of every mapping key in values.yaml -> whether a comment line precedes it."""
    found: dict[str, bool] = {}
    stack: list[tuple[int, str]] = []
    previous = ""
    for line in text.splitlines():
        match = re.match(r"^(\s*)([A-Za-z][\w.-]*):", line)
        if match and not line.lstrip().startswith("- "):
            indent, key = len(match.group(1)), match.group(2)
            while stack and stack[-1][0] >= indent:
                stack.pop()
            path = ".".join([*(k for _, k in stack), key])
            found[path] = previous.lstrip().startswith("#")
            stack.append((indent, key))
        if line.strip():
            previous = line
    return found


def test_values_yaml_documents_every_key_the_schema_names():
    documented = _documented_keys(VALUES_TEXT)
    for path, _ in _properties(SCHEMA):
        assert path in documented, f"{path} is in the schema but not in values.yaml"
        assert documented[path], f"values.yaml: {path} has no comment above it"


def test_values_yaml_passes_its_own_schema():
    import jsonschema

    jsonschema.validate(yaml.safe_load(VALUES_TEXT), SCHEMA)


def test_strings_that_read_as_other_types_stay_strings(helm):
    # YAML 1.1 reads a bare no/on as a boolean and "tandem:" as a map.
    sets = ["redis.appendfsync=no", "keyPrefix=tandem:", "redis.persistence.storageClass=on"]
    manifests = render(helm, sets=sets)
    redis = next(m for m in manifests if m["kind"] == "StatefulSet")
    args = redis["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--appendfsync") + 1] == "no"
    assert redis["spec"]["volumeClaimTemplates"][0]["spec"]["storageClassName"] == "on"
    deployments = [m for m in manifests if m["kind"] == "Deployment"]
    gateway = next(m for m in deployments if m["metadata"]["name"].endswith("-gateway"))
    assert "--key-prefix=tandem:" in gateway["spec"]["template"]["spec"]["containers"][0]["args"]


def test_an_ingress_without_hosts_or_paths_is_refused(helm, tmp_path):
    # Rendered, both were Ingresses the API server refuses (no rules, no paths).
    cases = (([], "/gateway/ingress/hosts"), ([{"host": "a.b", "paths": []}], "/paths"))
    for hosts, where in cases:
        values = tmp_path / "ingress.yaml"
        ingress = {"enabled": True, "hosts": hosts}
        values.write_text(yaml.safe_dump({"gateway": {"ingress": ingress}}))
        result = run_helm(helm, *template_args(CHART, values=[values]))
        assert result.returncode != 0 and "minItems: got 0, want 1" in result.stderr
        assert where in result.stderr


def test_a_namespace_that_reads_as_a_boolean_stays_a_name(helm):
    result = run_helm(helm, "template", "t", str(CHART), "--namespace", "no")
    assert result.returncode == 0, result.stderr
    namespaces = {d["metadata"].get("namespace") for d in yaml.safe_load_all(result.stdout) if d}
    assert namespaces <= {"no", None}


def test_release_names_become_service_names_or_a_clear_error(helm):
    dotted = run_helm(helm, "template", "my.release", str(CHART))
    assert dotted.returncode == 0, dotted.stderr
    names = {d["metadata"]["name"] for d in yaml.safe_load_all(dotted.stdout) if d}
    assert "my-release-tandem-gateway" in names and not any("." in n for n in names)
    digit = run_helm(helm, "template", "1abc", str(CHART))
    assert digit.returncode != 0
    assert "Services need a letter first" in digit.stderr


def test_the_notes_send_models_to_a_namespace_the_operator_serves(helm):
    values = CHART / "ci" / "namespace-scoped-values.yaml"
    served = yaml.safe_load(values.read_text())["operator"]["namespaces"][0]
    args = ["install", "t", str(CHART), "--dry-run=client", "-n", "tandem-system"]
    result = run_helm(helm, *args, "--values", str(values))
    assert result.returncode == 0, result.stderr
    assert f"kubectl apply -n {served} -f - <<'EOF'" in result.stdout


def _notes(helm: str) -> str:
    args = ["install", "t", str(CHART), "--dry-run=client", "-n", "tandem-system"]
    result = run_helm(helm, *args)
    assert result.returncode == 0, result.stderr
    return result.stdout.split("NOTES:\n", 1)[1]


def test_the_notes_model_pastes_into_a_shell_and_is_one_the_cluster_takes(helm):
    # A packaged chart has no examples/ to apply: the notes carry the model itself.
    notes = _notes(helm)
    command = re.search(r"^kubectl apply .*?^EOF$", notes, re.S | re.M)
    assert command, notes
    # As pasted into a shell, kubectl standing in: the heredoc ends where it should.
    shell = "kubectl() { printf '%s\\n' \"$*\"; cat; }\n" + command.group(0) + "\n"
    done = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, check=True)
    argv, document = done.stdout.split("\n", 1)
    assert argv == "apply -n tandem-system -f -"
    model = yaml.safe_load(document)
    assert api_server_errors(crd.root_schema(), model) == []
    spec = validate_spec(model["spec"], name=model["metadata"]["name"])
    # The curl and SDK calls below it ask for the model by this name.
    served = spec.model.served_model_name or model["metadata"]["name"]
    assert notes.count(f'"model": "{served}"') == 1 and f'model="{served}"' in notes
    # No file of the repository: the chart's home names where they are.
    assert "examples/" not in notes
    assert "https://github.com/tandem-serving/tandem" in notes


def test_numbers_values_yaml_documents_are_accepted(helm):
    # values.yaml says maxmemory "0" is none; --set makes 0 and 10 integers.
    manifests = render(helm, sets=["redis.maxmemory=0", "redis.persistence.size=10"])
    redis = next(m for m in manifests if m["kind"] == "StatefulSet")
    args = redis["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--maxmemory") + 1] == "0"
    claim = redis["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]
    assert claim["storage"] == "10"


def test_large_numbers_from_a_values_file_render_as_integers(helm, tmp_path):
    # A values file's numbers reach the templates as floats, which print as 8e+08:
    # Redis refuses that maxmemory, and an OpenShift-range UID would not be an integer.
    values = tmp_path / "numbers.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "redis": {
                    "maxmemory": 800_000_000,
                    "runAsUser": 1_000_650_000,
                    "persistence": {"size": 8_589_934_592},
                },
                "gateway": {"requestTimeout": 1_000_000, "shutdownTimeout": 1_000_000},
                "operator": {"scrapeInterval": 2_000_000, "scrapeTimeout": 0.5},
            }
        )
    )
    manifests = render(helm, values=[values])
    redis = next(m for m in manifests if m["kind"] == "StatefulSet")
    pod = redis["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--maxmemory") + 1] == "800000000"
    assert pod["securityContext"]["runAsUser"] == 1_000_650_000
    [claim] = redis["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "8589934592"
    gateway, operator = (
        next(
            m
            for m in manifests
            if m["kind"] == "Deployment" and m["metadata"]["name"].endswith(suffix)
        )
        for suffix in ("-gateway", "-operator")
    )
    gateway_args = gateway["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--request-timeout=1000000" in gateway_args
    assert "--shutdown-timeout=1000000" in gateway_args
    env = {
        e["name"]: e.get("value")
        for e in operator["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["TANDEM_OPERATOR_SCRAPE_INTERVAL"] == "2000000"
    assert env["TANDEM_OPERATOR_SCRAPE_TIMEOUT"] == "0.5"


def test_key_forms_the_gateway_accepts_pass_the_schema(helm, tmp_path):
    keys = [
        {"name": "every", "key": "k1", "models": ["*"]},
        {"name": "one", "key": "k2", "models": "smollm2"},
        {"name": "hashed", "key_sha256": "AB" * 32},
    ]
    values = tmp_path / "keys.yaml"
    values.write_text(
        yaml.safe_dump({"gateway": {"auth": {"keys": keys}}, "redis": {"maxmemory": "768MB"}})
    )
    result = run_helm(helm, *template_args(CHART, values=[values]))
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("values", ["namespace-scoped-values.yaml", "defaults-values.yaml"])
def test_releases_of_one_name_in_two_namespaces_claim_different_cluster_objects(helm, values):
    # Helm refuses to install an object another release owns: the second release failed.
    def cluster_scoped(namespace: str) -> set[str]:
        args = ["template", "tandem", str(CHART), "-n", namespace]
        args += ["--values", str(CHART / "ci" / values)]
        result = run_helm(helm, *args)
        assert result.returncode == 0, result.stderr
        docs = [d for d in yaml.safe_load_all(result.stdout) if d]
        return {d["metadata"]["name"] for d in docs if d["kind"].startswith("Cluster")}

    first, second = cluster_scoped("ops-a"), cluster_scoped("ops-b")
    assert first and not first & second


class _UniqueKeys(yaml.SafeLoader):
    """A YAML loader that refuses a key twice in one mapping (PyYAML keeps the last)."""


def _unique_mapping(loader: _UniqueKeys, node: yaml.MappingNode, deep: bool = False) -> Any:
    keys = [loader.construct_object(key, deep=True) for key, _ in node.value]
    twice = sorted({str(k) for k in keys if keys.count(k) > 1})
    assert not twice, f"keys twice in one mapping: {twice}"
    return loader.construct_mapping(node, deep)


_UniqueKeys.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def test_monitoring_labels_merge_with_the_chart_labels_each_key_once(helm):
    # Appended after the chart's labels, a key in both came out twice (the last won).
    sets = [
        "monitoring.enabled=true",
        "commonLabels.release=common",
        "commonLabels.team=a",
        "monitoring.labels.release=kube-prometheus-stack",
        "monitoring.labels.app\\.kubernetes\\.io/part-of=other",
        "monitoring.labels.helm\\.sh/chart=other",
        "monitoring.dashboard.labels.team=b",
    ]
    result = run_helm(helm, *template_args(CHART, sets=sets))
    assert result.returncode == 0, result.stderr
    manifests = [d for d in yaml.load_all(result.stdout, Loader=_UniqueKeys) if d]
    by_kind = {m["kind"]: m["metadata"]["labels"] for m in manifests}
    for kind in ("ServiceMonitor", "PodMonitor"):
        labels = by_kind[kind]
        assert labels["release"] == "kube-prometheus-stack", kind  # over commonLabels
        assert labels["team"] == "a", kind
        # The chart's own labels win.
        assert labels["app.kubernetes.io/part-of"] == "tandem", kind
        assert labels["helm.sh/chart"] == "tandem-0.1.0", kind
    dashboard = by_kind["ConfigMap"]
    assert dashboard["team"] == "b" and dashboard["grafana_dashboard"] == "1"
    assert dashboard["release"] == "common"


def test_ingress_paths_and_class_stay_as_written(helm, tmp_path):
    # Unquoted, "/a: b" broke the YAML, "/v1 #x" lost its " #x", and class "on" was true.
    paths = ["/a: b", "/v1 #x", "/{x}"]
    ingress = {
        "enabled": True,
        "className": "on",
        "hosts": [{"host": "a.b", "paths": [{"path": p, "pathType": "Prefix"} for p in paths]}],
    }
    values = tmp_path / "ingress.yaml"
    values.write_text(yaml.safe_dump({"gateway": {"ingress": ingress}}))
    (rendered,) = [m for m in render(helm, values=[values]) if m["kind"] == "Ingress"]
    assert rendered["spec"]["ingressClassName"] == "on"
    (rule,) = rendered["spec"]["rules"]
    assert [p["path"] for p in rule["http"]["paths"]] == paths


def test_the_notes_keep_a_blank_line_under_their_first_line(helm):
    notes = _notes(helm)
    assert notes.startswith("Tandem 0.1.0 is installed in namespace tandem-system.\n\n1. Serve")


def test_decimal_seconds_given_with_set_reach_the_gateway_and_the_operator(helm):
    # --set passes 0.5 as the string "0.5" (only whole numbers become numbers).
    manifests = render(
        helm,
        sets=[
            "gateway.requestTimeout=0.5",
            "operator.scrapeInterval=2.5",
            "operator.scrapeTimeout=.25",
        ],
    )
    deployments = {m["metadata"]["name"]: m for m in manifests if m["kind"] == "Deployment"}
    gateway = deployments["tandem-gateway"]["spec"]["template"]["spec"]["containers"][0]
    assert "--request-timeout=0.5" in gateway["args"]
    operator = deployments["tandem-operator"]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in operator["env"]}
    assert env["TANDEM_OPERATOR_SCRAPE_INTERVAL"] == "2.5"
    assert env["TANDEM_OPERATOR_SCRAPE_TIMEOUT"] == "0.25"


@pytest.mark.parametrize("value", ["0.0", ".0", "0", "abc", "-1.5", "1.2.3"])
def test_seconds_that_are_not_above_zero_are_refused(helm, value):
    result = run_helm(helm, *template_args(CHART, sets=[f"gateway.requestTimeout={value}"]))
    assert result.returncode != 0
    assert "at '/gateway/requestTimeout'" in result.stderr


def test_a_compound_scrape_interval_reaches_the_monitors(helm):
    # Prometheus durations compound (1m30s): the schema took one unit only.
    sets = ["monitoring.enabled=true", "monitoring.interval=1m30s"]
    monitors = [m for m in render(helm, sets=sets) if m["kind"] == "ServiceMonitor"]
    assert monitors and all(
        endpoint["interval"] == "1m30s" for m in monitors for endpoint in m["spec"]["endpoints"]
    )
