#!/usr/bin/env bash
# Run HERE, in the repo root, after ../shared/tools/gpu-mlx/fetch-wheels.sh (which empties .gpu-mlx):
# adds to .gpu-mlx/b the wheels of specgate's core dependencies (pyproject.toml) that the GPU
# machine's image lacks (/work/.library/device/KINDS.md, "Python packages already there"), at
# uv.lock's versions, for its Python 3.12 on x86_64 Linux. .gpu-mlx/b/on-device.sh installs every
# wheel in .gpu-mlx/b with MLX, so `specgate` and bench/gpu_suite.py import there.
# Already in the image: httpx, pyyaml, prometheus-client, uvloop, tokenizers, safetensors, pip,
# tqdm, numpy, anyio, click, h11, annotated-doc, typing-extensions (and mlx-lm's own dependencies).
set -euo pipefail
[ -d .gpu-mlx/b ] || { echo "run ../shared/tools/gpu-mlx/fetch-wheels.sh first (it makes .gpu-mlx/b)" >&2; exit 2; }
# name: the package, as uv.lock spells it; its version is read from uv.lock.
packages=(fastapi starlette uvicorn httptools pydantic pydantic-core annotated-types typing-inspection
          opentelemetry-api llguidance gguf)
pins=$(python3 - "${packages[@]}" <<'PY'
import sys, tomllib
lock = {p["name"]: p["version"] for p in tomllib.load(open("uv.lock", "rb"))["package"]}
missing = [n for n in sys.argv[1:] if n not in lock]
if missing:
    sys.exit(f"not in uv.lock: {', '.join(missing)}")
print(" ".join(f"{n}=={lock[n]}" for n in sys.argv[1:]))
PY
)
# shellcheck disable=SC2086  # one argument per pin
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux2014_x86_64 \
  -d .gpu-mlx/b $pins
ls .gpu-mlx/b/*.whl | sed 's|.*/||'
du -sh .gpu-mlx/b
# A call carries the repo's tree (~22 MiB) and at most 64 MiB in all: MLX's CUDA wheel goes in
# three parts (bench/device/on-device.sh stages a and a2, then installs with b).
big=$(awk '{print $2}' .gpu-mlx/b/big.sha256)
mkdir -p .gpu-mlx/a2
cat $(ls .gpu-mlx/a/part_a* .gpu-mlx/a2/part_a* .gpu-mlx/b/part_a* 2>/dev/null | awk -F/ '{print $NF, $0}' | sort | cut -d' ' -f2) > ".gpu-mlx/$big"
(cd .gpu-mlx && sha256sum -c --quiet b/big.sha256) || { echo "sha256 mismatch" >&2; exit 4; }
rm -f .gpu-mlx/a/part_a* .gpu-mlx/a2/part_a* .gpu-mlx/b/part_a*
(cd .gpu-mlx && split -b 40M "$big" part_ && mv part_aa a/ && mv part_ab a2/ && mv part_ac b/ && rm "$big")
du -sh .gpu-mlx/a .gpu-mlx/a2 .gpu-mlx/b
