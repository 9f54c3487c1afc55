#!/usr/bin/env bash
# Usage: install_debian_package.sh PACKAGE COMMAND...
# Installs Debian's PACKAGE when any of the COMMANDs is missing from PATH.
#
# The tests run real tools instead of re-implementing them: HAProxy (package `haproxy`: the
# fleet's balancer), Prometheus and promtool (package
# `prometheus`: a scraping server, `promtool check metrics|rules`, `promtool test rules`) and wrk
# (package `wrk`: the load the Prometheus test measures, and `make bench`). Non-interactive
# (CI=true, no stdin). A package's service is never started here: a policy-rc.d that denies starts
# covers images where invoke-rc.d would try, and the tests start binaries themselves on loopback
# with their own configuration.
set -euo pipefail

if [[ $# -lt 2 ]]; then
    echo "usage: $0 PACKAGE COMMAND..." >&2
    exit 2
fi
package=$1
shift

missing=0
for command in "$@"; do
    command -v "$command" >/dev/null 2>&1 || missing=1
done
if [[ "$missing" -eq 0 ]]; then
    exit 0
fi

if [[ "$(id -u)" -ne 0 ]]; then
    if command -v sudo >/dev/null 2>&1; then
        if sudo -n true 2>/dev/null; then
            exec sudo -n -E bash "$0" "$package" "$@"
        fi
        # A person at a terminal (make bench) may type a password; tests and CI never wait.
        if [[ -t 0 && -z "${CI:-}" ]]; then
            exec sudo -E bash "$0" "$package" "$@"
        fi
    fi
    echo "install_debian_package.sh: $* missing and not root (no passwordless sudo)" >&2
    exit 1
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_debian_package.sh: $* missing and apt-get not available" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
# Deny service starts during the install; remove our policy afterwards only if we created it.
policy=/usr/sbin/policy-rc.d
created_policy=0
if [[ ! -e "$policy" ]]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy"
    chmod +x "$policy"
    created_policy=1
fi
cleanup() {
    if [[ "$created_policy" -eq 1 ]]; then
        rm -f "$policy"
    fi
}
trap cleanup EXIT

# Another apt run (a parallel session, unattended-upgrades) may hold the dpkg lock: wait for it.
apt_opts=(-o DPkg::Lock::Timeout=600 -qq)
apt-get "${apt_opts[@]}" update
apt-get "${apt_opts[@]}" install -y --no-install-recommends "$package" </dev/null

# Where systemd runs, make sure no distribution instance (Prometheus would hold :9090) runs on
# our behalf; where it is absent the package could not start one anyway.
if command -v systemctl >/dev/null 2>&1 && [[ -d /run/systemd/system ]]; then
    systemctl stop "$package" >/dev/null 2>&1 || true
fi

for command in "$@"; do
    command -v "$command" >/dev/null
done
