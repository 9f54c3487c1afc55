"""``nograd fleet``: several nograd replicas behind HAProxy on one machine, each model routed to
the replica that holds it (docs/fleet.md). Torch-free: it starts and stops processes and talks
to HAProxy's Runtime API; the replicas are ordinary ``python -m nograd`` servers."""
