{{/*
Helpers. Those about one component take a dict: "root" (the chart's top-level
context, $) and "component" ("operator", "gateway", "redis" or "test"), so
every component's objects are named, labelled and secured by the same code.
*/}}

{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The prefix of every object name. 40 characters at most: the longest suffix,
"-gateway-bootstrap-key", must still fit a 63-character name.
*/}}
{{- define "tandem.fullname" -}}
{{- $full := "" }}
{{- if .Values.fullnameOverride }}
{{- $full = .Values.fullnameOverride }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- $full = contains $name .Release.Name | ternary .Release.Name (printf "%s-%s" .Release.Name $name) }}
{{- end }}
{{- /* Service names are DNS-1035 labels: no dots, a letter first. */}}
{{- $full = $full | replace "." "-" | trunc 40 | trimSuffix "-" }}
{{- if not (regexMatch "^[a-z]" $full) }}
{{- fail (printf "object names would start with %q: Services need a letter first; use a release name or fullnameOverride that starts with one" $full) }}
{{- end }}
{{- $full }}
{{- end }}

{{/* <fullname>-<component>: a component's Deployment, Service, ServiceAccount... */}}
{{- define "tandem.componentName" -}}
{{- printf "%s-%s" (include "tandem.fullname" .root) .component }}
{{- end }}

{{/* The labels that pick a component's pods; fixed, since selectors cannot change. */}}
{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
Every object's labels. Optional: "pod" true leaves out the chart's version and
appVersion (a pod template's labels: a chart bump alone must not restart a pod,
least of all Redis' only one), and "extra", a map of labels of this object that
win over commonLabels. The chart's own labels win over both: each key once.
*/}}
{{- define "tandem.labels" -}}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/part-of: tandem
{{- if not .pod }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | replace "+" "_" | trunc 63 | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- if not .pod }}
{{- /* A label value takes no "+" (SemVer build metadata): "_", as `helm create` does. */}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- $own := keys (fromYaml (include "tandem.selectorLabels" .)) | concat (list "app.kubernetes.io/part-of" "app.kubernetes.io/version" "app.kubernetes.io/managed-by" "helm.sh/chart") }}
{{- range $key, $value := merge (dict) (.extra | default dict) .root.Values.commonLabels }}
{{- if not (has $key $own) }}
{{ $key }}: {{ $value | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* A pod template's labels: tandem.labels without the version labels. */}}
{{- define "tandem.podLabels" -}}
{{- include "tandem.labels" (dict "root" .root "component" .component "pod" true) }}
{{- end }}

{{/*
What operator/manifests.py puts on every engine pod (selector_labels and
labels there; a test checks that these stay a subset of them).
*/}}
{{- define "tandem.engineSelectorLabels" -}}
app.kubernetes.io/name: tandem-engine
app.kubernetes.io/managed-by: tandem-operator
{{- end }}

{{/*
A component's image: "image" is its values block. By digest where one is given (the
tag is then ignored), else by tag, which defaults to appVersion.
*/}}
{{- define "tandem.image" -}}
{{- if .image.digest }}
{{- printf "%s@%s" .image.repository .image.digest }}
{{- else }}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) }}
{{- end }}
{{- end }}

{{/*
Pod-level security of every pod: a non-root user, and the runtime's default seccomp
profile. "values" is the component's values block. Its runAsUser (the image's user)
fixes user, group and fsGroup; null (a key Helm then removes) sets none, for platforms
that assign them: OpenShift's restricted-v2 SCC refuses ids outside the namespace's range.
*/}}
{{- define "tandem.podSecurityContext" -}}
runAsNonRoot: true
{{- with .values.runAsUser }}
runAsUser: {{ int64 . }}
runAsGroup: {{ int64 . }}
fsGroup: {{ int64 . }}
{{- end }}
{{- /* Kept without an fsGroup too: the one OpenShift assigns needs it as much. */}}
fsGroupChangePolicy: OnRootMismatch
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* Container-level security: no privilege, no capability, nothing written outside volumes. */}}
{{- define "tandem.containerSecurityContext" -}}
runAsNonRoot: true
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end }}

{{/*
The names of the imagePullSecrets value, each once, as JSON. Values take {name: regcred},
as a pod spec does, or the name alone (the form this chart took first).
*/}}
{{- define "tandem.imagePullSecretNames" -}}
{{- $names := list }}
{{- range .Values.imagePullSecrets }}
{{- if kindIs "map" . }}
{{- $names = append $names .name }}
{{- else }}
{{- $names = append $names . }}
{{- end }}
{{- end }}
{{- toJson (uniq $names) }}
{{- end }}

{{/* imagePullSecrets of a pod spec: every name as {name: ...}. */}}
{{- define "tandem.imagePullSecrets" -}}
{{- with include "tandem.imagePullSecretNames" . | fromJsonArray }}
imagePullSecrets:
{{- range . }}
  - name: {{ . | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Where a component's pods run: "values" is its values block. With "component" (and
"root") too, its replicas are spread over nodes softly unless the values place them
apart themselves (topologySpreadConstraints, or a podAntiAffinity): a user's own wins.
*/}}
{{- define "tandem.podPlacement" -}}
{{- include "tandem.imagePullSecrets" .root }}
{{- with .values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if .values.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml .values.topologySpreadConstraints | nindent 2 }}
{{- else if and .component (not (dig "podAntiAffinity" nil (.values.affinity | default dict))) }}
topologySpreadConstraints:
  {{- include "tandem.nodeSpread" . | nindent 2 }}
{{- end }}
{{- end }}

{{/*
A component's default spread ("root", "component"): its pods on different nodes where
the scheduler can, so one node's loss takes one replica, never all. ScheduleAnyway: a
preference, so pods still start on a cluster of one node. pod-template-hash: a rollout's
new pods spread among themselves, not around the old ones about to go.
*/}}
{{- define "tandem.nodeSpread" -}}
- maxSkew: 1
  topologyKey: kubernetes.io/hostname
  whenUnsatisfiable: ScheduleAnyway
  labelSelector:
    matchLabels:
      {{- include "tandem.selectorLabels" . | nindent 6 }}
  matchLabelKeys: [pod-template-hash]
{{- end }}

{{/* The namespaces whose ModelDeployments the operator serves (scope "namespace"), as JSON. */}}
{{- define "tandem.servedNamespaces" -}}
{{- toJson (default (list .Release.Namespace) .Values.operator.namespaces | uniq) }}
{{- end }}

{{/* The namespaces that get the engines' NetworkPolicy, as JSON. */}}
{{- define "tandem.engineNamespaces" -}}
{{- if .Values.networkPolicy.engineNamespaces }}
{{- toJson (uniq .Values.networkPolicy.engineNamespaces) }}
{{- else if eq .Values.operator.scope "namespace" }}
{{- include "tandem.servedNamespaces" . }}
{{- else }}
{{- toJson (list .Release.Namespace) }}
{{- end }}
{{- end }}

{{- define "tandem.redisPasswordSecret" -}}
{{- default (include "tandem.componentName" (dict "root" . "component" "redis")) .Values.redis.auth.existingSecret }}
{{- end }}

{{- define "tandem.redisUrlSecret" -}}
{{- default (printf "%s-url" (include "tandem.componentName" (dict "root" . "component" "redis"))) .Values.redis.external.existingSecret }}
{{- end }}

{{/*
The environment that gives a container the Redis URL in variable "name". The
password never shows in a spec: it comes from a Secret, and Kubernetes
expands $(REDIS_PASSWORD) into the URL when the container starts.
*/}}
{{- define "tandem.redisEnv" -}}
{{- if .root.Values.redis.enabled }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "tandem.redisPasswordSecret" .root }}
      key: password
- name: {{ .name }}
  value: {{ printf "redis://:$(REDIS_PASSWORD)@%s.%s.svc:6379/0" (include "tandem.componentName" (dict "root" .root "component" "redis")) .root.Release.Namespace | quote }}
{{- else }}
- name: {{ .name }}
  valueFrom:
    secretKeyRef:
      name: {{ include "tandem.redisUrlSecret" .root }}
      key: {{ ternary .root.Values.redis.external.existingSecretKey "url" (ne .root.Values.redis.external.existingSecret "") }}
{{- end }}
{{- end }}

{{/*
A checksum of what decides Redis' password (or an external Redis' URL), for the pod
annotation checksum/redis-auth: Redis and its clients read it at start only, so a
change must restart them all together. The values are hashed, not the Secret: a
generated password is looked up on upgrade but random under `helm template` (Argo
CD), and its hash would then restart every pod on every render. A change inside an
existingSecret is not seen: restart the pods (kubectl rollout restart).
*/}}
{{- define "tandem.redisAuthChecksum" -}}
{{- $redis := .Values.redis }}
{{- if $redis.enabled }}
{{- toJson (dict "enabled" true "auth" $redis.auth) | sha256sum }}
{{- else }}
{{- toJson (dict "enabled" false "external" $redis.external) | sha256sum }}
{{- end }}
{{- end }}

{{/* A volume for /tmp: every root filesystem is read-only. */}}
{{- define "tandem.tmpVolume" -}}
- name: tmp
  emptyDir:
    sizeLimit: 64Mi
{{- end }}

{{/*
A quantity ("500m", "1.5Gi", "1e3", or a number) as its value in nano-units, a
float64 printed as text, so that two quantities compare by value: "1Gi" equals
"1024Mi", "0.5" equals "500m". As the API server does, it rounds up to a whole
nano-unit and caps at 2^63-1 units. The decimal part goes through one correctly
rounded ParseFloat and a binary suffix multiplies by a power of two (exact), so
a <= b by value gives nanos(a) <= nanos(b): a valid pair is never refused.
The limit: quantities that differ only past ~15 significant digits may compare
equal (a request a hair above its limit passes here; the API server refuses it).
*/}}
{{- define "tandem.quantityNanos" -}}
{{- $text := toString . }}
{{- $grammar := `^([+-]?)([0-9]*)(?:\.([0-9]*))?([KMGTPE]i|[numkMGTPE]|[eE]([+-]?)([0-9]+))?$` }}
{{- if not (and (regexMatch $grammar $text) (regexMatch "[0-9]" (regexReplaceAll $grammar $text "${2}${3}"))) }}
{{- fail (printf "%q is not a Kubernetes quantity (e.g. 2, 500m, 1.5Gi)" $text) }}
{{- end }}
{{- $fraction := regexReplaceAll $grammar $text "${3}" }}
{{- $suffix := regexReplaceAll $grammar $text "${4}" }}
{{- $digits := regexReplaceAll "^0+" (regexReplaceAll $grammar $text "${2}${3}") "" }}
{{- /* The value is $digits x 10^$exponent nano-units, times a binary suffix. */}}
{{- $exponent := sub 9 (len $fraction) }}
{{- $decimal := dict "n" -9 "u" -6 "m" -3 "k" 3 "M" 6 "G" 9 "T" 12 "P" 15 "E" 18 }}
{{- $binary := dict "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 "Pi" 1125899906842624 "Ei" 1152921504606846976 }}
{{- $cap := 9223372036854775807e9 }}
{{- $power := regexReplaceAll "^0+" (regexReplaceAll $grammar $text "${6}") "" }}
{{- if gt (len $power) 4 }}
{{- /* 10^10000 or more (or less): past the cap, or below one nano-unit, either way. */}}
{{- $exponent = eq (regexReplaceAll $grammar $text "${5}") "-" | ternary -100 100 }}
{{- else if $power }}
{{- $exponent = add $exponent (mul (eq (regexReplaceAll $grammar $text "${5}") "-" | ternary -1 1) (atoi $power)) }}
{{- else if hasKey $decimal $suffix }}
{{- $exponent = add $exponent (get $decimal $suffix) }}
{{- end }}
{{- $nanos := 0.0 }}
{{- if not $digits }}
{{- /* Out of float64's range, the answer is known: the cap, or one nano-unit. */}}
{{- else if gt (add (len $digits) $exponent) 40 }}
{{- $nanos = $cap }}
{{- else if lt (add (len $digits) $exponent) -40 }}
{{- $nanos = 1.0 }}
{{- else }}
{{- $nanos = printf "%se%d" $digits $exponent | float64 }}
{{- with get $binary $suffix }}
{{- $nanos = mulf $nanos . }}
{{- end }}
{{- $nanos = minf (ceil $nanos) $cap }}
{{- end }}
{{- if hasPrefix "-" $text }}
{{- $nanos = mulf $nanos -1 }}
{{- end }}
{{- $nanos }}
{{- end }}

{{/*
The chart's own pods with a request above its limit: the API server refuses
them ("must be less than or equal to ... limit"); say which value, by name.
Resources it cannot overcommit (extended resources such as nvidia.com/gpu, named
with a domain other than kubernetes.io or one of its subdomains, and hugepages-*)
must have a limit, and the request must equal it.
*/}}
{{- define "tandem.resourceChecks" -}}
{{- $workloads := dict "operator" .Values.operator "gateway" .Values.gateway "tests" .Values.tests }}
{{- if .Values.redis.enabled }}
{{- $_ := set $workloads "redis" .Values.redis }}
{{- end }}
{{- range $component, $values := $workloads }}
{{- $limits := $values.resources.limits }}
{{- range $name, $request := $values.resources.requests }}
{{- $native := or (not (contains "/" $name)) (contains "kubernetes.io/" $name) }}
{{- $exact := or (hasPrefix "hugepages-" $name) (not $native) }}
{{- if and $exact (not (hasKey $limits $name)) }}
{{- fail (printf "%s.resources.requests.%s (%v) has no limit: the API server cannot overcommit %s, and wants %s.resources.limits.%s set, equal to the request" $component $name $request $name $component $name) }}
{{- end }}
{{- if hasKey $limits $name }}
{{- $limit := index $limits $name }}
{{- $asked := include "tandem.quantityNanos" $request | float64 }}
{{- $most := include "tandem.quantityNanos" $limit | float64 }}
{{- if and $exact (ne $asked $most) }}
{{- fail (printf "%s.resources.requests.%s (%v) differs from %s.resources.limits.%s (%v): the API server cannot overcommit %s, so the request must equal the limit" $component $name $request $component $name $limit $name) }}
{{- end }}
{{- if gt $asked $most }}
{{- fail (printf "%s.resources.requests.%s (%v) is more than %s.resources.limits.%s (%v): the API server refuses a pod that requests more than its limit. Lower the request or raise the limit" $component $name $request $component $name $limit) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
On an upgrade, Redis' volume claim against the StatefulSet already there: the
API server refuses any change to a StatefulSet's volumeClaimTemplates, with a
message that names no value. `lookup` finds nothing under `helm template`,
`helm lint` or a client-side dry run, and then there is nothing to compare.
*/}}
{{- define "tandem.redisClaimCheck" -}}
{{- $name := include "tandem.componentName" (dict "root" . "component" "redis") }}
{{- $live := lookup "apps/v1" "StatefulSet" .Release.Namespace $name }}
{{- if and .Values.redis.enabled $live }}
{{- $persistence := .Values.redis.persistence }}
{{- $claim := dict }}
{{- range dig "spec" "volumeClaimTemplates" (list) $live }}
{{- if eq (dig "metadata" "name" "" .) "data" }}
{{- $claim = . }}
{{- end }}
{{- end }}
{{- $liveSize := toString (dig "spec" "resources" "requests" "storage" "" $claim) }}
{{- $liveClass := toString (dig "spec" "storageClassName" "" $claim) }}
{{- $problem := "" }}
{{- if ne (not (empty $claim)) $persistence.enabled }}
{{- $problem = printf "redis.persistence.enabled is %t but the Redis StatefulSet %s was made with it %t" $persistence.enabled $name (not $persistence.enabled) }}
{{- else if and $claim $liveSize (ne (include "tandem.quantityNanos" $liveSize | float64) (include "tandem.quantityNanos" $persistence.size | float64)) }}
{{- $problem = printf "redis.persistence.size is %v but the Redis StatefulSet %s claims %s" $persistence.size $name $liveSize }}
{{- else if and $claim (ne $liveClass (toString $persistence.storageClass)) }}
{{- $problem = printf "redis.persistence.storageClass is %q but the Redis StatefulSet %s claims storage class %q" (toString $persistence.storageClass) $name $liveClass }}
{{- end }}
{{- if $problem }}
{{- fail (printf "%s, and Kubernetes refuses any change to a StatefulSet's volume claims. Keep the value it was made with, or see \"Changing Redis' volume\" in docs/guide.md (in short: kubectl delete statefulset %s --namespace %s --cascade=orphan, then upgrade again)" $problem $name .Release.Namespace) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Redis' maxmemory against its container's memory limit: at its cap Redis still needs
memory beyond it (client buffers, the fork that rewrites the append-only file), so a
cap at or above the limit gets the pod OOM-killed where Redis would have refused writes.
maxmemory is in Redis' units, in any case: k, m, g are 1000s, kb, mb, gb 1024s; a number
is bytes.
*/}}
{{- define "tandem.redisMemoryCheck" -}}
{{- $redis := .Values.redis }}
{{- $limit := dig "resources" "limits" "memory" "" $redis }}
{{- if and $redis.enabled $limit }}
{{- $cap := $redis.maxmemory }}
{{- $bytes := 0.0 }}
{{- if kindIs "string" $cap }}
{{- $cap = lower $cap }}
{{- $unit := regexFind "[a-z]+$" $cap }}
{{- $scale := get (dict "b" 1 "k" 1000 "kb" 1024 "m" 1000000 "mb" 1048576 "g" 1000000000 "gb" 1073741824) $unit | default 1 }}
{{- $bytes = mulf (trimSuffix $unit $cap | float64) $scale }}
{{- else }}
{{- $bytes = float64 $cap }}
{{- end }}
{{- $limitBytes := divf (include "tandem.quantityNanos" $limit | float64) 1e9 }}
{{- if and (gt $bytes 0.0) (ge $bytes $limitBytes) }}
{{- fail (printf "redis.maxmemory (%v) is not below redis.resources.limits.memory (%v): Redis needs memory beyond its cap, and the pod would be OOM-killed instead of Redis refusing writes. Lower maxmemory (about three quarters of the limit) or raise the limit" $cap $limit) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
API keys the gateway refuses at start (gateway/auth.py, KeyStore.load; a crash loop): a
name twice, a name the bootstrap key takes (the gateway names TANDEM_API_KEYS' keys
env-1, env-2, ...), or one key twice, in either form: the gateway compares SHA-256
digests of `key` (trimmed) and of `key_sha256` (hex in any case).
*/}}
{{- define "tandem.keyNameCheck" -}}
{{- if and .enabled (not .existingSecret) }}
{{- $seen := dict }}
{{- $digests := dict }}
{{- range .keys }}
{{- if hasKey $seen .name }}
{{- fail (printf "gateway.auth.keys: the name %q is used twice; the gateway needs each key's name unique" .name) }}
{{- end }}
{{- $_ := set $seen .name true }}
{{- if and (eq (toString $.bootstrapKey) "true") (eq .name "env-1") }}
{{- fail "gateway.auth.keys: the name \"env-1\" is the bootstrap key's (gateway.auth.bootstrapKey); name the key otherwise" }}
{{- end }}
{{- $digest := lower (toString .key_sha256) }}
{{- if hasKey . "key" }}
{{- $digest = sha256sum (trim (toString .key)) }}
{{- end }}
{{- if hasKey $digests $digest }}
{{- fail (printf "gateway.auth.keys: %q and %q hold the same key (as key or key_sha256); the gateway refuses a key listed twice" (get $digests $digest) .name) }}
{{- end }}
{{- $_ := set $digests $digest .name }}
{{- end }}
{{- end }}
{{- end }}

{{/*
"true" where the chart makes the bootstrap key: gateway.auth.bootstrapKey true, or
auto while no key of the user's is set (their keys retire it: it has no limits).
*/}}
{{- define "tandem.makesBootstrapKey" -}}
{{- $auth := .Values.gateway.auth }}
{{- $mode := toString $auth.bootstrapKey }}
{{- if and $auth.enabled (or (eq $mode "true") (and (eq $mode "auto") (not $auth.keys) (not $auth.existingSecret))) }}true{{- end }}
{{- end }}

{{/*
Name of the operator's cluster-scoped objects (operator.scope cluster): the release's
namespace in it, so that releases of one name in two namespaces claim different ones.
*/}}
{{- define "tandem.operatorClusterName" -}}
{{- printf "%s-%s" (include "tandem.componentName" (dict "root" . "component" "operator")) .Release.Namespace }}
{{- end }}

{{/*
The kopf peering's name: operator.peeringName, else <fullname>-operator, with the
namespace in it when cluster-scoped. A ClusterKopfPeering this release made under the
old name (before the namespace was in it) keeps it: replicas of the old and the new
operator pods in one rollout must share one peering, or both act at once.
*/}}
{{- define "tandem.peeringName" -}}
{{- $plain := include "tandem.componentName" (dict "root" . "component" "operator") }}
{{- if .Values.operator.peeringName }}
{{- .Values.operator.peeringName }}
{{- else if eq .Values.operator.scope "cluster" }}
{{- /* Asked only where the kind exists: without the CRDs (tandem-crds not installed
yet) lookup failed with a discovery error inside this helper, before Helm's own
"ensure CRDs are installed first". */}}
{{- $live := dict }}
{{- if .Capabilities.APIVersions.Has "kopf.dev/v1/ClusterKopfPeering" }}
{{- $live = lookup "kopf.dev/v1" "ClusterKopfPeering" "" $plain }}
{{- end }}
{{- if and $live (eq (dig "metadata" "annotations" "meta.helm.sh/release-namespace" "" $live) .Release.Namespace) }}
{{- $plain }}
{{- else }}
{{- include "tandem.operatorClusterName" . }}
{{- end }}
{{- else }}
{{- $plain }}
{{- end }}
{{- end }}

{{/*
An upgrade that renames the release's objects (nameOverride, fullnameOverride): the
selectors it would give the Deployments are refused by Kubernetes, and Redis would
start on a new, empty volume. Found by the gateway Deployment this release made.
*/}}
{{- define "tandem.renameCheck" -}}
{{- $ctx := dict "root" . "component" "gateway" }}
{{- $name := include "tandem.componentName" $ctx }}
{{- $selector := include "tandem.selectorLabels" $ctx | fromYaml }}
{{- range (lookup "apps/v1" "Deployment" .Release.Namespace "").items | default list }}
{{- $labels := .metadata.labels | default dict }}
{{- $annotations := .metadata.annotations | default dict }}
{{- if and (eq (get $annotations "meta.helm.sh/release-name") $.Release.Name) (eq (get $labels "app.kubernetes.io/component") "gateway") (eq (get $labels "app.kubernetes.io/part-of") "tandem") }}
{{- $was := dig "spec" "selector" "matchLabels" dict . }}
{{- if or (ne .metadata.name $name) (ne (get $was "app.kubernetes.io/name") (get $selector "app.kubernetes.io/name")) }}
{{- fail (printf "this release's objects are named %s (app.kubernetes.io/name %s) and these values would name them %s (%s): Kubernetes refuses a Deployment's new selector, and Redis would start on a new, empty volume. Keep nameOverride and fullnameOverride as they were" .metadata.name (get $was "app.kubernetes.io/name") $name (get $selector "app.kubernetes.io/name")) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* The values that cannot work together, refused before anything is made. */}}
{{- define "tandem.checks" -}}
{{- include "tandem.resourceChecks" . }}
{{- include "tandem.labelChecks" . }}
{{- include "tandem.redisMemoryCheck" . }}
{{- include "tandem.redisClaimCheck" . }}
{{- include "tandem.renameCheck" . }}
{{- $auth := .Values.gateway.auth }}
{{- if and $auth.enabled (not $auth.existingSecret) (not $auth.keys) (not (include "tandem.makesBootstrapKey" .)) }}
{{- fail "gateway.auth: no API key source. Set gateway.auth.keys, gateway.auth.existingSecret or gateway.auth.bootstrapKey, or gateway.auth.enabled=false (no authentication)" }}
{{- end }}
{{- include "tandem.keyNameCheck" $auth }}
{{- if and (not .Values.redis.enabled) (not .Values.redis.external.url) (not .Values.redis.external.existingSecret) }}
{{- fail "redis: with redis.enabled=false set redis.external.url or redis.external.existingSecret" }}
{{- end }}
{{- include "tandem.externalRedisHostCheck" . }}
{{- if and (eq .Values.operator.scope "cluster") .Values.operator.namespaces }}
{{- fail "operator.namespaces is for operator.scope=namespace; a cluster-scoped operator serves every namespace" }}
{{- end }}
{{- end }}

{{- /* An external Redis named by a short host name (redis://my-redis:6379/0): the
gateway and the operator resolve it in the release namespace, but the operator hands
the same URL to engines in their models' namespaces, where it names another Service
or none. Refused where engines may run elsewhere; a Secret's URL is not read here. */}}
{{- define "tandem.externalRedisHostCheck" -}}
{{- $url := .Values.redis.external.url }}
{{- if and (not .Values.redis.enabled) $url (not .Values.redis.external.existingSecret) }}
{{- $elsewhere := or (eq .Values.operator.scope "cluster") (without .Values.operator.namespaces .Release.Namespace) }}
{{- $host := regexReplaceAll ":[0-9]*$" (urlParse $url).host "" }}
{{- if and $elsewhere $host (not (contains "." $host)) (not (hasPrefix "[" $host)) }}
{{- fail (printf "redis.external.url: host %q is a short name, which each pod resolves in its own namespace, and the engines run in their models' namespaces: give %s.%s.svc (a Service's full name), another DNS name or an IP address" $host $host .Release.Namespace) }}
{{- end }}
{{- end }}
{{- end }}

{{- /* The chart's selector labels in a values map of labels: a second copy of one
would break the selectors. Here, not in the schema, so the refusal names the map. */}}
{{- define "tandem.labelChecks" -}}
{{- $maps := dict "commonLabels" .Values.commonLabels "monitoring.labels" .Values.monitoring.labels "monitoring.dashboard.labels" .Values.monitoring.dashboard.labels }}
{{- range $where, $labels := $maps }}
{{- range $key := list "app.kubernetes.io/name" "app.kubernetes.io/instance" "app.kubernetes.io/component" }}
{{- if hasKey ($labels | default dict) $key }}
{{- fail (printf "%s: %s is one of the chart's own selector labels (app.kubernetes.io/name, instance, component), which it sets itself: remove it (a second copy would break the selectors)" $where $key) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
