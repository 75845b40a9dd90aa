{{/* The release's base name: the release name when it already says kmend, else <release>-kmend. */}}
{{- define "kmend.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kmend.agentName" -}}
{{- printf "%s-agent" (include "kmend.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kmend.labels" -}}
app.kubernetes.io/part-of: kmend
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels: never change across upgrades. */}}
{{- define "kmend.controlPlaneSelector" -}}
app.kubernetes.io/name: {{ include "kmend.fullname" . }}
app.kubernetes.io/component: control-plane
{{- end -}}

{{- define "kmend.agentSelector" -}}
app.kubernetes.io/name: {{ include "kmend.agentName" . }}
{{- end -}}

{{- define "kmend.image" -}}
{{- printf "%s:%s" .image.repository (default .chart.AppVersion .image.tag) -}}
{{- end -}}

{{- define "kmend.secretName" -}}
{{- $t := index .root.Values.tokens .kind -}}
{{- default (printf "%s-%s" (include "kmend.fullname" .root) .kind) $t.secretName -}}
{{- end -}}

{{/*
One env entry per set key of a settings map: KMEND_<PREFIX><KEY>, strings as they are, numbers, booleans and
lists as JSON (pydantic-settings reads lists as JSON; JSON never writes a large number in exponent form).
*/}}
{{- define "kmend.settingsEnv" -}}
{{- range $key, $value := .config }}
{{- if not (kindIs "invalid" $value) }}
- name: {{ printf "%s%s" $.prefix (upper $key) }}
  value: {{ if kindIs "string" $value }}{{ $value | quote }}{{ else }}{{ $value | toJson | quote }}{{ end }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The restricted Pod Security container context (the control plane). */}}
{{- define "kmend.restrictedContainer" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities: {drop: [ALL]}
seccompProfile: {type: RuntimeDefault}
{{- end -}}
