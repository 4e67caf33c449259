{{/* Names and labels. */}}
{{- define "specdec.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "specdec.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "specdec.labels" -}}
app.kubernetes.io/name: {{ include "specdec.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* Selector labels of one component: "server" (the sidecar pod), "coordinator", "verifier", "drafter". */}}
{{- define "specdec.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specdec.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "specdec.image" -}}
{{- $tag := .Values.image.tag | default (printf "%s-%s" .Chart.AppVersion .Values.image.variant) -}}
{{ printf "%s:%s" .Values.image.repository $tag }}
{{- end -}}

{{- define "specdec.cacheClaim" -}}
{{- if eq .Values.models.cache.type "existingClaim" -}}
{{ .Values.models.cache.existingClaim }}
{{- else -}}
{{ include "specdec.fullname" . }}-models
{{- end -}}
{{- end -}}

{{/* Service DNS names in split mode. */}}
{{- define "specdec.verifierHost" -}}{{ include "specdec.fullname" . }}-verifier{{- end -}}
{{- define "specdec.drafterHost" -}}{{ include "specdec.fullname" . }}-drafter{{- end -}}

{{/* gRPC probes on a container's health-only port. */}}
{{- define "specdec.probes" -}}
{{- $p := .root.Values.probes -}}
startupProbe:
  grpc: {port: {{ .port }}}
  periodSeconds: {{ $p.startup.periodSeconds }}
  failureThreshold: {{ $p.startup.failureThreshold }}
  timeoutSeconds: {{ $p.startup.timeoutSeconds }}
readinessProbe:
  grpc: {port: {{ .port }}}
  periodSeconds: {{ $p.readiness.periodSeconds }}
  failureThreshold: {{ $p.readiness.failureThreshold }}
  timeoutSeconds: {{ $p.readiness.timeoutSeconds }}
livenessProbe:
  grpc: {port: {{ .port }}}
  periodSeconds: {{ $p.liveness.periodSeconds }}
  failureThreshold: {{ $p.liveness.failureThreshold }}
  timeoutSeconds: {{ $p.liveness.timeoutSeconds }}
{{- end -}}

{{/* Environment every service container gets: the model cache, OTel. */}}
{{- define "specdec.env" -}}
- name: SPECDEC_HOME
  value: /models
- name: HOME
  value: /tmp
{{- if .root.Values.otel.enabled }}
- name: OTEL_SERVICE_NAME
  value: {{ printf "%s-%s" .root.Values.otel.serviceNamePrefix .component | quote }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ .root.Values.otel.endpoint | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ .root.Values.otel.protocol | quote }}
- name: K8S_POD_NAME
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: "k8s.pod.name=$(K8S_POD_NAME),k8s.namespace.name={{ .root.Release.Namespace }}"
{{- with .root.Values.otel.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}
{{- end -}}

{{/* A model service container: "verifier" or "drafter". */}}
{{- define "specdec.modelContainer" -}}
{{- $root := .root -}}
{{- $v := index $root.Values .component -}}
{{- $split := eq $root.Values.mode "split" -}}
- name: {{ .component }}
  image: {{ include "specdec.image" $root }}
  imagePullPolicy: {{ $root.Values.image.pullPolicy }}
  command: [{{ printf "specdec-%s" .component | quote }}]
  args:
    - --model={{ ternary $root.Values.models.target $root.Values.models.draft (eq .component "verifier") }}
    {{- include "specdec.modelSettings" $v | nindent 4 }}  {{- /* _settings.tpl: derived from the settings table */}}
    {{- if $split }}
    - --host=0.0.0.0
    - --port={{ $v.port }}
    {{- else }}
    {{- /* Sidecar mode: a Unix socket in a 0700 directory (made by the service) inside the pod-private emptyDir; no TCP port. */}}
    - --uds=/run/specdec/private/{{ .component }}.sock
    {{- end }}
    - --health-host=0.0.0.0  {{- /* kubelet probes reach the pod's IP */}}
    - --grace-period={{ add $root.Values.gracePeriodSeconds 5 }}
    {{- if $split }}
    - --tls-cert=/etc/specdec/backend-tls/tls.crt
    - --tls-key=/etc/specdec/backend-tls/tls.key
    - --tls-client-ca=/etc/specdec/backend-tls/ca.crt
    {{- end }}
    {{- range $v.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  ports:
    {{- if $split }}
    - {name: grpc, containerPort: {{ $v.port }}, protocol: TCP}
    {{- end }}
    - {name: {{ printf "%s-health" (trunc 3 .component) }}, containerPort: {{ $v.healthPort }}, protocol: TCP}
  env:
    {{- include "specdec.env" (dict "root" $root "component" .component) | nindent 4 }}
  {{- include "specdec.probes" (dict "root" $root "port" $v.healthPort) | nindent 2 }}
  resources:
    {{- $resources := deepCopy $v.resources }}
    {{- if gt (int $v.gpus) 0 }}
    {{- $_ := set $resources "limits" (merge (default dict $resources.limits) (dict "nvidia.com/gpu" $v.gpus)) }}
    {{- end }}
    {{- toYaml $resources | nindent 4 }}
  securityContext:
    {{- toYaml $root.Values.securityContext | nindent 4 }}
  volumeMounts:
    - {name: models, mountPath: /models, readOnly: true}
    - {name: tmp, mountPath: /tmp}
    {{- if $split }}
    - {name: backend-tls, mountPath: /etc/specdec/backend-tls, readOnly: true}
    {{- else }}
    - {name: sockets, mountPath: /run/specdec}
    {{- end }}
{{- end -}}

{{/* The coordinator container. */}}
{{- define "specdec.coordinatorContainer" -}}
{{- $root := . -}}
{{- $c := .Values.coordinator -}}
{{- $split := eq .Values.mode "split" -}}
- name: coordinator
  image: {{ include "specdec.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: ["specdec-coordinator"]
  args:
    {{- if $split }}
    - --verifier={{ include "specdec.verifierHost" . }}:{{ .Values.verifier.port }}
    - --drafter={{ include "specdec.drafterHost" . }}:{{ .Values.drafter.port }}
    - --backend-tls-ca=/etc/specdec/backend-tls/ca.crt
    - --backend-tls-cert=/etc/specdec/backend-tls/tls.crt
    - --backend-tls-key=/etc/specdec/backend-tls/tls.key
    {{- else }}
    - --verifier=unix:/run/specdec/private/verifier.sock
    - --drafter=unix:/run/specdec/private/drafter.sock
    {{- end }}
    - --host=0.0.0.0
    - --port={{ $c.port }}
    {{- if $c.httpPort }}
    - --http-port={{ $c.httpPort }}
    {{- end }}
    - --health-host=0.0.0.0
    {{- include "specdec.coordinatorSettings" $c | nindent 4 }}  {{- /* _settings.tpl: derived from the settings table */}}
    - --grace-period={{ .Values.gracePeriodSeconds }}
    {{- if .Values.metrics.enabled }}
    - --metrics-port={{ .Values.metrics.port }}
    {{- end }}
    {{- if .Values.tls.enabled }}
    - --tls-cert=/etc/specdec/tls/tls.crt
    - --tls-key=/etc/specdec/tls/tls.key
    {{- if .Values.tls.clientCA }}
    - --tls-client-ca=/etc/specdec/tls/ca.crt
    {{- end }}
    {{- end }}
    {{- if .Values.auth.enabled }}
    - --auth-token-file=/etc/specdec/auth/{{ .Values.auth.secretKey }}
    {{- end }}
    {{- range $c.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  ports:
    - {name: grpc, containerPort: {{ $c.port }}, protocol: TCP}
    {{- if $c.httpPort }}
    - {name: http, containerPort: {{ $c.httpPort }}, protocol: TCP}
    {{- end }}
    - {name: coord-health, containerPort: {{ $c.healthPort }}, protocol: TCP}
    {{- if .Values.metrics.enabled }}
    - {name: metrics, containerPort: {{ .Values.metrics.port }}, protocol: TCP}
    {{- end }}
  env:
    {{- include "specdec.env" (dict "root" . "component" "coordinator") | nindent 4 }}
  {{- include "specdec.probes" (dict "root" . "port" $c.healthPort) | nindent 2 }}
  resources:
    {{- toYaml $c.resources | nindent 4 }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  volumeMounts:
    - {name: tmp, mountPath: /tmp}
    {{- if .Values.tls.enabled }}
    - {name: tls, mountPath: /etc/specdec/tls, readOnly: true}
    {{- end }}
    {{- if .Values.auth.enabled }}
    - {name: auth, mountPath: /etc/specdec/auth, readOnly: true}
    {{- end }}
    {{- if $split }}
    - {name: backend-tls, mountPath: /etc/specdec/backend-tls, readOnly: true}
    {{- else }}
    - {name: sockets, mountPath: /run/specdec}
    {{- end }}
{{- end -}}

{{/* The init container that pulls the models into the cache. */}}
{{- define "specdec.pullContainer" -}}
- name: pull-models
  image: {{ include "specdec.image" .root }}
  imagePullPolicy: {{ .root.Values.image.pullPolicy }}
  command: ["specdec", "models", "pull"]
  args:
    {{- range .models }}
    - {{ . | quote }}
    {{- end }}
  env:
    - {name: SPECDEC_HOME, value: /models}
    - {name: HOME, value: /tmp}
    {{- with .root.Values.models.indexUrl }}
    - {name: SPECDEC_INDEX_URL, value: {{ . | quote }}}
    {{- end }}
  resources:
    requests: {cpu: 500m, memory: 1Gi}
    limits: {memory: 8Gi}
  securityContext:
    {{- toYaml .root.Values.securityContext | nindent 4 }}
  volumeMounts:
    - {name: models, mountPath: /models}
    - {name: tmp, mountPath: /tmp}
{{- end -}}

{{/* The model cache volume. */}}
{{- define "specdec.modelsVolume" -}}
- name: models
{{- if eq .Values.models.cache.type "emptyDir" }}
  emptyDir:
    sizeLimit: {{ .Values.models.cache.size }}
{{- else }}
  persistentVolumeClaim:
    claimName: {{ include "specdec.cacheClaim" . }}
{{- end }}
{{- end -}}

{{- define "specdec.podSpecCommon" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
terminationGracePeriodSeconds: {{ add .Values.gracePeriodSeconds 10 }}
enableServiceLinks: false
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Pod annotations; Prometheus scrape hints on the pod that runs the coordinator. */}}
{{- define "specdec.podAnnotations" -}}
{{- $v := .root.Values -}}
{{- if and $v.metrics.enabled $v.metrics.podAnnotations .coordinator }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ $v.metrics.port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- with $v.podAnnotations }}
{{ toYaml . }}
{{- end }}
{{- end -}}
