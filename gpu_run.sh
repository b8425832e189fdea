set -x
export PYTHONPATH=.
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
date -u
timeout 280 python benchmarks/decode_layers.py --contexts 64,128,170,256,1024 --ways layers,layers-att4,layers-att4-solo4,layers-poll-merge,layers-prefetch,layers-solo8-att4-prefetch --replays 400 2>&1 | grep -v o+mlp | tee $OUT/layers.txt
date -u
timeout 280 python benchmarks/engine_decode.py --modes step-async --kernels triton --batches 1 --no-hf --steps 100 --gemm-variant default,poll-merge,att4-solo4,solo8-att4-prefetch,default,poll-merge,att4-solo4,solo8-att4-prefetch 2>&1 | tail -30 | tee $OUT/engine.txt
date -u
