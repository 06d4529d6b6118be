{{/* Names and labels. */}}
{{- define "slogate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "slogate.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "slogate.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "slogate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "slogate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "slogate.labels" -}}
helm.sh/chart: {{ include "slogate.chart" . }}
{{ include "slogate.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "slogate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "slogate.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "slogate.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "slogate.secretName" -}}
{{- default (printf "%s-api-keys" (include "slogate.fullname" .)) .Values.apiKeys.existingSecret }}
{{- end }}

{{- define "slogate.hasSecret" -}}
{{- $k := .Values.apiKeys -}}
{{- if or $k.existingSecret $k.clientKeys $k.adminKeys $k.policies }}true{{ end }}
{{- end }}

{{/* Where a custom profile is mounted; a name the chart does not carry stays a name. */}}
{{- define "slogate.profileRef" -}}
{{- $kind := index . 0 -}}{{- $name := index . 1 -}}{{- $profiles := index . 2 -}}
{{- if hasKey (index $profiles $kind) $name -}}
/etc/slogate/profiles/{{ $kind }}/{{ $name }}.yaml
{{- else -}}
{{ $name }}
{{- end -}}
{{- end }}

{{/*
The chart's own engines, one entry per Deployment: a list of dicts with
name (DNS-1035, also the Deployment and Service name), kind, role, model, port.
*/}}
{{- define "slogate.engineList" -}}
{{- $full := include "slogate.fullname" . | trunc 40 | trimSuffix "-" -}}
{{- $out := list -}}
{{- if .Values.vllm.enabled -}}
{{- range $role := list "collocated" "prefill" "decode" -}}
{{- $n := int (index $.Values.vllm $role).replicas -}}
{{- range $i := until $n -}}
{{- $out = append $out (dict "name" (printf "%s-vllm-%s-%d" $full $role $i) "kind" "vllm" "role" $role "model" $.Values.vllm.servedModelName "port" (int $.Values.vllm.port) "engine" "vllm") -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if .Values.simEngines.enabled -}}
{{- range $i := until (int .Values.simEngines.replicas) -}}
{{- $out = append $out (dict "name" (printf "%s-sim-%d" $full $i) "kind" "sim" "role" $.Values.simEngines.role "model" $.Values.simEngines.model "port" (int $.Values.simEngines.port) "engine" "sim") -}}
{{- end -}}
{{- end -}}
{{- toJson $out -}}
{{- end }}

{{/* gateway.yaml: the user's settings plus the engine list. */}}
{{- define "slogate.gatewayConfig" -}}
{{- $cfg := deepCopy .Values.gateway.config -}}
{{- $profiles := .Values.profiles -}}
{{- if hasKey $cfg "routing_profile" -}}
{{- $_ := set $cfg "routing_profile" (include "slogate.profileRef" (list "routing" $cfg.routing_profile $profiles)) -}}
{{- end -}}
{{- if hasKey $cfg "slo_profile" -}}
{{- $_ := set $cfg "slo_profile" (include "slogate.profileRef" (list "slo" $cfg.slo_profile $profiles)) -}}
{{- end -}}
{{- $engines := list -}}
{{- range $i, $e := .Values.gateway.engines -}}
{{- $e = deepCopy $e -}}
{{- if $e.api_key_secret -}}
{{- /* the key stays in its Secret: the gateway reads it from the variable the Deployment sets */ -}}
{{- $_ := unset $e "api_key_secret" -}}
{{- $_ := set $e "api_key_env" (include "slogate.engineKeyEnv" $i) -}}
{{- end -}}
{{- if $e.latency_profile -}}
{{- $_ := set $e "latency_profile" (include "slogate.profileRef" (list "engines" $e.latency_profile $profiles)) -}}
{{- end -}}
{{- $engines = append $engines $e -}}
{{- end -}}
{{- range $e := include "slogate.engineList" . | fromJsonArray -}}
{{- $entry := dict "name" $e.name "url" (printf "http://%s:%d" $e.name (int $e.port)) "kind" $e.kind "model" $e.model "role" $e.role -}}
{{- if eq $e.engine "vllm" -}}
{{- $_ := set $entry "priority_scheduling" $.Values.vllm.priorityScheduling -}}
{{- if $.Values.vllm.latencyProfile -}}
{{- $_ := set $entry "latency_profile" (include "slogate.profileRef" (list "engines" $.Values.vllm.latencyProfile $profiles)) -}}
{{- end -}}
{{- else -}}
{{- $_ := set $entry "latency_profile" (include "slogate.profileRef" (list "engines" $.Values.simEngines.profile $profiles)) -}}
{{- $_ := set $entry "time_scale" $.Values.simEngines.timeScale -}}
{{- if $.Values.simEngines.priorityScheduling -}}
{{- $_ := set $entry "priority_scheduling" true -}}
{{- end -}}
{{- end -}}
{{- $engines = append $engines $entry -}}
{{- end -}}
{{- $_ := set $cfg "engines" $engines -}}
{{- toYaml $cfg -}}
{{- end }}

{{/* The environment variable that carries gateway.engines[i]'s API key from its Secret. */}}
{{- define "slogate.engineKeyEnv" -}}
SLOGATE_ENGINE_API_KEY_{{ . }}
{{- end }}

{{/* Checks across values that the schema cannot express; fails the render with the reason. */}}
{{- define "slogate.validate" -}}
{{- $k := .Values.apiKeys -}}
{{- if and $k.required (not $k.existingSecret) (or (not $k.clientKeys) (not $k.adminKeys)) -}}
{{- fail "apiKeys.required: give client and admin keys, e.g. --set-json 'apiKeys.clientKeys=[\"<client key>\"]' --set-json 'apiKeys.adminKeys=[\"<admin key>\"]' (openssl rand -hex 24 makes one), or name your own Secret in apiKeys.existingSecret" -}}
{{- end -}}
{{- /* each model's roles, the chart's engines and the user's: a half of a P/D pair alone is a
fleet the gateway refuses at start-up (pods crash-looping instead of a failed install) */ -}}
{{- $roles := dict -}}
{{- range $e := include "slogate.engineList" . | fromJsonArray -}}
{{- $_ := set $roles $e.model (append (get $roles $e.model | default (list)) $e.role) -}}
{{- end -}}
{{- range $e := .Values.gateway.engines -}}
{{- $_ := set $roles $e.model (append (get $roles $e.model | default (list)) ($e.role | default "collocated")) -}}
{{- end -}}
{{- range $model, $present := $roles -}}
{{- if and (has "prefill" $present) (not (has "decode" $present)) -}}
{{- fail (printf "model %q has prefill engines but no decode engine (role: decode): the gateway would refuse this fleet at start-up" $model) -}}
{{- end -}}
{{- if and (has "decode" $present) (not (has "prefill" $present)) (not (has "collocated" $present)) -}}
{{- fail (printf "model %q has decode engines but no prefill engine (role: prefill): the gateway would refuse this fleet at start-up" $model) -}}
{{- end -}}
{{- end -}}
{{- $g := .Values.gateway -}}
{{- if and (gt (int $g.preStopSleepSeconds) 0) (ge (int $g.preStopSleepSeconds) (int $g.terminationGracePeriodSeconds)) -}}
{{- fail (printf "gateway.terminationGracePeriodSeconds (%d) must be above gateway.preStopSleepSeconds (%d): the grace period counts from the start of the preStop sleep" (int $g.terminationGracePeriodSeconds) (int $g.preStopSleepSeconds)) -}}
{{- end -}}
{{- /* a gateway grace the pod's kill cuts short: open streams were cut instead of ended with an
answer saying so */ -}}
{{- $grace := (($g.config | default dict).shutdown_grace_s) -}}
{{- /* (and 5 s more: the time the gateway gives itself to end what is open with those answers,
after the grace; uvicorn's own stop waits that long too, gateway/server.py SHUTDOWN_BACKSTOP_S) */ -}}
{{- if and (not (kindIs "invalid" $grace)) (gt (float64 $grace) (float64 (sub (sub (int $g.terminationGracePeriodSeconds) (int $g.preStopSleepSeconds)) 5))) -}}
{{- fail (printf "gateway.config.shutdown_grace_s (%v) must end before the pod is killed, with 5 s to end what is open: at most gateway.terminationGracePeriodSeconds (%d) less gateway.preStopSleepSeconds (%d) less 5" $grace (int $g.terminationGracePeriodSeconds) (int $g.preStopSleepSeconds)) -}}
{{- end -}}
{{- end }}

{{/* Volumes for custom profiles (gateway and simulated engines). */}}
{{- define "slogate.hasProfiles" -}}
{{- if or .Values.profiles.routing .Values.profiles.slo .Values.profiles.engines }}true{{ end }}
{{- end }}

{{- define "slogate.profilesVolume" -}}
- name: profiles
  configMap:
    name: {{ include "slogate.fullname" . }}-profiles
    items:
      {{- range $kind := list "routing" "slo" "engines" }}
      {{- range $name, $_ := index $.Values.profiles $kind }}
      - key: {{ printf "%s.%s.yaml" $kind $name }}
        path: {{ printf "%s/%s.yaml" $kind $name }}
      {{- end }}
      {{- end }}
{{- end }}

{{/* "redis" when the gateway replicas share their load through Redis, else "memory". */}}
{{- define "slogate.stateStore" -}}
{{- $s := .Values.stateStore -}}
{{- $g := .Values.gateway -}}
{{- if eq $s.mode "auto" -}}
{{- if or (and (not $g.autoscaling.enabled) (gt (int $g.replicas) 1)) (and $g.autoscaling.enabled (gt (int $g.autoscaling.maxReplicas) 1)) -}}
redis
{{- else -}}
memory
{{- end -}}
{{- else -}}
{{ $s.mode }}
{{- end -}}
{{- end }}

{{/* The chart runs its own Redis: the replicas share through Redis and none is named. */}}
{{- define "slogate.redisInChart" -}}
{{- $r := .Values.stateStore.redis -}}
{{- if and (eq (include "slogate.stateStore" .) "redis") (not $r.url) (not $r.existingSecret) }}true{{ end }}
{{- end }}

{{/* The chart's Redis: its Deployment, Service and password Secret (63 characters at most). */}}
{{- define "slogate.redisName" -}}
{{- printf "%s-redis" (include "slogate.fullname" . | trunc 57 | trimSuffix "-") }}
{{- end }}

{{/* The Secret holding the chart's Redis password (key password): given, or the chart's own. */}}
{{- define "slogate.redisPasswordSecret" -}}
{{- default (include "slogate.redisName" .) .Values.stateStore.redis.passwordSecret }}
{{- end }}
