# weightroll images. Two targets from one build:
#
#   operator  the kopf operator, slim: weightroll without the engine extra (no torch, no vLLM)
#   agent     a vLLM image plus weightroll: the worker extension
#             (--worker-extension-cls engine_agent.vllm_extension.WeightRollExtension) and the
#             `weightroll-agent` sidecar; the same image serves both containers of a vLLM pod
#
# Build arguments:
#   BASE       Python base of the build and operator stages (Debian, python3 with venv and pip)
#   VLLM_BASE  vLLM base image of the agent target; pick the vLLM version your fleet runs
#
# Supply chain: both bases are pinned by digest (the tag in the `# pin:` comment above each;
# refresh with `scripts/pin-images.sh`, check with `scripts/pin-images.sh --check`). Python
# packages come only from the hash-locked files in requirements/ (`scripts/lock.sh`
# regenerates them and the SBOMs): `pip install --require-hashes --no-deps`, then the weightroll
# wheel with `--no-deps`, so the operator image gets the `operator` extra (no torch, no vLLM)
# and the agent image the `agent` and `signing` extras (no kopf, no kubernetes client). Each
# image carries its CycloneDX SBOM at /usr/share/doc/weightroll/sbom.cdx.json
# (sbom/<target>.cdx.json).
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
# pin: python:3.11-slim-bookworm
ARG BASE=python:3.11-slim-bookworm@sha256:2e32f7d302adc1c37428355c1e646897c0c53f4fd60b6a551245fb90ee129f91
# pin: vllm/vllm-openai:v0.32.0
ARG VLLM_BASE=vllm/vllm-openai:v0.32.0
# The vLLM version of VLLM_BASE: requirements/agent.lock is resolved against it (scripts/lock.sh).
ARG VLLM_VERSION=0.32.0

# ---- build: one wheel of weightroll ------------------------------------------------------------
FROM ${BASE} AS build
ARG PIP_NO_INDEX=
ARG PIP_FIND_LINKS=
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_INDEX=${PIP_NO_INDEX} \
    PIP_FIND_LINKS=${PIP_FIND_LINKS}
WORKDIR /src
COPY . /src
# wheelhouse/ is optional; make sure it exists for the COPY --from below. The build backend comes
# from its lock too (no build isolation: nothing unhashed is downloaded).
RUN mkdir -p /src/wheelhouse \
    && python3 -m venv /opt/build \
    && /opt/build/bin/pip install --no-cache-dir --require-hashes --no-deps \
        -r /src/requirements/build.lock \
    && /opt/build/bin/pip wheel --no-cache-dir --no-deps --no-build-isolation \
        --wheel-dir /wheels /src

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
COPY requirements/operator.lock /src/requirements/operator.lock
COPY sbom/operator.cdx.json /usr/share/doc/weightroll/sbom.cdx.json
# The wheel's name is not known in advance, hence the glob; never name a module operator.py here.
# `pip check`: the lock is complete for the wheel's `operator` extra.
RUN python3 -m venv /opt/weightroll \
    && /opt/weightroll/bin/pip install --no-cache-dir --require-hashes --no-deps \
        -r /src/requirements/operator.lock \
    && /opt/weightroll/bin/pip install --no-cache-dir --no-deps /wheels/weightroll-*.whl \
    && /opt/weightroll/bin/pip check \
    && rm -rf /wheels /src
WORKDIR /opt/weightroll
USER 65532:65532
EXPOSE 8080 8081
ENTRYPOINT ["weightroll-operator"]

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
COPY requirements/agent.lock /src/requirements/agent.lock
COPY sbom/agent.cdx.json /usr/share/doc/weightroll/sbom.cdx.json
# Into the base image's own Python, next to vLLM (its workers import the extension); deliberate,
# hence PIP_BREAK_SYSTEM_PACKAGES for bases whose Python is marked externally managed. The lock
# holds the `agent` and `signing` extras at the versions vLLM itself uses, so nothing vLLM
# pinned moves; the engine extra is not installed: the base image provides vLLM and torch.
ENV PIP_BREAK_SYSTEM_PACKAGES=1
RUN python3 -m pip install --no-cache-dir --require-hashes --no-deps \
        -r /src/requirements/agent.lock \
    && python3 -m pip install --no-cache-dir --no-deps /wheels/weightroll-*.whl \
    && rm -rf /wheels /src
USER 65532:65532
EXPOSE 8000 8470
