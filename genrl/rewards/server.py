"""A loopback reward server: one genrl reward behind HTTP, for :class:`~genrl.rewards.remote.RemoteReward`
(docs/rewards.md, The reward server; the role of Flow-GRPO's yifan123/reward-server, without its pickle / JPEG).

Run::

    python -m genrl.rewards.server --reward ocr --port 8765
    genrl reward-serve --reward pickscore --path /weights/pickscore --device cuda:1 --port 8766
    genrl reward-serve --reward ocr --kwargs '{"frames": {"frames": "stride", "stride": 4}}' --port 0

It prints ``genrl reward server: serving reward '<name>' at http://127.0.0.1:<port>`` on stdout once it
listens (``--port 0`` picks a free port: read it from that line), then serves until interrupted.

Endpoints (wire format in :mod:`genrl.rewards.remote`):

* ``GET /info``: name, class, output keys (``dims``), accepted channels, ``differentiable: false`` (gradients
  do not cross the wire), version, genrl version, ``weights_sha256`` (sha256 over the weight files: the files
  the reward class declares in ``weight_files`` under ``--path``, every file under ``--path`` if it declares
  none, plus weights bundled in a package that the reward lists with a ``bundled_weights()`` method, like the
  OCR models; ``"none"`` without weights), and the server's ``batch_size``.
* ``GET /health``: ``{"ok": true}``.
* ``POST /score``: a safetensors body with uint8 frames [B, T, C, H, W] and JSON prompts / meta; the reward
  scores ``frames.float() / 255`` in chunks of ``--batch-size`` videos and the answer holds every output key
  (raw main key: set ``scale`` / ``shift`` on the client) and the ``valid`` mask.

Security: the server has no authentication, so it binds 127.0.0.1 by default and refuses a non-loopback
``--host`` unless ``--allow-remote`` is given (then put it behind a firewall or an authenticating proxy).
Bodies are parsed as safetensors and JSON only (never pickle) and are capped by ``--max-body-mb``.

Concurrency: the HTTP layer is the standard library's ``ThreadingHTTPServer`` (one thread per connection);
requests are scored one at a time on the single model (a lock), which is what one model on one device can do
anyway. The standard library was chosen over FastAPI + uvicorn because the API is two routes with a binary
body, the model serialises the work, and it adds no dependency to genrl; run one server per GPU for more
throughput (Flow-GRPO's reward-server runs one gunicorn worker per GPU for the same reason).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import ipaddress
import json
import logging
import math
import socket
import sys
import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import genrl.rewards  # noqa: F401  (registers the built-in rewards)
from genrl.rewards.base import RewardModel
from genrl.rewards.check import load_reward_modules
from genrl.rewards.manager import slice_meta
from genrl.rewards.registry import available_rewards, build_reward
from genrl.rewards.remote import PROTOCOL, decode_score_request

__all__ = ["RewardServer", "RewardService", "build_service", "check_host", "main", "weights_sha256"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_MB = 2048


def _genrl_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("genrl")
    except PackageNotFoundError:  # pragma: no cover - a source tree without metadata
        return "unknown"


def _weight_file_list(model: RewardModel, path: str | Path | None) -> list[tuple[str, Path]]:
    files: dict[str, Path] = {}
    if path is not None:
        root = Path(path).expanduser()
        if root.is_file():
            files[root.name] = root
        elif root.is_dir():
            declared = list(type(model).weight_files)
            for pattern in declared or ["**/*"]:
                for p in sorted(root.glob(pattern)):
                    if p.is_file():
                        files[p.relative_to(root).as_posix()] = p
                    elif p.is_dir() and declared:  # a declared folder: every file in it
                        for q in sorted(p.rglob("*")):
                            if q.is_file():
                                files[q.relative_to(root).as_posix()] = q
    bundled = getattr(model, "bundled_weights", None)
    if callable(bundled):
        for p in bundled():
            files[f"<bundled>/{Path(p).name}"] = Path(p)
    return sorted(files.items())


def weights_sha256(model: RewardModel, path: str | Path | None = None) -> str:
    """Hex sha256 identifying a reward's weights, or ``"none"`` when it has none.

    Hashed, in sorted order of their relative names: the files of ``type(model).weight_files`` under ``path``
    (every file under ``path`` when the class declares none; ``path`` itself when it is a file), and the files
    ``model.bundled_weights()`` lists, if the reward has that method. Each file contributes its relative name,
    its size and its bytes, so renaming or changing a file changes the hash.
    """
    files = _weight_file_list(model, path)
    if not files:
        return "none"
    h = hashlib.sha256()
    for rel, p in files:
        h.update(rel.encode() + b"\0" + p.stat().st_size.to_bytes(8, "little"))
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


class RequestError(ValueError):
    """A bad request (HTTP 400): the message goes back to the client."""


class RewardService:
    """One reward model answering ``/info`` and ``/score`` payloads (transport-free, so it is testable alone).

    Args:
        reward: the built reward (moved to ``device``, frozen, eval mode).
        batch_size: videos per reward call (a large request is scored in chunks).
        device: where the reward runs (``"auto"``: CUDA if available, else CPU).
        weights_hash: the ``weights_sha256`` to report (default: :func:`weights_sha256` of ``reward`` and
            ``path``).
        path: the reward's weights path (for the hash).

    Raises:
        ValueError: ``batch_size < 1``.
    """

    def __init__(self, reward: RewardModel, batch_size: int = 16, device: str | torch.device = "auto",
                 weights_hash: str | None = None, path: str | Path | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.reward = reward.requires_grad_(False).eval().to(self.device)
        self.batch_size = int(batch_size)
        self.lock = threading.Lock()
        self.requests = 0
        version = getattr(reward, "version", None)
        self.info: dict[str, Any] = {
            "protocol": PROTOCOL,
            "name": reward.name or type(reward).__name__,
            "class": f"{type(reward).__module__}.{type(reward).__qualname__}",
            "dims": list(reward.dimensions),
            "channels": list(reward.channels),
            "differentiable": False,
            "higher_is_better": bool(reward.higher_is_better),
            "version": str(version) if isinstance(version, str) else _genrl_version(),
            "genrl_version": _genrl_version(),
            "weights_sha256": weights_hash if weights_hash is not None else weights_sha256(reward, path),
            "batch_size": self.batch_size,
        }

    def score(self, frames: Tensor, prompts: list[str], meta: dict[str, Any]) -> dict[str, Any]:
        """Score uint8 frames [B, T, C, H, W]; the ``/score`` answer (JSON-able, NaN as None).

        Raises:
            RequestError: the reward rejected the input (its TypeError / ValueError: wrong channels, a bad
                meta value, an unparsable prompt, ...).
            Exception: anything else the reward raised (the server answers 500).
        """
        b = frames.shape[0]
        dims = list(self.info["dims"])
        cols: dict[str, list[Tensor]] = {}
        valid: list[Tensor] = []
        with self.lock, torch.no_grad():
            self.requests += 1
            for lo in range(0, b, self.batch_size):
                hi = min(b, lo + self.batch_size)
                x = frames[lo:hi].to(self.device).float() / 255
                sub = slice_meta(meta, b, lo, hi)
                try:
                    out = self.reward(x, prompts[lo:hi], **sub)
                except (TypeError, ValueError) as exc:
                    raise RequestError(f"reward {self.info['name']!r} rejected samples {lo}:{hi}: {exc}") from exc
                for key, value in out.items():
                    if key == "valid":
                        valid.append(value.detach().cpu().bool().reshape(-1))
                    else:
                        cols.setdefault(key, []).append(value.detach().cpu().double().reshape(-1))
                for key in dims:  # a reward that omits a key: NaN for this chunk
                    if key not in out:
                        cols.setdefault(key, []).append(torch.full((hi - lo,), math.nan, dtype=torch.float64))
        scores = {k: [v if math.isfinite(v) else None for v in torch.cat(parts).tolist()] for k, parts in cols.items()}
        flags = torch.cat(valid).tolist() if valid else [False] * b
        return {"name": self.info["name"], "weights_sha256": self.info["weights_sha256"], "scores": scores,
                "valid": flags}


class _Handler(BaseHTTPRequestHandler):
    server: RewardServer
    server_version = "genrl-reward-server"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        logger.debug("%s %s", self.address_string(), format % args)

    def _send(self, status: int, payload: dict[str, Any], close: bool = False) -> None:
        body = json.dumps(payload, allow_nan=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the client went away
            pass

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        if self.path == "/info":
            self._send(200, self.server.service.info)
        elif self.path == "/health":
            self._send(200, {"ok": True})
        else:
            self._send(404, {"error": f"no route GET {self.path}; routes: GET /info, GET /health, POST /score"})

    def do_POST(self) -> None:  # noqa: N802 - stdlib name
        if self.path != "/score":
            self._send(404, {"error": f"no route POST {self.path}; routes: GET /info, GET /health, POST /score"},
                       close=True)
            return
        length = self.headers.get("Content-Length")
        try:
            n = int(length) if length is not None else -1
        except ValueError:
            n = -1
        if n < 0:
            self._send(411, {"error": "POST /score needs a Content-Length header"}, close=True)
            return
        if n > self.server.max_body_bytes:
            self._send(413, {"error": f"body of {n} bytes exceeds the server's limit of "
                                      f"{self.server.max_body_bytes} (--max-body-mb); send smaller requests "
                                      f"(the client's batch_size)"}, close=True)
            return
        body = self.rfile.read(n)
        try:
            frames, prompts, meta = decode_score_request(body)
            answer = self.server.service.score(frames, prompts, meta)
        except (RequestError, ValueError) as exc:
            self._send(400, {"error": str(exc)})
            return
        except Exception as exc:
            logger.exception("reward %r failed on a request", self.server.service.info["name"])
            self._send(500, {"error": f"{type(exc).__name__}: {exc}"})
            return
        self._send(200, answer)


def check_host(host: str, allow_remote: bool = False) -> None:
    """Refuse a non-loopback bind address unless ``allow_remote``.

    Raises:
        ValueError: ``host`` is not ``localhost`` or a loopback IP literal (127.0.0.0/8, ::1) and
            ``allow_remote`` is False.
    """
    if allow_remote or host == "localhost":
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(
            f"refusing to bind {host!r}: the reward server has no authentication, so it only listens on loopback "
            f"(127.0.0.1, ::1, localhost) unless you pass --allow-remote (then restrict access with a firewall)"
        )


class RewardServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` serving one :class:`RewardService`.

    Args:
        service: the reward service.
        host, port: bind address (``port=0``: a free port; see :attr:`url`).
        allow_remote: allow a non-loopback ``host`` (see :func:`check_host`).
        max_body_bytes: larger ``/score`` bodies get HTTP 413.

    Raises:
        ValueError: a non-loopback host without ``allow_remote``.
        OSError: the address is in use.

    ``serve_forever()`` serves in the calling thread; :meth:`start` serves in a daemon thread; ``shutdown()``
    followed by ``server_close()`` stops it.
    """

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, service: RewardService, host: str = "127.0.0.1", port: int = 0,
                 allow_remote: bool = False, max_body_bytes: int = DEFAULT_MAX_BODY_MB << 20) -> None:
        check_host(host, allow_remote)
        if ":" in host:
            self.address_family = socket.AF_INET6
        self.service = service
        self.max_body_bytes = int(max_body_bytes)
        super().__init__((host, port), _Handler)

    @property
    def url(self) -> str:
        """``http://host:port`` the server listens on."""
        host, port = self.server_address[:2]
        host = f"[{host}]" if ":" in str(host) else host
        return f"http://{host}:{port}"

    def start(self) -> threading.Thread:
        """Serve in a daemon thread (tests, notebooks); returns the thread."""
        thread = threading.Thread(target=self.serve_forever, name=f"genrl-reward-server-{self.url}", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        """Stop serving and close the socket (from another thread than ``serve_forever``'s)."""
        self.shutdown()
        self.server_close()


def build_service(name: str, path: str | None = None, kwargs: dict[str, Any] | None = None, batch_size: int = 16,
                  device: str = "auto", hash_weights: bool = True) -> RewardService:
    """Build the registered reward ``name`` (``build_reward(name, path, **kwargs)``) and wrap it.

    ``hash_weights=False`` reports ``weights_sha256: "skipped"`` instead of hashing (fast start on big weights).

    Raises:
        UnknownRewardError, TypeError, ValueError, FileNotFoundError, ImportError: from the reward.
    """
    reward = build_reward(name, path, **(kwargs or {}))
    return RewardService(reward, batch_size=batch_size, device=device,
                         weights_hash=None if hash_weights else "skipped", path=path)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="genrl reward-serve",
        description="Serve one genrl reward over HTTP on loopback for the 'remote' reward "
                    "(wire format: genrl/rewards/remote.py).",
    )
    p.add_argument("--reward", required=True, help="registered reward name (see `genrl rewards check`)")
    p.add_argument("--path", default=None, help="local weights folder of the reward")
    p.add_argument("--kwargs", default="{}", help="constructor arguments as a JSON object")
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback only unless --allow-remote)")
    p.add_argument("--port", type=int, default=0, help="port (0: a free one, printed at start)")
    p.add_argument("--allow-remote", action="store_true",
                   help="allow a non-loopback --host (the server has no authentication)")
    p.add_argument("--batch-size", type=int, default=16, help="videos per reward call")
    p.add_argument("--device", default="auto", help="torch device of the reward (auto: cuda if available)")
    p.add_argument("--max-body-mb", type=int, default=DEFAULT_MAX_BODY_MB, help="largest accepted request body")
    p.add_argument("--no-hash", action="store_true", help="do not hash the weights at start (reports 'skipped')")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import MODULE first (it registers custom rewards); repeatable")
    p.add_argument("--log-level", default="INFO", help="logging level (DEBUG logs every request)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``genrl reward-serve`` / ``python -m genrl.rewards.server``: serve until interrupted.

    Returns:
        0 after Ctrl-C; 2 for a bad argument or a reward that cannot be built (message on stderr).
    """
    args = _parser().parse_args(list(argv) if argv is not None else None)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        kwargs = json.loads(args.kwargs)
        if not isinstance(kwargs, dict):
            raise ValueError(f"--kwargs must be a JSON object, got {args.kwargs!r}")
        check_host(args.host, args.allow_remote)
        for module in args.imports:
            importlib.import_module(module)
        if args.reward not in available_rewards():  # import the other reward modules only when needed
            load_reward_modules()
        service = build_service(args.reward, args.path, kwargs, batch_size=args.batch_size, device=args.device,
                                hash_weights=not args.no_hash)
        server = RewardServer(service, args.host, args.port, allow_remote=args.allow_remote,
                              max_body_bytes=args.max_body_mb << 20)
    except Exception as exc:
        print(f"genrl reward-serve: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    if args.allow_remote:
        logger.warning("listening on %s without authentication (--allow-remote)", server.url)
    print(f"genrl reward server: serving reward {service.info['name']!r} at {server.url} "
          f"(weights sha256 {service.info['weights_sha256']}, device {service.device})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
