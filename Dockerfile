# One image for every SplitMoE service: `splitmoe serve-experts | serve-attention | serve-gateway | up`.
#   docker build -t splitmoe .
#   docker run --rm -p 8000:8000 splitmoe          # the whole stack in one container, demo model
#   docker compose up --scale expert=3             # one container per service: see compose.yaml
# Where Docker Hub is out of reach, build on a local base (tests/compose/base_image.sh makes one
# from the Debian mirror) and take torch from a local wheel directory served over HTTP:
#   docker build --build-arg BASE_IMAGE=splitmoe-base:bookworm \
#       --build-arg TORCH_PIP_ARGS="--no-index --find-links http://172.17.0.1:8765/" -t splitmoe:local .
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# CPU-only torch from PyTorch's CPU index, pinned, before anything else: the PyPI wheel bundles
# CUDA libraries (gigabytes) that CPU expert services never use. `pip install .` below then finds
# its `torch>=2.4` requirement already met and leaves it alone. TORCH_PIP_ARGS: where pip finds it
# (a local wheel directory: see the top).
ARG TORCH_VERSION=2.13.0
ARG TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
RUN pip install ${TORCH_PIP_ARGS} "torch==${TORCH_VERSION}"

# Only what the package needs (the tests and any local models stay out of the image).
WORKDIR /opt/splitmoe/src
COPY pyproject.toml setup.py README.md ./
COPY splitmoe/ splitmoe/
COPY modelfile/ modelfile/
COPY kernels/ kernels/
COPY attention_service/ attention_service/
COPY expert_service/ expert_service/
COPY gateway/ gateway/
COPY proto/ proto/
COPY bench/ bench/
# g++ only for this step: it builds the native kernels (kernels/_native*.so, setup.py), then is
# purged with what it pulled in, which keeps the image about 200 MB smaller; nothing compiles at
# run time. The library picks AVX-512 VNNI / AVX-512 / AVX2 / scalar code from the CPU it runs
# on, so the image stays portable across machines. The check fails the build if it is missing
# (pip treats the extension as optional so that installs without a compiler still work).
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && pip install . \
    && apt-get purge -y --auto-remove g++ \
    && rm -rf /var/lib/apt/lists/* /opt/splitmoe/src \
    && cd / && python -c "import splitmoe.kernels.native as n; assert n.AVAILABLE, n.UNAVAILABLE_REASON; print('native kernels:', n.isa())"

# The trained demo model the package ships, at a path every container of the stack opens the very
# same file from (the services compare the file's identity: name and size). compose.yaml's MODEL
# defaults to it when no model is mounted.
RUN python -c "import shutil; from splitmoe.demo import trained_model_path; shutil.copy(trained_model_path(), '/opt/splitmoe/demo.gguf')" \
    && chmod 0444 /opt/splitmoe/demo.gguf

# Not root: the services need no privileges, and mounted models are read-only. /var/lib/splitmoe
# is where compose's volume keeps the cluster secret: a new volume takes this directory's owner
# and mode, so the (non-root) services can write it once and no one else can read it.
RUN useradd --system --uid 10001 --create-home --home-dir /home/splitmoe --shell /usr/sbin/nologin splitmoe \
    && mkdir -p /models /var/lib/splitmoe \
    && chown splitmoe:splitmoe /var/lib/splitmoe && chmod 0700 /var/lib/splitmoe
USER splitmoe
WORKDIR /home/splitmoe

# gateway HTTP, attention gRPC, expert gRPC (compose.yaml uses these ports)
EXPOSE 8000 50051 50061
ENTRYPOINT ["splitmoe"]
CMD ["up", "/opt/splitmoe/demo.gguf", "--host", "0.0.0.0", "--port", "8000"]
