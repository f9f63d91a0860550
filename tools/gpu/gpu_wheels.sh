#!/usr/bin/env bash
# Downloads into .whl/ the wheels the GPU machine lacks, for tools/gpu/gpu_check.sh to install there.
#
# Run it here, in the checkout, with network access: the GPU machine has none. It fetches cp312
# manylinux x86-64 wheels (the GPU machine's python3 is 3.12) with --no-deps, then checks every
# wheel's Requires-Dist (extras aside) against the packages the GPU machine's image holds (the
# list below) and the wheels fetched: a need met by neither is an error. .whl/ is kept out of git
# through .git/info/exclude; it travels to the GPU machine as a carried path.
#
#     tools/gpu/gpu_wheels.sh [DIR]        # default DIR: .whl in the checkout's root
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DEST="${1:-$ROOT/.whl}"
PYTHON="${PYTHON:-python3}"

# The runtime dependencies of pyproject.toml and the test extra's that the image lacks, with what
# they need in turn; versions are those the project is tested with here.
WHEELS=(
    posix_ipc==1.3.2 msgspec==0.22.0 nvtx==0.2.17 setproctitle==1.3.8 uvicorn==0.54.0 httptools==0.9.0
    pyzmq==27.3.0 llguidance==1.9.1 gguf==0.19.0 pexpect==4.9.0 ptyprocess==0.7.0
    jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
    openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 pydantic==2.14.4 pydantic_core==2.50.5 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1
    typing-inspection==0.4.5 annotated-types==0.8.0
)

# The GPU machine's image, as /work/.library/device/KINDS.md lists it (names normalised: lower
# case, '-' for '_' and '.').
IMAGE="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas
nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile
nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13
nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax
opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy
portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core
scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile
tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel
wrapt xarray xxhash yarl zipp"

mkdir -p "$DEST"
if git -C "$ROOT" rev-parse --git-dir >/dev/null 2>&1; then
    exclude="$(git -C "$ROOT" rev-parse --git-path info/exclude)"
    case "$exclude" in /*) ;; *) exclude="$ROOT/$exclude" ;; esac
    mkdir -p "$(dirname "$exclude")"
    grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
fi

"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 \
    -d "$DEST" "${WHEELS[@]}"

"$PYTHON" - "$DEST" "$IMAGE" <<'EOF'
"""Every wheel's needs (extras aside) are met by the image or another wheel; one version of each."""
import re
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement

# The GPU machine's interpreter, for the requirements' environment markers (extras are left out).
GPU_PYTHON = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
              "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
              "platform_machine": "x86_64", "os_name": "posix", "extra": ""}

def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()

dest, image = Path(sys.argv[1]), {norm(n) for n in sys.argv[2].split()}
wheels = sorted(dest.glob("*.whl"))
names = [norm(w.name.split("-")[0]) for w in wheels]
twice = sorted({n for n in names if names.count(n) > 1})
missing = []
for wheel in wheels:
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        for line in archive.read(metadata).decode().splitlines():
            if not line.startswith("Requires-Dist:"):
                continue
            requirement = Requirement(line.split(":", 1)[1].strip())
            if requirement.marker is not None and not requirement.marker.evaluate(GPU_PYTHON):
                continue  # an extra, another Python or another platform
            need = norm(requirement.name)
            if need not in image and need not in names:
                missing.append(f"{wheel.name} needs {need}")
total_mb = sum(w.stat().st_size for w in wheels) / 1e6
print(f"{len(wheels)} wheels, {total_mb:.1f} MB in {dest}")
for wheel in wheels:
    print(f"  {wheel.name}")
if twice:
    sys.exit(f"more than one version of {twice} in {dest}: the install takes one of each")
if missing:
    sys.exit("needs met neither by the GPU machine's image nor by a wheel:\n  " + "\n  ".join(missing))
EOF
