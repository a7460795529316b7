# polca node agent image: a virtual environment built in one stage, copied into a slim
# Python runtime. No CUDA base image: the agent needs only NVML (libnvidia-ml.so.1), which
# the NVIDIA Container Toolkit mounts from the host driver when
# NVIDIA_DRIVER_CAPABILITIES includes "utility".
#
# Build:   docker build -t polca .
#
# Run (controls the GPUs): NVML's set calls need CAP_SYS_ADMIN, and the agent restores the
# original GPU settings from the volume after a crash; give it more than its 5 s restore
# bound to stop:
#   docker run -d --name polca-agent --restart on-failure --stop-timeout 20 \
#     --gpus all --cap-add SYS_ADMIN \
#     -v /etc/polca:/etc/polca:ro -v polca-state:/var/lib/polca polca
#
# Run read-only (observe and publish, never write to the GPUs): no capability at all.
#   docker run -d --gpus all --cap-drop ALL --read-only -e POLCA_AGENT__OBSERVE_ONLY=true \
#     -v /etc/polca:/etc/polca:ro polca
#
# Verify on the target host that `docker run --rm --gpus all polca gpu probe` lists the GPUs.
#
# No HEALTHCHECK: liveness is published over MQTT (a retained status topic with a Last
# Will), and a failed agent exits non-zero for the restart policy to act on.

# Both stages use the same image, so the venv's python symlink resolves in the runtime.
FROM python:3.11-slim AS builder

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN python -m venv /opt/polca

WORKDIR /src
# Only what the build needs; .dockerignore keeps the rest out of the context.
COPY requirements/runtime.txt requirements/
COPY pyproject.toml README.md ./
COPY daemon/ daemon/
# The exact releases of the runtime lock, hash-checked (requirements/README.md), then polca
# itself, resolving nothing (setuptools and wheel come from the lock too). Every dependency
# ships wheels for linux x86_64/aarch64: no compiler needed.
RUN /opt/polca/bin/pip install --require-hashes -r requirements/runtime.txt \
 && /opt/polca/bin/pip install --no-deps --no-build-isolation . \
 && /opt/polca/bin/pip check


FROM python:3.11-slim AS runtime

LABEL org.opencontainers.image.title="polca" \
      org.opencontainers.image.description="polca node agent: GPU power and thermal capping over NVML and MQTT" \
      org.opencontainers.image.licenses="Apache-2.0"

COPY --from=builder /opt/polca /opt/polca
# The licence travels with the image (Apache-2.0 asks for it with every copy).
COPY LICENSE /usr/share/doc/polca/LICENSE

# NVIDIA_*: ask the NVIDIA container runtime for every GPU and for NVML (utility), not CUDA.
# STATE_DIRECTORY: where the original GPU settings are saved, as systemd would set it.
# PYTHONDONTWRITEBYTECODE: the venv is compiled at build time; works with --read-only.
ENV PATH=/opt/polca/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=utility \
    STATE_DIRECTORY=/var/lib/polca

RUN mkdir -p /etc/polca /var/lib/polca && chmod 700 /var/lib/polca
# Saved GPU settings must survive the container so a restarted agent can restore them.
VOLUME /var/lib/polca

# Runs as root: NVML checks for root before its set calls (with --cap-add SYS_ADMIN).
# SIGTERM (docker stop) starts the orderly shutdown that restores the GPU settings.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/opt/polca/bin/polca"]
CMD ["agent", "--config", "/etc/polca/agent.yaml"]
