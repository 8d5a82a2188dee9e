#!/usr/bin/env bash
# On the GPU machine (call 1): unpack what prepare.sh made and start building
# llama-cpp-python with CUDA into /tmp/dev/site, in the background (setsid: it outlives
# the call while the machine stays warm; about 6 minutes on 16 cores).
#
# The system's g++, not the image's default /opt/gcc/bin/g++: that one links libstdc++
# statically (libllama then NEEDs no libstdc++.so), and with torch's libstdc++ in the same
# process, whichever of torch and llama.cpp loaded second crashed (docs/gpu.md).
#
# `build_cuda.sh cpu` builds llama.cpp without CUDA (about a minute): enough for Dovetail
# (the head on the GPU through torch, the target on the CPU), as a laptop's CPU wheel runs it.
set -u
BACKEND=${1:-cuda}
D=/tmp/dev
mkdir -p $D/site
echo "$BACKEND" > $D/build.backend  # checks.sh: a CUDA build must offload (gpu_check --strict)
cp .dev/model.1 .dev/model.sha256 .dev/prompts.jsonl $D/
cp -r .dev/site/. $D/site/
tar -xzf .dev/lcp.tar.gz -C $D
# AMX CPUs: the Makefile's flags (a native build segfaults on decode there).
if grep -qs amx_tile /proc/cpuinfo; then
    CPU="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON \
-DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DGGML_FMA=ON -DGGML_F16C=ON"
else
    CPU=""
fi
export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++
if [ "$BACKEND" = cuda ]; then
    GPU="-DCMAKE_CUDA_HOST_COMPILER=/usr/bin/g++ -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
-DGGML_CUDA_NCCL=OFF"
else
    GPU=""
fi
export CMAKE_ARGS="$GPU -DLLAVA_BUILD=OFF -DLLAMA_BUILD_MTMD=OFF -DGGML_LLAMAFILE=ON \
-DGGML_RPC=ON $CPU"
export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
cd $D/llama_cpp_python-*/ || exit 1
setsid nohup bash -c "date +%s > $D/build.start; python3 -m pip install -v --no-build-isolation \
--no-deps --no-index --no-cache-dir --target $D/site . > $D/build.log 2>&1; \
echo \$? > $D/build.rc; date +%s > $D/build.end" > /dev/null 2>&1 < /dev/null &
sleep 20
nvidia-smi --query-gpu=name,memory.total,memory.free,driver_version --format=csv
lscpu | grep -E "Model name|^CPU\(s\)|Thread|Socket"
grep -o -E "avx512f|amx_tile" /proc/cpuinfo | sort | uniq -c
python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))"
tail -5 $D/build.log
