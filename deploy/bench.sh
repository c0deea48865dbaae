#!/usr/bin/env bash
# The benchmark lives in bench/ (bench/bench.sh); operators and the documents run it from here.
exec "$(dirname "$0")/../bench/bench.sh" "$@"
