{{- define "colocate-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "colocate-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "colocate-operator.labels" -}}
{{ include "colocate-operator.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "colocate-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "colocate-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The namespaces the operator manages, as a JSON list: watchNamespaces, else the release's namespace; empty
(every namespace) only with rbac.clusterWide, which may not be combined with a list. */}}
{{- define "colocate-operator.watchNamespaces" -}}
{{- if .Values.rbac.clusterWide -}}
{{- if .Values.watchNamespaces -}}
{{- fail "rbac.clusterWide manages every namespace: leave watchNamespaces empty, or set rbac.clusterWide=false to manage only the listed ones" -}}
{{- end -}}
{{- list | toJson -}}
{{- else -}}
{{- default (list .Release.Namespace) .Values.watchNamespaces | toJson -}}
{{- end -}}
{{- end -}}

{{/* externalMetaStore.allowedAddresses: names fully qualified or IPs, as the operator requires
(colocate_operator/addresses.py; it would refuse to start): a short name is completed by each pod's DNS search
path. A name is fully qualified when it ends with a dot, or has three labels or more and does not end in .svc
(under `*.`, the domain needs two). */}}
{{- define "colocate-operator.checkAllowList" -}}
{{- range .Values.externalMetaStore.allowedAddresses }}
{{- $host := regexReplaceAll ":[0-9]+$" (lower .) "" }}
{{- $wild := hasPrefix "*." $host }}
{{- $name := trimPrefix "*." $host }}
{{- if not (or (eq . "*") (contains "/" .) (regexMatch "^[0-9.]+$" $name) (hasSuffix "." $name)) }}
{{- $labels := splitList "." $name }}
{{- if or (lt (len $labels) (ternary 2 3 $wild)) (eq (last $labels) "svc") }}
{{- fail (printf "externalMetaStore.allowedAddresses: %q is not a fully qualified name or an IP address; a short name is completed by each pod's DNS search path, so it would name a different host in every namespace (write e.g. redis.shared.svc.cluster.local, or end the name with a dot)" .) }}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Every verb the operator uses in a namespace it manages, and nothing else (the integration suite runs the
operator under exactly these rules, so a missing verb fails a test):
- colocatejobs: get (each pass), list/watch (kopf), delete (ttlSecondsAfterFinished), patch (spec.suspend,
  only on a rollout consistency breach of a job whose action is SuspendAtStepBoundary); status: patch;
  finalizers: update, because children set blockOwnerDeletion (OwnerReferencesPermissionEnforcement).
- pods: list (each pass), list/watch (kopf), get (a pod name held by another object, read back), create,
  delete (group restarts, suspend, a pod stuck on a lost node).
- services, secrets, networkpolicies, poddisruptionbudgets, resourceclaimtemplates: get (existence, metadata
  only except an External password Secret) and create; garbage collection deletes them through their
  ownerReferences.
- deployments (the Redis): get (readiness), list/watch (kopf), create.
- resourceclaims: get (allocation status). events: create (the operator's and kopf's).
- scheduling.k8s.io workloads, podgroups (native gang scheduling, where served): get (metadata) and create.
The step follower reads the password Secret of the jobs' meta-stores: that is the `get` on secrets. */}}
{{- define "colocate-operator.rules" -}}
- apiGroups: [colocate.dev]
  resources: [colocatejobs]
  verbs: [get, list, watch, delete, patch]
- apiGroups: [colocate.dev]
  resources: [colocatejobs/status]
  verbs: [patch]
- apiGroups: [colocate.dev]
  resources: [colocatejobs/finalizers]
  verbs: [update]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, create, delete]
# Services, NetworkPolicies and PodDisruptionBudgets are listed (metadata only) once per resync interval
# for all jobs of a namespace at once; Secrets are never listed, only read by name.
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, create]
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, create]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, create]
- apiGroups: [resource.k8s.io]
  resources: [resourceclaimtemplates]
  verbs: [get, create]
- apiGroups: [resource.k8s.io]
  resources: [resourceclaims]
  verbs: [get]
# Native gang scheduling, where the cluster serves it (Kubernetes 1.37, GenericWorkload): the job's Workload
# and its PodGroup, read (metadata only) and created; garbage collection deletes them.
- apiGroups: [scheduling.k8s.io]
  resources: [workloads, podgroups]
  verbs: [get, create]
# A job with a Kueue queue is a Workload of its own: created, followed, finished or handed back after an
# eviction (workloads/status).
- apiGroups: [kueue.x-k8s.io]
  resources: [workloads]
  verbs: [get, list, watch, create]
- apiGroups: [kueue.x-k8s.io]
  resources: [workloads/status]
  verbs: [patch]
{{- end -}}
