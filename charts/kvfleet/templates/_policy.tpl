{{/* The operator's policy file (operator/policy.py reads it): the same lists the admission policy
checks, so the two can never disagree. */}}
{{- define "kvfleet.policyFile" -}}
{{- $p := .Values.policy -}}
nodeCacheHostPaths: {{ $p.nodeCacheHostPaths | toJson }}
imageRegistries: {{ $p.imageRegistries | toJson }}
priorityClasses: {{ $p.priorityClasses | toJson }}
tolerationKeys: {{ $p.tolerationKeys | toJson }}
{{- end -}}

{{/* A policy list for a message: "a, b" or "none". */}}
{{- define "kvfleet.policyAllowed" -}}
{{- if . }}{{ join ", " . }}{{ else }}none{{ end -}}
{{- end -}}

{{/* A list of directories or registry prefixes without trailing "/" (the CEL adds the boundary), as
a JSON list, which is also a CEL list literal. */}}
{{- define "kvfleet.policyPrefixes" -}}
{{- $out := list -}}
{{- range . }}{{ $out = append $out (ternary . (trimSuffix "/" .) (eq . "*")) }}{{ end -}}
{{- $out | toJson -}}
{{- end -}}
