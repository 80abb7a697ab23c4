#!/usr/bin/env bash
# Stage another revision's plugin sources for the GPU harness's A/B phase (gpu_check.sh ... ab):
#   bash scripts/stage_variant.sh REV [PLUGIN_DIR ...]     (default: every plugins/* directory)
# writes them under .variants/<REV as a path-safe name>/ (ignored by git; pass ".variants" in the device call's carry).
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:?usage: stage_variant.sh REV [PLUGIN_DIR ...]}; shift
dirs=${*:-plugins}
dest=.variants/$(echo "$rev" | tr -c 'A-Za-z0-9._\n-' _)
rm -rf "$dest" && mkdir -p "$dest"
# shellcheck disable=SC2086
git archive "$rev" $dirs | tar -x -C "$dest"
echo "$(git rev-parse --short "$rev")" > "$dest/COMMIT"
# A diagnostic build (its commit subject begins "DIAGNOSTIC": parts left out, wrong results by design) is timed only:
# gpu_check.sh's smoke and variant-tests phases pass it by.
subject=$(git log -1 --format=%s "$rev")
case "$subject" in DIAGNOSTIC*) echo "$subject" > "$dest/DIAGNOSTIC";; esac
echo "staged $rev ($(cat "$dest/COMMIT")) at $dest: $(ls -d "$dest"/plugins/*/ | xargs -n1 basename | tr '\n' ' ')"
