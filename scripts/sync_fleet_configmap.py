"""Copy deploy/fleet/haproxy.cfg into the ConfigMap of deploy/k8s/fleet/balancer.yaml, so the
Kubernetes balancer runs the file the one-machine fleet runs (tests/deploy checks they match).

Usage: python scripts/sync_fleet_configmap.py
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "deploy" / "fleet" / "haproxy.cfg"
MANIFEST = ROOT / "deploy" / "k8s" / "fleet" / "balancer.yaml"
INDENT = "    "


def main() -> None:
    block = "".join(
        INDENT + line if line.strip() else "\n" for line in CONFIG.read_text().splitlines(True)
    )
    manifest = MANIFEST.read_text()
    # The literal block runs from "haproxy.cfg: |" to the document's end marker.
    pattern = re.compile(r"(  haproxy\.cfg: \|\n)(.*?)(^---$)", re.DOTALL | re.MULTILINE)
    updated, count = pattern.subn(lambda m: m.group(1) + block + m.group(3), manifest)
    if count != 1:
        raise SystemExit(f"{MANIFEST}: no haproxy.cfg block to replace")
    MANIFEST.write_text(updated)


if __name__ == "__main__":
    main()
