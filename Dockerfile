# kmend images, two targets from one file:
#   docker build --target service -t ghcr.io/kmend/kmend:0.1.0 .        # kmend serve (control plane)
#   docker build --target agent   -t ghcr.io/kmend/kmend-agent:0.1.0 .  # kmend agent (one per node)
# The agent image holds only the base dependencies (no scikit-learn, pandas, web stack, database or cluster
# client); the service image adds the `service` extra. Both run as a non-root user; the agent's DaemonSet
# asks for root itself (deploy/helm/kmend/values.yaml says why). The source tree is kept as it is laid out
# here (/opt/kmend), where the code finds its rule packs and the health-check Job template.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Dependencies only: kmend itself is installed to resolve them, then removed (the code runs from /opt/kmend).
FROM base AS agent-deps
WORKDIR /src
COPY pyproject.toml README.md ./
RUN python -m venv /opt/venv \
    && /opt/venv/bin/pip install . \
    && /opt/venv/bin/pip uninstall -y kmend

FROM agent-deps AS service-deps
RUN /opt/venv/bin/pip install ".[service]" \
    && /opt/venv/bin/pip uninstall -y kmend

FROM base AS source
COPY collector /opt/kmend/collector
COPY analyzer /opt/kmend/analyzer
COPY models /opt/kmend/models
COPY healer /opt/kmend/healer
COPY kmend /opt/kmend/kmend
COPY sim /opt/kmend/sim
COPY rules /opt/kmend/rules
COPY deploy/healthcheck /opt/kmend/deploy/healthcheck
RUN python -m compileall -q /opt/kmend

FROM base AS agent
COPY --from=agent-deps /opt/venv /opt/venv
COPY --from=source /opt/kmend /opt/kmend
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONPATH=/opt/kmend
USER 65532:65532
EXPOSE 9401
ENTRYPOINT ["python", "-m", "kmend.cli"]
CMD ["agent"]

FROM base AS service
COPY --from=service-deps /opt/venv /opt/venv
COPY --from=source /opt/kmend /opt/kmend
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONPATH=/opt/kmend
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["python", "-m", "kmend.cli"]
CMD ["serve"]
