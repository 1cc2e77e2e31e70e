#!/usr/bin/env python3
"""The core's folders are its data flow (include/reshard/reshard.hpp): a
header includes only from its own folder and the folders before it, the
core never includes what sits beside it (presets, sim) or this repository's
support, and cuda/ (the device side, used inside the core) includes no
planner and, outside its .cuh kernels, no executor. Prints each violation
as `header: includes X (rule)` and exits 1 if there is any."""
import os
import re
import sys

CORE = ["base", "layout", "schedule", "plan", "transport", "exec"]
TOP = "top"  # resharder.hpp, commit.hpp, json_io.hpp, reshard.hpp: what a user calls


def folder_of(rel):
    return rel.split("/")[0] if "/" in rel else TOP


def allowed(src, dst):
    """Why `src` may not include `dst` (paths relative to include/reshard), or None."""
    fs, fd = folder_of(src), folder_of(dst)
    if fs in CORE:
        if fd in CORE and CORE.index(fd) <= CORE.index(fs):
            return None
        if fd == "cuda" and dst.endswith(".hpp"):
            return None
        return f"{fs}/ may include only {', '.join(CORE[: CORE.index(fs) + 1])} and cuda/*.hpp"
    if fs == TOP:
        return None if fd in CORE + [TOP, "cuda"] else "the core's user-facing headers include only the core"
    if fs == "cuda":
        ok = ["base", "layout", "schedule", "transport", "cuda"] + (["exec"] if src.endswith(".cuh") else [])
        return None if fd in ok else f"cuda/ may include only {', '.join(ok)}"
    if fs == "presets":
        return None if fd in ["base", "layout", "presets"] else "presets/ builds layouts: base, layout and presets only"
    if fs == "sim":
        return None if fd in CORE + [TOP, "sim"] else "sim/ may include the core and sim/ only"
    return f"unknown folder {fs}/"


def main(root):
    inc = os.path.join(root, "include", "reshard")
    bad = []
    headers = 0
    for d, _, files in os.walk(inc):
        for name in sorted(files):
            if not name.endswith((".hpp", ".cuh")):
                continue
            headers += 1
            path = os.path.join(d, name)
            src = os.path.relpath(path, inc)
            for m in re.finditer(r'^#include "([^"]+)"', open(path).read(), re.M):
                target = m.group(1)
                if target.startswith("reshard/"):
                    dst = target[len("reshard/"):]
                else:
                    dst = os.path.relpath(os.path.normpath(os.path.join(os.path.dirname(path), target)), inc)
                if dst.startswith("..") or not os.path.exists(os.path.join(inc, dst)):
                    bad.append(f"{src}: includes {target} (not a header of include/reshard)")
                    continue
                why = allowed(src, dst)
                if why:
                    bad.append(f"{src}: includes {dst} ({why})")
    for b in bad:
        print(b)
    print(f"{headers} headers, {len(bad)} include(s) against the layering")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")))
