#!/usr/bin/env bash
# Build the nograd image from the Dockerfile with podman and serve from it, without a Docker engine.
#
#   bash scripts/container_test.sh        (what `make container-test` runs; needs root)
#
# 1. installs podman, buildah and debootstrap with apt-get when missing;
# 2. makes the base image locally: a Debian bookworm minbase rootfs (python3 3.11 + venv + pip +
#    ca-certificates) from the machine's own Debian mirror, with the host's CA bundle, imported as
#    $BASE_IMAGE (the rootfs tarball is cached in $CACHE_DIR and reused);
# 3. copies the pinned CPU torch wheel into ./wheels/ and runs `podman build` with
#    --build-arg TORCH_WHEEL_DIR=wheels (the PyTorch index is not reachable here);
# 4. reads CMD/ENTRYPOINT/USER/HEALTHCHECK from the image, runs the server with `buildah run` as the
#    image's user on a free loopback port, and checks readiness, a V2 digits inference, the OpenAI
#    embeddings route (when minilm is loaded), /metrics and the image's own HEALTHCHECK command;
# 5. stops the server and removes the working container (a trap does it on failure too). The image
#    nograd:test and its layers stay in podman's store, so a re-run is an incremental build.
#
# Environment knobs (all optional):
#   IMAGE=nograd:test                    tag to build
#   BASE_IMAGE=localhost/nograd-base:bookworm
#   CACHE_DIR=/var/cache/nograd-container where the base rootfs tarball is kept
#   DEBIAN_MIRROR=...                    defaults to the bookworm mirror in the apt sources
#   READY_TIMEOUT=180                    seconds to wait for /v2/health/ready
#   LOG_DIR=.container/container-test    where the build and server logs are left (gitignored)
#   PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_TRUSTED_HOST, HTTP_PROXY, HTTPS_PROXY, NO_PROXY
#                                        passed to the build as build args when set
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

IMAGE="${IMAGE:-nograd:test}"
BASE_IMAGE="${BASE_IMAGE:-localhost/nograd-base:bookworm}"
CACHE_DIR="${CACHE_DIR:-/var/cache/nograd-container}"
READY_TIMEOUT="${READY_TIMEOUT:-180}"
LOG_DIR="${LOG_DIR:-$PWD/.container/container-test}"  # build and server logs, kept after the run
SUITE="bookworm"
BASE_TAR="$CACHE_DIR/base-$SUITE-minbase.tar"
HOST_CA_BUNDLE="/etc/ssl/certs/ca-certificates.crt"
HOST_PYTHON="$(command -v python3 || true)"

SCRIPT_START="$(date +%s)"
log() { printf '[container-test %4ss] %s\n' "$(($(date +%s) - SCRIPT_START))" "$*"; }
die() { printf '[container-test] FAIL: %s\n' "$*" >&2; exit 1; }

# ---------------------------------------------------------------------------------------------------
# Cleanup: whatever this run started, it stops, on success and on failure alike.
WORK_DIR=""
CTR=""
SERVER_PID=""
cleanup() {
    local rc=$?
    set +e
    if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
        # The server runs in its own process group (setsid): end the whole group, by its id.
        kill -TERM -- "-$SERVER_PID" 2>/dev/null
        for _ in $(seq 1 20); do
            kill -0 "$SERVER_PID" 2>/dev/null || break
            sleep 0.5
        done
        kill -KILL -- "-$SERVER_PID" 2>/dev/null
        wait "$SERVER_PID" 2>/dev/null
    fi
    if [[ -n "$CTR" ]]; then
        buildah rm "$CTR" >/dev/null 2>&1
    fi
    if [[ -n "$WORK_DIR" && -d "$WORK_DIR" ]]; then
        rm -rf "$WORK_DIR"
    fi
    if [[ "$rc" -ne 0 ]]; then
        printf '[container-test] FAILED (exit %s) after %ss\n' "$rc" "$(($(date +%s) - SCRIPT_START))" >&2
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

[[ "$(id -u)" -eq 0 ]] || die "run as root (podman build/buildah run with chroot isolation and debootstrap need it)"
[[ -n "$HOST_PYTHON" ]] || die "python3 is needed on the host"
WORK_DIR="$(mktemp -d /tmp/nograd-container-test.XXXXXX)"
mkdir -p "$LOG_DIR"

# ---------------------------------------------------------------------------------------------------
# 1. Tools.
missing=()
for tool in podman buildah debootstrap; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if [[ "${#missing[@]}" -gt 0 ]]; then
    log "installing ${missing[*]} with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >"$LOG_DIR/apt.log" 2>&1 || { tail -20 "$LOG_DIR/apt.log" >&2; die "apt-get update failed"; }
    apt-get install -y -q podman buildah debootstrap >>"$LOG_DIR/apt.log" 2>&1 \
        || { tail -20 "$LOG_DIR/apt.log" >&2; die "apt-get install podman buildah debootstrap failed"; }
fi
log "$(podman --version), $(buildah --version | cut -d' ' -f1-3)"

# ---------------------------------------------------------------------------------------------------
# 2. Base image: Debian bookworm minbase via debootstrap, cached as a tarball.
debian_mirror() {
    # The first plain-suite (no -security/-updates) Debian URI in the machine's apt sources.
    "$HOST_PYTHON" - <<'PY'
import glob, re
def deb822(path):
    for stanza in re.split(r"\n\s*\n", open(path, encoding="utf-8", errors="replace").read()):
        fields, key = {}, None
        for line in stanza.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            if line[0].isspace() and key:
                fields[key] += " " + line.strip()
                continue
            key, _, value = line.partition(":")
            key = key.strip().lower()
            fields[key] = value.strip()
        if fields.get("enabled", "yes").lower() == "no" or "deb" not in fields.get("types", "").split():
            continue
        for uri in fields.get("uris", "").split():
            yield uri, fields.get("suites", "").split()
def one_line(path):
    for line in open(path, encoding="utf-8", errors="replace"):
        parts = re.sub(r"\[[^]]*\]", "", line.split("#", 1)[0]).split()
        if len(parts) >= 3 and parts[0] == "deb":
            yield parts[1], [parts[2]]
sources = []
for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
    sources += list(deb822(path))
for path in ["/etc/apt/sources.list"] + sorted(glob.glob("/etc/apt/sources.list.d/*.list")):
    try:
        sources += list(one_line(path))
    except OSError:
        pass
for uri, suites in sources:
    if "security" in uri:
        continue
    if any(s in ("bookworm", "trixie", "bullseye", "sid", "stable", "testing") for s in suites):
        print(uri.rstrip("/"))
        break
PY
}

if [[ ! -s "$BASE_TAR" ]]; then
    mirror="${DEBIAN_MIRROR:-$(debian_mirror)}"
    [[ -n "$mirror" ]] || die "no Debian mirror found in /etc/apt/sources.list{,.d/*}; set DEBIAN_MIRROR"
    log "debootstrap $SUITE (minbase + python3) from $mirror"
    mkdir -p "$CACHE_DIR"
    rootfs="$CACHE_DIR/rootfs.tmp"
    rm -rf "$rootfs"
    debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
        "$SUITE" "$rootfs" "$mirror" >"$LOG_DIR/debootstrap.log" 2>&1 \
        || { tail -30 "$LOG_DIR/debootstrap.log" >&2; rm -rf "$rootfs"; die "debootstrap failed"; }
    # Slim it the way the python:*-slim images are: no apt lists/archives, docs, man pages, locales.
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/lib/apt/lists/* \
        "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* "$rootfs"/var/log/*.log
    find "$rootfs/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name locale.alias -exec rm -rf {} +
    tar --numeric-owner -C "$rootfs" -cf "$BASE_TAR.tmp" .
    mv "$BASE_TAR.tmp" "$BASE_TAR"
    rm -rf "$rootfs"
else
    log "reusing cached base rootfs $BASE_TAR"
fi

# The imported image carries the host's CA bundle (so pip in the build trusts what the host's pip
# trusts); the key below re-imports it when either the tarball or the bundle changes.
base_key="$(cat <(stat -c '%s %Y' "$BASE_TAR") "$HOST_CA_BUNDLE" | sha256sum | cut -c1-32)"
have_key="$(podman image inspect --format '{{index .Config.Labels "org.nograd.base-key"}}' "$BASE_IMAGE" 2>/dev/null || true)"
if [[ "$have_key" != "$base_key" ]]; then
    log "importing $BASE_IMAGE"
    rootfs="$WORK_DIR/rootfs"
    mkdir -p "$rootfs"
    tar --numeric-owner -C "$rootfs" -xf "$BASE_TAR"
    cp "$HOST_CA_BUNDLE" "$rootfs/etc/ssl/certs/ca-certificates.crt"
    tar --numeric-owner -C "$rootfs" -c . | podman import --quiet \
        --change 'ENV LANG=C.UTF-8' \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change "LABEL org.nograd.base-key=$base_key" \
        --change 'CMD ["python3"]' \
        - "$BASE_IMAGE" >/dev/null
    rm -rf "$rootfs"
else
    log "reusing base image $BASE_IMAGE"
fi

# ---------------------------------------------------------------------------------------------------
# 3. The pinned CPU torch wheel in ./wheels/ (gitignored), then the build.
torch_version="$(sed -n 's/^torch==\([^[:space:]#]*\).*/\1/p' constraints.txt | head -n1)"
[[ -n "$torch_version" ]] || die "constraints.txt pins no torch==VERSION"
mkdir -p wheels
torch_wheel="$(find wheels -maxdepth 1 -name "torch-${torch_version}+cpu-cp311-cp311-*.whl" -print -quit)"
if [[ -z "$torch_wheel" ]]; then
    log "fetching torch==$torch_version (CPU, cp311) into wheels/ with pip download"
    # pip's find-links (/opt/wheels here) holds the +cpu build, which sorts above PyPI's CUDA build.
    "$HOST_PYTHON" -m pip download --disable-pip-version-check --no-deps --only-binary=:all: \
        --python-version 3.11 --implementation cp --abi cp311 \
        --platform "manylinux_2_28_$(uname -m)" \
        -d "$WORK_DIR/torch" "torch==$torch_version" >"$LOG_DIR/pip-download.log" 2>&1 \
        || { tail -20 "$LOG_DIR/pip-download.log" >&2; die "pip download torch==$torch_version failed"; }
    got="$(find "$WORK_DIR/torch" -maxdepth 1 -name 'torch-*.whl' -print -quit)"
    [[ "$got" == *"+cpu-"* ]] || die "pip found ${got:-no wheel}, not a +cpu torch build; put torch-${torch_version}+cpu-cp311-*.whl into wheels/"
    mv "$got" wheels/
    torch_wheel="wheels/$(basename "$got")"
fi
log "torch wheel: $torch_wheel"

build_args=(--build-arg "BASE_IMAGE=$BASE_IMAGE" --build-arg "TORCH_WHEEL_DIR=wheels" --build-arg "VARIANT=cpu")
for var in PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_TRUSTED_HOST HTTP_PROXY HTTPS_PROXY NO_PROXY http_proxy https_proxy no_proxy; do
    if [[ -n "${!var:-}" ]]; then
        build_args+=(--build-arg "$var=${!var}")
    fi
done

log "podman build -t $IMAGE (log: $LOG_DIR/build.log)"
old_image_id="$(podman image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)"
build_start="$(date +%s)"
# --format docker keeps HEALTHCHECK (the OCI image format has no field for it);
# --isolation chroot works without a Docker engine or nested namespaces.
if ! podman build --isolation chroot --pull=never --format docker --layers \
    "${build_args[@]}" -t "$IMAGE" -f Dockerfile . >"$LOG_DIR/build.log" 2>&1; then
    tail -40 "$LOG_DIR/build.log" >&2
    die "podman build failed"
fi
BUILD_SECONDS="$(($(date +%s) - build_start))"
# The image this tag named before (if the build changed it) would only take disk: drop it. The
# builder stage's layers stay, as the cache of the next build.
new_image_id="$(podman image inspect --format '{{.Id}}' "$IMAGE")"
if [[ -n "$old_image_id" && "$old_image_id" != "$new_image_id" ]]; then
    podman rmi "$old_image_id" >/dev/null 2>&1 || true
fi
IMAGE_SIZE="$(podman image inspect --format '{{.Size}}' "$IMAGE")"
log "built $IMAGE in ${BUILD_SECONDS}s, size $IMAGE_SIZE bytes ($((IMAGE_SIZE / 1024 / 1024)) MiB)"

# ---------------------------------------------------------------------------------------------------
# 4. What the image says it runs.
inspect_json="$WORK_DIR/inspect.json"
podman image inspect "$IMAGE" >"$inspect_json"
image_field() {
    # Prints the argv of .Config.<field> (or the HEALTHCHECK test), one NUL-terminated word each.
    "$HOST_PYTHON" - "$inspect_json" "$1" <<'PY'
import json, sys
img = json.load(open(sys.argv[1]))[0]
cfg = img.get("Config") or {}
field = sys.argv[2]
if field == "Healthcheck":
    # podman puts it at the top level ("Healthcheck"); docker under Config.
    hc = img.get("Healthcheck") or cfg.get("Healthcheck") or img.get("HealthCheck") or {}
    test = hc.get("Test") or []
    if not test or test[0] == "NONE":
        sys.exit("the image has no HEALTHCHECK")
    words = test[1:] if test[0] == "CMD" else ["/bin/sh", "-c", test[1]] if test[0] == "CMD-SHELL" else test
elif field == "User":
    words = [cfg.get("User") or ""]
else:
    words = cfg.get(field) or []
sys.stdout.write("".join(w + "\0" for w in words))
PY
}
mapfile -d '' entrypoint < <(image_field Entrypoint)
mapfile -d '' cmd < <(image_field Cmd)
mapfile -d '' healthcheck < <(image_field Healthcheck)
mapfile -d '' user_field < <(image_field User)
user="${user_field[0]:-}"
server_argv=("${entrypoint[@]}" "${cmd[@]}")
[[ "${#server_argv[@]}" -gt 0 ]] || die "the image has neither ENTRYPOINT nor CMD"
[[ "${#healthcheck[@]}" -gt 0 ]] || die "the image has no HEALTHCHECK (built without --format docker?)"
case "${user%%:*}" in
    "" | root | 0) die "the image runs as root (USER '$user'); it must set a non-root USER" ;;
esac
log "image runs ${server_argv[*]} as USER $user; HEALTHCHECK ${healthcheck[*]:0:2} ..."

# ---------------------------------------------------------------------------------------------------
# 5. Serve from the image on a free loopback port, as the image's user.
free_port() {
    "$HOST_PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}
# Both ports free ones: the container shares the host's network, where 8001 (gRPC's default) may
# be taken by another server.
port="$(free_port)"
grpc_port="$(free_port)"
base_url="http://127.0.0.1:$port"
CTR="$(buildah from --pull-never --name "nograd-container-test-$$" "$IMAGE")"
server_log="$LOG_DIR/server.log"
log "starting the server in $CTR on $base_url (log: $server_log)"
setsid buildah run --isolation chroot --user "$user" \
    --env "NOGRAD_PORT=$port" --env "NOGRAD_GRPC_PORT=$grpc_port" --env "NOGRAD_HOST=127.0.0.1" \
    "$CTR" -- "${server_argv[@]}" </dev/null >"$server_log" 2>&1 &
SERVER_PID=$!

# http METHOD PATH OUTFILE [BODY] -> prints the HTTP status (0 when no answer), body into OUTFILE.
http() {
    "$HOST_PYTHON" - "$1" "$base_url$2" "$3" "${4:-}" <<'PY'
import sys, urllib.error, urllib.request
method, url, out, body = sys.argv[1:5]
req = urllib.request.Request(url, method=method, data=body.encode() if body else None,
                             headers={"Content-Type": "application/json"} if body else {})
try:
    with urllib.request.urlopen(req, timeout=30) as resp:
        status, data = resp.status, resp.read()
except urllib.error.HTTPError as err:
    status, data = err.code, err.read()
except Exception as err:  # connection refused while starting, timeouts
    status, data = 0, repr(err).encode()
with open(out, "wb") as fh:
    fh.write(data)
print(status)
PY
}

ready_start="$(date +%s)"
while true; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
        tail -40 "$server_log" >&2
        die "the server exited before it was ready"
    fi
    status="$(http GET /v2/health/ready "$WORK_DIR/ready.out")"
    [[ "$status" == 200 ]] && break
    if (($(date +%s) - ready_start >= READY_TIMEOUT)); then
        tail -40 "$server_log" >&2
        die "/v2/health/ready not 200 within ${READY_TIMEOUT}s (last status $status)"
    fi
    sleep 1
done
READY_SECONDS="$(($(date +%s) - ready_start))"
log "ready after ${READY_SECONDS}s"

live="$(http GET /v2/health/live "$WORK_DIR/live.out")"
[[ "$live" == 200 ]] || die "/v2/health/live answered $live"
log "PASS live"

# A handwritten 0 from the digits data set (8x8, values 0..16).
digit='[0,0,5,13,9,1,0,0,0,0,13,15,10,15,5,0,0,3,15,2,0,11,8,0,0,4,12,0,0,8,8,0,0,5,8,0,0,9,8,0,0,4,11,0,1,12,7,0,0,2,14,5,10,12,0,0,0,0,6,13,10,0,0,0]'
infer_body='{"inputs":[{"name":"image","shape":[1,1,8,8],"datatype":"FP32","data":'"$digit"'}]}'
status="$(http POST /v2/models/digits/infer "$WORK_DIR/infer.out" "$infer_body")"
[[ "$status" == 200 ]] || die "digits inference answered $status: $(head -c 600 "$WORK_DIR/infer.out")"
"$HOST_PYTHON" - "$WORK_DIR/infer.out" <<'PY' || die "digits inference answer is wrong: $(head -c 600 "$WORK_DIR/infer.out")"
import json, sys
doc = json.load(open(sys.argv[1]))
assert doc.get("model_name") == "digits", doc.get("model_name")
outputs = doc.get("outputs")
assert isinstance(outputs, list) and outputs, "no outputs"
names = {o.get("name"): o for o in outputs}
summary = ", ".join(f"{o.get('name')}{o.get('shape')}" for o in outputs)
label = names.get("label", {}).get("data")
print(f"digits outputs: {summary}; label={label}")
PY
log "PASS digits V2 inference"

minilm_ready="$(http GET /v2/models/minilm/ready "$WORK_DIR/minilm-ready.out")"
if [[ "$minilm_ready" == 200 ]]; then
    status="$(http POST /v1/embeddings "$WORK_DIR/embed.out" '{"model":"minilm","input":"hello world"}')"
    [[ "$status" == 200 ]] || die "embeddings answered $status: $(head -c 600 "$WORK_DIR/embed.out")"
    "$HOST_PYTHON" - "$WORK_DIR/embed.out" <<'PY' || die "embeddings answer is wrong: $(head -c 600 "$WORK_DIR/embed.out")"
import json, math, sys
doc = json.load(open(sys.argv[1]))
assert doc.get("object") == "list", doc.get("object")
emb = doc["data"][0]["embedding"]
assert len(emb) == 384, len(emb)
assert all(math.isfinite(x) for x in emb)
print(f"embedding: {len(emb)} floats, norm {math.sqrt(sum(x * x for x in emb)):.3f}")
PY
    log "PASS OpenAI embeddings (minilm)"
else
    log "SKIP: embeddings check: GET /v2/models/minilm/ready answered $minilm_ready (minilm not loaded in this image)"
fi

status="$(http GET /metrics "$WORK_DIR/metrics.out")"
[[ "$status" == 200 ]] || die "/metrics answered $status"
grep -q '^nograd_requests_total' "$WORK_DIR/metrics.out" \
    || die "/metrics has no nograd_requests_total"
log "PASS /metrics has nograd_requests_total"

# The image's own HEALTHCHECK command, run inside the image as its user: 0 now, non-zero on a port
# where nothing listens (so a check that always passes would be caught).
buildah run --isolation chroot --user "$user" --env "NOGRAD_PORT=$port" "$CTR" -- "${healthcheck[@]}" \
    >"$LOG_DIR/hc.log" 2>&1 || { cat "$LOG_DIR/hc.log" >&2; die "the image's HEALTHCHECK failed against the ready server"; }
dead_port="$(free_port)"
if buildah run --isolation chroot --user "$user" --env "NOGRAD_PORT=$dead_port" "$CTR" -- "${healthcheck[@]}" \
    >"$LOG_DIR/hc-dead.log" 2>&1; then
    die "the image's HEALTHCHECK passed with no server listening"
fi
log "PASS image HEALTHCHECK (exit 0 when ready, non-zero with no server)"

# ---------------------------------------------------------------------------------------------------
# 6. Stop the server as `docker stop` does: SIGTERM to the image's command itself (below buildah
#    run's wrappers; PID 1 in a real container), then check it shuts down by itself. It is found
#    by name, not as the leaf: with worker processes its children are the workers and
#    multiprocessing's resource tracker, which ignores SIGTERM.
server_name="$(basename "${server_argv[0]}")"
server_proc="$SERVER_PID"
while [[ "$(ps -o comm= -p "$server_proc" | tr -d ' ')" != "${server_name:0:15}" ]] \
    && child="$(ps -o pid= --ppid "$server_proc" | head -n1 | tr -d ' ')" && [[ -n "$child" ]]; do
    server_proc="$child"
done
kill -TERM "$server_proc" 2>/dev/null || true
for _ in $(seq 1 30); do
    kill -0 "$SERVER_PID" 2>/dev/null || break
    sleep 0.5
done
if kill -0 "$SERVER_PID" 2>/dev/null; then
    die "the server (pid $server_proc) did not stop within 15s of SIGTERM"
fi
server_rc=0
wait "$SERVER_PID" 2>/dev/null || server_rc=$?
SERVER_PID=""
# A clean stop: exit status 0 after nograd's own drain (uvicorn's lifespan lines are not nograd's:
# its fronts run without a lifespan).
[[ "$server_rc" == 0 ]] && grep -q 'drain finished in' "$server_log" \
    || die "the server stopped on SIGTERM without a clean shutdown (exit $server_rc; see $server_log)"
log "PASS server shut down cleanly on SIGTERM (buildah run exit $server_rc)"

TOTAL_SECONDS="$(($(date +%s) - SCRIPT_START))"
printf 'container-test: image %s size %s bytes (%s MiB), build %ss, ready %ss, total %ss\n' \
    "$IMAGE" "$IMAGE_SIZE" "$((IMAGE_SIZE / 1024 / 1024))" "$BUILD_SECONDS" "$READY_SECONDS" "$TOTAL_SECONDS"
echo "container-test: PASSED"
