#!/usr/bin/env bash
# Regenerate every results page in benchmarks/results/ with the settings its figures were measured
# at. Each step replaces only its own generated section; a step that fails stops the script. Every
# command here writes a section that is on its page, and every section on a page but the GPU's (it
# needs a GPU: benchmarks/gpu.py) is written by a command here (tests/benchmarks/test_results_claims.py).
#   benchmarks/regenerate.sh [quality|micro|parallel|serving|all]   (default: all; `micro` skips the training runs)
# The sizes are small enough for a shared 2-core CPU; larger runs: see each script's --help.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
what="${1:-all}"

micro() {
  $PY benchmarks/kernels.py --reps 5 --allocators default --write-results
  # the QAT step on this CPU's best ISA, then held to AVX2 (torch's kernels and the extension's)
  $PY benchmarks/train_step.py --models bert --variants fp32,qc_w8a8,qc_w4a8,qc_w4 --rounds 3 --mem-jobs 1 --write-results
  ATEN_CPU_CAPABILITY=avx2 QCOMPRESS_LOWBIT_ISA=avx2 $PY benchmarks/train_step.py --models bert \
      --variants fp32,qc_w8a8,qc_w4a8,qc_w4 --rounds 2 --mem-jobs 2 --write-results
  $PY benchmarks/compile_step.py --write-results
  $PY benchmarks/inference.py --only stack --layers 8 --width 2048 --rounds 3
  $PY benchmarks/export.py --repeats 3
  $PY benchmarks/formats.py --threads 1 --reps 5 --rows 1024 --cols 2048 --width 512 --batch 64 --write-results
  $PY benchmarks/comm.py --worlds 2 4 --sizes 1M 4M 16M --reps 5 --shaped 1gbit --shaped-sizes 1M 4M
  $PY benchmarks/comm_train.py --worlds 2 --compression-steps 4 --timeout 1500
  $PY benchmarks/checkpoint_cost.py --rounds 3 --write-results
  $PY benchmarks/activation_checkpointing.py --rounds 2 --steps 2 --write-results
  $PY benchmarks/nvme_offload.py --steps 4 --rounds 1 --write-results
  $PY benchmarks/pld.py --steps 150 --eval-every 25 --write-results
}

quality() {
  # the causal LM is made here, pinned to a step count (the same checkpoint on any machine)
  [ -f runs/gpt2-austen/config.json ] || $PY benchmarks/pretrain_gpt2.py --corpus austen --out runs/gpt2-austen \
      --steps 200 --layers 2 --d-model 256 --heads 4
  $PY benchmarks/quality.py --task classifier --recipes w8a8,w4a8_g128,fp8_dynamic,nvfp4,mxfp4a16 --train-samples 320 --eval-samples 150 \
      --threads 1 --write-results
  # why the classifier's QAD trails its QAT at this budget: the student against its teacher's confidence
  $PY benchmarks/qad_teacher.py --threads 1 --write-results
  # the float recipes run QAT and QAD (minmax) where the integer ones run all three variants, then their
  # mse rows (PTQ mse, QAT + RL) by --float-rl; the second line writes the table of both
  $PY benchmarks/quality.py --task lm --lm runs/gpt2-austen --recipes w4_g32,fp8_dynamic,fp8_block,nvfp4,nvfp4a16,mxfp4a16 \
      --max-steps 20 --batch-size 8 --eval-samples 32 --threads 1
  $PY benchmarks/quality.py --task lm --lm runs/gpt2-austen --recipes fp8_dynamic,nvfp4,mxfp4a16,fp8_block,nvfp4a16 \
      --float-rl --variants qat_rl --max-steps 20 --batch-size 8 --eval-samples 32 --threads 1 --write-results
  # the MoE model is made by moe.py itself, pinned to its --steps (600; kept in runs/moe-austen)
  $PY benchmarks/moe.py
  # SmolLM2-135M with FP8 / int8 KV-cache quantization, before and after a short W4 g128 QAT
  $PY benchmarks/kv_quality.py --write-results
  # SmolLM2-135M: every 4-bit method's perplexity (finished rows are kept in runs/llm/summary.json)
  # (PTQ rows, then the training rows at 40 steps, then the LoRA pair at 20 steps, which writes the page)
  $PY benchmarks/llm.py --eval-blocks 40 --calib-blocks 32 \
      --rows fp32,w4_rtn,w4_gptq,w4_gptq_r124,w4a8_rtn,w4a8_gptq,w4a8_gptq_r124,nvfp4_rtn,nvfp4_r124,w4ch_rtn,w4ch_gptq,w3_rtn,w3_gptq,kv_fp8,kv_int8,kv_fp8_head,w4_mse,w4_gptq_r12,w4ch_gptq_r124,w3_gptq_r124,nvfp4_gptq_r124,nvfp4_r124_b16,nvfp4_gptq_r124_b16,w4_gptq_mse_r124,w4_gptq_mse_r124_c128,w4a8_gptq_mse_r124_c128,nvfp4_gptq_mse
  $PY benchmarks/llm.py --eval-blocks 40 --calib-blocks 32 --steps 40 --batch 2 --lr 2e-5 \
      --rows w4_qad,w4_qad_lrot,w4_qad_gmse,w4_qad_gmse_c128,w4_qad_gmse_c128_lr,w4_qat,fp32_ft,w4qat_kv_fp8,w4qat_kv_fp8_head,w4qat_kv_fp8_learned,w4qat_kv_int8,nvfp4_qad_gmse_r4,nvfp4_qad_gmse,nvfp4_qad_gmse_r4_lr,nvfp4_qad_gmse_r4_lr2,nvfp4_qad_gmse_r4_lr_80
  $PY benchmarks/llm.py --eval-blocks 40 --calib-blocks 32 --steps 20 --batch 2 --lr 2e-5 \
      --rows lora_full_qat,lora_qat_r16 --write-results
  # LoRA QAT's and QLoRA's peak training memory against full-parameter QAT, without and with
  # activation checkpointing (on every variant alike)
  $PY benchmarks/lora_memory.py
  $PY benchmarks/lora_memory.py --checkpointing
}

serving() {
  # vLLM's CPU build lives in its own environment (make serve-check builds it); the transformers
  # column runs in the project's
  local PY=.venv-serve/bin/python
  $PY benchmarks/serving_check.py --transformers-python .venv/bin/python --work runs/serving --reuse --write-results
  $PY benchmarks/serving_check.py --write-docs
  # decode speed against vLLM CPU on the same exports: this CPU's best ISA, then both held to AVX2
  $PY benchmarks/serving_speed.py --tokens 16 --rounds 3 --isa native --work runs/speed --write-results
  ATEN_CPU_CAPABILITY=avx2 QCOMPRESS_LOWBIT_ISA=avx2 $PY benchmarks/serving_speed.py --tokens 16 --rounds 3 --isa avx2 --work runs/speed --write-results
}

parallel() {
  # gloo ranks on CPU: one process against itself nudged by 1 ulp, two-half sums and TP2 (constant LR;
  # losses, then weight codes and static ranges),
  # then every mesh (DP, TP, PP and their compositions, up to 8 ranks) at one global batch
  $PY benchmarks/parallel.py --drift --drift-steps 100 --ulp-runs 2
  $PY benchmarks/parallel_flips.py --steps 5
  $PY benchmarks/parallel.py --steps 200 --ulp-runs 2
  $PY benchmarks/parallel.py --spread --steps 200 --ulp-runs 7 --schemes W8A8
}

case "$what" in
  micro) micro ;;
  quality) quality ;;
  parallel) parallel ;;
  serving) serving ;;
  all) micro; quality; parallel; serving ;;
  *) echo "usage: $0 [quality|micro|parallel|serving|all]" >&2; exit 2 ;;
esac
# RESULTS.md's table of what each section was run at, read from the headers just written
$PY benchmarks/provenance.py --write-results
