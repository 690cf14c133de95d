{{/*
One kvfleet component: its Deployment. Call with
  (dict "root" $ "component" "router" "args" (list ...) "healthPath" "/health" "replicas" 2 "wakeToken" true)
"wakeToken" mounts the shared wake token (wake-token.yaml) at /var/run/kvfleet/wake/token.
"volumes" and "mounts" (lists of Volume and VolumeMount objects) add the component's own.
"policy" mounts the spec policy ConfigMap (spec-policy.yaml) at /etc/kvfleet/policy/policy.yaml
and stamps its checksum on the pod template, so a changed policy restarts the pod that reads it.
The three components differ only in command, port, probes and replica policy, so they share this.
*/}}
{{- define "kvfleet.deployment" -}}
{{- $root := .root -}}
{{- $values := index $root.Values .component -}}
{{- $singleton := eq (int .replicas) 1 -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "kvfleet.fullname" $root }}-{{ .component }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "kvfleet.componentLabels" (dict "root" $root "component" .component) | nindent 4 }}
spec:
  replicas: {{ .replicas }}
  revisionHistoryLimit: 5
  selector:
    matchLabels:
      {{- include "kvfleet.selectorLabels" (dict "root" $root "component" .component) | nindent 6 }}
  strategy:
    {{- if $singleton }}
    # A singleton: the old pod stops before the new one starts, so two never act at once.
    type: Recreate
    {{- else }}
    type: RollingUpdate
    rollingUpdate:
      maxUnavailable: 0
      maxSurge: 1
    {{- end }}
  template:
    metadata:
      labels:
        {{- include "kvfleet.selectorLabels" (dict "root" $root "component" .component) | nindent 8 }}
        {{- with $values.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- if or $values.podAnnotations .policy }}
      annotations:
        {{- if .policy }}
        kvfleet.io/policy-checksum: {{ printf "%s%s" (include "kvfleet.policyFile" $root) $root.Values.artifacts.publicKeys | sha256sum }}
        {{- end }}
        {{- with $values.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- end }}
    spec:
      serviceAccountName: {{ include "kvfleet.serviceAccountName" (dict "root" $root "component" .component) }}
      automountServiceAccountToken: true
      enableServiceLinks: false
      securityContext:
        {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- range . }}
        - name: {{ . }}
        {{- end }}
      {{- end }}
      {{- with $values.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      {{- with $values.terminationGracePeriodSeconds }}
      terminationGracePeriodSeconds: {{ . }}
      {{- end }}
      containers:
        - name: {{ .component }}
          image: {{ include "kvfleet.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          args:
            {{- toYaml .args | nindent 12 }}
            {{- with $values.extraArgs }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          env:
            - name: POD_NAMESPACE
              valueFrom:
                fieldRef:
                  fieldPath: metadata.namespace
            - name: POD_NAME
              valueFrom:
                fieldRef:
                  fieldPath: metadata.name
            {{- with $values.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            - name: http
              containerPort: {{ $values.port }}
              protocol: TCP
          readinessProbe:
            httpGet:
              path: {{ .healthPath }}
              port: http
            periodSeconds: 5
            failureThreshold: 3
          livenessProbe:
            httpGet:
              path: {{ .healthPath }}
              port: http
            initialDelaySeconds: 10
            periodSeconds: 10
            failureThreshold: 6
          securityContext:
            {{- toYaml $root.Values.containerSecurityContext | nindent 12 }}
          resources:
            {{- toYaml $values.resources | nindent 12 }}
          volumeMounts:
            - name: tmp
              mountPath: /tmp
            {{- if .wakeToken }}
            - name: wake-token
              mountPath: /var/run/kvfleet/wake
              readOnly: true
            {{- end }}
            {{- if .policy }}
            - name: policy
              mountPath: /etc/kvfleet/policy
              readOnly: true
            {{- end }}
            {{- with .mounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
      volumes:
        - name: tmp
          emptyDir:
            medium: Memory
            sizeLimit: {{ $root.Values.tmpSizeLimit }}
        {{- if .wakeToken }}
        - name: wake-token
          secret:
            secretName: {{ include "kvfleet.fullname" $root }}-wake-token
            defaultMode: 0444
        {{- end }}
        {{- if .policy }}
        - name: policy
          configMap:
            name: {{ include "kvfleet.fullname" $root }}-policy
        {{- end }}
        {{- with .volumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $values.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $values.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $values.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if and $values.topologySpread $values.topologySpread.enabled (not $singleton) }}
      topologySpreadConstraints:
        - maxSkew: {{ $values.topologySpread.maxSkew }}
          topologyKey: {{ $values.topologySpread.topologyKey }}
          whenUnsatisfiable: {{ $values.topologySpread.whenUnsatisfiable }}
          labelSelector:
            matchLabels:
              {{- include "kvfleet.selectorLabels" (dict "root" $root "component" .component) | nindent 14 }}
      {{- end }}
{{- end -}}

{{/* The Service of one component; call with (dict "root" $ "component" "router" "type" "ClusterIP" "port" 80). */}}
{{- define "kvfleet.service" -}}
{{- $root := .root -}}
{{- $values := index $root.Values .component -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "kvfleet.fullname" $root }}-{{ .component }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "kvfleet.componentLabels" (dict "root" $root "component" .component) | nindent 4 }}
  {{- with $values.service.annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  type: {{ .type }}
  selector:
    {{- include "kvfleet.selectorLabels" (dict "root" $root "component" .component) | nindent 4 }}
  ports:
    - name: http
      port: {{ .port }}
      targetPort: http
      protocol: TCP
{{- end -}}

{{/* ServiceAccount, (Cluster)Role(s) and binding(s) of one component; call with
(dict "root" $ "component" "router" "rules" (include "kvfleet.rules.router" $) "ownNamespaceRules" "").
Cluster mode: one ClusterRole with the rules, bound cluster-wide. Namespace mode: a Role with the
rules in each watched namespace (nothing cluster-scoped). ownNamespaceRules (e.g. a leader-election
Lease) go in a Role "<name>-self" in the release namespace, in both modes. */}}
{{- define "kvfleet.access" -}}
{{- $root := .root -}}
{{- $values := index $root.Values .component -}}
{{- $name := printf "%s-%s" (include "kvfleet.fullname" $root) .component -}}
{{- $sa := include "kvfleet.serviceAccountName" (dict "root" $root "component" .component) -}}
{{- $labels := include "kvfleet.componentLabels" (dict "root" $root "component" .component) -}}
{{- if $values.serviceAccount.create }}
---
apiVersion: v1
kind: ServiceAccount
metadata:
  name: {{ $sa }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- $labels | nindent 4 }}
  {{- with $values.serviceAccount.annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
{{- if $root.Values.rbac.create }}
{{- if eq $root.Values.scope.mode "cluster" }}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: {{ $name }}
  labels:
    {{- $labels | nindent 4 }}
rules:
  {{- .rules | nindent 2 }}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: {{ $name }}
  labels:
    {{- $labels | nindent 4 }}
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: {{ $name }}
subjects:
  - kind: ServiceAccount
    name: {{ $sa }}
    namespace: {{ $root.Release.Namespace }}
{{- else }}
{{- range $ns := (include "kvfleet.watchNamespaces" $root | fromJsonArray) }}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata:
  name: {{ $name }}
  namespace: {{ $ns }}
  labels:
    {{- $labels | nindent 4 }}
rules:
  {{- $.rules | nindent 2 }}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata:
  name: {{ $name }}
  namespace: {{ $ns }}
  labels:
    {{- $labels | nindent 4 }}
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: Role
  name: {{ $name }}
subjects:
  - kind: ServiceAccount
    name: {{ $sa }}
    namespace: {{ $root.Release.Namespace }}
{{- end }}
{{- end }}
{{- with .ownNamespaceRules }}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata:
  name: {{ $name }}-self
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- $labels | nindent 4 }}
rules:
  {{- . | nindent 2 }}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata:
  name: {{ $name }}-self
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- $labels | nindent 4 }}
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: Role
  name: {{ $name }}-self
subjects:
  - kind: ServiceAccount
    name: {{ $sa }}
    namespace: {{ $root.Release.Namespace }}
{{- end }}
{{- end }}
{{- end -}}
