{{/*
The RBAC rules of each component, as data. Least privilege: named API groups, resources and verbs
only (a test fails on any "*"), and nothing cluster-scoped in namespace mode. Every rule is one a
component's code uses; tests/chart/test_chart_rbac.py compares them with what each publishes.
*/}}

{{/* The operator: exactly operator/rbac.py's RULES, less kopf's peering rule (the chart runs one
operator, standalone, so kopf never reads a peering object). Every resource is namespaced, so the
same list serves a ClusterRole (cluster mode) and a Role per watched namespace. */}}
{{- define "kvfleet.rules.operator" -}}
- apiGroups: [kvfleet.io]
  # Watch InferenceDeployments; patch only to remove the finalizer an older operator version added.
  resources: [inferencedeployments]
  verbs: [get, list, watch, patch]
- apiGroups: [kvfleet.io]
  # Conditions, readyReplicas, endpoint, observedGeneration.
  resources: [inferencedeployments/status]
  verbs: [get, patch]
- apiGroups: [kvfleet.io]
  # Children carry ownerReferences with blockOwnerDeletion (OwnerReferencesPermissionEnforcement).
  resources: [inferencedeployments/finalizers]
  verbs: [update]
- apiGroups: [apps]
  # Engine Deployment: watched for drift (labelled children only), server-side apply; never deleted.
  resources: [deployments]
  verbs: [get, list, watch, create, patch]
- apiGroups: [""]
  # Engine Service and the launcher's spec ConfigMap, as above.
  resources: [services, configmaps]
  verbs: [get, list, watch, create, patch]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch]
- apiGroups: [monitoring.coreos.com]
  # The engine ServiceMonitor, only where the Prometheus Operator CRD exists (found by discovery).
  resources: [servicemonitors]
  verbs: [get, list, watch, create, patch]
- apiGroups: [""]
  # Engine pods (watched, labelled ones only): why unready ones fail, pull progress, measured cold start.
  resources: [pods]
  verbs: [list, watch]
- apiGroups: [""]
  # An Event per status transition.
  resources: [events]
  verbs: [create]
{{- end -}}

{{/* The router: lists once, then watches (kvfleet/kube/watch.py; it never gets one object). */}}
{{- define "kvfleet.rules.router" -}}
- apiGroups: [kvfleet.io]
  # Served names and spec.routing of each deployment.
  resources: [inferencedeployments]
  verbs: [list, watch]
- apiGroups: [discovery.k8s.io]
  # Ready engine endpoints, selected by the kvfleet.io/deployment label.
  resources: [endpointslices]
  verbs: [list, watch]
{{- end -}}

{{/* The autoscaler in the namespaces it scales: it lists deployments once, then watches them
(kvfleet/kube/watch.py), and merge-patches its decision into status (desiredReplicas,
scaleReason, lastScaleTime), never spec. */}}
{{- define "kvfleet.rules.autoscaler" -}}
- apiGroups: [kvfleet.io]
  resources: [inferencedeployments]
  verbs: [list, watch]
- apiGroups: [kvfleet.io]
  resources: [inferencedeployments/status]
  verbs: [patch]
{{- end -}}

{{/* The autoscaler in its own namespace: its leader-election Lease. create cannot be limited to a
name (the object does not exist yet); reading and renewing are limited to the one Lease. */}}
{{- define "kvfleet.rules.autoscalerLease" -}}
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  verbs: [create]
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  resourceNames: [kvfleet-autoscaler]
  verbs: [get, patch]
{{- end -}}
