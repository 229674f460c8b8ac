"""A local stand-in for the Hugging Face Hub HTTP API: just the endpoints ``create_repo`` and ``upload_folder`` use.

huggingface_hub 2.4 (without ``hf_xet``, or with ``HF_HUB_DISABLE_XET=1``) makes these requests:

- ``POST /api/repos/create`` (``create_repo``; 409 when it exists, accepted with ``exist_ok=True``);
- ``POST /api/validate-yaml`` (``create_commit`` checks README.md's front matter first);
- ``POST /api/models/{repo}/preupload/{rev}`` (per file: ``"regular"`` (inlined in the commit) or ``"lfs"``);
- ``POST /{repo}.git/info/lfs/objects/batch`` then ``PUT`` to the returned ``href`` (git-lfs "basic" transfer);
- ``POST /api/models/{repo}/commit/{rev}`` (NDJSON: a header, ``file`` entries in base64, ``lfsFile`` pointers).

Like the Hub, it keeps binary files (``.safetensors``, ``.png``, ...) in LFS, checks the uploaded bytes against their
sha256, requires the bearer token, and fails the commit when an LFS pointer has no uploaded object. Every request is
recorded; anything else answers 404 and is listed in ``unexpected``, except the lookups that other libraries make
while a fresh process imports them (``DEPENDENCY_LOOKUPS``): those answer 404 too and are listed in
``dependency_lookups``, so a test checks only the requests the package itself makes.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

import yaml

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".png", ".jpg", ".ckpt")

# Import-time requests of dependencies, not of marble_trl. bitsandbytes' CPU backend (on CPUs with AVX512-BF16) asks
# `kernels` for a hub kernel when it is importable (transformers >= 5.25 requires it), and `kernels` first checks the
# publisher: GET /api/organizations/kernels-community/overview. trl -> transformers -> peft imports bitsandbytes, so
# every fresh process does this; on a 404 bitsandbytes keeps its built-in CPU ops.
DEPENDENCY_LOOKUPS = (re.compile(r"^/api/organizations/[^/]+/overview$"),)


class StubHub:
    def __init__(self, token: str = "hf_stub_token", user: str = "stub-user") -> None:
        self.token, self.user = token, user
        self.repos: dict[str, dict[str, bytes]] = {}
        self.commits: list[dict] = []
        self.lfs: dict[str, bytes] = {}
        self.requests: list[tuple[str, str]] = []
        self.unexpected: list[tuple[str, str]] = []
        self.dependency_lookups: list[tuple[str, str]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):
                hub._handle(self, "POST")

            def do_PUT(self):
                hub._handle(self, "PUT")

            def do_GET(self):
                hub._handle(self, "GET")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> StubHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    # ------------------------------------------------------------------ HTTP plumbing
    @staticmethod
    def _body(request) -> bytes:
        if request.headers.get("Transfer-Encoding", "").lower() == "chunked":
            data = b""
            while True:
                size = int(request.rfile.readline().strip().split(b";")[0], 16)
                if size == 0:
                    request.rfile.readline()
                    return data
                data += request.rfile.read(size)
                request.rfile.readline()
        return request.rfile.read(int(request.headers.get("Content-Length") or 0))

    @staticmethod
    def _reply(request, status: int, payload=None) -> None:
        body = json.dumps(payload if payload is not None else {}).encode()
        request.send_response(status)
        request.send_header("Content-Type", "application/json")
        request.send_header("Content-Length", str(len(body)))
        request.end_headers()
        request.wfile.write(body)

    def _handle(self, request, method: str) -> None:
        path = unquote(urlparse(request.path).path)
        body = self._body(request)
        self.requests.append((method, path))
        if method == "GET" and any(lookup.match(path) for lookup in DEPENDENCY_LOOKUPS):
            self.dependency_lookups.append((method, path))
            return self._reply(request, 404, {"error": f"stub hub: {path} is not served"})
        if request.headers.get("Authorization") != f"Bearer {self.token}" and not path.startswith("/lfs-upload/"):
            return self._reply(request, 401, {"error": "Invalid credentials in Authorization header"})
        parts = path.strip("/").split("/")
        try:
            if method == "POST" and path == "/api/repos/create":
                return self._create_repo(request, json.loads(body))
            if method == "POST" and path == "/api/validate-yaml":
                return self._validate_yaml(request, json.loads(body))
            if method == "POST" and parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "preupload":
                return self._preupload(request, f"{parts[2]}/{parts[3]}", json.loads(body))
            if method == "POST" and path.endswith(".git/info/lfs/objects/batch"):
                return self._lfs_batch(request, path[1 : -len(".git/info/lfs/objects/batch")], json.loads(body))
            if method == "PUT" and parts[0] == "lfs-upload":
                return self._lfs_put(request, parts[1], body)
            if method == "POST" and parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "commit":
                return self._commit(request, f"{parts[2]}/{parts[3]}", body)
        except (KeyError, ValueError) as err:
            return self._reply(request, 400, {"error": f"bad request: {err!r}"})
        self.unexpected.append((method, path))
        return self._reply(request, 404, {"error": f"stub hub: no route for {method} {path}"})

    # ------------------------------------------------------------------ endpoints
    def _create_repo(self, request, payload: dict) -> None:
        repo_id = f"{payload.get('organization') or self.user}/{payload['name']}"
        url = f"{self.url}/{repo_id}"
        if repo_id in self.repos:
            return self._reply(request, 409, {"error": "You already created this model repo", "url": url})
        self.repos[repo_id] = {}
        return self._reply(request, 200, {"url": url, "name": repo_id, "id": repo_id})

    def _validate_yaml(self, request, payload: dict) -> None:
        content = payload["content"]
        errors = []
        if content.startswith("---"):
            try:
                meta = yaml.safe_load(content.split("---")[1])
                if not isinstance(meta, dict):
                    errors.append({"message": "metadata must be a mapping"})
            except yaml.YAMLError as err:
                errors.append({"message": f"invalid YAML: {err}"})
        return self._reply(request, 400 if errors else 200, {"errors": errors, "warnings": []})

    def _repo(self, repo_id: str) -> dict[str, bytes]:
        if repo_id not in self.repos:
            raise KeyError(repo_id)
        return self.repos[repo_id]

    def _preupload(self, request, repo_id: str, payload: dict) -> None:
        if repo_id not in self.repos:
            return self._reply(request, 404, {"error": "Repository not found"})
        files = [
            {
                "path": f["path"],
                "uploadMode": "lfs" if f["path"].endswith(LFS_SUFFIXES) or f["size"] > 1_000_000 else "regular",
                "shouldIgnore": False,
                "oid": None,
            }
            for f in payload["files"]
        ]
        return self._reply(request, 200, {"files": files, "commitOid": "0" * 40})

    def _lfs_batch(self, request, repo_id: str, payload: dict) -> None:
        self._repo(repo_id)
        assert payload["operation"] == "upload" and payload["hash_algo"] == "sha256"
        objects = []
        for obj in payload["objects"]:
            entry = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
            if obj["oid"] not in self.lfs:
                entry["actions"] = {"upload": {"href": f"{self.url}/lfs-upload/{obj['oid']}"}}
            objects.append(entry)
        return self._reply(request, 200, {"transfer": "basic", "objects": objects})

    def _lfs_put(self, request, oid: str, body: bytes) -> None:
        if hashlib.sha256(body).hexdigest() != oid:
            return self._reply(request, 400, {"error": "sha256 mismatch"})
        self.lfs[oid] = body
        return self._reply(request, 200, {})

    def _commit(self, request, repo_id: str, body: bytes) -> None:
        files = self._repo(repo_id)
        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        header = lines[0]
        assert header["key"] == "header", header
        staged = {}
        for line in lines[1:]:
            value = line["value"]
            if line["key"] == "file":
                assert value["encoding"] == "base64"
                staged[value["path"]] = base64.b64decode(value["content"])
            elif line["key"] == "lfsFile":
                if value["oid"] not in self.lfs:
                    return self._reply(request, 422, {"error": f"LFS object {value['oid']} was never uploaded"})
                staged[value["path"]] = self.lfs[value["oid"]]
            elif line["key"] in ("deletedFile", "deletedFolder"):
                staged[value["path"]] = None
            else:
                raise ValueError(f"unknown commit entry {line['key']}")
        for path, data in staged.items():
            if data is None:
                files.pop(path, None)
            else:
                files[path] = data
        oid = hashlib.sha1(body).hexdigest()
        self.commits.append({"repo_id": repo_id, "summary": header["value"]["summary"], "paths": sorted(staged)})
        url = f"{self.url}/{repo_id}/commit/{oid}"
        return self._reply(request, 200, {"commitUrl": url, "commitOid": oid, "pullRequestUrl": None})
