#!/usr/bin/env bash
# Headless Chromium for the report tests (tests/reports): Debian's `chromium` package. Idempotent; fast when
# installed. Without root or apt-get it says so and the browser tests skip; in CI (CI=true) that is an error.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "scripts/browser.sh: chromium is not installed and this user cannot apt-get it; the browser tests will skip" >&2
    [ "${CI:-}" = "true" ] && exit 1
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq chromium fonts-dejavu-core >/dev/null
chromium --version
