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

{{- define "tandem.labels" -}}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/part-of: tandem
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- /* The chart's own labels win: a second copy of a key would break the selectors. */}}
{{- $own := fromYaml (include "tandem.selectorLabels" .) }}
{{- range $key, $value := .root.Values.commonLabels }}
{{- if and (not (hasKey $own $key)) (not (has $key (list "app.kubernetes.io/part-of" "app.kubernetes.io/version" "app.kubernetes.io/managed-by" "helm.sh/chart"))) }}
{{ $key }}: {{ $value | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/*
What operator/manifests.py puts on every engine pod (selector_labels and
labels there; a test checks that these stay a subset of them).
*/}}
{{- define "tandem.engineSelectorLabels" -}}
app.kubernetes.io/name: tandem-engine
app.kubernetes.io/managed-by: tandem-operator
{{- end }}

{{/* A component's image: "image" is its values block; the tag defaults to appVersion. */}}
{{- define "tandem.image" -}}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) }}
{{- end }}

{{/*
Pod-level security of every pod: a fixed non-root user (the image's), and the
runtime's default seccomp profile. "values" is the component's values block.
*/}}
{{- define "tandem.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .values.runAsUser }}
runAsGroup: {{ .values.runAsUser }}
fsGroup: {{ .values.runAsUser }}
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

{{/* Where a component's pods run: "values" is its values block. */}}
{{- define "tandem.podPlacement" -}}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
{{- range . }}
  - name: {{ . }}
{{- end }}
{{- end }}
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

{{/* A volume for /tmp: every root filesystem is read-only. */}}
{{- define "tandem.tmpVolume" -}}
- name: tmp
  emptyDir:
    sizeLimit: 64Mi
{{- end }}

{{/* The values that cannot work together, refused before anything is made. */}}
{{- define "tandem.checks" -}}
{{- $auth := .Values.gateway.auth }}
{{- if and $auth.enabled (not $auth.existingSecret) (not $auth.keys) (not $auth.bootstrapKey) }}
{{- fail "gateway.auth: no API key source. Set gateway.auth.keys, gateway.auth.existingSecret or gateway.auth.bootstrapKey, or gateway.auth.enabled=false (no authentication)" }}
{{- end }}
{{- if and (not .Values.redis.enabled) (not .Values.redis.external.url) (not .Values.redis.external.existingSecret) }}
{{- fail "redis: with redis.enabled=false set redis.external.url or redis.external.existingSecret" }}
{{- end }}
{{- if and (eq .Values.operator.scope "cluster") .Values.operator.namespaces }}
{{- fail "operator.namespaces is for operator.scope=namespace; a cluster-scoped operator serves every namespace" }}
{{- end }}
{{- end }}
