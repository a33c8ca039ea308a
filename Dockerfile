# Layerswap's images, two targets of one file:
#   worker:            workers run merges and evaluations: everything, lm-eval included
#   api (the default): the API, the one-shot migration and flower: no lm-eval (and none of its
#                      datasets stack: pandas, pyarrow, scikit-learn; 0.56 GB)
# Both are one virtualenv (/opt/venv) with torch (the API plans merges and reads checkpoint
# headers with the engine), the `server` extra's dependencies (the `worker` extra's with them)
# and flower, run as the non-root user `layerswap`, and share every layer up to those
# dependencies. No secret is read at
# build time: every setting (database password, Hub tokens) comes from the environment when a
# container starts.
#
# The dependencies are installed from pyproject.toml and constraints.txt alone, before the source
# is copied: a code change rebuilds only the last layers (seconds).
#
# torch: from PyPI the Linux wheel carries CUDA (GPU workers). A CPU-only image:
#   --build-arg TORCH_SPEC=torch==2.13.0+cpu --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS deps
RUN useradd --create-home --uid 1000 layerswap \
    && mkdir -p /data/checkpoints /data/eval-data && chown -R layerswap /data
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 LAYERSWAP_DATA_DIR=/data
RUN python3 -m venv /opt/venv
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX_URL=""
RUN if [ -n "$TORCH_INDEX_URL" ]; then \
        pip install "$TORCH_SPEC" --index-url "$TORCH_INDEX_URL"; \
    else \
        pip install "$TORCH_SPEC"; \
    fi
WORKDIR /tmp/deps
COPY pyproject.toml constraints.txt ./
COPY client/pyproject.toml client/
COPY deploy/requirements.py deploy/
RUN python deploy/requirements.py server >requirements.txt \
    && pip install -c constraints.txt -r requirements.txt "flower==2.0.1" "setuptools>=77"

# The source, alone in a stage: what both targets install last.
FROM scratch AS source
COPY pyproject.toml README.md /src/
COPY engine /src/engine
COPY core /src/core
COPY service /src/service
COPY worker /src/worker
COPY layerswap /src/layerswap
COPY client /src/client

# The source last. Installed as a package (not editable): the Alembic migrations travel inside it.
FROM deps AS worker
RUN python deploy/requirements.py --extras-only eval >requirements-eval.txt \
    && pip install -c constraints.txt -r requirements-eval.txt
COPY --from=source /src /tmp/src
RUN pip install --no-deps --no-build-isolation --no-index /tmp/src /tmp/src/client \
    && rm -rf /tmp/src
WORKDIR /home/layerswap
USER layerswap
EXPOSE 8000
CMD ["layerswap", "worker"]

# Last, so that a builder without BuildKit, which builds every stage up to its target, does
# not build this one for `--target worker`; compose names the target of each image.
FROM deps AS api
COPY --from=source /src /tmp/src
RUN pip install --no-deps --no-build-isolation --no-index /tmp/src /tmp/src/client \
    && rm -rf /tmp/src
WORKDIR /home/layerswap
USER layerswap
EXPOSE 8000
CMD ["layerswap", "serve"]
