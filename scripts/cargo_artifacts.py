#!/usr/bin/env python3
"""Reads cargo's `--message-format=json` messages on stdin and prints one line per artifact the
shell scripts look for: `bin NAME PATH` and `test NAME PATH` for executables, `out-dir PACKAGE DIR`
for each build script that ran."""
import json
import sys


def package_name(package_id: str) -> str:
    """`path+file:///x/main#tandem@0.1.0`, `path+file:///x/tandem#0.1.0` (the folder is the name),
    `registry+https://...#serde@1.0.0`, or before cargo 1.77 `tandem 0.1.0 (path+file:///x/main)`."""
    if "#" not in package_id:
        return package_id.split(" ")[0]
    url, fragment = package_id.rsplit("#", 1)
    if "@" in fragment:
        return fragment.split("@")[0]
    return url.rstrip("/").rsplit("/", 1)[-1]


for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        t = m["target"]
        for kind in ("bin", "test"):
            if kind in t["kind"]:
                print(kind, t["name"], m["executable"])
    elif m.get("reason") == "build-script-executed":
        print("out-dir", package_name(m["package_id"]), m["out_dir"])
