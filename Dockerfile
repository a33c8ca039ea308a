# Layerswap's images, two targets of one file:
#   worker: everything, lm-eval included: GPU and CPU workers run merges and
#          evaluations (lm-eval and its datasets stack, about 0.2 GB more than `api`)
#   api (the default): the API, the one-shot migration and flower: merges and evaluations never run there,
#          so no lm-eval
# Both hold one virtualenv (/opt/venv) with torch (the API plans merges and reads checkpoint
# headers with the engine), the service's dependencies and flower, and run as the non-root user
# `layerswap`. No secret is read at build time: every setting (database password, Hub tokens)
# comes from the environment when a container starts.
#
# The dependencies are installed from pyproject.toml and constraints.txt alone, before the source
# is copied: a code change rebuilds only the last two layers (seconds).
#
# torch: from PyPI the Linux wheel carries CUDA (GPU workers). A CPU-only image:
#   --build-arg TORCH_SPEC=torch==2.13.0+cpu --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# BASE_IMAGE is the runtime's base; BUILD_IMAGE (the same unless given) is where the virtualenv
# is built, the place for a build-only pip configuration (a private index, a CA bundle).
ARG BASE_IMAGE=python:3.11-slim
ARG BUILD_IMAGE=${BASE_IMAGE}

FROM ${BUILD_IMAGE} AS deps
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX_URL=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
RUN python3 -m venv /opt/venv
RUN if [ -n "$TORCH_INDEX_URL" ]; then \
        pip install "$TORCH_SPEC" --index-url "$TORCH_INDEX_URL"; \
    else \
        pip install "$TORCH_SPEC"; \
    fi
WORKDIR /src
COPY pyproject.toml constraints.txt ./
COPY client/pyproject.toml client/
COPY deploy/requirements.py deploy/
RUN python deploy/requirements.py >/tmp/requirements.txt \
    && pip install -c constraints.txt -r /tmp/requirements.txt "flower==2.0.1" "setuptools>=77"

FROM deps AS deps-eval
RUN python deploy/requirements.py eval >/tmp/requirements-eval.txt \
    && pip install -c constraints.txt -r /tmp/requirements-eval.txt

# The source, alone in a stage: what both targets install last.
FROM scratch AS source
COPY pyproject.toml README.md /src/
COPY engine /src/engine
COPY core /src/core
COPY service /src/service
COPY worker /src/worker
COPY layerswap /src/layerswap
COPY client /src/client

FROM ${BASE_IMAGE} AS runtime
RUN useradd --create-home --uid 1000 layerswap \
    && mkdir -p /data/checkpoints /data/eval-data && chown -R layerswap /data
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 LAYERSWAP_DATA_DIR=/data
WORKDIR /home/layerswap
EXPOSE 8000
CMD ["layerswap", "serve"]

# The source last. Installed as a package (not editable): the Alembic migrations travel inside it.
FROM runtime AS worker
COPY --from=deps-eval /opt/venv /opt/venv
COPY --from=source /src /tmp/src
RUN pip install --no-deps --no-build-isolation --no-index /tmp/src /tmp/src/client \
    && rm -rf /tmp/src
USER layerswap

# Last, so that a builder without BuildKit, which builds every stage up to its target, does
# not build this one for `--target worker`; compose names the target of each image.
FROM runtime AS api
COPY --from=deps /opt/venv /opt/venv
COPY --from=source /src /tmp/src
RUN pip install --no-deps --no-build-isolation --no-index /tmp/src /tmp/src/client \
    && rm -rf /tmp/src
USER layerswap
