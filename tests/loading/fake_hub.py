"""A Hugging Face hub on loopback: the routes huggingface_hub uses to resolve a revision, list a repository and
download its files, with the hub's headers and error codes. Point ``HF_ENDPOINT`` at `FakeHub.url`; `requests`
records every file fetched."""

from __future__ import annotations

import dataclasses
import hashlib
import http.server
import json
import re
import threading
from urllib.parse import unquote, urlparse


@dataclasses.dataclass
class Repo:
    files: dict[str, bytes]
    commit: str = ""
    branches: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> commit
    gated: bool = False
    revisions: dict[str, dict[str, bytes]] = dataclasses.field(default_factory=dict)  # other commits' files

    def __post_init__(self):
        self.commit = self.commit or _sha1(json.dumps(sorted(self.files)).encode() + b"".join(self.files.values()))
        self.branches.setdefault("main", self.commit)

    def at(self, revision: str) -> tuple[str, dict[str, bytes]] | None:
        commit = self.branches.get(revision, revision)
        if commit == self.commit:
            return commit, self.files
        return (commit, self.revisions[commit]) if commit in self.revisions else None


def _sha1(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


class FakeHub:
    def __init__(self, repos: dict[str, Repo]):
        self.repos = repos
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):  # noqa: N802
                hub._serve(self, body=False)

            def do_GET(self):  # noqa: N802
                hub._serve(self, body=True)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def downloads(self, repo: str) -> list[str]:
        """The files of `repo` fetched with GET."""
        prefix = f"/{repo}/resolve/"
        return [p[len(prefix):].split("/", 1)[1] for m, p in self.requests if m == "GET" and p.startswith(prefix)]

    def _error(self, h, status: int, code: str, message: str):
        h.send_response(status)
        h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", message)
        h.send_header("Content-Type", "application/json")
        data = json.dumps({"error": message}).encode()
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _json(self, h, value, body: bool):
        data = json.dumps(value).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)

    def _serve(self, h, body: bool):
        path = unquote(urlparse(h.path).path)
        self.requests.append((h.command, path))
        api = re.match(r"^/api/models/([^/]+/[^/]+)/(revision|tree)/([^/]+)/?$", path)
        resolve = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
        repo_id = (api or resolve).group(1) if (api or resolve) else None
        repo = self.repos.get(repo_id)
        if repo is None:
            return self._error(h, 404, "RepoNotFound", f"Repository Not Found for url: {h.path}.")
        if repo.gated and "authorization" not in {k.lower() for k in h.headers}:
            return self._error(h, 401, "GatedRepo", f"Access to model {repo_id} is restricted.")
        revision = api.group(3) if api else resolve.group(2)
        found = repo.at(revision)
        if found is None:
            return self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {revision}")
        commit, files = found
        if api and api.group(2) == "revision":
            return self._json(h, {"id": repo_id, "modelId": repo_id, "sha": commit, "private": False,
                                  "gated": repo.gated, "siblings": [{"rfilename": f} for f in sorted(files)]}, body)
        if api:
            return self._json(h, [{"type": "file", "path": f, "size": len(d), "oid": _sha1(d)}
                                  for f, d in sorted(files.items())], body)
        name = resolve.group(3)
        if name not in files:
            return self._error(h, 404, "EntryNotFound", f"{name} does not exist at {commit}")
        data = files[name]
        h.send_response(200)
        h.send_header("X-Repo-Commit", commit)
        h.send_header("ETag", f'"{_sha1(data)}"')
        h.send_header("Content-Length", str(len(data)))
        h.send_header("Content-Type", "application/octet-stream")
        h.end_headers()
        if body:
            h.wfile.write(data)
