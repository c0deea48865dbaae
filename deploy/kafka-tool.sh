#!/usr/bin/env bash
# Apache Kafka's own tools against the quick start's broker (or INTAKE_KAFKA_BROKERS):
#   deploy/kafka-tool.sh kafka-topics --describe --topic intake.requests
#   deploy/kafka-tool.sh kafka-consumer-groups --describe --group intake-writer
#   deploy/kafka-tool.sh kafka-consumer-groups --group intake-writer --topic intake.requests:3 \
#       --reset-offsets --to-offset 1200 --execute          (writers stopped; see deploy/RUNBOOK.md)
# --bootstrap-server is added when not given. The tools are the broker's version, installed with
# it (deploy/lib.sh install_kafka, which up.sh runs): they need no registry.
source "$(dirname "$0")/lib.sh"

tool="${1:-}"
case "$tool" in
    kafka-topics) class=org.apache.kafka.tools.TopicCommand ;;
    kafka-consumer-groups) class=org.apache.kafka.tools.consumer.group.ConsumerGroupCommand ;;
    kafka-get-offsets) class=org.apache.kafka.tools.GetOffsetShell ;;
    kafka-console-consumer) class=org.apache.kafka.tools.consumer.ConsoleConsumer ;;
    *) echo "usage: $0 kafka-topics|kafka-consumer-groups|kafka-get-offsets|kafka-console-consumer [ARGS...]" >&2; exit 2 ;;
esac
shift

# The tools are installed with the broker, never fetched here: an operator's machine may have
# no registry to fetch them from.
if [ ! -f "$KAFKA_LIBS/kafka-tools-$KAFKA_VERSION.jar" ]; then
    say "Kafka's tools are not installed ($KAFKA_LIBS): deploy/up.sh installs them with the broker"
    exit 1
fi

args=("$@")
case " ${args[*]} " in
    *" --bootstrap-server "*) ;;
    *) args=(--bootstrap-server "$INTAKE_KAFKA_BROKERS" "${args[@]}") ;;
esac
exec java -Xmx256m -XX:TieredStopAtLevel=1 -cp "$KAFKA_LIBS/*" "$class" "${args[@]}"
