# The node server's image: `tensordb serve` as a non-root user, with a health check that
# pings its Flight port. Build: docker build -t tensordb:0.1.0 .
# Run (one per host; the engines of the host share its /dev/shm and IPC namespace):
#   docker run --ipc=host -v /dev/shm:/dev/shm -v /var/lib/tensordb:/var/lib/tensordb \
#     -v /etc/tensordb/token:/run/tensordb/token:ro -e TENSORDB_CATALOG=postgresql+psycopg://... \
#     -p 7070:7070 -p 7071:7071 -p 9100:9100 tensordb:0.1.0
# docs/deploy.md walks through it, and through the Kubernetes manifests in deploy/k8s.
FROM python:3.11-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# torch first, from its CPU index, so that the project's requirement does not pull a
# CUDA build (the GPU tier takes the [gpu] extra and a CUDA base image instead)
RUN python -m venv /opt/tensordb \
    && /opt/tensordb/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
    && /opt/tensordb/bin/pip install .

FROM python:3.11-slim-bookworm
COPY --from=build /opt/tensordb /opt/tensordb
RUN groupadd --system --gid 10001 tensordb \
    && useradd --system --uid 10001 --gid tensordb --home-dir /var/lib/tensordb tensordb \
    && mkdir -p /var/lib/tensordb /run/tensordb \
    && chown tensordb:tensordb /var/lib/tensordb
ENV PATH=/opt/tensordb/bin:$PATH \
    TENSORDB_HOME=/var/lib/tensordb \
    TENSORDB_TOKEN_FILE=/run/tensordb/token \
    TENSORDB_PORT=7070 TENSORDB_DATA_PORT=7071 TENSORDB_METRICS_PORT=9100
USER 10001:10001
WORKDIR /var/lib/tensordb
VOLUME ["/var/lib/tensordb"]
EXPOSE 7070 7071 9100
HEALTHCHECK --interval=15s --timeout=6s --start-period=20s --retries=3 \
    CMD ["sh", "-c", "tensordb ping 127.0.0.1:${TENSORDB_PORT} --timeout 5 > /dev/null"]
# the catalog comes from $TENSORDB_CATALOG, the node name from $TENSORDB_NODE (the
# host's name where unset), the address other nodes reach from $TENSORDB_ADVERTISE
ENTRYPOINT ["sh", "-c", "exec tensordb --catalog \"$TENSORDB_CATALOG\" --node \"${TENSORDB_NODE:-$(hostname)}\" serve --host 0.0.0.0 --port \"$TENSORDB_PORT\" --data-port \"$TENSORDB_DATA_PORT\" --metrics-port \"$TENSORDB_METRICS_PORT\" --data-dir /var/lib/tensordb/data ${TENSORDB_ADVERTISE:+--advertise \"$TENSORDB_ADVERTISE\"} \"$@\"", "tensordb"]
