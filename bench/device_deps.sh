#!/usr/bin/env bash
# Copies the header libraries' installs (nlohmann-json, fmt with its shared
# library, doctest) from this Debian machine into DIR (default .devdeps,
# which .git/info/exclude should list), laid out as under /usr, for a
# device machine that has nvcc and CMake but not these packages:
#   bash bench/device_deps.sh .devdeps
#   (device) DEPS=.devdeps bash bench/gpu_check.sh $OUT     # carry .devdeps
set -euo pipefail
D=${1:-.devdeps}
rm -rf "$D"
mkdir -p "$D/include" "$D/share/cmake" "$D/lib/x86_64-linux-gnu/cmake" "$D/lib/cmake"
cp -r /usr/include/nlohmann /usr/include/fmt /usr/include/doctest "$D/include/"
cp -r /usr/share/cmake/nlohmann_json "$D/share/cmake/"
cp -r /usr/lib/x86_64-linux-gnu/cmake/fmt "$D/lib/x86_64-linux-gnu/cmake/"
cp -a /usr/lib/x86_64-linux-gnu/libfmt.so* "$D/lib/x86_64-linux-gnu/"
cp -r /usr/lib/cmake/doctest "$D/lib/cmake/"
du -sh "$D"
