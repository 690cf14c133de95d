{{/*
The RBAC rules of each component, as data. Least privilege: named API groups, resources and verbs
only (a test fails on any "*"), and nothing cluster-scoped in namespace mode.
*/}}

{{/* Rules the operator needs in every namespace it manages. */}}
{{- define "kvfleet.rules.operator" -}}
- apiGroups: [kvfleet.io]
  resources: [inferencedeployments]
  # patch: kopf's finalizer and last-handled-configuration annotation.
  verbs: [get, list, watch, patch]
- apiGroups: [kvfleet.io]
  resources: [inferencedeployments/status]
  verbs: [get, patch, update]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, update, delete]
- apiGroups: [""]
  resources: [services, configmaps]
  verbs: [get, list, watch, create, patch, update, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch, update, delete]
- apiGroups: [""]
  # Read-only: readiness and restart reasons for status conditions.
  resources: [pods]
  verbs: [get, list, watch]
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]
{{- end -}}

{{/* Cluster-scoped rules the operator needs in cluster mode only: kopf watches CRDs to notice when
InferenceDeployments become servable. In namespace mode kopf falls back to API discovery. */}}
{{- define "kvfleet.rules.operatorCluster" -}}
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [get, list, watch]
{{- end -}}

{{- define "kvfleet.rules.router" -}}
- apiGroups: [kvfleet.io]
  # Served names and spec.routing of each deployment.
  resources: [inferencedeployments]
  verbs: [get, list, watch]
- apiGroups: [discovery.k8s.io]
  # Ready engine endpoints, selected by the kvfleet.io/deployment label.
  resources: [endpointslices]
  verbs: [get, list, watch]
{{- end -}}

{{- define "kvfleet.rules.autoscaler" -}}
- apiGroups: [kvfleet.io]
  resources: [inferencedeployments]
  verbs: [get, list, watch]
- apiGroups: [kvfleet.io]
  # The decision lives in status (desiredReplicas, scaleReason, lastScaleTime), never in spec.
  resources: [inferencedeployments/status]
  verbs: [get, patch]
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]
{{- end -}}
