{{/* The release's base name: the release name, with the chart's appended unless it already holds it. */}}
{{- define "tokenmill.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tokenmill.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* A model's pods: ctx = dict "root" $ "model" $model */}}
{{- define "tokenmill.serverSelector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: server
tokenmill.io/model: {{ .model.name }}
{{- end -}}

{{- define "tokenmill.routerSelector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: router
tokenmill.io/model: {{ .model.name }}
{{- end -}}

{{/*
terminationGracePeriodSeconds: the preStop sleep, then the drain of --shutdown-timeout, then up to 5 s for the
answers of the requests failed at its end (tokenmill/api/lifecycle.py) and uvicorn's own 5 s graceful close
(tokenmill/server/launch.py), plus 5 s to spare. The kubelet's SIGKILL comes after all of that.
ctx = dict "preStop" N "shutdownTimeout" N
*/}}
{{- define "tokenmill.gracePeriod" -}}
{{- add (int .preStop) (int (ceil .shutdownTimeout)) 15 -}}
{{- end -}}

{{/* How many replicas a model may have: the router lists that many (KEDA's maximum when KEDA scales it). */}}
{{- define "tokenmill.maxReplicas" -}}
{{- if .root.Values.keda.enabled -}}{{ .root.Values.keda.maxReplicaCount }}{{- else -}}{{ .model.replicas }}{{- end -}}
{{- end -}}

{{/* The --kv-events-config each replica publishes with when the router is on. */}}
{{- define "tokenmill.kvEventsConfig" -}}
{{- dict "enable_kv_cache_events" true "publisher" "zmq" "endpoint" (printf "tcp://*:%v" .Values.router.kvEvents.port) "replay_endpoint" (printf "tcp://*:%v" .Values.router.kvEvents.replayPort) | toJson -}}
{{- end -}}
