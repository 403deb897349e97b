"""Reward ``"remote"``: a reward scored by a genrl reward server (docs/rewards.md, The reward server), plus the wire
format both sides use.

Start a server (loopback only by default; see :mod:`genrl.rewards.server`)::

    genrl reward-serve --reward ocr --kwargs '{"frames": {"frames": "stride", "stride": 4}}' --port 8765

and use it like a local reward::

    rewards:
      - name: shapes
      - name: remote
        weight: 0.5
        kwargs: {url: "http://127.0.0.1:8765", expected_name: ocr, timeout: 120, retries: 2}

Why a server: a reward with a heavy or conflicting environment (mmdet 2.x, an old transformers pin, a 7B VLM
on its own GPU) runs in its own process, and the training process sees the same protocol as a local reward.

Wire format (protocol 1, no pickle, no JPEG: the server sees exactly the uint8 frames the client sent):

* ``GET /info`` -> JSON ``{"protocol", "name", "class", "dims", "channels", "differentiable": false,
  "version", "genrl_version", "weights_sha256", "batch_size"}``; ``weights_sha256`` is the hex sha256 over the
  reward's weight files (relative path and bytes of each, sorted), or ``"none"`` for a reward without weights.
* ``POST /score`` with a safetensors body (``Content-Type: application/x-genrl-safetensors``): one uint8 tensor
  ``"pixels"`` [B, T, C, H, W] (0..255) and, in the safetensors metadata under ``"genrl_request"``, the JSON
  ``{"protocol": 1, "prompts": [B strings], "meta": {key: JSON value}}``. Answer: JSON ``{"name",
  "weights_sha256", "scores": {key: [B floats or null]}, "valid": [B bools]}`` with the reward's raw main key
  (no client-side scale / shift applied); null is NaN. Errors: JSON ``{"error": message}`` with status 400
  (bad request), 404, 413 (body too large) or 500 (the reward raised).

Meta travels as JSON: tensors and arrays become (nested) lists, so a server-side reward receives lists.
"""

from __future__ import annotations

import json
import logging
import math
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from genrl.rewards.base import RewardModel
from genrl.rewards.manager import slice_meta
from genrl.rewards.registry import register_reward

__all__ = [
    "CONTENT_TYPE",
    "PROTOCOL",
    "RemoteReward",
    "RemoteRewardError",
    "decode_score_request",
    "encode_score_request",
    "quantize_uint8",
]

logger = logging.getLogger(__name__)

#: version of the wire format (``/info``'s and every request's ``protocol``).
PROTOCOL = 1
#: content type of a ``/score`` request body.
CONTENT_TYPE = "application/x-genrl-safetensors"
_META_KEY = "genrl_request"


class RemoteRewardError(RuntimeError):
    """A failed exchange with a reward server (unreachable, timeout, error status, malformed answer).

    Attributes:
        retryable: True for failures worth another attempt (connection refused / reset, timeout, HTTP 5xx).
    """

    def __init__(self, message: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


# ---------------------------------------------------------------------------------------------- wire format
def quantize_uint8(pixels: Tensor) -> Tensor:
    """float [..] in [0, 1] -> uint8 ``round(x * 255)`` on the CPU (values clamped to [0, 1], NaN / inf -> 0).

    What the server scores is ``quantize_uint8(pixels).float() / 255``: compare a remote reward with a local
    one on that input.
    """
    x = torch.nan_to_num(pixels.detach().float(), nan=0.0, posinf=1.0, neginf=0.0).clamp(0.0, 1.0)
    return x.mul(255.0).round().to(torch.uint8).cpu()


def _jsonable(value: Any, key: str) -> Any:
    if isinstance(value, Tensor):
        return value.detach().cpu().tolist()
    if hasattr(value, "tolist") and type(value).__module__.startswith("numpy"):
        return value.tolist()
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v, key) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, key) for v in value]
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    raise TypeError(
        f"remote reward: meta {key!r} holds a {type(value).__name__}, which cannot be sent to a reward server; "
        f"meta must be JSON values (strings, numbers, bools, None, lists, dicts) or tensors / arrays"
    )


def encode_score_request(frames: Tensor, prompts: list[str], meta: Mapping[str, Any] | None = None) -> bytes:
    """The body of a ``/score`` request.

    Args:
        frames: uint8 [B, T, C, H, W].
        prompts: B strings.
        meta: JSON-able extras (tensors / numpy arrays are converted to lists).
    Raises:
        ValueError: frames not uint8 rank 5, or ``len(prompts) != B``.
        TypeError: a meta value that is not JSON-able.
    """
    from safetensors.torch import save

    if not isinstance(frames, Tensor) or frames.dtype != torch.uint8 or frames.ndim != 5:
        got = f"{frames.dtype} {tuple(frames.shape)}" if isinstance(frames, Tensor) else type(frames).__name__
        raise ValueError(f"a /score request holds uint8 frames [B, T, C, H, W], got {got}")
    if len(prompts) != frames.shape[0]:
        raise ValueError(f"a /score request needs one prompt per video: {len(prompts)} prompts, B={frames.shape[0]}")
    payload = {"protocol": PROTOCOL, "prompts": list(prompts),
               "meta": {str(k): _jsonable(v, str(k)) for k, v in (meta or {}).items()}}
    return save({"pixels": frames.contiguous()}, metadata={_META_KEY: json.dumps(payload)})


def decode_score_request(body: bytes) -> tuple[Tensor, list[str], dict[str, Any]]:
    """Parse a ``/score`` body into ``(uint8 [B, T, C, H, W], prompts, meta)``.

    Raises:
        ValueError: not a safetensors body, no / bad ``genrl_request`` metadata, a protocol mismatch, tensors
            other than a single uint8 rank-5 ``"pixels"``, or a prompt count different from B.
    """
    from safetensors.torch import load

    if len(body) < 8:
        raise ValueError("the body is not a safetensors file (shorter than its 8-byte header length)")
    n = int.from_bytes(body[:8], "little")
    if n <= 0 or 8 + n > len(body):
        raise ValueError(f"the body is not a safetensors file (header length {n} for a body of {len(body)} bytes)")
    try:
        header = json.loads(body[8 : 8 + n])
        request = json.loads(header["__metadata__"][_META_KEY])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"the safetensors metadata must hold a JSON {_META_KEY!r} entry: {exc}") from None
    if not isinstance(request, dict) or request.get("protocol") != PROTOCOL:
        got = request.get("protocol") if isinstance(request, dict) else request
        raise ValueError(f"request protocol {got!r}, this server speaks protocol {PROTOCOL}")
    try:
        tensors = load(body)
    except Exception as exc:  # safetensors raises its own error types
        raise ValueError(f"the body is not a valid safetensors file: {exc}") from None
    if set(tensors) != {"pixels"}:
        raise ValueError(f"the request must hold exactly one tensor 'pixels', got {sorted(tensors)}")
    frames = tensors["pixels"]
    if frames.dtype != torch.uint8 or frames.ndim != 5:
        raise ValueError(f"'pixels' must be uint8 [B, T, C, H, W], got {frames.dtype} {tuple(frames.shape)}")
    prompts, meta = request.get("prompts"), request.get("meta", {})
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise ValueError("'prompts' must be a list of strings")
    if len(prompts) != frames.shape[0]:
        raise ValueError(f"got {len(prompts)} prompts for a batch of {frames.shape[0]} videos "
                         f"(shape {tuple(frames.shape)})")
    if not isinstance(meta, dict):
        raise ValueError(f"'meta' must be a JSON object, got {type(meta).__name__}")
    return frames, prompts, meta


# ---------------------------------------------------------------------------------------------- client
@register_reward("remote")
class RemoteReward(RewardModel):
    """A reward scored by a genrl reward server (:mod:`genrl.rewards.server`), usable anywhere a local reward
    is (a :class:`~genrl.rewards.RewardManager` entry, ``build_reward("remote", url=...)``).

    At construction (``connect=True``) it reads ``/info`` once: the served reward's name (checked against
    ``expected_name``), output keys (they become :attr:`dimensions`), accepted channel counts and weights hash.
    Each call validates the input like any reward (float [B, T, C, H, W] in [0, 1], one prompt per video),
    quantises it to uint8 (``round(x * 255)``, :func:`quantize_uint8`), sends it in requests of at most
    ``batch_size`` videos and applies ``scale`` / ``shift`` to the returned raw main key.

    Failures never raise into training and never produce a fake score: a request that times out, cannot
    connect, gets an error status or a malformed answer (or one from a server whose name / weights hash
    changed) is retried up to ``retries`` times with a bounded exponential backoff
    (``min(max_backoff, backoff * 2**k)`` seconds; 4xx answers and malformed answers are not retried), then its
    samples are NaN in every key and ``valid = False``, and ``logging.warning`` names the URL, the samples and
    the exception. Metrics then show the reward's ``invalid_fraction``.

    Args:
        url: server base URL, e.g. ``"http://127.0.0.1:8765"``.
        timeout: seconds per connection / read (one request).
        retries: extra attempts per request after the first (>= 0).
        backoff, max_backoff: backoff before retry k (0-based) is ``min(max_backoff, backoff * 2**k)`` seconds.
        expected_name: the registry name the server must serve (None: any).
        expected_weights_sha256: the weights hash the server must report (None: any).
        batch_size: at most this many videos per request (None: the whole call in one request). The server
            may further score each request in chunks of its own ``--batch-size``.
        connect: read ``/info`` at construction (fail fast). With False it is read at the first call, and an
            unreachable server then only makes that call's samples invalid.
        scale, shift: affine on the main key, applied here (the server returns the raw score).

    Raises:
        ValueError: a bad URL scheme, non-positive ``timeout``, negative ``retries`` / ``backoff``,
            ``batch_size < 1``; with ``connect``: a server serving another reward than ``expected_name``, or
            other weights than ``expected_weights_sha256``.
        ConnectionError: with ``connect``, ``/info`` could not be read after the retries (the message says how
            to start a server).
        TypeError (at call): a meta value that is not JSON-able; plus the protocol's input checks.
    """

    differentiable = False
    #: what the server's /info said (replaced per instance at connection).
    dimensions: ClassVar[tuple[str, ...]] = ("reward",)
    channels: ClassVar[tuple[int, ...]] = (1, 3)

    def __init__(
        self,
        url: str,
        timeout: float = 60.0,
        retries: int = 2,
        backoff: float = 0.5,
        max_backoff: float = 8.0,
        expected_name: str | None = None,
        expected_weights_sha256: str | None = None,
        batch_size: int | None = None,
        connect: bool = True,
        scale: float = 1.0,
        shift: float = 0.0,
    ) -> None:
        super().__init__(scale=scale, shift=shift)
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"remote reward: url must start with http:// or https://, got {url!r}")
        if not timeout > 0:
            raise ValueError(f"remote reward: timeout must be > 0 seconds, got {timeout}")
        if retries < 0 or backoff < 0 or max_backoff < 0:
            raise ValueError(f"remote reward: retries, backoff and max_backoff must be >= 0, got {retries}, "
                             f"{backoff}, {max_backoff}")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"remote reward: batch_size must be >= 1 or None, got {batch_size}")
        self.url = url.rstrip("/")
        self.timeout = float(timeout)
        self.retries = int(retries)
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)
        self.expected_name = expected_name
        self.expected_weights_sha256 = expected_weights_sha256
        self.batch_size = batch_size
        self.info: dict[str, Any] | None = None
        # never route loopback traffic through an http_proxy from the environment
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        if connect:
            try:
                info = self._with_retries("GET /info", self._get_info)
            except RemoteRewardError as exc:
                raise ConnectionError(
                    f"remote reward: cannot read {self.url}/info: {exc}; start the server first, e.g. "
                    f"`genrl reward-serve --reward <name> --port <port>`, or set connect: false"
                ) from None
            self._accept_info(info, strict=True)

    # ------------------------------------------------------------------ transport
    def _request(self, method: str, path: str, body: bytes | None = None) -> dict[str, Any]:
        """One HTTP exchange; the decoded JSON answer. Raises RemoteRewardError (retryable or not)."""
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = CONTENT_TYPE
        req = urllib.request.Request(self.url + path, data=body, method=method, headers=headers)
        try:
            with self._opener.open(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = ""
            try:
                detail = json.loads(exc.read() or b"{}").get("error", "")
            except Exception:
                pass
            raise RemoteRewardError(f"HTTP {exc.code} from {method} {path}: {detail or exc.reason}",
                                    retryable=exc.code >= 500) from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise RemoteRewardError(f"{method} {path}: {type(reason).__name__}: {reason}", retryable=True) from None
        try:
            answer = json.loads(raw)
        except ValueError as exc:
            raise RemoteRewardError(f"{method} {path}: the answer is not JSON: {exc}") from None
        if not isinstance(answer, dict):
            raise RemoteRewardError(f"{method} {path}: the answer is not a JSON object")
        return answer

    def _get_info(self) -> dict[str, Any]:
        return self._request("GET", "/info")

    def _with_retries(self, what: str, fn, *args):
        """``fn(*args)`` with up to ``retries`` more attempts on retryable failures; raises the last failure."""
        for attempt in range(self.retries + 1):
            try:
                return fn(*args)
            except RemoteRewardError as exc:
                if not exc.retryable or attempt == self.retries:
                    if attempt:
                        raise RemoteRewardError(f"{exc} (after {attempt + 1} attempts)", exc.retryable) from None
                    raise
                delay = min(self.max_backoff, self.backoff * 2**attempt)
                logger.info("remote reward %s: %s failed (%s); retrying in %.2f s", self.url, what, exc, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    def _check_info(self, info: dict[str, Any]) -> list[str]:
        problems = []
        dims = info.get("dims")
        if info.get("protocol") != PROTOCOL:
            problems.append(f"protocol {info.get('protocol')!r} (this client speaks {PROTOCOL})")
        if not (isinstance(dims, list) and dims and dims[0] == "reward" and all(isinstance(d, str) for d in dims)):
            problems.append(f"dims must be a list of strings starting with 'reward', got {dims!r}")
        if self.expected_name is not None and info.get("name") != self.expected_name:
            problems.append(f"it serves reward {info.get('name')!r}, expected {self.expected_name!r}")
        if self.expected_weights_sha256 is not None and info.get("weights_sha256") != self.expected_weights_sha256:
            problems.append(f"weights sha256 {info.get('weights_sha256')!r}, expected {self.expected_weights_sha256!r}")
        return problems

    def _accept_info(self, info: dict[str, Any], strict: bool) -> bool:
        problems = self._check_info(info)
        if problems:
            msg = f"remote reward: the server at {self.url} does not match: " + "; ".join(problems)
            if strict:
                raise ValueError(msg)
            logger.warning("%s; marking the batch invalid", msg)
            return False
        self.info = info
        self.dimensions = tuple(info["dims"])
        channels = info.get("channels")
        if isinstance(channels, list) and channels and all(isinstance(c, int) for c in channels):
            self.channels = tuple(channels)
        return True

    def _ensure_info(self) -> bool:
        if self.info is not None:
            return True
        try:
            info = self._with_retries("GET /info", self._get_info)
        except RemoteRewardError as exc:
            logger.warning("remote reward %s: cannot read /info; marking the batch invalid: %s", self.url, exc)
            return False
        return self._accept_info(info, strict=False)

    def _score_chunk(self, body: bytes, n: int) -> dict[str, list]:
        """POST one request and check the answer (``scores`` for every dim, ``valid``, all of length n)."""
        answer = self._request("POST", "/score", body)
        info = self.info or {}
        if answer.get("name") != info.get("name") or answer.get("weights_sha256") != info.get("weights_sha256"):
            raise RemoteRewardError(
                f"the server now serves {answer.get('name')!r} with weights {answer.get('weights_sha256')!r}, "
                f"not {info.get('name')!r} with {info.get('weights_sha256')!r} as at connection (restarted with "
                f"another reward?)"
            )
        scores, valid = answer.get("scores"), answer.get("valid")
        if not isinstance(scores, dict) or not isinstance(valid, list) or len(valid) != n:
            raise RemoteRewardError(f"malformed /score answer: need 'scores' and {n} 'valid' flags")
        for key in self.dimensions:
            col = scores.get(key)
            if not isinstance(col, list) or len(col) != n:
                raise RemoteRewardError(f"malformed /score answer: key {key!r} missing or not {n} values")
            if not all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in col):
                raise RemoteRewardError(f"malformed /score answer: key {key!r} holds non-numbers")
        return {"valid": valid, **{k: scores[k] for k in self.dimensions}}

    # ------------------------------------------------------------------ protocol
    def score(self, pixels: Tensor, prompts: list[str], **meta: Any) -> dict[str, Tensor]:
        b = pixels.shape[0]
        frames = quantize_uint8(pixels)
        step = self.batch_size or max(b, 1)
        sliced = []
        for lo in range(0, b, step):  # encode first: a bad meta value is the caller's error and raises
            hi = min(b, lo + step)
            sub = slice_meta(meta, b, lo, hi)  # per-sample values: length-B lists / tensors
            sliced.append((lo, hi, encode_score_request(frames[lo:hi], prompts[lo:hi], sub)))
        ok = self._ensure_info()
        out = {k: torch.full((b,), float("nan")) for k in self.dimensions}
        valid = torch.zeros(b, dtype=torch.bool)
        for lo, hi, body in sliced if ok else []:
            try:
                answer = self._with_retries("POST /score", self._score_chunk, body, hi - lo)
            except Exception as exc:  # never into training: the chunk is invalid and the failure is logged
                logger.warning(
                    "remote reward %s: scoring samples %d:%d of %d failed; marking them invalid: %s: %s",
                    self.url, lo, hi, b, type(exc).__name__, exc,
                )
                continue
            for key in self.dimensions:
                out[key][lo:hi] = torch.tensor([math.nan if v is None else float(v) for v in answer[key]])
            valid[lo:hi] = torch.tensor([bool(v) for v in answer["valid"]])
        out["reward"] = torch.where(valid, out["reward"], torch.full_like(out["reward"], float("nan")))
        dev = pixels.device
        return {**{k: v.to(dev) for k, v in out.items()}, "valid": valid.to(dev)}

    def extra_repr(self) -> str:
        served = self.info.get("name") if self.info else None
        return f"{super().extra_repr()}, url={self.url!r}, serves={served!r}"
