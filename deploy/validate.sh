#!/usr/bin/env bash
# Validates the multi-machine deployment files with the tools made for them, installing each
# tool on first use (kept in ~/.cache/intake/deploy-tools; later runs install nothing):
#
# - Kubernetes manifests (k8s/): kubernetes-validate from PyPI, strict (unknown fields are
#   errors), against Kubernetes 1.28 (the oldest with the pod-index label the gateways use) and
#   1.37. It ships the API's JSON schemas, so it works offline; kubeconform would download them.
# - Prometheus rules (prometheus/): promtool check rules, and promtool test rules on the
#   synthetic series of every *.test.yml. promtool is taken out of Debian's
#   prometheus package without installing the package (which would start a Prometheus server).
# - systemd units (systemd/): systemd-analyze verify, with the programs' paths pointed at
#   stubs (it checks that ExecStart= is executable), the gateway also with its TLS drop-in;
#   any warning fails.
#
# Run by tests/tests/deploy_files.rs; by hand: deploy/validate.sh
# deploy/validate.sh promtool: installs promtool only and prints its path (tests/tests/dashboard.rs).
source "$(dirname "$0")/lib.sh"

DEPLOY="$REPO/deploy"
TOOLS="$INTAKE_CACHE/deploy-tools"
KUBERNETES_VALIDATE_VERSION=1.37.0
mkdir -p "$TOOLS/bin"

install_kubernetes_validate() {
    [ -x "$TOOLS/venv/bin/kubernetes-validate" ] && return
    # Two tests may get here at once on a fresh machine: one installs, the other waits for it
    # (it found the half-made virtualenv without pip before).
    local lock
    exec {lock}>"$TOOLS/venv.lock"
    flock "$lock"
    if [ ! -x "$TOOLS/venv/bin/kubernetes-validate" ]; then
        say "installing kubernetes-validate $KUBERNETES_VALIDATE_VERSION from PyPI (once)"
        rm -rf "$TOOLS/venv"
        python3 -m venv "$TOOLS/venv" 2>/dev/null || { install_python_venv; python3 -m venv "$TOOLS/venv"; }
        "$TOOLS/venv/bin/pip" install -q "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION"
    fi
    exec {lock}>&-
}

install_promtool() {
    [ -x "$TOOLS/bin/promtool" ] && return
    say "extracting promtool from Debian's prometheus package (once)"
    local dir
    dir="$(mktemp -d)"
    # apt-get download needs no root, only package lists: fetch them when it finds none.
    (cd "$dir" && apt-get download -q prometheus >/dev/null 2>&1) || {
        as_root flock /var/lock/intake-apt.lock apt-get update -qq -o DPkg::Lock::Timeout=600
        (cd "$dir" && apt-get download -q prometheus >/dev/null 2>&1)
    }
    # A part file of this process's own: two tests may install it at once, and mv is atomic.
    dpkg-deb --fsys-tarfile "$dir"/prometheus_*.deb | tar -x -O ./usr/bin/promtool >"$TOOLS/bin/promtool.part.$$"
    chmod +x "$TOOLS/bin/promtool.part.$$"
    mv "$TOOLS/bin/promtool.part.$$" "$TOOLS/bin/promtool"
    rm -rf "$dir"
}

install_systemd_analyze() {
    command -v systemd-analyze >/dev/null && return
    apt_install --no-install-recommends systemd  # for systemd-analyze
}

# kubernetes-validate only warns about a kind it has no schema for, and passes it: every such
# kind must be one of the vendored CRDs', which validate-crds.py checks strictly instead.
check_manifests() {
    local version output unknown
    for version in 1.28.0 1.37.0; do
        output="$("$TOOLS/venv/bin/kubernetes-validate" --strict --quiet -k "$version" "$DEPLOY"/k8s/*.yaml "$DEPLOY"/k8s/restore/*.yaml 2>&1)" \
            || { echo "$output" >&2; return 1; }
        unknown="$(grep "Couldn't find schema for kind" <<<"$output" \
            | grep -v -F -f <("$TOOLS/venv/bin/python" "$DEPLOY/validate-crds.py" "$DEPLOY/k8s/schemas" --kinds \
                | sed 's/^\([^ ]*\) \(.*\)$/kind \1 with api version \2 /'))" || true
        if [ -n "$unknown" ]; then
            echo "$unknown" >&2
            echo "FAILED: Kubernetes manifests (deploy/k8s): kinds without a schema" >&2
            return 1
        fi
    done
    echo "ok: Kubernetes manifests (deploy/k8s and k8s/restore, strict, Kubernetes 1.28 and 1.37)"
    "$TOOLS/venv/bin/python" "$DEPLOY/validate-crds.py" "$DEPLOY/k8s/schemas" "$DEPLOY"/k8s/*.yaml "$DEPLOY"/k8s/restore/*.yaml >/dev/null
    echo "ok: CloudNativePG resources (deploy/k8s, strict, against the CRDs vendored in deploy/k8s/schemas)"
}

# The HAProxy configurations: the one-machine layout's template (rendered) and the example for
# the writer and gateway machines.
check_haproxy() {
    local dir
    if ! command -v haproxy >/dev/null; then
        apt_install haproxy  # for haproxy -c
        ha_stop_debian_services
    fi
    dir="$(mktemp -d)"
    ha_render "$DEPLOY/ha/haproxy.cfg" "$dir/haproxy.cfg" RUN="$dir" PRIMARY_PORT=5432 STATS_PORT=8404 \
        PG_PORT_1=1 PG_PORT_2=2 PG_PORT_3=3 REST_PORT_1=4 REST_PORT_2=5 REST_PORT_3=6
    haproxy -c -q -f "$dir/haproxy.cfg" && haproxy -c -q -f "$DEPLOY/systemd/haproxy.cfg.example" \
        || { rm -rf "$dir"; echo "FAILED: HAProxy configurations" >&2; return 1; }
    rm -rf "$dir"
    echo "ok: HAProxy configurations (deploy/ha/haproxy.cfg, deploy/systemd/haproxy.cfg.example: haproxy -c)"
}

check_rules() {
    "$TOOLS/bin/promtool" check rules "$DEPLOY/prometheus/alerts.yml" >/dev/null
    "$TOOLS/bin/promtool" check config "$DEPLOY/prometheus/prometheus.yml" >/dev/null
    (cd "$DEPLOY/prometheus" && "$TOOLS/bin/promtool" test rules ./*.test.yml >/dev/null)
    echo "ok: Prometheus rules (deploy/prometheus: promtool check rules, check config, test rules)"
}

check_units() {
    local dir unit program output
    dir="$(mktemp -d)"
    mkdir "$dir/bin"
    # Every program a unit runs (intake's, etcd's, Patroni's, ...) becomes a stub.
    for unit in "$DEPLOY"/systemd/*.service "$DEPLOY"/systemd/*.timer; do
        sed -E "s#^(Exec[A-Za-z]*=[-+@!:]*)/(usr/)?(local/)?s?bin/#\1$dir/bin/#" "$unit" >"$dir/$(basename "$unit")"
    done
    for program in $(sed -nE "s#^Exec[A-Za-z]*=[-+@!:]*($dir/bin/[^ ]+).*#\1#p" "$dir"/*.service | sort -u); do
        printf '#!/bin/sh\n' >"$program"
        chmod +x "$program"
    done
    # The gateway with the TLS drop-in, as one unit (a section given twice is merged).
    cat "$dir/intake-gateway@.service" "$DEPLOY/systemd/intake-gateway-tls.conf" >"$dir/intake-gateway-tls@.service"
    # The templates are verified through an instance, so that %i is expanded.
    local status=0
    output="$(cd "$dir" && systemd-analyze verify --man=no ./intake-gateway@0.service ./intake-gateway-tls@0.service \
        ./intake-writer.service ./intake-migrate.service ./intake-etcd.service ./intake-patroni.service \
        ./intake-haproxy.service ./intake-pgbackrest-server@postgres.service ./intake-pgbackrest-backup@full.service \
        ./intake-pgbackrest-full.timer ./intake-pgbackrest-diff.timer 2>&1)" || status=$?
    rm -rf "$dir"
    if [ "$status" != 0 ] || [ -n "$output" ]; then
        echo "$output" >&2
        echo "FAILED: systemd units (deploy/systemd)" >&2
        return 1
    fi
    echo "ok: systemd units (deploy/systemd: systemd-analyze verify)"
}

if [ "${1:-}" = promtool ]; then
    install_promtool
    echo "$TOOLS/bin/promtool"
    exit 0
fi
# deploy/validate.sh crds MANIFEST...: the CRD validation alone, on other manifests
# (tests/tests/deploy_files.rs shows that it refuses what it should).
if [ "${1:-}" = crds ]; then
    shift
    install_kubernetes_validate
    exec "$TOOLS/venv/bin/python" "$DEPLOY/validate-crds.py" "$DEPLOY/k8s/schemas" "$@"
fi
install_kubernetes_validate
install_promtool
install_systemd_analyze
check_manifests
check_rules
check_units
check_haproxy
