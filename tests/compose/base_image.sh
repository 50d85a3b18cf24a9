#!/bin/sh
# A local base image for the Dockerfile where Docker Hub is out of reach (python:3.11-slim cannot be
# pulled): Debian bookworm's minimal root (debootstrap, from the Debian mirror this host's apt uses)
# with Python 3.11 in a venv on PATH, imported as an image. pip inside it trusts this host's CA
# bundle (PIP_CERT), so that it reaches the package registries exactly as the host's pip does.
#   tests/compose/base_image.sh [TAG]        (default splitmoe-base:bookworm; kept once built)
#   docker build --build-arg BASE_IMAGE=splitmoe-base:bookworm -t splitmoe:local .
set -eu
TAG=${1:-splitmoe-base:bookworm}
if docker image inspect "$TAG" >/dev/null 2>&1; then
    echo "$TAG: already built"
    exit 0
fi
MIRROR=$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -n 1)
MIRROR=${MIRROR:-$(awk '$1 == "deb" {print $2; exit}' /etc/apt/sources.list 2>/dev/null)}
ROOT=$(mktemp -d)
trap 'rm -rf "$ROOT"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
    bookworm "$ROOT" "${MIRROR:-http://deb.debian.org/debian}"
cp /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/ssl/certs/host-ca-bundle.crt"
chroot "$ROOT" python3 -m venv /opt/venv
rm -rf "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/lib/apt/lists/*
tar -C "$ROOT" -c . | docker import \
    --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV PIP_CERT=/etc/ssl/certs/host-ca-bundle.crt' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' - "$TAG"
echo "$TAG: built"
