# Source this first in every GPU-machine command (../shared/GPU.md): installs the carried wheels (.whl/) and the
# project itself (non-editable, no deps) into /tmp/site, so `minigpt`, `minigpt_kernels` and the configs import
# exactly as after `pip install -e .`.
#   source scripts/gpu_env.sh && python3 -m pytest -m gpu
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade --target /tmp/site . >/dev/null 2>&1 \
  || echo "gpu_env: installing the project into /tmp/site failed" >&2
export PYTHONPATH=/tmp/site WANDB_MODE=offline PYTHONUNBUFFERED=1 MINIGPT_COMMIT=${MINIGPT_COMMIT:-unknown}
export PATH=/tmp/site/bin:$PATH
