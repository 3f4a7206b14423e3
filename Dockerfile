# The operator image. Only the operator's dependencies are installed: the in-pod runtime (torch) goes into
# the trainer and SGLang images instead (see operator/README.md, "Runtime in your images").
# The base: any image with Python 3.11 at `python` and groupadd/useradd. The default is the public image, pinned
# by tag and by the digest of its multi-architecture index; `make images` builds one from Debian's packages
# instead (scripts/build-images.sh, no registry needed) and passes it with
# --build-arg BASE_IMAGE=localhost/colocate-base --build-arg BASE_TAG=<its tag>.
ARG BASE_IMAGE=python
ARG BASE_TAG=3.11.14-slim-bookworm@sha256:65a93d69fa75478d554f4ad27c85c1e69fa184956261b4301ebaf6dbb0a3543d
FROM ${BASE_IMAGE}:${BASE_TAG} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator/ operator/
COPY runtime/ runtime/
COPY devcluster/ devcluster/
RUN python -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir /src \
    && /opt/venv/bin/colocate-operator --help > /dev/null

FROM ${BASE_IMAGE}:${BASE_TAG}
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
