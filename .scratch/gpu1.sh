set -o pipefail; export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,power.limit --format=csv,noheader
timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/runtime/test_nccl_step.py tests/runtime/test_pipeline_nccl.py tests/dp/test_dp_nccl.py 2>&1 | tee $OUT/gpu-tests.log | tail -25
C="--model mlp-stack --layers 16 --hidden 4096 --ffn 16384 --tokens 4096 --microbatches 8 --layers-kind zbpp --zbpp-torch-layers 1f1b --warmup 2 --steps 4"
timeout 150 torchrun --nproc-per-node=2 benchmarks/bench_pipeline.py $C --zbpp 1f1b,zb-h1,zb-v --torch Schedule1F1B,ScheduleZBVZeroBubble --out $OUT/b.json 2>&1 | tee $OUT/b1.log | grep -v "^  done" | tail -22
timeout 80 torchrun --nproc-per-node=2 benchmarks/bench_pipeline.py $C --zbpp zb-v --torch "" --comm-max-ctas none --append --out $OUT/b.json 2>&1 | tee $OUT/b2.log | grep -v "^  done" | tail -8
timeout 80 torchrun --nproc-per-node=2 benchmarks/bench_pipeline.py $C --zbpp zb-v --torch "" --recv-lead 1 --append --out $OUT/b.json 2>&1 | tee $OUT/b3.log | grep -v "^  done" | tail -8
