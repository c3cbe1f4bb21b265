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

{{/* The state store's URL (the chart's state Redis, or state.external.url), or "" when there is none. */}}
{{- define "loraplex.stateURL" -}}
{{- if .Values.state.enabled -}}
{{- printf "redis://%s-state:6379/0" (include "loraplex.fullname" .) -}}
{{- else -}}
{{- .Values.state.external.url -}}
{{- end -}}
{{- end -}}

{{/* The Secret holding the state store's password, or "" when it needs none. */}}
{{- define "loraplex.statePasswordSecret" -}}
{{- if .Values.state.enabled -}}
{{- if .Values.state.auth.enabled -}}
{{- default (printf "%s-state" (include "loraplex.fullname" .)) .Values.state.auth.existingSecret -}}
{{- end -}}
{{- else if .Values.state.external.url -}}
{{- .Values.state.external.passwordSecret -}}
{{- end -}}
{{- end -}}

{{/* A Redis password Secret (root, name, password): the password given, else the installed one, else a new one. */}}
{{- define "loraplex.passwordSecret" -}}
apiVersion: v1
kind: Secret
metadata:
  name: {{ .name }}
  labels:
    {{- include "loraplex.labels" .root | nindent 4 }}
type: Opaque
data:
  {{- $existing := lookup "v1" "Secret" .root.Release.Namespace .name }}
  {{- if .password }}
  password: {{ .password | b64enc | quote }}
  {{- else if and $existing $existing.data }}
  password: {{ index $existing.data "password" | quote }}
  {{- else }}
  password: {{ randAlphaNum 32 | b64enc | quote }}
  {{- end }}
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
{{- else -}}
{{- printf "%s-operator" (include "loraplex.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* The config's state: section: the values' timeout_s and stale_after_s, plus where the store is. With
     none and state.ephemeral, redis_url stays unset: the state lives in the cache's Redis. */}}
{{- define "loraplex.stateConfig" -}}
{{- $state := deepCopy (default (dict) .Values.loraplex.state) -}}
{{- $url := include "loraplex.stateURL" . -}}
{{- if $url -}}
{{- if and (eq $url (include "loraplex.redisURL" .)) (not .Values.state.ephemeral) -}}
{{- fail (printf "state.external.url is the cache's Redis (%s): the prefix cache's KV would fill the state store, and it evicts; give the state its own Redis (state.enabled: true, this chart's) or set state.ephemeral: true to accept losing bills, keys and registered adapters" $url) -}}
{{- end -}}
{{- $_ := set $state "redis_url" $url -}}
{{- $_ := set $state "cluster" (and (not .Values.state.enabled) .Values.state.external.cluster) -}}
{{- if include "loraplex.statePasswordSecret" . }}{{- $_ := set $state "password_file" "/etc/loraplex/state-redis/password" -}}{{- end -}}
{{- else if not .Values.state.ephemeral -}}
{{- fail "state: no state store (state.enabled is false and state.external.url is empty): accounts, keys, usage and the adapter registry need a Redis that never evicts and keeps its data on disk; set state.enabled: true (this chart's, with a volume) or state.external.url (yours: maxmemory-policy noeviction, appendonly yes), or state.ephemeral: true to keep them in the cache's Redis, which evicts them and loses them on restart" -}}
{{- end -}}
{{- $_ := set $state "ephemeral" .Values.state.ephemeral -}}
{{- toYaml $state -}}
{{- end -}}

{{/* The loraplex config the application is built from: the values' config plus what
     the cluster decides (both Redis, the Secrets' mount paths, the HTTP port). */}}
{{- define "loraplex.config" -}}
{{- $config := deepCopy .Values.loraplex -}}
{{- $cache := deepCopy (default (dict) $config.cache) -}}
{{- $url := include "loraplex.redisURL" . -}}
{{- if $url }}{{- $_ := set $cache "redis_url" $url -}}{{- else }}{{- $_ := set $cache "redis_url" nil -}}{{- end -}}
{{- if include "loraplex.redisPasswordSecret" . }}{{- $_ := set $cache "redis_password_file" "/etc/loraplex/redis/password" -}}{{- end -}}
{{- $_ := set $config "cache" $cache -}}
{{- $_ := set $config "state" (include "loraplex.stateConfig" . | fromYaml) -}}
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
{{- $http := merge (dict "host" "0.0.0.0" "port" 8000 "listener" "serve-proxy") (default (dict) $config.http) -}}
{{- if include "loraplex.gatewayOnHead" . }}{{- $_ := set $http "node_labels" (dict "loraplex.io/ingress" "yes") -}}{{- end -}}
{{- $_ := set $config "http" $http -}}
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

{{/* Volumes and mounts every Ray pod gets: models, the adapter store, tenants, both Redis' passwords, operator key. */}}
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
{{- with include "loraplex.statePasswordSecret" . }}
- name: state-redis-password
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
{{- if include "loraplex.statePasswordSecret" . }}
- name: state-redis-password
  mountPath: /etc/loraplex/state-redis
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

{{/* Where the head's GCS keeps its tables (host:port), or "" for no GCS fault tolerance: the values'
     redisAddress, else the state store when it is one Redis reached without TLS. */}}
{{- define "loraplex.gcsRedisAddress" -}}
{{- $ft := default (dict) .Values.ray.gcsFaultTolerance -}}
{{- if $ft.enabled -}}
{{- if $ft.redisAddress -}}
{{- $ft.redisAddress -}}
{{- else if .Values.state.enabled -}}
{{- printf "%s-state:6379" (include "loraplex.fullname" .) -}}
{{- else if .Values.state.external.url -}}
{{- if or .Values.state.external.cluster (not (hasPrefix "redis://" .Values.state.external.url)) -}}
{{- fail "ray.gcsFaultTolerance: the state store is a Redis Cluster or is reached over TLS, and this chart sets Ray's GCS up only on one plain Redis; set ray.gcsFaultTolerance.redisAddress (host:port of a plain Redis) or ray.gcsFaultTolerance.enabled: false" -}}
{{- end -}}
{{- regexReplaceAll "^redis://(?:[^@/]*@)?([^/]+).*$" .Values.state.external.url "${1}" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "loraplex.gcsRedisPasswordSecret" -}}
{{- $ft := default (dict) .Values.ray.gcsFaultTolerance -}}
{{- if $ft.redisAddress -}}
{{- $ft.passwordSecret -}}
{{- else -}}
{{- include "loraplex.statePasswordSecret" . -}}
{{- end -}}
{{- end -}}

{{/* The gateway replicas go on the head (a label on its `ray start`) when there is one of them and the
     config names no nodes for them: a worker pod that dies then takes no gateway and none of the
     requests it holds; the head has no CPUs for replicas (rayStartParams num-cpus 0). */}}
{{- define "loraplex.gatewayOnHead" -}}
{{- $http := default (dict) .Values.loraplex.http -}}
{{- if and (le (int (default 1 $http.gateway_replicas)) 1) (not $http.node_labels) -}}true{{- end -}}
{{- end -}}

{{/* A Kubernetes memory quantity (512Mi, 16Gi, 2G, 1e9, 1073741824) in bytes. */}}
{{- define "loraplex.bytes" -}}
{{- $quantity := toString . -}}
{{- $number := regexFind "^[0-9]+(\\.[0-9]+)?([eE][0-9]+)?" $quantity -}}
{{- $units := dict "" 1 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 "k" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 -}}
{{- $unit := trimPrefix $number $quantity -}}
{{- if or (not $number) (not (hasKey $units $unit)) -}}
{{- fail (printf "ray.worker.resources.requests.memory: %q is not a memory quantity this chart reads (e.g. 16Gi, 512Mi, 2G or bytes)" $quantity) -}}
{{- end -}}
{{- mulf (float64 $number) (get $units $unit) | int64 -}}
{{- end -}}

{{/* The bytes a worker pod's replicas are budgeted on the host (docs/kubernetes.md#a-workers-memory):
per replica, ray.worker.memoryPerReplica (the model, a CPU's KV cache, the runtime) and its host tier
(loraplex.residency.host_bytes), and on a CPU worker its device tier too (device_bytes); one replica per
GPU, one on a worker without. Empty when no budget bounds the host tier. */}}
{{- define "loraplex.workerBudgetBytes" -}}
{{- $residency := default (dict) .Values.loraplex.residency -}}
{{- $perReplica := .Values.ray.worker.memoryPerReplica -}}
{{- $isTiered := or (hasKey $residency "device_adapters") (hasKey $residency "device_bytes") -}}
{{- $isCPU := not .Values.ray.worker.gpusPerPod -}}
{{- if and $isTiered (kindIs "invalid" (index $residency "host_bytes")) -}}
{{- fail "loraplex.residency.host_bytes: with a device tier and no host_bytes, the host tier keeps every adapter a worker reads, so no memory request bounds a worker; set host_bytes (0: none kept)" -}}
{{- end -}}
{{- $host := int64 (default 0 (index $residency "host_bytes")) -}}
{{- $device := 0 -}}
{{- if and $isCPU (hasKey $residency "device_bytes") -}}{{- $device = int64 (default 0 $residency.device_bytes) -}}{{- end -}}
{{- $each := add (int64 $perReplica.modelBytes) (int64 $perReplica.kvBytes) (int64 $perReplica.overheadBytes) $host $device -}}
{{- mul $each (max 1 (int64 .Values.ray.worker.gpusPerPod)) -}}
{{- end -}}

{{/* Refuses a worker memory request below what its replicas are budgeted: a scheduler places pods by
their requests, and a replica past its request is the first the kubelet evicts. */}}
{{- define "loraplex.workerMemoryCheck" -}}
{{- $requested := dig "requests" "memory" "" (default (dict) .Values.ray.worker.resources) -}}
{{- $budget := int64 (include "loraplex.workerBudgetBytes" .) -}}
{{- if not $requested -}}
{{- fail (printf "ray.worker.resources.requests.memory: unset; the worker's budgets sum to %d bytes (docs/kubernetes.md#a-workers-memory)" $budget) -}}
{{- end -}}
{{- if lt (int64 (include "loraplex.bytes" $requested)) $budget -}}
{{- fail (printf "ray.worker.resources.requests.memory: %s is below the %d bytes the worker's replicas are budgeted (ray.worker.memoryPerReplica and loraplex.residency per replica; docs/kubernetes.md#a-workers-memory)" (toString $requested) $budget) -}}
{{- end -}}
{{- end -}}
