"""Keep of Triton's builds only what a cache hit reads:
``python bench/slim_triton_cache.py BUILD_DIR...`` (folders of a Triton cache, one per build).

A build's group file (``__grp__<kernel>.json``) lists its parts; a hit needs every part it lists
and reads the metadata (.json) and the machine code (.cubin). The IR a compile leaves beside
them (.source, .ttir, .ttgir, .llir, .ptx) is most of the bytes: the 289 builds of
bench/results/2026-12-03-1xH200-soak-shared-0810ddd.log were 653 MB, 35.5 MB with xz, 5.5 MB
without the IR. This deletes the IR and lists the rest in each group file, so that
bench/device_run.sh can carry a machine's builds to the next call (tests/test_sm90_compile.py
checks that Triton takes such a cache).

A group file names its parts by absolute path, and Triton takes a part only where that path
exists: a cache that will lie elsewhere (made on another machine, e.g. by
bench/prebuild_for_device.sh, for the device's /tmp/triton-cache) is slimmed with
``--lies-at DIR``, which names each kept part as DIR/<build>/<part>; without it, a build read
from another place was compiled again (all 340 of a cache prebuilt here, on an H200 on
2026-12-04, though their keys agreed).
"""

import argparse
import json
import pathlib

KEPT = (".json", ".cubin", ".so")


def slim(build_dirs: list[str], lies_at: str | None = None) -> int:
    """Slim the builds in ``build_dirs``; returns the bytes deleted. ``lies_at``: the cache
    directory where the builds will be read (their parts named there); None: where they are."""
    deleted = 0
    for group_file in (f for d in build_dirs for f in pathlib.Path(d).glob("__grp__*.json")):
        group = json.loads(group_file.read_text())
        children = group["child_paths"]
        for name, path in list(children.items()):
            part = group_file.parent / pathlib.Path(path).name  # wherever the cache lies now
            if not name.endswith(KEPT):
                if part.exists():
                    deleted += part.stat().st_size
                    part.unlink()
                del children[name]
            elif lies_at is not None:
                children[name] = str(pathlib.Path(lies_at) / part.parent.name / part.name)
        group_file.write_text(json.dumps(group))
    return deleted


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("builds", nargs="+", help="build folders of a Triton cache")
    parser.add_argument("--lies-at", help="the cache folder where the builds will be read")
    args = parser.parse_args()
    deleted = slim(args.builds, args.lies_at)
    print(f"{len(args.builds)} builds: {deleted / 1e6:.1f} MB of IR deleted")
