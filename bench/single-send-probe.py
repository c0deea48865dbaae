#!/usr/bin/env python3
"""A single send from outside, as a user's script would do it: one kept-alive HTTP/1.1
connection (Python's http.client), each send a new conversion with an email, answered
before the next. Prints p50, p90, p99 and max in milliseconds, client included.

    bench/single-send-probe.py KEY [SENDS [GAP_SECONDS [URL]]]

KEY is the quick start's demo key (deploy/up.sh prints it). GAP_SECONDS 0 sends back to back;
0.12 is about 8 a second. Mind the key's limit of 600 requests a minute.
"""
import http.client
import json
import sys
import time
import urllib.parse


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    key = sys.argv[1]
    sends = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    gap = float(sys.argv[3]) if len(sys.argv) > 3 else 0.12
    url = urllib.parse.urlsplit(sys.argv[4] if len(sys.argv) > 4 else "http://127.0.0.1:8080")
    connection = http.client.HTTPConnection(url.hostname, url.port or 80)
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    latencies, statuses = [], {}
    for i in range(sends):
        body = json.dumps({
            "event": "lead",
            "external_id": f"probe-{time.time_ns()}-{i}",
            "occurred_at": "2026-01-01T10:00:00Z",
            "email": f"probe{i}@example.com",
        })
        started = time.perf_counter()
        connection.request("POST", "/v1/conversions", body, headers)
        response = connection.getresponse()
        response.read()
        latencies.append((time.perf_counter() - started) * 1000)
        statuses[response.status] = statuses.get(response.status, 0) + 1
        time.sleep(gap)
    latencies.sort()

    def at(q: float) -> float:
        return round(latencies[min(len(latencies) - 1, int(q * len(latencies)))], 2)

    print(json.dumps({"sends": sends, "gap_s": gap, "statuses": statuses,
                      "p50_ms": at(0.5), "p90_ms": at(0.9), "p99_ms": at(0.99), "max_ms": round(latencies[-1], 2)}))


if __name__ == "__main__":
    main()
