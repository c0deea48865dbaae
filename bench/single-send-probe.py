#!/usr/bin/env python3
"""A single send from outside, as a user's script would do it: one kept-alive HTTP/1.1
connection (Python's http.client), each send a new conversion with an email, answered
before the next. Prints p50, p90, p99 and max in milliseconds, client included.

    bench/single-send-probe.py KEY [SENDS [GAP_SECONDS [URL]]]

KEY is the quick start's demo key (deploy/up.sh prints it). GAP_SECONDS 0 sends back to back;
0.12 is about 8 a second. Mind the key's limit of 600 requests a minute.

Also prints where the time of the slowest sends went: each stage's mean over the sends at or
above p99, and over all, from their Server-Timing headers (docs/operations.md, "Where a
write's time goes"), and the five slowest with their request ids, to find in the logs.
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
    latencies, statuses, timed = [], {}, []
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
        latency = (time.perf_counter() - started) * 1000
        latencies.append(latency)
        timed.append((latency, response.getheader("X-Request-ID"), stages(response.getheader("Server-Timing"))))
        statuses[response.status] = statuses.get(response.status, 0) + 1
        time.sleep(gap)
    latencies.sort()

    def at(q: float) -> float:
        return round(latencies[min(len(latencies) - 1, int(q * len(latencies)))], 2)

    timed.sort(key=lambda t: t[0])
    slowest = [t for t in timed if t[0] >= at(0.99)]
    print(json.dumps({"sends": sends, "gap_s": gap, "statuses": statuses,
                      "p50_ms": at(0.5), "p90_ms": at(0.9), "p99_ms": at(0.99), "max_ms": round(latencies[-1], 2),
                      "stages_ms_of_slowest_1pct": means([t[2] for t in slowest]),
                      "stages_ms_of_all": means([t[2] for t in timed]),
                      "slowest": [{"ms": round(t[0], 2), "request_id": t[1], "stages": t[2]} for t in timed[-5:]]}))


def stages(header):
    """{stage: ms} of a Server-Timing header, without the total."""
    found = {}
    for part in (header or "").split(","):
        name, _, duration = part.strip().partition(";dur=")
        if name and name != "total" and duration:
            found[name] = float(duration)
    return found


def means(all_stages):
    names = {name for stages_ in all_stages for name in stages_}
    count = max(1, len(all_stages))
    return {name: round(sum(s.get(name, 0.0) for s in all_stages) / count, 2) for name in sorted(names)}


if __name__ == "__main__":
    main()
