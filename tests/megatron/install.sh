#!/usr/bin/env bash
# Install what tests/megatron/ needs into the ACTIVE virtual environment, from PyPI only:
#   torch 2.13.0+cpu  the CPU build (the "+cpu" local version exists only as a CPU wheel, so pip
#                     cannot fall back to a CUDA build and its nvidia-* wheels)
#   triton 3.9.0      megatron.core imports it at module level (MoE paged-stash kernels); never run
#   megatron-core 0.19.0  megatron.core + megatron.training. It is published for Python >= 3.12
#                     only while torch's CPU wheel here is cp311, so the wheel is unpacked into
#                     $VIRTUAL_ENV/megatron-core (--target, --ignore-requires-python) and put on
#                     sys.path with a .pth file; cpu_launch.py backports the one 3.12 name it imports.
#   pybind11          Megatron compiles its dataset index helper (helpers.cpp) with it at start-up;
#                     the Makefile it runs is not in the wheel and is copied from upstream/.
# Usage:  . .venv/bin/activate && bash tests/megatron/install.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
: "${VIRTUAL_ENV:?activate the virtual environment first}"
MEGATRON_CORE=0.19.0

python -m pip install --quiet -e "$here/../..[megatron]"   # pyproject's megatron extra: the pins above
target="$VIRTUAL_ENV/megatron-core"
if [ ! -f "$target/megatron_core-$MEGATRON_CORE.dist-info/METADATA" ]; then
    rm -rf "$target"
    python -m pip install --quiet --no-deps --only-binary=:all: --python-version 3.12 \
        --ignore-requires-python --target "$target" "megatron-core==$MEGATRON_CORE"
fi
site="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$target" > "$site/megatron_core_wheel.pth"
datasets="$target/megatron/core/datasets"
cp "$here/upstream/megatron/core/datasets/Makefile" "$datasets/Makefile"
# Build the helper once here (about a minute) rather than inside the first trial.
PATH="$VIRTUAL_ENV/bin:$PATH" make --quiet -C "$datasets"
python -W ignore -c "import torch, megatron.core; assert not torch.version.cuda, torch.version.cuda; \
print('megatron test prerequisites: torch', torch.__version__, '| megatron-core', megatron.core.__version__)"
