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

{{/* What the operator does to the children of a ColocateJob, shared by the ClusterRole and the Roles. */}}
{{- define "colocate-operator.rules" -}}
- apiGroups: [colocate.dev]
  resources: [colocatejobs]
  verbs: [get, list, watch, patch, update]
- apiGroups: [colocate.dev]
  resources: [colocatejobs/status]
  verbs: [get, patch, update]
- apiGroups: [""]
  resources: [pods, services, secrets]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]
- apiGroups: [events.k8s.io]
  resources: [events]
  verbs: [create, patch]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [resource.k8s.io]
  resources: [resourceclaimtemplates]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [resource.k8s.io]
  resources: [resourceclaims]
  verbs: [get, list, watch]
{{- end -}}
