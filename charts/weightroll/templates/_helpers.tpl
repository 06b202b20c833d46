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
The operator's ClusterRole rules: exactly the verbs it uses, no more. tests/charts checks this
list against the set the operator needs, and tests/cluster (RBAC) against a real apiserver.
- weightupdates: kopf watches them and patches finalizers/progress annotations.
- weightupdates/status: the aggregate status, written only when it changed.
- pods: observed through @kopf.index (list/watch), annotations/labels patched (weight-state,
  owner, weight-version, trafficLabel).
- pods/status: the `weightroll.io/weights-ready` condition, strategic merge patch (never Ready).
- events: kopf posts Events for every unit transition and phase change.
- secrets: `get` of the agent token Secret named in the spec (never list/watch).
- customresourcedefinitions, namespaces: kopf's resource and namespace discovery.
No kopf peering objects: the operator runs standalone (one replica, Recreate).
*/}}
{{- define "weightroll.rbacRules" -}}
- apiGroups: ["weightroll.io"]
  resources: ["weightupdates"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["weightroll.io"]
  resources: ["weightupdates/status"]
  verbs: ["get", "patch"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: [""]
  resources: ["pods/status"]
  verbs: ["get", "patch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get"]
{{- with .Values.rbac.agentTokenSecretNames }}
  resourceNames: {{ toJson . }}
{{- end }}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- with .Values.rbac.extraRules }}
{{ toYaml . }}
{{- end }}
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
{{- $w := .Values.workloadExample -}}
- name: vllm
  image: {{ $w.vllm.image }}
  command: ["vllm", "serve"]
  args:
    - {{ $w.vllm.model | quote }}
    - --host={{ $w.vllm.host }}
    - --port={{ $w.vllm.port }}
    - --worker-extension-cls=engine_agent.vllm_extension.WeightRollExtension
    {{- range $w.vllm.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  env:
    - name: VLLM_SERVER_DEV_MODE
      value: "1"
  ports:
    - name: http
      containerPort: {{ $w.vllm.port }}
  volumeMounts:
    - name: models
      mountPath: {{ $w.models.mountPath }}
      readOnly: true
  {{- with $w.vllm.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{/*
3. weightroll.workload.agentContainer: the agent sidecar on port 8470 (name `weightroll`); its
   /readyz is the pod's readiness probe (it fails while the engine is paused, dirty or poisoned).
*/}}
{{- define "weightroll.workload.agentContainer" -}}
{{- $w := .Values.workloadExample -}}
- name: weightroll-agent
  image: {{ $w.agent.image }}
  command: ["weightroll", "agent"]
  args:
    - --vllm-url=http://127.0.0.1:{{ $w.vllm.port }}
    - --token-file=/var/run/weightroll/token
    - --state-dir=/var/lib/weightroll
    {{- range $w.agent.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  ports:
    - name: weightroll
      containerPort: 8470
  readinessProbe:
    httpGet:
      path: /readyz
      port: weightroll
    periodSeconds: 5
    failureThreshold: 2
  livenessProbe:
    httpGet:
      path: /healthz
      port: weightroll
    periodSeconds: 15
    failureThreshold: 4
  volumeMounts:
    - name: weightroll-token
      mountPath: /var/run/weightroll
      readOnly: true
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
  {{- with $w.agent.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{/*
4. weightroll.workload.volumes: the agent token Secret (key `token`) as a file, the agent's state
   directory (survives agent restarts within the pod) and the checkpoints, which vLLM's ranks read
   (`spec.source.uri` of a WeightUpdate is a path under this mount).
*/}}
{{- define "weightroll.workload.volumes" -}}
- name: weightroll-token
  secret:
    secretName: {{ .Values.workloadExample.tokenSecret.name }}
    defaultMode: 0400
    items:
      - key: token
        path: token
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
