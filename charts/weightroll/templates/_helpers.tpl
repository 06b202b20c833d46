{{/*
Names, labels and the operator's RBAC rules. Every resource of the chart uses these.
*/}}

{{- define "weightroll.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "weightroll.fullname" -}}
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

{{- define "weightroll.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "weightroll.selectorLabels" -}}
app.kubernetes.io/name: {{ include "weightroll.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "weightroll.labels" -}}
helm.sh/chart: {{ include "weightroll.chart" . }}
{{ include "weightroll.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: weightroll
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "weightroll.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (printf "%s-operator" (include "weightroll.fullname" .)) .Values.serviceAccount.name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "weightroll.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{/*
The operator's RBAC rules: exactly the verbs it uses, no more.
tests/charts/test_rbac_audit_cluster.py runs rollouts and a deletion under the chart's
ServiceAccount on a real kube-apiserver with its audit log on and checks these rules grant
exactly the (verb, resource, subresource) tuples the log shows; test_security_cluster.py removes
each rule to show the operator then gets a 403.
Namespaced (weightroll.rbacNamespacedRules; a Role per watched namespace, the release namespace
by default, unless operator.clusterWide or a glob in operator.watchNamespaces: then in the
ClusterRole):
- weightupdates: kopf lists and watches them and patches finalizers/progress annotations (it
  never reads one by name).
- weightupdates/status: the aggregate status, written only when it changed (patch only).
- pods: observed through @kopf.index (list/watch), annotations/labels patched (weight-state,
  owner, weight-version, trafficLabel); never read by name.
- pods/status: the `weightroll.io/weights-ready` condition, strategic merge patch (never Ready).
- events: Events for every unit transition and phase change (on the WeightUpdate) and on each
  pod (drained, updating, verified, failed); `patch` raises the count of a repeated pod Event.
- secrets: `get` of the agent token Secret named in the spec (never list/watch); limited to
  rbac.agentTokenSecretNames when set. RBAC cannot select by label: the operator itself refuses
  Secrets without `weightroll.io/agent-token: "true"`.
Cluster-scoped (weightroll.rbacClusterRules, in the ClusterRole unless every watched namespace
is a plain name: then kopf's cluster scanning is off and no cluster-scoped rule is needed):
- customresourcedefinitions: kopf's resource discovery (it watches CRDs while scanning).
- namespaces: only when a watched namespace is a glob (kopf lists namespaces to resolve it).
No kopf peering objects: leader election uses one Lease (templates/rbac.yaml).
*/}}
{{- define "weightroll.rbacNamespacedRules" -}}
- apiGroups: ["weightroll.io"]
  resources: ["weightupdates"]
  verbs: ["list", "watch", "patch"]
- apiGroups: ["weightroll.io"]
  resources: ["weightupdates/status"]
  verbs: ["patch"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch", "patch"]
- apiGroups: [""]
  resources: ["pods/status"]
  verbs: ["patch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get"]
{{- with .Values.rbac.agentTokenSecretNames }}
  resourceNames: {{ toJson . }}
{{- end }}
{{- end }}

{{- define "weightroll.rbacClusterRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- if (include "weightroll.watchGlobs" .) }}
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- end }}
{{- end }}

{{/*
Watched namespaces that are kopf patterns (globs, negations, lists) rather than plain names:
non-empty output means "some". A pattern cannot be bound per namespace, so its rules stay
cluster-wide.
*/}}
{{- define "weightroll.watchGlobs" -}}
{{- range (include "weightroll.watchNamespaces" . | fromJsonArray) }}{{ if regexMatch "[*?!]" . }}{{ . }} {{ end }}{{ end }}
{{- end }}

{{/*
The namespaces the operator watches, as a JSON list: operator.watchNamespaces, or the release
namespace alone when that is empty; an empty list (every namespace, a ClusterRole) only with the
explicit opt-in operator.clusterWide.
*/}}
{{- define "weightroll.watchNamespaces" -}}
{{- if .Values.operator.clusterWide }}
{{- if .Values.operator.watchNamespaces }}
{{- fail "operator.clusterWide watches every namespace: leave operator.watchNamespaces empty" }}
{{- end }}
{{- list | toJson }}
{{- else }}
{{- default (list .Release.Namespace) .Values.operator.watchNamespaces | toJson }}
{{- end }}
{{- end }}

{{/*
"true" when the namespaced rules are granted per namespace (Role + RoleBinding each).
*/}}
{{- define "weightroll.rbacPerNamespace" -}}
{{- if and (include "weightroll.watchNamespaces" . | fromJsonArray) (not (include "weightroll.watchGlobs" .)) }}true{{ end }}
{{- end }}

{{/*
Metric selector for alert expressions: `{{ include "weightroll.sel" (list $ "phase=\"Failed\"") }}`
renders `{phase="Failed",<metricSelector>}`.
*/}}
{{- define "weightroll.sel" -}}
{{- $root := index . 0 }}
{{- $parts := list }}
{{- range (rest .) }}{{- if . }}{{- $parts = append $parts . }}{{- end }}{{- end }}
{{- with $root.Values.prometheusRule.metricSelector }}{{- $parts = append $parts . }}{{- end }}
{{- if $parts }}{{ printf "{%s}" (join "," $parts) }}{{ end }}
{{- end }}

{{/*
The same for the agent-metric alerts (prometheusRule.agentMetricSelector).
*/}}
{{- define "weightroll.agentSel" -}}
{{- $root := index . 0 }}
{{- $parts := list }}
{{- range (rest .) }}{{- if . }}{{- $parts = append $parts . }}{{- end }}{{- end }}
{{- with $root.Values.prometheusRule.agentMetricSelector }}{{- $parts = append $parts . }}{{- end }}
{{- if $parts }}{{ printf "{%s}" (join "," $parts) }}{{ end }}
{{- end }}

{{/*
Preparing a vLLM workload for weightroll (used by templates/workload-example.yaml; copy into your
own pod templates). Argument: the chart root context.

1. weightroll.workload.readinessGates: the pod must declare the gate at creation; the operator
   sets the condition False to drain the pod and True after every rank verified the new weights.
*/}}
{{- define "weightroll.workload.readinessGates" -}}
readinessGates:
  - conditionType: weightroll.io/weights-ready
{{- end }}

{{/*
2. weightroll.workload.vllmContainer: vLLM with the worker extension and dev-mode routes, bound
   to loopback so those unauthenticated routes stay pod-local.
*/}}
{{- define "weightroll.workload.vllmContainer" -}}
{{- /* With workloadExample.inject the webhook adds the loopback host, the extension and dev mode. */ -}}
{{- $w := .Values.workloadExample -}}
- name: vllm
  image: {{ $w.vllm.image }}
  command: ["vllm", "serve"]
  args:
    - {{ $w.vllm.model | quote }}
    {{- if not (and $w.inject (eq $w.vllm.host "127.0.0.1")) }}
    - --host={{ $w.vllm.host }}
    {{- end }}
    - --port={{ $w.vllm.port }}
    {{- if not $w.inject }}
    - --worker-extension-cls=engine_agent.vllm_extension.WeightRollExtension
    {{- end }}
    {{- range $w.vllm.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  {{- if or (not $w.inject) $w.trainerNetworks }}
  env:
    {{- if not $w.inject }}
    - name: VLLM_SERVER_DEV_MODE
      value: "1"
    {{- end }}
    {{- with $w.trainerNetworks }}
    # Every worker checks a trainer's rendezvous address against these before it connects.
    - name: WEIGHTROLL_TRAINER_NETWORKS
      value: {{ join "," . | quote }}
    {{- end }}
  {{- end }}
  ports:
    - name: http
      containerPort: {{ $w.vllm.port }}
  volumeMounts:
    - name: models
      mountPath: {{ $w.models.mountPath }}
      readOnly: true
  # The restricted Pod Security Standard (the agent image runs vLLM as 65532, HOME=/tmp).
  securityContext:
    allowPrivilegeEscalation: false
    runAsNonRoot: true
    capabilities:
      drop: ["ALL"]
    seccompProfile:
      type: RuntimeDefault
  {{- with $w.vllm.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{/*
3. weightroll.workload.agentContainer: the agent sidecar on port 8470 (name `weightroll`, the
   only port the operator calls); its /readyz is the pod's readiness probe (it fails while the
   engine is paused, dirty or poisoned). It listens on the pod IP (POD_IP from the downward API),
   never on 0.0.0.0, and serves TLS with the mounted certificate when agentTLS.enabled. With
   agent.manifestPublicKey.configMap it loads only manifests signed by that key's holder.
*/}}
{{- define "weightroll.workload.agentContainer" -}}
{{- $w := .Values.workloadExample -}}
- name: weightroll-agent
  image: {{ $w.agent.image }}
  command: ["weightroll-agent"]
  args:
    - --vllm-url=http://127.0.0.1:{{ $w.vllm.port }}
    - --token-file=/var/run/weightroll/token
    - --state-dir=/var/lib/weightroll
    {{- if .Values.agentTLS.enabled }}
    - --tls-cert-file=/var/run/weightroll-tls/tls.crt
    - --tls-key-file=/var/run/weightroll-tls/tls.key
    {{- end }}
    {{- if $w.trainerNetworks }}
    # Trainers authenticate with their own Secret; the operator's token never opens their routes.
    - --trainer-token-file=/var/run/weightroll-trainer/token
    {{- end }}
    {{- range $w.agent.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  env:
    # The agent binds to the pod IP only.
    - name: POD_IP
      valueFrom:
        fieldRef:
          fieldPath: status.podIP
    # Sources and manifests must resolve (symlinks and .. followed) inside the model volume.
    - name: WEIGHTROLL_AGENT_MODEL_DIR
      value: {{ $w.models.mountPath | quote }}
    {{- with $w.initialWeights }}
    # The boot weights: what a booted pod serves and what a rollback restores.
    {{- if .version }}
    - name: WEIGHTROLL_AGENT_INITIAL_VERSION
      value: {{ .version | quote }}
    {{- end }}
    {{- $source := .source | default (hasPrefix "/" $w.vllm.model | ternary $w.vllm.model "") }}
    {{- if $source }}
    - name: WEIGHTROLL_AGENT_INITIAL_SOURCE
      value: {{ $source | quote }}
    {{- end }}
    {{- if .manifest }}
    - name: WEIGHTROLL_AGENT_INITIAL_MANIFEST
      value: {{ .manifest | quote }}
    {{- end }}
    {{- end }}
    {{- with $w.trainerNetworks }}
    # Trainer pushes: only rendezvous addresses inside these networks (none: all refused).
    - name: WEIGHTROLL_AGENT_TRAINER_NETWORKS
      value: {{ join "," . | quote }}
    {{- end }}
    {{- if $w.agent.manifestPublicKey.configMap }}
    # Signed manifests: every update's manifest needs <manifest>.sig by this key's holder.
    - name: WEIGHTROLL_AGENT_MANIFEST_PUBLIC_KEY
      value: /var/run/weightroll-manifest-key/public.pem
    {{- end }}
  ports:
    - name: weightroll
      containerPort: 8470
  readinessProbe:
    httpGet:
      path: /readyz
      port: weightroll
      {{- if .Values.agentTLS.enabled }}
      scheme: HTTPS
      {{- end }}
    periodSeconds: 5
    failureThreshold: 2
  livenessProbe:
    httpGet:
      path: /healthz
      port: weightroll
      {{- if .Values.agentTLS.enabled }}
      scheme: HTTPS
      {{- end }}
    periodSeconds: 15
    failureThreshold: 4
  volumeMounts:
    - name: weightroll-token
      mountPath: /var/run/weightroll
      readOnly: true
    {{- if $w.trainerNetworks }}
    - name: weightroll-trainer-token
      mountPath: /var/run/weightroll-trainer
      readOnly: true
    {{- end }}
    {{- if .Values.agentTLS.enabled }}
    - name: weightroll-tls
      mountPath: /var/run/weightroll-tls
      readOnly: true
    {{- end }}
    {{- if $w.agent.manifestPublicKey.configMap }}
    - name: weightroll-manifest-key
      mountPath: /var/run/weightroll-manifest-key
      readOnly: true
    {{- end }}
    - name: weightroll-state
      mountPath: /var/lib/weightroll
    - name: models
      mountPath: {{ $w.models.mountPath }}
      readOnly: true
  securityContext:
    allowPrivilegeEscalation: false
    runAsNonRoot: true
    runAsUser: 65532
    capabilities:
      drop: ["ALL"]
    seccompProfile:
      type: RuntimeDefault
  {{- with $w.agent.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{/*
4. weightroll.workload.volumes: the agent token Secret (key `token`) as a file, the agent's state
   directory (survives agent restarts within the pod) and the checkpoints, which vLLM's ranks read
   (`spec.source.uri` of a WeightUpdate is a path under this mount); the manifest-signing public
   key (a ConfigMap) when configured.
*/}}
{{- define "weightroll.workload.volumes" -}}
- name: weightroll-token
  secret:
    secretName: {{ .Values.workloadExample.tokenSecret.name }}
    defaultMode: 0400
    items:
      - key: token
        path: token
{{- if .Values.workloadExample.trainerNetworks }}
- name: weightroll-trainer-token
  secret:
    secretName: {{ .Values.workloadExample.trainerTokenSecret.name }}
    defaultMode: 0400
    items:
      - key: token
        path: token
{{- end }}
{{- if .Values.agentTLS.enabled }}
- name: weightroll-tls
  secret:
    secretName: {{ .Values.workloadExample.name }}-weightroll-tls
    defaultMode: 0400
    items:
      - key: tls.crt
        path: tls.crt
      - key: tls.key
        path: tls.key
{{- end }}
{{- with .Values.workloadExample.agent.manifestPublicKey }}
{{- if .configMap }}
- name: weightroll-manifest-key
  configMap:
    name: {{ .configMap }}
    items:
      - key: {{ .key }}
        path: public.pem
{{- end }}
{{- end }}
- name: weightroll-state
  emptyDir: {}
- name: models
  {{- toYaml .Values.workloadExample.models.volume | nindent 2 }}
{{- end }}

{{/*
One alerting rule: dict with root, alert, expr, summary, description. `for` and severity come
from prometheusRule.customRules.<alert>; runbook_url is <runbookUrlBase>/<alert>.md.
*/}}
{{- define "weightroll.alertRule" -}}
{{- $pr := .root.Values.prometheusRule }}
{{- $custom := index $pr.customRules .alert -}}
- alert: {{ .alert }}
  expr: |-
    {{- .expr | nindent 4 }}
  for: {{ $custom.for }}
  labels:
    severity: {{ $custom.severity }}
    {{- with $pr.additionalRuleLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    summary: {{ .summary | quote }}
    description: {{ .description | quote }}
    runbook_url: {{ printf "%s/%s.md" (trimSuffix "/" $pr.runbookUrlBase) .alert }}
    {{- with $pr.additionalRuleAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}

{{/*
The admission webhook's Service name and TLS Secret (templates/webhook.yaml).
*/}}
{{- define "weightroll.webhookService" -}}
{{- printf "%s-webhook" (include "weightroll.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "weightroll.webhookSecretName" -}}
{{- default (printf "%s-webhook-tls" (include "weightroll.fullname" .)) .Values.webhook.existingSecret }}
{{- end }}
