{{- define "loraplex.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "loraplex.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "loraplex.selector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "loraplex.redisURL" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s-redis:6379/0" (include "loraplex.fullname" .) -}}
{{- else -}}
{{- .Values.redis.external.url -}}
{{- end -}}
{{- end -}}

{{/* The Secret holding Redis' password, or "" when Redis needs none. */}}
{{- define "loraplex.redisPasswordSecret" -}}
{{- if .Values.redis.enabled -}}
{{- if .Values.redis.auth.enabled -}}
{{- default (printf "%s-redis" (include "loraplex.fullname" .)) .Values.redis.auth.existingSecret -}}
{{- end -}}
{{- else -}}
{{- .Values.redis.external.passwordSecret -}}
{{- end -}}
{{- end -}}

{{- define "loraplex.tenantsSecret" -}}
{{- if .Values.tenants.existingSecret -}}
{{- .Values.tenants.existingSecret -}}
{{- else if .Values.tenants.items -}}
{{- printf "%s-tenants" (include "loraplex.fullname" .) -}}
{{- end -}}
{{- end -}}

{{- define "loraplex.operatorSecret" -}}
{{- if .Values.operator.existingSecret -}}
{{- .Values.operator.existingSecret -}}
{{- else if .Values.operator.key -}}
{{- printf "%s-operator" (include "loraplex.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* The loraplex config the application is built from: the values' config plus what
     the cluster decides (Redis, the Secrets' mount paths, the HTTP port). */}}
{{- define "loraplex.config" -}}
{{- $config := deepCopy .Values.loraplex -}}
{{- $cache := deepCopy (default (dict) $config.cache) -}}
{{- $url := include "loraplex.redisURL" . -}}
{{- if $url }}{{- $_ := set $cache "redis_url" $url -}}{{- else }}{{- $_ := set $cache "redis_url" nil -}}{{- end -}}
{{- if include "loraplex.redisPasswordSecret" . }}{{- $_ := set $cache "redis_password_file" "/etc/loraplex/redis/password" -}}{{- end -}}
{{- $_ := set $config "cache" $cache -}}
{{- if include "loraplex.tenantsSecret" . }}{{- $_ := set $config "tenants_file" "/etc/loraplex/tenants/tenants.yaml" -}}{{- end -}}
{{- if include "loraplex.operatorSecret" . }}{{- $_ := set $config "operator_key_file" "/etc/loraplex/operator/operator-key" -}}{{- end -}}
{{- $registry := deepCopy (default (dict) $config.registry) -}}
{{- $_ := set $registry "store_dir" .Values.adapterStore.mountPath -}}
{{- if .Values.adapterStore.url }}{{- $_ := set $registry "store_url" .Values.adapterStore.url -}}{{- end -}}
{{- $workerPods := max (int .Values.ray.worker.replicas) (int .Values.ray.worker.maxReplicas) -}}
{{- if and (not $registry.store_url) (not .Values.adapterStore.existingClaim) (gt $workerPods 1) -}}
{{- fail (printf "adapterStore: up to %d worker pods with the default emptyDir adapter store: workers on other pods cannot read the gateway's disk, so an adapter uploaded at run time would not load there; set adapterStore.url (s3://bucket/prefix) or adapterStore.existingClaim (a ReadWriteMany volume)" $workerPods) -}}
{{- end -}}
{{- $_ := set $config "registry" $registry -}}
{{- $_ := set $config "http" (merge (dict "host" "0.0.0.0" "port" 8000 "listener" "serve-proxy") (default (dict) $config.http)) -}}
{{- toYaml $config -}}
{{- end -}}

{{- define "loraplex.serveConfigV2" -}}
applications:
  - name: loraplex
    import_path: gateway.serve:app_from_config
    route_prefix: /
    args:
      base_dir: {{ .Values.models.mountPath }}
      config:
{{ include "loraplex.config" . | indent 8 }}
{{- end -}}

{{/* Volumes and mounts every Ray pod gets: models, the adapter store, tenants, Redis password, operator key. */}}
{{- define "loraplex.volumes" -}}
- name: models
{{- if .Values.models.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.models.existingClaim }}
    readOnly: true
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.models.emptyDirSizeLimit }}
{{- end }}
- name: adapter-store
{{- if .Values.adapterStore.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.adapterStore.existingClaim }}
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.adapterStore.emptyDirSizeLimit }}
{{- end }}
{{- with include "loraplex.tenantsSecret" . }}
- name: tenants
  secret:
    secretName: {{ . }}
    items: [{key: tenants.yaml, path: tenants.yaml}]
{{- end }}
{{- with include "loraplex.redisPasswordSecret" . }}
- name: redis-password
  secret:
    secretName: {{ . }}
    items: [{key: password, path: password}]
{{- end }}
{{- with include "loraplex.operatorSecret" . }}
- name: operator-key
  secret:
    secretName: {{ . }}
    items: [{key: operator-key, path: operator-key}]
{{- end }}
{{- end -}}

{{- define "loraplex.volumeMounts" -}}
- name: models
  mountPath: {{ .Values.models.mountPath }}
  readOnly: {{ not .Values.models.initContainer.enabled }}
- name: adapter-store
  mountPath: {{ .Values.adapterStore.mountPath }}
{{- if include "loraplex.tenantsSecret" . }}
- name: tenants
  mountPath: /etc/loraplex/tenants
  readOnly: true
{{- end }}
{{- if include "loraplex.redisPasswordSecret" . }}
- name: redis-password
  mountPath: /etc/loraplex/redis
  readOnly: true
{{- end }}
{{- if include "loraplex.operatorSecret" . }}
- name: operator-key
  mountPath: /etc/loraplex/operator
  readOnly: true
{{- end }}
{{- end -}}

{{- define "loraplex.initContainers" -}}
{{- if .Values.models.initContainer.enabled }}
initContainers:
  - name: fetch-models
    image: {{ .Values.models.initContainer.image }}
    command: {{ toJson .Values.models.initContainer.command }}
    volumeMounts:
      - name: models
        mountPath: {{ .Values.models.mountPath }}
{{- end }}
{{- end -}}

{{/* The adapter store's AWS variables (gateway and workers: either may run on any Ray pod). */}}
{{- define "loraplex.storeEnv" -}}
{{- with .Values.adapterStore.endpointUrl }}
- {name: AWS_ENDPOINT_URL, value: {{ . | quote }}}
{{- end }}
{{- with .Values.adapterStore.region }}
- {name: AWS_DEFAULT_REGION, value: {{ . | quote }}}
{{- end }}
{{- end -}}

{{- define "loraplex.storeEnvFrom" -}}
{{- with .Values.adapterStore.credentialsSecret }}
envFrom:
  - secretRef: {name: {{ . }}}
{{- end }}
{{- end -}}

{{/* Ray Serve's throughput settings, the same as gateway/serve.py's SERVE_ENV. */}}
{{- define "loraplex.serveEnv" -}}
- {name: RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD, value: "0"}
- {name: RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP, value: "0"}
- {name: RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE, value: "1000"}
- {name: RAY_SERVE_CONTROL_LOOP_INTERVAL_S, value: "0.5"}
- {name: RAY_SERVE_METRICS_EXPORT_INTERVAL_MS, value: "1000"}
{{- end }}
