# One image for every Layerswap process: api (`layerswap serve`), worker (`layerswap worker`),
# the one-shot migration (`layerswap db upgrade`) and flower.
FROM python:3.11-slim

# torch first and pinned, as scripts/setup.sh does. From PyPI, the Linux wheel carries CUDA
# (GPU workers); for a smaller CPU-only image build with
#   --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX_URL=""
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN if [ -n "$TORCH_INDEX_URL" ]; then \
        pip install "$TORCH_SPEC" --index-url "$TORCH_INDEX_URL"; \
    else \
        pip install "$TORCH_SPEC"; \
    fi

WORKDIR /app
COPY pyproject.toml README.md constraints.txt ./
COPY engine engine
COPY core core
COPY service service
COPY worker worker
COPY layerswap layerswap
COPY migrations migrations
COPY client client
# Editable, so the Alembic migrations are found beside the code they belong to.
RUN pip install -c constraints.txt -e ./client -e ".[eval]" "flower>=2.0"

RUN useradd --create-home --uid 1000 layerswap && mkdir -p /data && chown layerswap /data
USER layerswap
ENV LAYERSWAP_DATA_DIR=/data
EXPOSE 8000
CMD ["layerswap", "serve"]
