#!/bin/bash
# GPT-3 175B as launched by Megatron-LM's SC'21 scripts (Narayanan et al., SC'21), flattened into
# one file for `hzpsim import megatron` (hzpsim does not run it). Source: NVIDIA/Megatron-LM
# examples/academic_paper_scripts/sc21/ (formerly examples/sc21/) at commit
# d98e8a64ddf34856e74b24714e3bedb2f5a39553; the scripts were written at 6985e58938d40ad91ac07b0fddcfad8132e1447e
# ("To replicate these results use Megatron-LM commit: 6985e589", sc21/README.md).
#
# Copied verbatim: SRUN.sh's #SBATCH line, CONFIG.sh's MEGATRON_PARAMS, SRUN.sh's CMD and srun
# line, the variable block layout of run_table_1.sh / run_figure_12.sh.
# Changed: (1) the variable values are GPT-3 175B's (96 layers, hidden 12288, 96 heads, TP 8,
# PP 16, micro-batch 1, global batch 1536, 128 DGX A100 nodes = 1,024 GPUs), which no sc21 script
# sets (run_table_1.sh has 145B and 310B; run_figure_12.sh runs 175B on TP 8 PP 12);
# (2) the `<...>` placeholders of CONFIG.sh are replaced by example paths (they do not affect a
# step); (3) the sbatch line of SBATCH.sh (--nodes=${NNODES}) is folded into the srun line as
# --nodes=${NNODES}, because sbatch passes it to the srun step. The interleaved case of
# run_figure_12.sh adds --num-layers-per-virtual-pipeline-stage 2 to MEGATRON_EXTRA_PARAMS
# (2 layers per virtual stage = 3 chunks per pipeline rank here); tests/test_import.py does that.

#SBATCH -t 0:30:00 --exclusive --mem=0 --overcommit --ntasks-per-node=8

TP=8
PP=16
MBS=1
GBS=1536
NLS=96
HS=12288
NAH=96
DDP=local
NNODES=128
MEGATRON_EXTRA_PARAMS="--activations-checkpoint-method uniform "

# Source code, data and tokenizer files (CONFIG.sh's placeholders, filled in).
MEGATRON_CODE_DIR=/workspace/megatron
MEGATRON_DATA=/data/gpt2/my-gpt2_text_document
BPE_VOCAB_FILE=/data/gpt2/gpt2-vocab.json
BPE_MERGE_FILE=/data/gpt2/gpt2-merges.txt

# Megatron input parameters (CONFIG.sh).
export MEGATRON_PARAMS=" ${MEGATRON_EXTRA_PARAMS} \
	--tensor-model-parallel-size ${TP} \
	--pipeline-model-parallel-size ${PP} \
	--micro-batch-size ${MBS} \
	--global-batch-size ${GBS} \
        --num-layers ${NLS} \
        --hidden-size ${HS} \
        --num-attention-heads ${NAH} \
	--DDP-impl ${DDP} \
	--data-path ${MEGATRON_DATA} \
	--vocab-file ${BPE_VOCAB_FILE} \
	--merge-file ${BPE_MERGE_FILE} \
        --log-interval 5 \
        --seq-length 2048 \
        --max-position-embeddings 2048 \
        --train-iters 500 \
        --lr-decay-iters 320 \
        --lr 0.0001 \
	--min-lr 0.00001 \
        --lr-decay-style cosine \
        --lr-warmup-fraction 0.01 \
        --split 969,30,1 \
        --eval-iters 100 \
        --eval-interval 1000 \
        --clip-grad 1.0 \
        --fp16 \
	--loss-scale 8192 "

# SRUN.sh
CMD="python -u ${MEGATRON_CODE_DIR}/pretrain_gpt.py ${MEGATRON_PARAMS}"

srun -l --nodes=${NNODES} \
     --container-image "nvcr.io#nvidia/pytorch:20.12-py3" \
     --output=logs/%x_%j.log sh -c "${CMD}"
