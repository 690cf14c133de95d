{{/*
Names. Truncated to 52 characters so that with the longest suffix this chart adds ("-autoscaler",
11 characters) a name stays within Kubernetes' 63-character DNS label limit.
*/}}
{{- define "kvfleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 52 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvfleet.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kvfleet.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels on every object. */}}
{{- define "kvfleet.labels" -}}
helm.sh/chart: {{ include "kvfleet.chart" . }}
app.kubernetes.io/name: {{ include "kvfleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvfleet
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of one component; call with (dict "root" $ "component" "router"). */}}
{{- define "kvfleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvfleet.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "kvfleet.componentLabels" -}}
{{ include "kvfleet.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "kvfleet.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if .Values.image.digest -}}
{{- printf "%s:%s@%s" .Values.image.repository $tag .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/* ServiceAccount name of one component; call with (dict "root" $ "component" "router"). */}}
{{- define "kvfleet.serviceAccountName" -}}
{{- $values := index .root.Values .component -}}
{{- if $values.serviceAccount.create -}}
{{- default (printf "%s-%s" (include "kvfleet.fullname" .root) .component) $values.serviceAccount.name -}}
{{- else -}}
{{- default "default" $values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The namespaces kvfleet watches in namespace mode, as a JSON list (the release namespace by default). */}}
{{- define "kvfleet.watchNamespaces" -}}
{{- if .Values.scope.namespaces -}}
{{- .Values.scope.namespaces | uniq | toJson -}}
{{- else -}}
{{- list .Release.Namespace | toJson -}}
{{- end -}}
{{- end -}}

{{/* The router's OpenAI base URL inside the cluster (the Service port is left out when it is 80). */}}
{{- define "kvfleet.routerUrl" -}}
{{- $port := int .Values.router.service.port -}}
{{- printf "http://%s-router.%s.svc%s/v1" (include "kvfleet.fullname" .) .Release.Namespace (ternary "" (printf ":%d" $port) (eq $port 80)) -}}
{{- end -}}

{{/* Command-line flags that tell the operator which namespaces to watch. */}}
{{- define "kvfleet.scopeArgs" -}}
{{- if eq .Values.scope.mode "cluster" }}
- --all-namespaces
{{- else }}
{{- range (include "kvfleet.watchNamespaces" . | fromJsonArray) }}
- --namespace={{ . }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The alert names the PrometheusRule defines (disabledAlerts must name one of them). */}}
{{- define "kvfleet.alertNames" -}}
{{- list "KvfleetDeploymentNotReady" "KvfleetQueueGrowingAtMaxReplicas" "KvfleetColdStartOverBudget" "KvfleetTTFTSLOBurnFast" "KvfleetTTFTSLOBurnSlow" "KvfleetAutoscalerMetricsStale" "KvfleetRouter5xxRatio" "KvfleetRouterDown" "KvfleetAutoscalerDown" "KvfleetOperatorDown" "KvfleetComponentInstanceDown" "KvfleetEngineCrashLooping" "KvfleetEnginePullFailing" "KvfleetKVCacheSaturated" | toJson -}}
{{- end -}}

{{/*
Fail fast on values the schema cannot express (cross-field rules), each with the key to change.
Rendered once from templates/validate.yaml.
*/}}
{{- define "kvfleet.validate" -}}
{{- $errors := list -}}
{{- $r := .Values.router -}}
{{- if and $r.enabled $r.pdb.enabled (gt (int $r.replicas) 1) (ge (int $r.pdb.minAvailable) (int $r.replicas)) -}}
{{- $errors = append $errors (printf "router.pdb.minAvailable (%d) must be below router.replicas (%d), or no router could ever be evicted and node drains would hang" (int $r.pdb.minAvailable) (int $r.replicas)) -}}
{{- end -}}
{{- if and $r.sharedNamespaces (not $r.clientNamespaceHeader) -}}
{{- $errors = append $errors "router.sharedNamespaces is only used with router.clientNamespaceHeader set (client scoping is off); set the header or remove the list" -}}
{{- end -}}
{{- $sm := .Values.monitoring.serviceMonitors -}}
{{- if gt (int $sm.scrapeTimeoutSeconds) (int $sm.intervalSeconds) -}}
{{- $errors = append $errors (printf "monitoring.serviceMonitors.scrapeTimeoutSeconds (%d) must not exceed intervalSeconds (%d)" (int $sm.scrapeTimeoutSeconds) (int $sm.intervalSeconds)) -}}
{{- end -}}
{{- $known := include "kvfleet.alertNames" . | fromJsonArray -}}
{{- range .Values.monitoring.prometheusRule.disabledAlerts -}}
{{- if not (has . $known) -}}
{{- $errors = append $errors (printf "monitoring.prometheusRule.disabledAlerts: unknown alert %q (known: %s)" . (join ", " $known)) -}}
{{- end -}}
{{- end -}}
{{- if and (eq .Values.scope.mode "cluster") .Values.scope.namespaces -}}
{{- $errors = append $errors "scope.namespaces is only used with scope.mode: namespace; remove it or set the mode" -}}
{{- end -}}
{{- if and .Values.router.enabled (eq .Values.scope.mode "namespace") (gt (len .Values.scope.namespaces) 1) -}}
{{- $errors = append $errors (printf "scope.namespaces lists %d namespaces, but the router watches one namespace or all (kvfleet router serve --namespace); use one namespace, or cluster mode" (len .Values.scope.namespaces)) -}}
{{- end -}}
{{- if and .Values.autoscaler.enabled (eq .Values.scope.mode "namespace") (gt (len .Values.scope.namespaces) 1) -}}
{{- $errors = append $errors (printf "scope.namespaces lists %d namespaces, but the autoscaler watches one namespace or all (kvfleet autoscaler run --namespace); use one namespace, or cluster mode" (len .Values.scope.namespaces)) -}}
{{- end -}}
{{- $le := .Values.autoscaler.leaderElection -}}
{{- if not (and (lt (int $le.retryPeriodSeconds) (int $le.renewDeadlineSeconds)) (lt (int $le.renewDeadlineSeconds) (int $le.leaseDurationSeconds))) -}}
{{- $errors = append $errors (printf "autoscaler.leaderElection needs retryPeriodSeconds (%d) < renewDeadlineSeconds (%d) < leaseDurationSeconds (%d): the leader must stop acting before a standby may take over" (int $le.retryPeriodSeconds) (int $le.renewDeadlineSeconds) (int $le.leaseDurationSeconds)) -}}
{{- end -}}
{{- if not (or .Values.operator.enabled .Values.router.enabled .Values.autoscaler.enabled) -}}
{{- $errors = append $errors "operator, router and autoscaler are all disabled: enable at least one" -}}
{{- end -}}
{{- if $errors -}}
{{- fail (printf "\ninvalid values:\n  - %s" (join "\n  - " $errors)) -}}
{{- end -}}
{{- end -}}
