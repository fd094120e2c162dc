#!/usr/bin/env bash
# Apply Elastor's pretrain_gpt.py patch to a Megatron-LM checkout.
#
#   tools/apply_megatron_patch.sh MEGATRON_LM_DIR
#
# Tries each patch in patches/ with a dry run first and applies the first one that
# fits (one per Megatron-LM release; each names the tag and commit it applies to).
# Nothing is changed unless a dry run succeeds; re-running on a patched tree is a no-op.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
target="${1:-}"
if [[ -z "$target" || ! -f "$target/pretrain_gpt.py" ]]; then
    echo "usage: $0 MEGATRON_LM_DIR  (a Megatron-LM checkout with pretrain_gpt.py)" >&2
    exit 2
fi
if grep -q "install_elastor_hooks" "$target/pretrain_gpt.py"; then
    echo "$target/pretrain_gpt.py already has the Elastor hooks; nothing to do"
    exit 0
fi

for p in "$here"/patches/*.patch; do
    applies_to="$(sed -n 's/^Applies to: //p' "$p")"
    if patch --dry-run --forward --silent -p1 -d "$target" < "$p" > /dev/null 2>&1; then
        echo "dry run OK: $(basename "$p") ($applies_to)"
        patch --forward -p1 -d "$target" < "$p"
        echo "patched $target/pretrain_gpt.py; run it with elastor-mcore importable (pip install -e $here)"
        exit 0
    fi
    echo "does not fit: $(basename "$p") ($applies_to)"
done
echo "no patch in $here/patches fits $target/pretrain_gpt.py; check out one of the releases named above" >&2
exit 1
