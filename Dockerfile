# policy-server image: gRPC policy server (+ openpi WebSocket and Prometheus ports) on one GPU.
#
#   docker build -t policy-server .
#   docker run --gpus 1 -p 127.0.0.1:50051:50051 policy-server
#
# The image also holds the robot-side tools (policy-rollout), so the simulated robot in
# docker-compose.yml runs from the same image.
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/policy-server

# The server compiles its GEN stack at warmup (torch.compile), which builds what it writes: Triton's kernel
# launchers with a C compiler on CUDA, inductor's C++ on a CPU. Without them the stack runs eagerly, slower.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

# torch first and pinned: the Linux wheel on PyPI is the CUDA build the GPU needs, and installing
# it before the project keeps pip from resolving a different version for `torch<2.14`.
RUN pip install torch==2.13.0

COPY pyproject.toml README.md ./
COPY protos ./protos
COPY policy_server ./policy_server
COPY robots ./robots
# [cosmos3]: diffusers' Wan2.2 VAE, which a real Cosmos3 checkpoint (`--checkpoint /models/...`) needs.
RUN pip install ".[cosmos3]"

RUN useradd --create-home --uid 10001 policy
USER policy
# One cache folder for torch's compiled kernels, measured quality profiles (policy-server) and Hub downloads
# (huggingface): docker-compose.yml keeps it in a volume, so a recreated container starts without recompiling,
# recalibrating or downloading again. runs/ takes the reports of the robot-side tools (the working folder is root's),
# a volume in docker-compose.yml too. Both made here, as the user, so that a new volume takes the user's ownership.
ENV TORCHINDUCTOR_CACHE_DIR=/home/policy/.cache/torchinductor
RUN mkdir -p /home/policy/.cache /home/policy/runs

# 50051 gRPC, 8000 openpi WebSocket, 9464 Prometheus /metrics (the OpenTelemetry Prometheus exporter's
# default; 9090 is Prometheus' own port, where a scraper beside this container would already listen)
EXPOSE 50051 8000 9464

# Health Check stays reachable without the auth token; SERVING only once the model is warm.
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-m", "policy_server.client", "health", "--server", "127.0.0.1:50051"]

ENTRYPOINT ["policy-server"]
CMD ["--host", "0.0.0.0", "--port", "50051", "--device", "cuda", "--metrics-port", "9464", "--metrics-host", "0.0.0.0"]
