# Copyright (c) deepspeed_offload_patch contributors.
# SPDX-License-Identifier: Apache-2.0
"""The DeepSpeed sdists that the fingerprints, ``patches/``, the variants and the matrix are made from: one cache.

The files are taken straight from the package index pip is configured to use (``index-url``, then each
``extra-index-url``, as ``pip config list`` reports them, environment included), checked against the sha256 the
index gives, and written to the cache atomically. Nothing is built: ``pip download --no-binary :all:`` would run each
release's ``setup.py`` to prepare its metadata (about 8 s of CPU per release). Only when no index serves the file does
it fall back to ``pip download``.

The cache is ``$DS_OFFLOAD_PATCH_SDISTS``, default ``~/.cache/ds-offload-patch/sdists``.

    python ci/sdists.py                  # every supported release, with progress
    python ci/sdists.py 0.19.8 0.16.9    # those releases
"""

import argparse
import hashlib
import html.parser
import json
import os
import runpy
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Iterable, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The variable's name is in the package's settings.py, read without importing the package (whose import patches).
SDISTS = runpy.run_path(os.path.join(ROOT, "deepspeed_offload_patch", "settings.py"))["SDISTS"]
DEFAULT_CACHE = os.environ.get(SDISTS) or os.path.expanduser("~/.cache/ds-offload-patch/sdists")
PROJECT = "deepspeed"
# A guard against a stalled connection, per request; a slow but moving download is not cut.
SOCKET_TIMEOUT_S = 120


def filename(version: str) -> str:
    return f"{PROJECT}-{version}.tar.gz"


def index_urls() -> List[str]:
    """The index URLs pip would ask, in order: ``index-url`` (the environment's over the files'), then every
    ``extra-index-url``."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    main: Dict[str, str] = {}
    extra: List[str] = []
    for line in out.splitlines():
        key, _, value = line.partition("=")
        value = value.strip().strip("'\"")
        if key.endswith(".index-url") and not key.endswith("extra-index-url"):
            main[key.split(".")[0]] = value
        elif key.endswith(".extra-index-url"):
            extra.extend(value.split())
    # pip's precedence: environment over the user's files over the global ones.
    first = main.get(":env:") or main.get("user") or main.get("site") or main.get("global")
    urls = [first or "https://pypi.org/simple"] + extra
    return list(dict.fromkeys(url.rstrip("/") + "/" for url in urls))


class _Links(html.parser.HTMLParser):

    def __init__(self):
        super().__init__()
        self.links: List[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            href = dict(attrs).get("href")
            if href:
                self.links.append(href)


def _open(url: str):
    request = urllib.request.Request(url, headers={"Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"})
    return urllib.request.urlopen(request, timeout=SOCKET_TIMEOUT_S)


def project_files(index: str) -> Dict[str, Tuple[str, Optional[str]]]:
    """``{filename: (url, sha256 or None)}`` of the project's files on one simple index (PEP 691 JSON or PEP 503
    HTML). An index that does not answer gives nothing."""
    page = urllib.parse.urljoin(index, PROJECT + "/")
    candidates = [page, page + "index.html"] if page.startswith("file:") else [page]
    for url in candidates:
        try:
            with _open(url) as response:
                body = response.read().decode()
                kind = response.headers.get("Content-Type", "") if hasattr(response, "headers") else ""
        except (OSError, ValueError):
            continue
        files = {}
        if "json" in (kind or ""):
            for entry in json.loads(body).get("files", []):
                files[entry["filename"]] = (urllib.parse.urljoin(url, entry["url"]), entry.get("hashes",
                                                                                               {}).get("sha256"))
            return files
        parser = _Links()
        parser.feed(body)
        for href in parser.links:
            target, _, fragment = urllib.parse.urljoin(url, href).partition("#")
            digest = fragment[len("sha256="):] if fragment.startswith("sha256=") else None
            files[urllib.parse.unquote(target.rsplit("/", 1)[-1])] = (target, digest)
        return files
    return {}


def _download(url: str, digest: Optional[str], path: str) -> None:
    folder = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".part-")
    try:
        sha = hashlib.sha256()
        with os.fdopen(fd, "wb") as out, _open(url) as response:
            while True:
                chunk = response.read(1 << 20)
                if not chunk:
                    break
                sha.update(chunk)
                out.write(chunk)
        if digest and sha.hexdigest() != digest:
            raise OSError(f"{url}: sha256 {sha.hexdigest()} is not the index's {digest}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _pip_download(version: str, cache: str) -> None:
    subprocess.run([
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
        "--no-build-isolation", f"{PROJECT}=={version}", "-d", cache
    ],
                   check=True)


class Fetcher:
    """Fetches sdists into ``cache``; the index listings are read once."""

    def __init__(self, cache: str = DEFAULT_CACHE):
        self.cache = cache
        self._files: Optional[Dict[str, Tuple[str, Optional[str]]]] = None
        self._lock = threading.Lock()
        os.makedirs(cache, exist_ok=True)

    def files(self) -> Dict[str, Tuple[str, Optional[str]]]:
        with self._lock:  # fetch threads ask at once: read the listings once, and only then answer
            if self._files is None:
                files: Dict[str, Tuple[str, Optional[str]]] = {}
                for index in reversed(index_urls()):  # the first index's entry wins
                    files.update(project_files(index))
                self._files = files
        return self._files

    def path(self, version: str) -> str:
        """The cached sdist of ``version``, fetched first when it is not there.

        Raises:
            OSError: the download failed or its sha256 is not the index's.
            subprocess.CalledProcessError: no index lists it and ``pip download`` failed too.
        """
        path = os.path.join(self.cache, filename(version))
        if not os.path.exists(path):
            entry = self.files().get(filename(version))
            if entry:
                _download(entry[0], entry[1], path)
            else:
                _pip_download(version, self.cache)
        return path

    def fetch(self, versions: Iterable[str], threads: int = 8, progress: bool = False) -> List[str]:
        """Fetch every release of ``versions`` not in the cache yet (a few at a time); return their paths."""
        versions = list(versions)
        missing = [v for v in versions if not os.path.exists(os.path.join(self.cache, filename(v)))]
        start = time.monotonic()
        if progress:
            print(
                f"sdists: {len(versions) - len(missing)} of {len(versions)} in {self.cache}; fetching "
                f"{len(missing)}",
                flush=True)
        done = []  # appended by the fetch threads (list.append is atomic): its length is the count so far

        def one(version):
            path = self.path(version)
            done.append(version)
            if progress:
                print(
                    f"  [{len(done)}/{len(missing)}] {os.path.basename(path)} "
                    f"({os.path.getsize(path) // 1024} KiB, {time.monotonic() - start:.1f} s)",
                    flush=True)
            return path

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, missing))
        if progress:
            print(f"sdists: {len(versions)} ready in {time.monotonic() - start:.1f} s", flush=True)
        return [os.path.join(self.cache, filename(v)) for v in versions]


_FETCHERS: Dict[str, Fetcher] = {}


def sdist_path(cache: str, version: str) -> str:
    """The sdist of DeepSpeed ``version`` under ``cache``, fetched when it is not there (see :class:`Fetcher`)."""
    return _FETCHERS.setdefault(cache, Fetcher(cache)).path(version)


def prefetch(cache: str, versions: Iterable[str]) -> None:
    _FETCHERS.setdefault(cache, Fetcher(cache)).fetch(versions)


def main() -> int:
    sys.path.insert(0, ROOT)
    from deepspeed_offload_patch.releases import PATCHED_RELEASES
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("versions", nargs="*", help="releases to fetch (default: every supported release)")
    parser.add_argument("--sdists", default=DEFAULT_CACHE, help="the cache (default: %(default)s)")
    args = parser.parse_args()
    Fetcher(args.sdists).fetch(args.versions or PATCHED_RELEASES, progress=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
