#!/usr/bin/env bash
# Run ON THE GPU MACHINE; a three-call variant of ../shared/tools/gpu-mlx/on-device.sh (the repo's
# tree is ~22 MiB, so a call carries at most ~42 MiB of wheels): bench/device/fetch-wheels.sh splits
# MLX's CUDA wheel in .gpu-mlx/a, .gpu-mlx/a2 and .gpu-mlx/b. Call 1 carries .gpu-mlx/a and runs
# `bash bench/device/on-device.sh stage .gpu-mlx/a`; call 2, at once, the same with a2; call 3
# carries .gpu-mlx/b and runs `source bench/device/on-device.sh install && python3 bench/...`
# (install joins the staged parts with b's in name order, checks the sha256, installs every wheel).
STAGE=/tmp/gpu-mlx
case "${1:-}" in
  stage)
    mkdir -p $STAGE && cp "$2"/part_a* $STAGE/ && ls $STAGE ;;
  install)
    if [ ! -d $STAGE/site/mlx ]; then
      whl=$STAGE/$(awk '{print $2}' .gpu-mlx/b/big.sha256)
      cat $(for f in $STAGE/part_a* .gpu-mlx/b/part_a*; do echo "$(basename $f) $f"; done | sort | awk '{print $2}') > "$whl"
      (cd $STAGE && sha256sum -c --quiet "$OLDPWD/.gpu-mlx/b/big.sha256") || { echo "sha256 mismatch" >&2; return 4 2>/dev/null || exit 4; }
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $STAGE/site "$whl" .gpu-mlx/b/*.whl
      sp=$(python3 -c "import site; print(site.getsitepackages()[0])")
      ln -sfn "$sp/nvidia" $STAGE/site/nvidia
    fi
    sp=$(python3 -c "import site; print(site.getsitepackages()[0])")
    export PYTHONPATH=$STAGE/site${PYTHONPATH:+:$PYTHONPATH}
    export LD_LIBRARY_PATH=$(ls -d "$sp"/nvidia/*/lib | tr '\n' ':')${LD_LIBRARY_PATH:-}
    [ -d /usr/local/cuda ] && export CUDA_HOME=/usr/local/cuda
    export MLX_PTX_CACHE_DIR=$STAGE/ptx
    python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())" ;;
  *) echo "usage: on-device.sh stage DIR | install" >&2 ;;
esac
