# syntax=docker/dockerfile:1
# slogate: the gateway and the simulated engine in one image.
#
#   docker build -t slogate:latest .
#   docker run --rm -p 8000:8000 slogate:latest up --host 0.0.0.0      # gateway + 2 simulated engines
#   docker run --rm -p 8000:8000 -v $PWD/gateway.yaml:/etc/slogate/gateway.yaml:ro slogate:latest
#
# The default command is `slogate serve --config /etc/slogate/gateway.yaml`; every setting can also
# come from SLOGATE_* environment variables (README, "Configuration").

FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY policies ./policies
COPY profiles ./profiles
# A wheel of the package and wheels of its dependencies, with what settings may ask for: the
# OTLP trace exporter and Hugging Face tokenizers (engine_tokenizers); the runtime stage installs
# from these only.
RUN pip install --no-cache-dir --upgrade pip \
 && pip wheel --no-cache-dir --wheel-dir /wheels ".[otlp,hf-tokenizer]"

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    SLOGATE_HOST=0.0.0.0 \
    SLOGATE_PORT=8000
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-index --find-links=/wheels "slogate[otlp,hf-tokenizer]" \
 && useradd --system --uid 10001 --user-group --home-dir /home/slogate --create-home slogate \
 && mkdir -p /etc/slogate \
 && printf 'engines: []\n' > /etc/slogate/gateway.yaml
USER 10001:10001
WORKDIR /home/slogate
EXPOSE 8000
# Liveness of the gateway on its own port (SLOGATE_PORT). Engines started from this image
# (`slogate sim-engine`) listen elsewhere and set their own healthcheck (docker-compose.yml).
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('SLOGATE_PORT', '8000'), timeout=2)"]
ENTRYPOINT ["slogate"]
CMD ["serve", "--config", "/etc/slogate/gateway.yaml"]
