#!/usr/bin/env bash
# Apache Kafka's own tools against the quick start's broker (or INTAKE_KAFKA_BROKERS):
#   deploy/kafka-tool.sh kafka-topics --describe --topic intake.requests
#   deploy/kafka-tool.sh kafka-consumer-groups --describe --group intake-writer
#   deploy/kafka-tool.sh kafka-consumer-groups --group intake-writer --topic intake.requests:3 \
#       --reset-offsets --to-offset 1200 --execute          (writers stopped; see deploy/RUNBOOK.md)
# --bootstrap-server is added when not given. The jars are fetched from Maven Central once.
source "$(dirname "$0")/lib.sh"

TOOLS_VERSION=4.3.1
TOOLS_LIBS="$INTAKE_CACHE/kafka-tools-$TOOLS_VERSION/libs"

tool="${1:-}"
case "$tool" in
    kafka-topics) class=org.apache.kafka.tools.TopicCommand ;;
    kafka-consumer-groups) class=org.apache.kafka.tools.consumer.group.ConsumerGroupCommand ;;
    kafka-get-offsets) class=org.apache.kafka.tools.GetOffsetShell ;;
    kafka-console-consumer) class=org.apache.kafka.tools.consumer.ConsoleConsumer ;;
    *) echo "usage: $0 kafka-topics|kafka-consumer-groups|kafka-get-offsets|kafka-console-consumer [ARGS...]" >&2; exit 2 ;;
esac
shift

if [ ! -f "$TOOLS_LIBS/.complete" ]; then
    command -v mvn >/dev/null || install_packages
    say "fetching Apache Kafka's tools $TOOLS_VERSION from Maven Central (once)"
    rm -rf "$TOOLS_LIBS"
    mvn -B -q -f "$REPO/deploy/kafka-tools/pom.xml" -Dmaven.repo.local="$INTAKE_CACHE/m2" \
        org.apache.maven.plugins:maven-dependency-plugin:3.6.1:copy-dependencies \
        -DincludeScope=runtime -DoutputDirectory="$TOOLS_LIBS" >"$LOGS/kafka-tools-install.log" 2>&1 \
        || { tail -n 30 "$LOGS/kafka-tools-install.log" >&2; exit 1; }
    touch "$TOOLS_LIBS/.complete"
fi

args=("$@")
case " ${args[*]} " in
    *" --bootstrap-server "*) ;;
    *) args=(--bootstrap-server "$INTAKE_KAFKA_BROKERS" "${args[@]}") ;;
esac
exec java -Xmx256m -XX:TieredStopAtLevel=1 -cp "$TOOLS_LIBS/*" "$class" "${args[@]}"
