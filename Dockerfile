# syntax=docker/dockerfile:1.7
# kvfleet's control-plane image: the operator, the router and the autoscaler (the chart runs it with
# `operator run`, `router serve` or `autoscaler run` as arguments). No torch: kvfleet is installed
# without its engine extra (with kv-events: the router's tokenizer); engines run in the images under engine_image/.
#
# Build from the repository root and push where the chart's image.repository points:
#   docker build -t ghcr.io/kvfleet/kvfleet:0.1.0 .
#   docker push ghcr.io/kvfleet/kvfleet:0.1.0
#
# The base is pinned by version. To pin it by digest as well (reproducible, immune to a re-pushed
# tag), resolve the digest once and pass it in:
#   docker buildx imagetools inspect python:3.11.13-slim-bookworm --format '{{json .Manifest.Digest}}'
#   docker build --build-arg PYTHON_IMAGE=python:3.11.13-slim-bookworm@sha256:<digest> ...
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

# Build the wheel in its own stage so the sources and the build backend stay out of the image.
FROM ${PYTHON_IMAGE} AS wheel
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY pyproject.toml README.md /src/
COPY kvfleet /src/kvfleet
COPY operator /src/operator
COPY autoscaler /src/autoscaler
COPY router /src/router
COPY weight_cache /src/weight_cache
COPY engine /src/engine
COPY engine_image /src/engine_image
RUN pip wheel --no-deps --wheel-dir /wheels /src

FROM ${PYTHON_IMAGE}
# The chart's pods run as this uid/gid (podSecurityContext.runAsUser), with a read-only root
# filesystem and an in-memory /tmp: nothing here writes outside /tmp.
ARG KVFLEET_UID=65532
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp
# kvfleet with its kv-events extra only (tokenizers and jinja2, for the router to tokenize prompts
# as the engines do; no torch or safetensors), then the installer itself goes: nothing at run time
# installs packages. The import check fails the build if torch crept back in.
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    pip install "$(echo /wheels/kvfleet-*.whl)[kv-events]" \
    && python -c "import importlib.util as u; assert u.find_spec('torch') is None, 'torch in the control-plane image'" \
    && kvfleet --version \
    && pip uninstall -y -q pip setuptools wheel \
    && (getent passwd "${KVFLEET_UID}" >/dev/null \
        || useradd --uid "${KVFLEET_UID}" --user-group --no-create-home --home-dir /tmp --shell /usr/sbin/nologin kvfleet)
USER 65532:65532
WORKDIR /tmp

# 8080: the operator's /healthz and the router's OpenAI API; 8081: the autoscaler's wake API.
EXPOSE 8080 8081
ENTRYPOINT ["kvfleet"]
CMD ["--help"]
