#!/usr/bin/env bash
# Installs Prometheus and promtool from Debian's `prometheus` package when either is missing.
#
# Used by tests/integration/test_prometheus.py and tests/unit/test_alert_rules.py: the tests run the
# real binaries (a scraping server, `promtool check metrics|rules`, `promtool test rules`) instead of
# re-implementing their checks. Non-interactive (CI=true, no stdin). The package's systemd service
# is never started here: a policy-rc.d that denies starts covers images where invoke-rc.d would try,
# and the tests start the binary themselves on loopback with their own config and storage.
set -euo pipefail

if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    exit 0
fi

if [[ "$(id -u)" -ne 0 ]]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        exec sudo -n -E bash "$0" "$@"
    fi
    echo "install_prometheus.sh: prometheus/promtool missing and not root (no passwordless sudo)" >&2
    exit 1
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_prometheus.sh: prometheus/promtool missing and apt-get not available" >&2
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
apt-get "${apt_opts[@]}" install -y --no-install-recommends prometheus </dev/null

# Where systemd is absent the package cannot start its service anyway; where it is present, make
# sure the distribution's instance (which would hold :9090) is not running on our behalf.
if command -v systemctl >/dev/null 2>&1 && [[ -d /run/systemd/system ]]; then
    systemctl stop prometheus >/dev/null 2>&1 || true
fi

command -v prometheus >/dev/null
command -v promtool >/dev/null
{ prometheus --version 2>&1 || true; } | sed -n 1p
