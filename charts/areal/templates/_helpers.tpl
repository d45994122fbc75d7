{{/* Names --------------------------------------------------------------------------------------------- */}}

{{- define "areal.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The resource name prefix. 40 characters leave room for the longest suffix ("-operator-crds"). */}}
{{- define "areal.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "areal.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels: call with (dict "ctx" $ "component" "operator") */}}
{{- define "areal.selectorLabels" -}}
app.kubernetes.io/name: {{ include "areal.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "areal.labels" -}}
{{ include "areal.selectorLabels" . }}
helm.sh/chart: {{ include "areal.chart" .ctx }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: areal-k8s
{{- end -}}

{{/* The labels the operator puts on every pod of an RLJob (services/areal_k8s/k8s_operator/names.py: labels()). */}}
{{- define "areal.jobPodLabels" -}}
app.kubernetes.io/name: areal-k8s
app.kubernetes.io/managed-by: areal-k8s-operator
{{- end -}}

{{/* Images ------------------------------------------------------------------------------------------- */}}

{{/* (dict "image" .Values.x.image "default" "<tag>") -> repository:tag or repository@digest */}}
{{- define "areal.image" -}}
{{- if .image.digest -}}
{{- printf "%s@%s" .image.repository .image.digest -}}
{{- else -}}
{{- printf "%s:%s" .image.repository (.image.tag | default .default) -}}
{{- end -}}
{{- end -}}

{{- define "areal.operatorImage" -}}
{{- include "areal.image" (dict "image" .Values.operator.image "default" .Chart.AppVersion) -}}
{{- end -}}

{{- define "areal.testImage" -}}
{{- if .Values.tests.image.repository -}}
{{- include "areal.image" (dict "image" .Values.tests.image "default" .Chart.AppVersion) -}}
{{- else -}}
{{- include "areal.operatorImage" . -}}
{{- end -}}
{{- end -}}

{{/* Operator ----------------------------------------------------------------------------------------- */}}

{{- define "areal.operator.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create -}}
{{- .Values.operator.serviceAccount.name | default (printf "%s-operator" (include "areal.fullname" .)) -}}
{{- else -}}
{{- .Values.operator.serviceAccount.name | default "default" -}}
{{- end -}}
{{- end -}}

{{- define "areal.clusterwide" -}}
{{- if not .Values.operator.watchNamespaces }}true{{ end -}}
{{- end -}}

{{/*
The operator's RBAC rules: exactly operator/rbac.yaml, which tests/cluster/test_operator_rbac.py checks against every API
call of a whole RLJob lifecycle (tests/cluster/test_chart.py checks these equal it). Cluster-scoped rules (CRD discovery)
always go into a ClusterRole; the namespaced ones into the same ClusterRole when the operator watches every
namespace, otherwise into a Role in each watched namespace.
*/}}
{{- define "areal.operator.clusterRules" -}}
# kopf finds the RLJob resource through CRD discovery
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
# with a Kueue queue: the node labels of the ResourceFlavors (cluster-scoped) a job's Workload was admitted with
- apiGroups: [kueue.x-k8s.io]
  resources: [resourceflavors]
  verbs: [get]
{{- end -}}

{{- define "areal.operator.namespacedRules" -}}
# kopf watches RLJobs and keeps its progress annotations and the finalizer on them; each reconcile reads its RLJob
# as it is now;
# the operator deletes a finished RLJob after its ttlSecondsAfterFinished
- apiGroups: [areal-k8s.dev]
  resources: [rljobs]
  verbs: [get, list, watch, patch, delete]
- apiGroups: [areal-k8s.dev]
  resources: [rljobs/status]
  verbs: [patch]
# children owner-referenced with blockOwnerDeletion need this (OwnerReferencesPermissionEnforcement)
- apiGroups: [areal-k8s.dev]
  resources: [rljobs/finalizers]
  verbs: [update]
# the children: create-or-patch
- apiGroups: [""]
  resources: [configmaps, services]
  verbs: [get, create, patch]
- apiGroups: [apps]
  resources: [deployments, statefulsets]
  verbs: [get, create, patch]
# with the chart's NetworkPolicies on: each job's reward pods admit that job's pods only
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, create, patch]
# container restarts count against failurePolicy.maxRestarts; the rebalancer restarts the trainer's pods when it
# moves the trainer (the whole world at once, at the new size)
- apiGroups: [""]
  resources: [pods]
  verbs: [list, delete]
# with spec.rebalance.enabled, an autoscaler targeting the RLJob would fight the rebalancer: it is reported
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [list]
# redis.urlSecretRef: the finalizer reads the URL to delete the job's Redis keys; workflow agent: the job's claim
# token, created once (never patched: the pods hold its value)
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create]
# with a Kueue queue (spec.queueName): the job's Workload, created and kept current; its status is written when
# an evicted job gives its quota back and when the job finishes
- apiGroups: [kueue.x-k8s.io]
  resources: [workloads]
  verbs: [get, create, patch]
- apiGroups: [kueue.x-k8s.io]
  resources: [workloads/status]
  verbs: [patch]
# kopf reports handler outcomes as Events on the RLJob
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end -}}

{{/* Namespaces ---------------------------------------------------------------------------------------- */}}

{{/* The namespaces RLJobs run in, as a JSON list (use with fromJsonArray). */}}
{{- define "areal.jobNamespaces" -}}
{{- $namespaces := .Values.jobs.namespaces | default .Values.operator.watchNamespaces | default (list .Release.Namespace) -}}
{{- $namespaces | uniq | toJson -}}
{{- end -}}

{{/*
Whether the job namespaces are all known: false when the operator watches every namespace and jobs.namespaces is
empty. Redis then admits job pods from any namespace, and the PodMonitor looks in every namespace.
*/}}
{{- define "areal.jobNamespacesKnown" -}}
{{- if or .Values.jobs.namespaces .Values.operator.watchNamespaces }}true{{ end -}}
{{- end -}}

{{/* Redis ----------------------------------------------------------------------------------------------- */}}

{{- define "areal.redis.fullname" -}}
{{- printf "%s-redis" (include "areal.fullname" .) -}}
{{- end -}}

{{/* The Secret holding the job's Redis URL (key `url`) in every job namespace, for spec.redis.urlSecretRef. */}}
{{- define "areal.redis.urlSecretName" -}}
{{- if and (not .Values.redis.enabled) .Values.redis.external.existingSecret -}}
{{- .Values.redis.external.existingSecret -}}
{{- else -}}
{{- include "areal.redis.fullname" . -}}
{{- end -}}
{{- end -}}

{{- define "areal.redis.urlSecretKey" -}}
{{- if and (not .Values.redis.enabled) .Values.redis.external.existingSecret -}}
{{- .Values.redis.external.existingSecretKey -}}
{{- else -}}
url
{{- end -}}
{{- end -}}

{{- define "areal.redis.host" -}}
{{- printf "%s.%s.svc" (include "areal.redis.fullname" .) .Release.Namespace -}}
{{- end -}}

{{/*
The in-chart Redis password: the value, else the one in the existing Secret (kept across upgrades), else a random
one. The random one is made once per render and remembered, so every Secret of this render carries the same.
*/}}
{{- define "areal.redis.password" -}}
{{- if .Values.redis.auth.password -}}
{{- .Values.redis.auth.password -}}
{{- else -}}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (include "areal.redis.fullname" .) -}}
{{- if and $existing $existing.data (hasKey $existing.data "password") -}}
{{- index $existing.data "password" | b64dec -}}
{{- else -}}
{{- if not (hasKey .Values.redis.auth "generatedPassword") -}}
{{- $_ := set .Values.redis.auth "generatedPassword" (randAlphaNum 32) -}}
{{- end -}}
{{- .Values.redis.auth.generatedPassword -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Whether the chart writes the URL Secrets of the job namespaces. */}}
{{- define "areal.redis.writesUrlSecrets" -}}
{{- if .Values.redis.enabled -}}
{{- if not .Values.redis.auth.existingSecret }}true{{ end -}}
{{- else if .Values.redis.external.url -}}
true
{{- end -}}
{{- end -}}

{{- define "areal.redis.url" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://:%s@%s:6379/0" (include "areal.redis.password" .) (include "areal.redis.host" .) -}}
{{- else -}}
{{- .Values.redis.external.url -}}
{{- end -}}
{{- end -}}

{{/* Checks that values.schema.json cannot express (it runs first; these are the cross-field rules). */}}
{{- define "areal.validate" -}}
{{- if and (not .Values.redis.enabled) (not .Values.redis.external.url) (not .Values.redis.external.existingSecret) -}}
{{- fail "redis.enabled is false: set redis.external.url or redis.external.existingSecret (the RLJobs need a Redis)" -}}
{{- end -}}
{{- if and (not .Values.redis.enabled) .Values.redis.external.url .Values.redis.external.existingSecret -}}
{{- fail "redis.external: set only one of url and existingSecret" -}}
{{- end -}}
{{- if and .Values.redis.enabled .Values.redis.auth.password .Values.redis.auth.existingSecret -}}
{{- fail "redis.auth: set only one of password and existingSecret" -}}
{{- end -}}
{{- end -}}
