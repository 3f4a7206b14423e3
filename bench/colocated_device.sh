#!/usr/bin/env bash
# GPU tests and benchmark of the colocated weight update on a lent H200 machine (no network there).
#
# Here, once:   bash bench/colocated_device.sh prepare
#               (puts redis-server with its libraries and the redis-py wheel into .device/colocated/, which
#                .git/info/exclude keeps out of git; the device tool carries it)
# On the H200:  device run, carry [".device"], command "bash bench/colocated_device.sh test"
#               device run, carry [".device"], command "bash bench/colocated_device.sh bench --size-gb 8 16"
#               device run, carry [".device"], command "bash bench/colocated_device.sh step --preset qwen3-8b"
#               (a whole step, trainer layout to SGLang's fused parameters: bench/step_bench.py)
#               device run, carry [".device"], command "bash bench/colocated_device.sh hops --gaps-ms 0 100"
#               (the protocol's meta-store hops alone, no GPU work: bench/hop_bench.py)
#               ("all" runs both; arguments after "bench" go to bench/colocated_bench.py; "copy --size-gb 8"
#                compares ways to do the copy phase alone, against one flat copy)
#               device run, carry [".device/sglang-gpu"], command "bash bench/colocated_device.sh sglang-gpu check"
#               (real SGLang 0.5.17 with our loader over CUDA IPC: bench/sglang_gpu.py, whose arguments follow,
#                e.g. "sglang-gpu bench --preset qwen3-8b"; here, first: bash scripts/sglang-gpu-carry.sh)
#               device run, carry [".device/sglang-classes"], command "bash bench/colocated_device.sh sglang-classes"
#               (SGLang 0.5.10's and 0.5.23's model classes on CUDA: bench/sglang_gpu_classes.py; here, first:
#                bash scripts/sglang-classes-carry.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
CARRY=$REPO/.device/colocated

prepare() {
    mkdir -p "$CARRY/redis/lib"
    grep -qx '/.device/' .git/info/exclude 2>/dev/null || echo '/.device/' >> .git/info/exclude
    cp "$(command -v redis-server)" "$CARRY/redis/redis-server"
    # Every shared library but the C runtime itself (the device's glibc is newer than Debian 12's).
    ldd "$(command -v redis-server)" | awk '/=> \//{print $3}' \
        | grep -Ev '/(libc|libm|libstdc\+\+|libgcc_s|ld-linux[^/]*)\.so' \
        | xargs -I{} cp -L {} "$CARRY/redis/lib/"
    local python=${PYTHON:-.venv/bin/python}
    "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d "$CARRY/wheels" \
        "redis==$("$python" -c 'import redis; print(redis.__version__)')"
    # hiredis parses Redis replies in C (a runtime dependency): about 0.4 ms of an 8 GB step.
    "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$CARRY/wheels" \
        "hiredis==$("$python" -c 'from importlib.metadata import version; print(version("hiredis"))')"
    du -sh "$CARRY"
}

setup_device() {
    [ -d "$CARRY" ] || { echo "no $CARRY: run 'bash bench/colocated_device.sh prepare' here and carry .device"; exit 2; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$CARRY"/wheels/*.whl
    mkdir -p /tmp/shim
    ln -sfn "$REPO/runtime" /tmp/shim/colocate_runtime
    ln -sfn "$REPO/devcluster" /tmp/shim/colocate_devcluster  # the local Redis launcher (tests, benches)
    printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$CARRY/redis/lib" "$CARRY/redis/redis-server" \
        > /tmp/redis-server
    chmod +x /tmp/redis-server "$CARRY/redis/redis-server"
    export COLOCATE_REDIS_SERVER=/tmp/redis-server
    export PYTHONPATH=/tmp/site:/tmp/shim:$REPO${PYTHONPATH:+:$PYTHONPATH}
    export PYTHONUNBUFFERED=1
    /tmp/redis-server --version
    python3 -c 'import torch, redis; print("torch", torch.__version__, "redis-py", redis.__version__, torch.cuda.get_device_name(0))'
}

run_tests() {
    # tests/conftest.py declares the redis_server fixture; its control plane starts only for tests that ask.
    python3 -m pytest tests/runtime/test_colocated_gpu.py tests/runtime/test_one_pass_gpu.py \
        tests/runtime/test_colocated_release.py -m gpu -v -p no:cacheprovider
}

run_all_gpu_tests() {
    # Every GPU test of the repository (colocated CUDA IPC, p2p over NCCL, the reshard exchange).
    NCCL_NVLS_ENABLE=0 python3 -m pytest tests/runtime/test_colocated_gpu.py tests/runtime/test_one_pass_gpu.py \
        tests/runtime/test_p2p_exec.py tests/runtime/test_colocated_release.py \
        tests/runtime/test_colocated_exchange.py tests/runtime/test_digest_gpu.py -m gpu -v -p no:cacheprovider
}

setup_sglang_gpu() {
    # What scripts/sglang-gpu-carry.sh packed: SGLang 0.5.17, the trimmed kernel, the light packages, Redis.
    local carry=$REPO/.device/sglang-gpu
    [ -d "$carry" ] || { echo "no $carry: run 'bash scripts/sglang-gpu-carry.sh' here and carry .device/sglang-gpu"; exit 2; }
    mkdir -p /tmp/site
    [ -d "$CARRY" ] || tar -C "$REPO/.device" -xJf "$carry/colocated.tar.xz"
    local f
    if [ ! -f /tmp/site/.sglang-gpu ]; then  # once per machine (a warm machine keeps /tmp)
        for f in "$carry"/site.tar.xz "$carry"/sglang-*.tar.xz "$carry"/sglang_kernel-*.tar.xz; do
            tar -C /tmp/site -xJf "$f"
        done
        touch /tmp/site/.sglang-gpu
    fi
    setup_device
    # First on the path: our flashinfer stub (tests/sglang_gpu/stubs/sitecustomize.py says why).
    export PYTHONPATH=$REPO/tests/sglang_gpu/stubs:$PYTHONPATH
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    export SGLANG_IS_FLASHINFER_AVAILABLE=false
    python3 -c 'import sglang, sgl_kernel, torch_memory_saver, transformers; print("sglang", sglang.__version__, "transformers", transformers.__version__)'
}

sglang_classes() {
    # SGLang 0.5.10's and 0.5.23's own model classes on CUDA (bench/sglang_gpu_classes.py, arguments follow):
    # what scripts/sglang-classes-carry.sh packed; the kernel and flashinfer stubbed
    # (tests/sglang_gpu/classes_stubs/sitecustomize.py says why). Lines and the log go to $OUT.
    local carry=$REPO/.device/sglang-classes v path status=0 out=${OUT:-/tmp}
    [ -d "$carry" ] || { echo "no $carry: run 'bash scripts/sglang-classes-carry.sh' here and carry .device/sglang-classes"; exit 2; }
    [ -d "$CARRY" ] || tar -C "$REPO/.device" -xJf "$carry/colocated.tar.xz"
    if [ ! -f /tmp/classes/.done ]; then  # once per machine (a warm machine keeps /tmp)
        mkdir -p /tmp/classes/site /tmp/classes/tf /tmp/classes/0.5.10 /tmp/classes/0.5.23
        tar -C /tmp/classes/site -xJf "$carry/site.tar.xz"
        tar -C /tmp/classes/tf -xJf "$carry/transformers-5.12.1.tar.xz"
        for v in 0.5.10 0.5.23; do tar -C "/tmp/classes/$v" -xJf "$carry/sglang-$v.tar.xz"; done
        touch /tmp/classes/.done
    fi
    setup_device
    export PYTHONPATH=$REPO/tests/sglang_gpu/classes_stubs:/tmp/classes/site:$PYTHONPATH
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    export SGLANG_IS_FLASHINFER_AVAILABLE=false
    for v in ${SGLANG_CLASSES_VERSIONS:-0.5.10 0.5.23}; do
        path=/tmp/classes/$v:$PYTHONPATH
        # The device's transformers first; 5.12.1 (carried) where SGLang's configs do not import with it.
        if ! PYTHONPATH=$path python3 -c 'import sglang.srt.configs' >/dev/null 2>"$out/import-$v.err"; then
            tail -3 "$out/import-$v.err"; echo "sglang $v: with transformers 5.12.1"
            path=/tmp/classes/$v:/tmp/classes/tf:$PYTHONPATH
        fi
        PYTHONPATH=$path python3 bench/sglang_gpu_classes.py --out "$out/sglang_gpu_classes.jsonl" "$@" 2>&1 \
            | tee -a "$out/sglang-classes.log" || status=1
    done
    return $status
}

run_bench() {
    python3 bench/colocated_bench.py "$@"
}

case "${1:-}" in
    prepare) prepare ;;
    test) setup_device; run_tests ;;
    gpu-tests) setup_device; run_all_gpu_tests ;;
    pytest) shift; setup_device; NCCL_NVLS_ENABLE=0 python3 -m pytest -p no:cacheprovider "$@" ;;  # chosen tests
    vmm) shift; setup_device; python3 bench/vmm_bench.py "$@" ;;
    bench) shift; setup_device; run_bench "$@" ;;
    copy) shift; setup_device; run_bench --role copy "$@" ;;
    step) shift; setup_device; python3 bench/step_bench.py "$@" ;;
    fp8-copy) shift; setup_device; python3 bench/fp8_copy_bench.py "$@" ;;
    hops) shift; setup_device; python3 -m bench.hop_bench "$@" ;;
    all) shift; setup_device; status=0; run_tests || status=$?; run_bench "$@"; exit $status ;;
    sglang-gpu) shift; setup_sglang_gpu; python3 bench/sglang_gpu.py "$@" ;;
    sglang-classes) shift; sglang_classes "$@" ;;
    *) echo "usage: $0 prepare|test|gpu-tests|bench [args]|copy [args]|step [args]|fp8-copy [args]|hops [args]|all [args]|sglang-gpu [args]|sglang-classes [args]"; exit 2 ;;
esac
