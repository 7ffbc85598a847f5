#!/usr/bin/env bash
# Run 48 (one H200): run 47's measurements again after the change it called for (run 47 measured
# contiguous runs of items slower: L2 locality lost): the items round-robin again, with only the
# items of experts past the resident chunks cut along K. Same script as run 47.
exec bash "$(dirname "${BASH_SOURCE[0]}")/gpu_run47.sh" "$@"
