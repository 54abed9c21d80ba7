#!/usr/bin/env bash
# pyperf GPU driver (scratch): build the Python package only, then A/B timings and a profile.
set -uo pipefail
cd "$(dirname "$0")"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TL=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))')
export LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-}
{ date -u; nvidia-smi -L; nproc; python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
t0=$SECONDS
deps=$(realpath build-gpu-deps); b=/tmp/uckpt-gpu
torch_prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
libdir=/usr/lib/$(gcc -print-multiarch); libz=$(ls $libdir/libz.so* | head -1); libcrypto=$(ls $libdir/libcrypto.so* | head -1)
gen=(); command -v ninja > /dev/null && gen=(-G Ninja)
cmake -S . -B $b "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$torch_prefix;$deps" -DUCKPT_TESTS=OFF -DUCKPT_BENCH=OFF \
  -DZLIB_INCLUDE_DIR=$deps/include -DZLIB_LIBRARY=$libz -DOPENSSL_INCLUDE_DIR=$deps/include -DOPENSSL_CRYPTO_LIBRARY=$libcrypto \
  -DOPENSSL_SSL_LIBRARY=$libcrypto -DXXHASH_LIBRARY=$deps/lib/libxxhash.a -DCMAKE_CXX_FLAGS="-isystem $deps/include" > $OUT/cmake.log 2>&1 || { tail -30 $OUT/cmake.log; exit 1; }
cmake --build $b -j$(nproc) --target python > $OUT/build.log 2>&1 || { grep -m5 -A5 error $OUT/build.log; tail -20 $OUT/build.log; exit 1; }
echo "built in $((SECONDS - t0)) s"
export MASTER_ADDR=127.0.0.1 MASTER_PORT=29533 RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 CUDA_VISIBLE_DEVICES=0
for step in ${STEPS:-}; do
  case $step in
    dsimport) PYTHONPATH=.ds timeout 60 python3 -c 'import deepspeed; from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer; print("deepspeed imports:", deepspeed.__version__)' > $OUT/dsimport.log 2>&1; tail -3 $OUT/dsimport.log ;;
    dsadam) PYTHONPATH=.ds timeout 150 python3 -c 'from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()' > $OUT/dsadam.log 2>&1; echo "ds cpu adam rc $?" ;;
    *:*:*) IFS=: read impl dtype var <<< "$step"
       path=$b/python; [ $impl = deepspeed ] && path=.ds
       env $([ "$var" = old ] && echo UCKPT_PYPERF_HOSTNORM=1 UCKPT_PYPERF_NOFUSE=1) $([ "$var" = mid ] && echo UCKPT_PYPERF_NOFUSE=1) PYTHONPATH=$path timeout 150 python3 bench/roberta_mlm.py --impl $impl --dtype $dtype --phases > $OUT/$impl-$dtype-$var.log 2>&1
       echo "== $impl $dtype $var rc $? $(grep '^{' $OUT/$impl-$dtype-$var.log | tail -1)" ;;
    prof:*) dtype=${step#prof:}; PYTHONPATH=$b/python timeout 150 python3 bench/python_step_cost.py --model roberta --device cuda --dtype $dtype --impl torch,uckpt --micro 8 --steps 20 --profile > $OUT/prof-$dtype.log 2>&1
       echo "== prof $dtype rc $?"; grep '^{' $OUT/prof-$dtype.log ;;
  esac
done
echo "total $((SECONDS - t0)) s"
