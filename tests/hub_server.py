"""A small stand-in for the Hugging Face Hub, so the tests run real `huggingface_hub` client code offline.

Stdlib only (`http.server` + `threading`; `yaml` from huggingface_hub's own dependencies for the card check).
It serves, on 127.0.0.1 and a random port, the endpoints that `huggingface_hub` 2.4 and `transformers` call
to create repos, commit files (regular and LFS uploads; no Xet, so run the client with `HF_HUB_DISABLE_XET=1`),
manage branches and tags, and download files by branch, tag or commit:

- auth: `Authorization: Bearer <token>`; an unknown token gets 401 "Invalid credentials in Authorization
  header" on every endpoint, like the Hub. Private repos answer 404/401 `RepoNotFound` to anyone but their owner.
- state: in memory. A repo holds commits (path → blob snapshots), branches, tags and `refs/pr/N` refs; a new repo
  starts with one commit holding `.gitattributes`, like the Hub. Commits are atomic: a commit request that
  does not arrive complete changes nothing.
- `upload_mode`: what `preupload` answers, `"regular"` (content base64 in the commit), `"lfs"` (LFS batch API +
  a signed PUT URL, sent without auth) or `"auto"` (LFS for weights and files over 10 MB).
- faults: `drop_connection(method, path_regex, times)` reads half of the next matching request's body and then
  closes the connection without answering (a network drop mid-upload).
- `requests`: a log of `(method, path, status)` so tests can check which protocol was really used.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import secrets
import socket
import threading
import time
import traceback
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

LFS_PATTERNS = re.compile(r".*\.(safetensors|bin|pt|pth|ckpt|h5|onnx|gguf|msgpack|npz|zip|tar|gz)$")
GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n*.bin filter=lfs diff=lfs merge=lfs -text\n"
REPO_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}
URL_PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/"}


def git_hash(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())


#: the tokens of the test Hub's two users (the `hub` fixture in conftest.py logs in as alice)
ALICE, BOB = "hf_alice_token", "hf_bob_token"


@dataclass(frozen=True)
class Blob:
    """One file version: its bytes and whether it is stored as an LFS object."""

    data: bytes
    lfs: bool

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def pointer(self) -> bytes:
        return f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\nsize {len(self.data)}\n".encode()

    @property
    def oid(self) -> str:
        """git blob id (of the pointer file for LFS files, as on the Hub)."""
        return git_hash(self.pointer if self.lfs else self.data)

    def entry(self, path: str) -> dict:
        out = {"type": "file", "path": path, "size": len(self.data), "oid": self.oid}
        if self.lfs:
            out["lfs"] = {"oid": self.sha256, "size": len(self.data), "pointerSize": len(self.pointer)}
        return out


@dataclass
class Commit:
    oid: str
    parent: str | None
    title: str
    message: str
    author: str
    date: str
    files: dict[str, Blob]


@dataclass
class Repo:
    repo_id: str
    repo_type: str
    owner: str
    private: bool
    created: str = field(default_factory=_now)
    commits: dict[str, Commit] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    prs: dict[int, str] = field(default_factory=dict)
    lfs: dict[str, bytes] = field(default_factory=dict)  # uploaded LFS objects by sha256, committed or not

    def resolve(self, rev: str) -> str | None:
        """Commit id of a branch, tag, `refs/heads|tags/…`, `refs/pr/N` or full commit id; `None` if unknown."""
        for prefix, refs in (("refs/heads/", self.branches), ("refs/tags/", self.tags)):
            if rev.startswith(prefix):
                return refs.get(rev[len(prefix) :])
        if m := re.fullmatch(r"refs/pr/(\d+)", rev):
            return self.prs.get(int(m.group(1)))
        if rev in self.branches:
            return self.branches[rev]
        if rev in self.tags:
            return self.tags[rev]
        return rev if rev in self.commits else None


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class HubServer(ThreadingHTTPServer):
    """The server; `url` is its endpoint, `tokens` maps access tokens to user names."""

    daemon_threads = True

    def __init__(self, tokens: dict[str, str], upload_mode: str = "auto") -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.tokens = dict(tokens)
        self.upload_mode = upload_mode
        self.repos: dict[tuple[str, str], Repo] = {}
        self.requests: list[tuple[str, str, int]] = []
        self.errors: list[str] = []  # tracebacks of server-side bugs
        self.unknown_routes: list[str] = []  # requests for endpoints this server does not implement
        self.lock = threading.RLock()
        self._secret = secrets.token_bytes(16)
        self._faults: list[list] = []  # [method, compiled regex, remaining]
        self._counter = 0
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle and test hooks
    def start(self) -> HubServer:
        self._thread = threading.Thread(target=self.serve_forever, name="hub-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()

    def drop_connection(self, method: str, path_regex: str, times: int = 1) -> None:
        """Close the connection half-way through the body of the next `times` matching requests."""
        with self.lock:
            self._faults.append([method, re.compile(path_regex), times])

    def _take_fault(self, method: str, path: str) -> bool:
        with self.lock:
            for fault in self._faults:
                if fault[0] == method and fault[1].search(path) and fault[2] > 0:
                    fault[2] -= 1
                    return True
        return False

    # ------------------------------------------------------------------ repo state
    def new_commit(self, repo: Repo, parent: str | None, files: dict[str, Blob], title: str, message: str, user: str):
        self._counter += 1
        seed = json.dumps([parent, sorted((p, b.oid) for p, b in files.items()), title, self._counter])
        oid = hashlib.sha1(seed.encode()).hexdigest()
        repo.commits[oid] = Commit(oid, parent, title, message, user, _now(), files)
        return oid

    def repo_url(self, repo: Repo) -> str:
        return f"{self.url}/{URL_PREFIX[repo.repo_type]}{repo.repo_id}"

    def sign(self, repo: Repo, oid: str) -> str:
        return hmac.new(self._secret, f"{repo.repo_type}:{repo.repo_id}:{oid}".encode(), "sha256").hexdigest()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: HubServer

    def log_message(self, format, *args):  # noqa: A002  (quiet)
        pass

    def do_GET(self):
        self._dispatch("GET")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_POST(self):
        self._dispatch("POST")

    def do_PUT(self):
        self._dispatch("PUT")

    def do_DELETE(self):
        self._dispatch("DELETE")

    # ------------------------------------------------------------------ plumbing
    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _drop(self) -> None:
        """Read half of the body, then close the socket without answering."""
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length // 2)
        else:
            self.rfile.read1(4096)
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _send(self, status: int, body: bytes | dict | list = b"", headers: dict | None = None, head=False) -> None:
        if not isinstance(body, bytes):
            body = json.dumps(body).encode()
            headers = {"Content-Type": "application/json", **(headers or {})}
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, str(value))
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head and self.command != "HEAD":
            self.wfile.write(body)
        self.server.requests.append((self.command, self.path, status))

    def _dispatch(self, method: str) -> None:
        split = urlsplit(self.path)
        path, query = split.path, parse_qs(split.query)
        if self.server._take_fault(method, path):
            self._drop()
            self.server.requests.append((method, self.path, 0))
            return
        body = self._read_body()  # always read the body first, or keep-alive breaks on errors
        try:
            for route_method, pattern, func in ROUTES:
                if route_method == method or (route_method == "GET" and method == "HEAD"):
                    if m := pattern.fullmatch(path):
                        return func(self, m, query, body)
            self.server.unknown_routes.append(f"{method} {path}")
            raise HubError(404, f"Unknown route {method} {path} (tests/hub_server.py does not implement it)")
        except HubError as e:
            headers = {"X-Error-Message": e.message}
            if e.code:
                headers["X-Error-Code"] = e.code
            self._send(e.status, {"error": e.message}, headers)
        except Exception:  # a bug in this server: answer 500 and keep the traceback for the test to show
            self.server.errors.append(traceback.format_exc())
            self._send(500, {"error": "internal error in tests/hub_server.py"})

    def _user(self) -> str | None:
        auth = self.headers.get("Authorization", "")
        if not auth:
            return None
        token = auth.removeprefix("Bearer ").strip()
        if token not in self.server.tokens:
            raise HubError(401, "Invalid credentials in Authorization header")
        return self.server.tokens[token]

    def _repo(self, m: re.Match, write: bool = False) -> tuple[Repo, str | None]:
        user = self._user()
        repo_type = REPO_TYPES.get(m.groupdict().get("type") or "models", "model")
        key = (repo_type, f"{unquote(m['ns'])}/{unquote(m['name'])}")
        repo = self.server.repos.get(key)
        if repo is None or (repo.private and user != repo.owner):
            raise HubError(401 if user is None else 404, "Repository not found", "RepoNotFound")
        if write and user != repo.owner:
            raise HubError(401 if user is None else 403, f"You don't have write access to {repo.repo_id}")
        return repo, user

    def _rev(self, repo: Repo, rev: str) -> Commit:
        oid = repo.resolve(unquote(rev))
        if oid is None:
            raise HubError(404, f"Invalid rev id: {unquote(rev)}", "RevisionNotFound")
        return repo.commits[oid]

    # ------------------------------------------------------------------ account and repos
    def whoami(self, m, query, body):
        user = self._user()
        if user is None:
            raise HubError(401, "Invalid username or password.")
        self._send(200, {"type": "user", "name": user, "fullname": user, "orgs": [], "auth": {"type": "access_token"}})

    def create_repo(self, m, query, body):
        user = self._user()
        data = json.loads(body or b"{}")
        ns = data.get("organization") or user
        repo_type = data.get("type") or "model"
        if user is None:
            raise HubError(401, "You must be authenticated to create a repo.")
        if ns != user:
            raise HubError(403, f"You don't have the rights to create a repo under the namespace {ns!r}.")
        private = data.get("visibility", "private" if data.get("private") else "public") == "private"
        repo = Repo(f"{ns}/{data['name']}", repo_type, user, private)
        with self.server.lock:
            key = (repo_type, repo.repo_id)
            if key in self.server.repos:
                url = self.server.repo_url(self.server.repos[key])
                return self._send(409, {"error": "You already created this model repo", "url": url})
            first = self.server.new_commit(
                repo, None, {".gitattributes": Blob(GITATTRIBUTES, False)}, "initial commit", "", user
            )
            repo.branches["main"] = first
            self.server.repos[key] = repo
        self._send(200, {"url": self.server.repo_url(repo), "name": repo.repo_id})

    def delete_repo(self, m, query, body):
        data = json.loads(body or b"{}")
        user = self._user()
        key = (data.get("type") or "model", f"{data.get('organization') or user}/{data['name']}")
        repo = self.server.repos.get(key)
        if repo is None or user != repo.owner:
            raise HubError(404, "Repository not found", "RepoNotFound")
        del self.server.repos[key]
        self._send(200, {})

    def settings(self, m, query, body):
        repo, _ = self._repo(m, write=True)
        data = json.loads(body or b"{}")
        if "private" in data:
            repo.private = bool(data["private"])
        if "visibility" in data:
            repo.private = data["visibility"] == "private"
        self._send(200, {})

    def repo_info(self, m, query, body):
        repo, _ = self._repo(m)
        commit = self._rev(repo, m["rev"] or "main")
        blobs = query.get("blobs", ["false"])[0].lower() in ("1", "true")
        siblings = []
        for path, blob in sorted(commit.files.items()):
            sib = {"rfilename": path}
            if blobs:
                entry = blob.entry(path)
                sib.update(size=entry["size"], blobId=entry["oid"])
                if blob.lfs:
                    sib["lfs"] = {"sha256": blob.sha256, "size": len(blob.data), "pointerSize": len(blob.pointer)}
            siblings.append(sib)
        card = _card_metadata(commit.files.get("README.md"))
        self._send(
            200,
            {
                "id": repo.repo_id,
                "_id": git_hash(repo.repo_id.encode())[:24],
                "modelId": repo.repo_id,
                "author": repo.owner,
                "sha": commit.oid,
                "private": repo.private,
                "disabled": False,
                "gated": False,
                "downloads": 0,
                "likes": 0,
                "tags": list(card.get("tags") or []) if isinstance(card, dict) else [],
                "library_name": card.get("library_name") if isinstance(card, dict) else None,
                "cardData": card if isinstance(card, dict) else None,
                "siblings": siblings,
                "createdAt": repo.created,
                "lastModified": commit.date,
            },
        )

    def validate_yaml(self, m, query, body):
        content = json.loads(body or b"{}").get("content", "")
        meta = _card_metadata(Blob(content.encode(), False))
        errors = _validate_card(meta) if meta else []
        warnings = [] if meta else [{"message": "Empty or missing yaml metadata in repo card"}]
        self._send(400 if errors else 200, {"errors": [{"message": e} for e in errors], "warnings": warnings})

    # ------------------------------------------------------------------ refs and history
    def refs(self, m, query, body):
        repo, _ = self._repo(m)

        def ref(kind, name, oid):
            return {"name": name, "ref": f"refs/{kind}/{name}", "targetCommit": oid}

        out = {
            "branches": [ref("heads", n, o) for n, o in repo.branches.items()],
            "tags": [ref("tags", n, o) for n, o in repo.tags.items()],
            "converts": [],
        }
        if query.get("include_prs"):
            out["pullRequests"] = [
                {"name": f"refs/pr/{n}", "ref": f"refs/pr/{n}", "targetCommit": o} for n, o in repo.prs.items()
            ]
        self._send(200, out)

    def commits(self, m, query, body):
        repo, _ = self._repo(m)
        commit, out = self._rev(repo, m["rev"]), []
        while commit is not None:
            out.append(
                {
                    "id": commit.oid,
                    "authors": [{"user": commit.author}],
                    "date": commit.date,
                    "title": commit.title,
                    "message": commit.message,
                }
            )
            commit = repo.commits.get(commit.parent) if commit.parent else None
        self._send(200, out)

    def branch(self, m, query, body):
        repo, _ = self._repo(m, write=True)
        name = unquote(m["branch"])
        with self.server.lock:
            if self.command == "DELETE":
                if name not in repo.branches:
                    raise HubError(404, f"Branch {name} not found", "RevisionNotFound")
                del repo.branches[name]
                return self._send(200, {})
            if name in repo.branches:
                raise HubError(409, f"Branch {name} already exists")
            start = json.loads(body or b"{}").get("startingPoint") or "main"
            repo.branches[name] = self._rev(repo, start).oid
        self._send(200, {})

    def tag(self, m, query, body):
        repo, _ = self._repo(m, write=True)
        with self.server.lock:
            if self.command == "DELETE":
                name = unquote(m["rev"])
                if name not in repo.tags:
                    raise HubError(404, f"Tag {name} not found", "RevisionNotFound")
                del repo.tags[name]
                return self._send(200, {})
            name = json.loads(body or b"{}")["tag"]
            if name in repo.tags:
                raise HubError(409, f"Tag {name} already exists")
            repo.tags[name] = self._rev(repo, m["rev"]).oid
        self._send(200, {})

    def tree(self, m, query, body):
        repo, _ = self._repo(m)
        commit = self._rev(repo, m["rev"])
        prefix = unquote(m["path"] or "").strip("/")
        recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
        base = f"{prefix}/" if prefix else ""
        if prefix and not any(p.startswith(base) for p in commit.files):
            raise HubError(404, f"{prefix} does not exist", "EntryNotFound")
        entries, folders = [], set()
        for path, blob in sorted(commit.files.items()):
            if not path.startswith(base):
                continue
            rest = path[len(base) :]
            if "/" in rest and not recursive:
                folders.add(base + rest.split("/")[0])
                continue
            if recursive:
                parts = rest.split("/")[:-1]
                folders.update(base + "/".join(parts[: i + 1]) for i in range(len(parts)))
            entries.append(blob.entry(path))
        entries += [{"type": "directory", "path": f, "oid": git_hash(f.encode())} for f in sorted(folders)]
        self._send(200, entries)

    def paths_info(self, m, query, body):
        repo, _ = self._repo(m)
        commit = self._rev(repo, m["rev"])
        form = parse_qs(body.decode())
        out = []
        for path in form.get("paths", []):
            if path in commit.files:
                out.append(commit.files[path].entry(path))
            elif any(p.startswith(path.rstrip("/") + "/") for p in commit.files):
                out.append({"type": "directory", "path": path, "oid": git_hash(path.encode())})
        self._send(200, out)

    # ------------------------------------------------------------------ uploads
    def preupload(self, m, query, body):
        repo, _ = self._repo(m, write=True)
        commit = self._rev(repo, m["rev"])
        files = []
        for f in json.loads(body)["files"]:
            mode = self.server.upload_mode
            if mode == "auto":
                mode = "lfs" if LFS_PATTERNS.match(f["path"]) or f["size"] > 10_000_000 else "regular"
            existing = commit.files.get(f["path"])
            oid = None if existing is None else (existing.sha256 if existing.lfs else existing.oid)
            files.append({"path": f["path"], "uploadMode": mode, "shouldIgnore": False, "oid": oid})
        self._send(200, {"files": files, "commitOid": commit.oid})

    def lfs_batch(self, m, query, body):
        repo, _ = self._repo(m, write=True)
        data = json.loads(body)
        if data.get("operation") != "upload":
            raise HubError(400, "Only the upload operation is implemented")
        objects = []
        for obj in data["objects"]:
            out = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
            if obj["oid"] not in repo.lfs:
                href = f"{self.server.url}/lfs-upload/{URL_PREFIX[repo.repo_type]}{repo.repo_id}/{obj['oid']}"
                out["actions"] = {
                    "upload": {"href": f"{href}?sig={self.server.sign(repo, obj['oid'])}&size={obj['size']}"},
                    "verify": {"href": f"{self.server.url}/lfs-verify/{URL_PREFIX[repo.repo_type]}{repo.repo_id}"},
                }
            objects.append(out)
        self._send(200, {"transfer": "basic", "objects": objects}, {"Content-Type": "application/vnd.git-lfs+json"})

    def lfs_upload(self, m, query, body):
        # The signed URL is the credential: the client sends no Authorization header here.
        repo = self.server.repos.get((REPO_TYPES.get(m["type"] or "models", "model"), f"{m['ns']}/{m['name']}"))
        oid = m["oid"]
        if repo is None or not hmac.compare_digest(query.get("sig", [""])[0], self.server.sign(repo, oid)):
            raise HubError(403, "Invalid or expired upload signature")
        if hashlib.sha256(body).hexdigest() != oid or len(body) != int(query.get("size", ["-1"])[0]):
            raise HubError(400, f"Uploaded content does not match oid {oid} / announced size")
        with self.server.lock:
            repo.lfs[oid] = body
        self._send(200, b"", {"ETag": f'"{oid}"'})

    def lfs_verify(self, m, query, body):
        repo, _ = self._repo(m)
        oid = json.loads(body)["oid"]
        if oid not in repo.lfs:
            raise HubError(404, f"LFS object {oid} was not uploaded")
        self._send(200, {"success": True})

    def commit(self, m, query, body):
        repo, user = self._repo(m, write=True)
        rev = unquote(m["rev"])
        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "The commit payload must start with a header line")
        header = lines[0]["value"]
        with self.server.lock:
            create_pr = query.get("create_pr", ["0"])[0] in ("1", "true")
            if create_pr:
                head = self._rev(repo, rev).oid
            elif rev in repo.branches:
                head = repo.branches[rev]
            elif repo.resolve(rev) is not None:
                raise HubError(400, f"Commits can only be made on a branch, not on {rev!r}")
            else:
                raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
            if header.get("parentCommit") and header["parentCommit"] != head:
                raise HubError(412, "A commit has happened since. Please refresh and try again.")
            files = dict(repo.commits[head].files)
            for line in lines[1:]:
                key, value = line["key"], line["value"]
                path = value["path"]
                if key == "file":
                    files[path] = Blob(base64.b64decode(value["content"]), False)
                elif key == "lfsFile":
                    if value["oid"] not in repo.lfs:
                        raise HubError(422, f"LFS object {value['oid']} for {path} was never uploaded")
                    files[path] = Blob(repo.lfs[value["oid"]], True)
                elif key == "deletedFile":
                    if path not in files:
                        raise HubError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
                    del files[path]
                elif key == "deletedFolder":
                    files = {p: b for p, b in files.items() if not p.startswith(path.rstrip("/") + "/")}
                else:
                    raise HubError(400, f"Unknown commit operation {key!r}")
            oid = self.server.new_commit(repo, head, files, header["summary"], header.get("description", ""), user)
            out = {"success": True, "commitOid": oid, "commitUrl": f"{self.server.repo_url(repo)}/commit/{oid}"}
            if create_pr:
                number = len(repo.prs) + 1
                repo.prs[number] = oid
                out["pullRequestUrl"] = f"{self.server.repo_url(repo)}/discussions/{number}"
            else:
                repo.branches[rev] = oid
        self._send(200, out)

    # ------------------------------------------------------------------ downloads
    def resolve(self, m, query, body):
        repo, _ = self._repo(m)
        commit = self._rev(repo, m["rev"])
        path = unquote(m["path"])
        blob = commit.files.get(path)
        if blob is None:
            raise HubError(404, f"Entry not found: {path}", "EntryNotFound")
        etag = blob.sha256 if blob.lfs else blob.oid
        headers = {"ETag": f'"{etag}"', "X-Repo-Commit": commit.oid, "Accept-Ranges": "bytes"}
        headers["Content-Type"] = "application/octet-stream"
        if blob.lfs:
            headers.update({"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": len(blob.data)})
        data, status = blob.data, 200
        if rng := re.fullmatch(r"bytes=(\d*)-(\d*)", self.headers.get("Range", "")):
            start = int(rng.group(1) or 0)
            end = int(rng.group(2)) if rng.group(2) else len(data) - 1
            if start >= len(data) and len(data):
                raise HubError(416, "Requested range not satisfiable")
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            data, status = data[start : end + 1], 206
        self._send(status, data, headers)


def _card_metadata(blob: Blob | None) -> dict | None:
    """The YAML block at the top of a README, parsed; `None` if there is none, `{"__error__": …}` if invalid."""
    if blob is None:
        return None
    text = blob.data.decode("utf-8", errors="replace")
    m = re.match(r"^---\s*\n(.*?)\n---\s*\n", text, re.DOTALL)
    if not m:
        return None
    import yaml

    try:
        meta = yaml.safe_load(m.group(1))
    except yaml.YAMLError as e:
        return {"__error__": f"YAML is not valid: {e}"}
    return meta if isinstance(meta, dict) else {"__error__": "YAML metadata must be a mapping"}


def _validate_card(meta: dict) -> list[str]:
    """The subset of the Hub's model-card metadata checks that the tests rely on."""
    if "__error__" in meta:
        return [meta["__error__"]]
    errors = []
    for key in ("library_name", "license", "pipeline_tag", "base_model_relation"):
        if key in meta and not isinstance(meta[key], str):
            errors.append(f'"{key}" must be a string')
    for key in ("tags", "datasets", "language"):
        if key in meta and not (isinstance(meta[key], (list, str))):
            errors.append(f'"{key}" must be a string or a list of strings')
    base = meta.get("base_model")
    if base is not None:
        for b in [base] if isinstance(base, str) else base if isinstance(base, list) else [None]:
            if not isinstance(b, str) or not re.fullmatch(r"[\w.-]+/[\w.-]+", b):
                errors.append(f'"base_model" must be Hub model ids like "org/name", got {b!r}')
    return errors


_REPO = r"(?:(?P<type>datasets|spaces)/)?(?P<ns>[^/]+)/(?P<name>[^/]+?)"
_API = r"/api/(?P<type>models|datasets|spaces)/(?P<ns>[^/]+)/(?P<name>[^/]+)"
ROUTES = [
    ("GET", re.compile(r"/api/whoami-v2"), _Handler.whoami),
    ("POST", re.compile(r"/api/repos/create"), _Handler.create_repo),
    ("DELETE", re.compile(r"/api/repos/delete"), _Handler.delete_repo),
    ("POST", re.compile(r"/api/validate-yaml"), _Handler.validate_yaml),
    ("GET", re.compile(_API + r"(?:/revision/(?P<rev>[^/]+))?"), _Handler.repo_info),
    ("PUT", re.compile(_API + r"/settings"), _Handler.settings),
    ("GET", re.compile(_API + r"/refs"), _Handler.refs),
    ("GET", re.compile(_API + r"/commits/(?P<rev>[^/]+)"), _Handler.commits),
    ("POST", re.compile(_API + r"/branch/(?P<branch>[^/]+)"), _Handler.branch),
    ("DELETE", re.compile(_API + r"/branch/(?P<branch>[^/]+)"), _Handler.branch),
    ("POST", re.compile(_API + r"/tag/(?P<rev>[^/]+)"), _Handler.tag),
    ("DELETE", re.compile(_API + r"/tag/(?P<rev>[^/]+)"), _Handler.tag),
    ("GET", re.compile(_API + r"/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?"), _Handler.tree),
    ("POST", re.compile(_API + r"/paths-info/(?P<rev>[^/]+)"), _Handler.paths_info),
    ("POST", re.compile(_API + r"/preupload/(?P<rev>[^/]+)"), _Handler.preupload),
    ("POST", re.compile(_API + r"/commit/(?P<rev>[^/]+)"), _Handler.commit),
    ("POST", re.compile("/" + _REPO + r"\.git/info/lfs/objects/batch"), _Handler.lfs_batch),
    ("PUT", re.compile(r"/lfs-upload/" + _REPO + r"/(?P<oid>[0-9a-f]{64})"), _Handler.lfs_upload),
    ("POST", re.compile(r"/lfs-verify/" + _REPO), _Handler.lfs_verify),
    ("GET", re.compile("/" + _REPO + r"/resolve/(?P<rev>[^/]+)/(?P<path>.+)"), _Handler.resolve),
]

__all__ = ["Blob", "HubServer", "git_hash"]
