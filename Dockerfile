# weightroll images. Two targets from one build:
#
#   operator  the kopf operator, slim: weightroll without the engine extra (no torch, no vLLM)
#   agent     a vLLM image plus weightroll: the worker extension
#             (--worker-extension-cls engine_agent.vllm_extension.WeightRollExtension) and the
#             `weightroll agent` sidecar; the same image serves both containers of a vLLM pod
#
# Build arguments:
#   BASE       Python base of the build and operator stages (Debian, python3 with venv and pip)
#   VLLM_BASE  vLLM base image of the agent target; pick the vLLM version your fleet runs
#
# With a registry:
#   docker build --target operator -t weightroll-operator .
#   docker build --target agent --build-arg VLLM_BASE=vllm/vllm-openai:v0.32.0 -t weightroll-agent .
# Without a daemon or registry (buildah; a local base from debootstrap, ../shared/design/tooling.md §6):
#   buildah bud --isolation chroot --pull=never --target operator \
#     --build-arg BASE=localhost/debian-python:bookworm -t localhost/weightroll-operator .
# Offline (no package index): put every wheel into wheelhouse/ first
#   (pip download -d wheelhouse . setuptools wheel) and add
#   --build-arg PIP_NO_INDEX=1 --build-arg PIP_FIND_LINKS=/src/wheelhouse
ARG BASE=python:3.11-slim-bookworm
ARG VLLM_BASE=vllm/vllm-openai:v0.32.0

# ---- build: one wheel of weightroll ------------------------------------------------------------
FROM ${BASE} AS build
ARG PIP_NO_INDEX=
ARG PIP_FIND_LINKS=
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_INDEX=${PIP_NO_INDEX} \
    PIP_FIND_LINKS=${PIP_FIND_LINKS}
WORKDIR /src
COPY . /src
# wheelhouse/ is optional; make sure it exists for the COPY --from below.
RUN mkdir -p /src/wheelhouse \
    && python3 -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels /src

# ---- operator: slim, no torch ------------------------------------------------------------------
FROM ${BASE} AS operator
ARG PIP_NO_INDEX=
ARG PIP_FIND_LINKS=
LABEL org.opencontainers.image.title="weightroll-operator" \
      org.opencontainers.image.description="Kubernetes operator rolling verified in-place weight updates through vLLM fleets" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/weightroll/weightroll"
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_INDEX=${PIP_NO_INDEX} \
    PIP_FIND_LINKS=${PIP_FIND_LINKS} \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/weightroll/bin:${PATH}
COPY --from=build /wheels /wheels
COPY --from=build /src/wheelhouse /src/wheelhouse
# The wheel's name is not known in advance, hence the glob; never name a module operator.py here.
RUN python3 -m venv /opt/weightroll \
    && /opt/weightroll/bin/pip install --no-cache-dir /wheels/weightroll-*.whl \
    && rm -rf /wheels /src
WORKDIR /opt/weightroll
USER 65532:65532
EXPOSE 8080 8081
ENTRYPOINT ["weightroll"]
CMD ["operator"]

# ---- agent: vLLM + worker extension + sidecar --------------------------------------------------
FROM ${VLLM_BASE} AS agent
ARG PIP_NO_INDEX=
ARG PIP_FIND_LINKS=
LABEL org.opencontainers.image.title="weightroll-agent" \
      org.opencontainers.image.description="vLLM with the weightroll worker extension and agent sidecar" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/weightroll/weightroll"
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_INDEX=${PIP_NO_INDEX} \
    PIP_FIND_LINKS=${PIP_FIND_LINKS} \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
COPY --from=build /wheels /wheels
COPY --from=build /src/wheelhouse /src/wheelhouse
# Into the base image's own Python, next to vLLM (its workers import the extension); deliberate,
# hence PIP_BREAK_SYSTEM_PACKAGES for bases whose Python is marked externally managed. The engine
# extra is not installed: the base image provides vLLM and torch.
ENV PIP_BREAK_SYSTEM_PACKAGES=1
RUN python3 -m pip install --no-cache-dir /wheels/weightroll-*.whl \
    && rm -rf /wheels /src
USER 65532:65532
EXPOSE 8000 8470
