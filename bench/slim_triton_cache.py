"""Keep of Triton's builds only what a cache hit reads:
``python bench/slim_triton_cache.py BUILD_DIR...`` (folders of a Triton cache, one per build).

A build's group file (``__grp__<kernel>.json``) lists its parts; a hit needs every part it lists
and reads the metadata (.json) and the machine code (.cubin). The IR a compile leaves beside
them (.source, .ttir, .ttgir, .llir, .ptx) is most of the bytes: the 289 builds of
bench/results/2026-12-03-1xH200-soak-shared-0810ddd.log were 653 MB, 35.5 MB with xz, 5.5 MB
without the IR. This deletes the IR and lists the rest in each group file, so that
bench/device_run.sh can carry a machine's builds to the next call (tests/test_sm90_compile.py
checks that Triton takes such a cache).
"""

import json
import pathlib
import sys

KEPT = (".json", ".cubin", ".so")


def slim(build_dirs: list[str]) -> int:
    """Slim the builds in ``build_dirs``; returns the bytes deleted."""
    deleted = 0
    for group_file in (f for d in build_dirs for f in pathlib.Path(d).glob("__grp__*.json")):
        group = json.loads(group_file.read_text())
        children = group["child_paths"]
        for name, path in list(children.items()):
            if not name.endswith(KEPT):
                part = group_file.parent / pathlib.Path(path).name  # wherever the cache lies now
                if part.exists():
                    deleted += part.stat().st_size
                    part.unlink()
                del children[name]
        group_file.write_text(json.dumps(group))
    return deleted


if __name__ == "__main__":
    print(f"{len(sys.argv) - 1} builds: {slim(sys.argv[1:]) / 1e6:.1f} MB of IR deleted")
