# The operator image. Only the operator's dependencies are installed: the in-pod runtime (torch) goes into
# the trainer and SGLang images instead (see operator/README.md, "Runtime in your images").
FROM python:3.11.14-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator/ operator/
COPY runtime/ runtime/
COPY devcluster/ devcluster/
RUN python -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir /src \
    && /opt/venv/bin/colocate-operator --help > /dev/null

FROM python:3.11.14-slim-bookworm
RUN groupadd --gid 10001 colocate \
    && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin colocate
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
# 8080: kopf liveness (/healthz); 9090: Prometheus metrics (/metrics).
EXPOSE 8080 9090
ENTRYPOINT ["colocate-operator"]
