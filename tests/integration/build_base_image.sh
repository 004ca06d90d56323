#!/usr/bin/env bash
# Build a Debian bookworm base image (python3 + venv) without pulling from a registry:
# debootstrap it from this machine's Debian mirror, carry over this machine's CA
# certificates, apt and pip settings (egress may need them), then `docker import` it.
#
#   tests/integration/build_base_image.sh [TAG]     (default strata-base:bookworm)
#
# Env: DEBIAN_MIRROR overrides the mirror read from /etc/apt/sources.list*;
#      DOCKER (default: docker) is the client to import with.
set -euo pipefail

TAG=${1:-strata-base:bookworm}
SUITE=bookworm
DOCKER=${DOCKER:-docker}

first_bookworm_mirror() {
    # The first "deb" source serving the bookworm suite, one-line or deb822 format.
    python3 - <<'PY'
import glob, re
files = ["/etc/apt/sources.list"] + sorted(glob.glob("/etc/apt/sources.list.d/*.list"))
for path in files:
    try:
        lines = open(path).read().splitlines()
    except OSError:
        continue
    for line in lines:
        parts = re.sub(r"\[[^]]*\]", "", line.split("#")[0]).split()
        if len(parts) >= 3 and parts[0] == "deb" and parts[2] == "bookworm":
            print(parts[1]); raise SystemExit
for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
    for stanza in open(path).read().split("\n\n"):
        fields = dict(re.findall(r"^([A-Za-z-]+):\s*(.*)$", stanza, re.M))
        if "deb" in fields.get("Types", "").split() and "bookworm" in fields.get("Suites", "").split():
            print(fields["URIs"].split()[0]); raise SystemExit
print("http://deb.debian.org/debian")
PY
}

MIRROR=${DEBIAN_MIRROR:-$(first_bookworm_mirror)}
ROOTFS=$(mktemp -d /var/tmp/strata-rootfs.XXXXXX)
trap 'rm -rf "$ROOTFS"' EXIT

echo "debootstrap $SUITE from $MIRROR into $ROOTFS" >&2
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    "$SUITE" "$ROOTFS" "$MIRROR" >&2

# CA certificates: the local ones, and the bundle that already contains them.
if [ -d /usr/local/share/ca-certificates ]; then
    cp -a /usr/local/share/ca-certificates/. "$ROOTFS/usr/local/share/ca-certificates/"
fi
cp -L /etc/ssl/certs/ca-certificates.crt "$ROOTFS/etc/ssl/certs/ca-certificates.crt"

# apt: this machine's sources (enabled ones only), their keyrings, and its apt.conf.d.
if compgen -G "/etc/apt/sources.list.d/*.sources" >/dev/null || [ -s /etc/apt/sources.list ]; then
    rm -f "$ROOTFS/etc/apt/sources.list"
    [ -s /etc/apt/sources.list ] && cp /etc/apt/sources.list "$ROOTFS/etc/apt/sources.list"
    for f in /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
        [ -e "$f" ] && cp "$f" "$ROOTFS/etc/apt/sources.list.d/"
    done
fi
for f in /usr/share/keyrings/*.gpg /etc/apt/trusted.gpg.d/*; do
    [ -e "$f" ] && [ ! -e "$ROOTFS$f" ] && cp "$f" "$ROOTFS$f"
done
cp -a /etc/apt/apt.conf.d/. "$ROOTFS/etc/apt/apt.conf.d/"

# pip: trust the system bundle (bookworm's pip vendors certifi otherwise) and keep any
# network index this machine uses; local file:// indexes would not exist in the image.
python3 - "$ROOTFS/etc/pip.conf" <<'PY'
import subprocess, sys
out = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                     capture_output=True, text=True).stdout
settings = {}
for line in out.splitlines():
    key, _, value = line.partition("=")
    name = key.split(".", 1)[-1]
    value = value.strip().strip("'\"")
    if name in ("index-url", "extra-index-url", "trusted-host", "default-timeout", "timeout"):
        kept = [v for v in value.split() if not v.startswith("file:") and not v.startswith("/")]
        if kept:
            settings[name] = " ".join(kept)
settings["cert"] = "/etc/ssl/certs/ca-certificates.crt"
with open(sys.argv[1], "w") as f:
    f.write("[global]\n" + "".join(f"{k} = {v}\n" for k, v in sorted(settings.items())))
PY

# Keep the image small: nothing below is needed to build or run.
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/* \
    "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/locale/*

tar --numeric-owner -C "$ROOTFS" -c . | "$DOCKER" import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' \
    - "$TAG" >&2
echo "$TAG"
