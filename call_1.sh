#!/bin/bash
# Session 25, call 1: the batch-1 decode ways (issue 54) and the fused-path GPU tests.
START=$(date +%s); DEADLINE=$((START + 565))
R=$OUT/r; mkdir -p $R
bounded() { local limit=$1; shift; local left=$((DEADLINE - $(date +%s))); [ $left -lt $limit ] && limit=$left; [ $limit -le 5 ] && { echo "skipped: $*"; return 124; }; timeout --signal=INT --kill-after=10 $limit "$@"; }
pack() { rm -rf /tmp/prof_*; tar czf - -C $OUT r | split -b 15M - $OUT/results.tgz.part-; rm -rf $R; }
trap pack EXIT
nvidia-smi --query-gpu=name,memory.used --format=csv > $R/gpus.txt
(
  export CUDA_VISIBLE_DEVICES=0
  bounded 330 python bench/decode_ways.py --ways before,today,matmul-attention,reduction-attention --profile --timeout 150 --out $R/decode-ways-a.json > $R/ways-a.log 2>&1
  bounded 400 python -m pytest -q -m gpu -p no:cacheprovider "tests/unit/test_generation_training.py::test_row_scales_equal_explicitly_scaled_norm_gains[cuda-graphs-compiled-terms-in-projections]" tests/unit/test_generation_training.py::test_compiled_terms_in_the_projections_add_no_matmul_to_the_decode_step_or_the_prefill "tests/unit/test_generation_training.py::test_samples_per_prompt_share_one_prefill" tests/unit/test_generation.py > $R/gpu-tests.log 2>&1
) &
(
  export CUDA_VISIBLE_DEVICES=1
  bounded 540 python bench/decode_ways.py --ways reduction-linear,reductions,reductions-autotuned --with-transformers --profile --timeout 200 --out $R/decode-ways-b.json > $R/ways-b.log 2>&1
) &
wait
