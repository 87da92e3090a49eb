#!/bin/sh
# One cron-driven data refresh: tokenize what is new in $MG_REFRESH_INPUT into
# shards under $MG_REFRESH_OUTPUT and publish blend.txt + manifest.json there.
#
#   MG_REFRESH_INPUT   folder the corpus files arrive in          (required)
#   MG_REFRESH_OUTPUT  folder of shards, blend.txt, manifest.json  (required)
#   MG_REFRESH_LOG     log file to append to (default: $MG_REFRESH_OUTPUT/refresh.log)
#   MG_REFRESH_FLAGS   tokenizer and other mg-prep refresh flags   (required), e.g.
#     "--tokenizer-type GPT2BPETokenizer --vocab-file /srv/tok/vocab.json
#      --merge-file /srv/tok/merges.txt --append-eod --workers 8"
#
# Overlapping runs are harmless: mg-prep refresh holds a lock on the output
# folder and a second run exits with status 0 ("another refresh is running").
# flock(1) on top of it also keeps a second run from even starting uv.
set -eu
: "${MG_REFRESH_INPUT:?set MG_REFRESH_INPUT to the folder the corpus files arrive in}"
: "${MG_REFRESH_OUTPUT:?set MG_REFRESH_OUTPUT to the folder to publish shards and blend.txt in}"
: "${MG_REFRESH_FLAGS:?set MG_REFRESH_FLAGS to the tokenizer flags (see mg-prep refresh --help)}"
root=$(cd "$(dirname "$0")/../.." && pwd)
log=${MG_REFRESH_LOG:-$MG_REFRESH_OUTPUT/refresh.log}
mkdir -p "$MG_REFRESH_OUTPUT" "$(dirname "$log")"
{
    echo "=== $(date '+%Y-%m-%d %H:%M:%S') refresh start (pid $$)"
    status=0
    # -n: do not queue behind a running refresh; -E 75: say so below, it is no error.
    # shellcheck disable=SC2086  # MG_REFRESH_FLAGS is a list of flags on purpose
    flock -n -E 75 "$MG_REFRESH_OUTPUT/.cron.lock" \
        "$root/bin/mg-prep" refresh \
        --input-dir "$MG_REFRESH_INPUT" --output-dir "$MG_REFRESH_OUTPUT" \
        $MG_REFRESH_FLAGS || status=$?
    if [ "$status" -eq 75 ]; then
        echo "another refresh is running (cron lock held); nothing to do"
        status=0
    fi
    echo "=== $(date '+%Y-%m-%d %H:%M:%S') refresh end, status $status"
} >>"$log" 2>&1
exit "${status:-0}"
