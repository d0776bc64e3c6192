# syntax=docker/dockerfile:1
# llm-gateway: build the wheels in one stage, install them into a slim runtime without
# compilers or build tools.
#
#   docker build -t llm-gateway .
#   docker run -p 8080:8080 -v $PWD/gateway.yaml:/etc/llm-gateway/gateway.yaml:ro llm-gateway
#   docker run -p 8080:8080 -e GATEWAY_MODELS='[...]' llm-gateway serve   # config from env only
#
# The gateway listens on 0.0.0.0:$GATEWAY_PORT (8080); GATEWAY_* variables override the file.

FROM python:3.11.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway ./gateway
# The package and every dependency as wheels (all have binary wheels for linux amd64/arm64,
# uvloop and httptools included, so nothing compiles here either).
RUN pip wheel --no-cache-dir --disable-pip-version-check --wheel-dir /wheels .

# The same base as the build stage: the wheels were built for its Python and libc.
FROM python:3.11.11-slim-bookworm
LABEL org.opencontainers.image.title="llm-gateway" \
      org.opencontainers.image.description="LLM-aware HTTP gateway for one-engine-per-GPU replicas"
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --disable-pip-version-check --no-index --find-links=/wheels \
        /wheels/llm_gateway-*.whl \
    && python -c "import uvloop, httptools" \
    && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin gateway \
    && mkdir -p /etc/llm-gateway
USER 10001
ENV GATEWAY_HOST=0.0.0.0 \
    GATEWAY_PORT=8080 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('GATEWAY_PORT', '8080'), timeout=2)"]
ENTRYPOINT ["llm-gateway"]
CMD ["serve", "--config", "/etc/llm-gateway/gateway.yaml"]
