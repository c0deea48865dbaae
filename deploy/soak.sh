#!/usr/bin/env bash
# The soak lives in bench/ (bench/soak.sh); operators and the documents run it from here.
exec "$(dirname "$0")/../bench/soak.sh" "$@"
