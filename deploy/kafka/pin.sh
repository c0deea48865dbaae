#!/usr/bin/env bash
# Pins the jars of Apache Kafka VERSION that deploy/lib.sh installs: the broker, its command-line
# tools and their runtime dependencies, as deploy/kafka/pom.xml names them. Maven resolves them
# into a scratch repository; deploy/kafka/jars-VERSION.txt gets each jar's SHA-256 and its path
# on Maven Central. The quick start then fetches that list with curl, without Maven's own start
# and resolution (14 s of CPU on a fresh machine).
#
#   deploy/kafka/pin.sh [VERSION]     default: the version deploy/lib.sh runs
source "$(dirname "$0")/../lib.sh"
version="${1:-$KAFKA_VERSION}"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
mvn -B -q -f "$REPO/deploy/kafka/pom.xml" -Dkafka.version="$version" -Dmaven.repo.local="$scratch/m2" \
    org.apache.maven.plugins:maven-dependency-plugin:3.6.1:copy-dependencies \
    -DincludeScope=runtime -DoutputDirectory="$scratch/libs"
out="$REPO/deploy/kafka/jars-$version.txt"
{
    echo "# Apache Kafka $version's broker and tools with their runtime dependencies, from Maven Central."
    echo "# Written by deploy/kafka/pin.sh; installed by deploy/lib.sh install_kafka. SHA-256, path."
    for jar in "$scratch"/libs/*.jar; do
        sum="$(sha256sum "$jar" | cut -d ' ' -f 1)"
        path=""
        while read -r candidate; do
            [ "$(sha256sum "$candidate" | cut -d ' ' -f 1)" = "$sum" ] && path="${candidate#"$scratch/m2/"}" && break
        done < <(find "$scratch/m2" -name "$(basename "$jar")")
        [ -n "$path" ] || { say "$(basename "$jar") is not in the scratch repository"; exit 1; }
        echo "$sum  $path"
    done | sort -k 2
} >"$out"
say "pinned $(grep -vc '^#' "$out") jars in $out"
