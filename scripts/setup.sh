#!/usr/bin/env bash
# Installs what reshard's build, tests and tools need from Debian's packages.
# Idempotent: packages already present are left alone and apt is not touched.
# With arguments, installs those packages instead (scripts/sanitize.sh: the
# compilers and sanitizer runtimes).
set -euo pipefail
pkgs=(cmake g++ make pkg-config nlohmann-json3-dev doctest-dev libcli11-dev libfmt-dev
      libucx-dev ucx-utils openmpi-bin libopenmpi-dev python3 python3-dev python3-venv iproute2
      procps)
[ $# -gt 0 ] && pkgs=("$@")
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all packages present"
  exit 0
fi
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
