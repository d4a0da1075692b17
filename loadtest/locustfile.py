"""Locust users for the OpenAI-compatible API: streaming completions and chat completions.

    locust -f loadtest/locustfile.py --headless -u 64 -r 64 --run-time 60s --host http://127.0.0.1:8000

Every request streams (``stream=true``, usage in every chunk) and is timed chunk by chunk.
Besides the request itself (``POST /v1/completions`` or ``POST /v1/chat/completions``: time of the
whole stream, content size = output tokens) the user adds these Locust entries (type ``SSE``):

- ``TTFT``   time to first token, ms, when the first token arrives (content size: tokens in
  that first chunk);
- ``ITL``    time between two chunks that carry tokens, ms, one entry per chunk after the first,
  when it arrives (content size: tokens in that chunk; a speculative step can deliver several).
  TTFT + ITL content sizes add up to every token streamed, also of requests cut off when a run
  ends: output tokens/s = their count x average content size / the stats window;
- ``TPOT``   time per output token after the first, ms, one entry per successful request;
- ``TOKENS_PER_S`` output tokens / whole request time, one entry per successful request. Locust
  has only a response-time column: here it holds tokens/s, not ms.

A non-200 answer, an ``{"error": ...}`` chunk, a chunk that is not JSON, or a stream that ends
without ``data: [DONE]`` fails the request with the server's (OpenAI-style) error message.

Two ways to load the server:

- closed loop (``OpenAIStreamUser``, the default): ``-u N`` users, each sending its next request when the
  previous one ends (``--think-time`` between them);
- open loop (``PoissonArrivals``, chosen by ``--request-rate R`` > 0, with ``-u 1``): requests arrive as a
  Poisson process of R per second, whatever the server does — exponential gaps drawn from ``--seed``, each
  request streamed in its own greenlet. Beyond ``--max-in-flight`` open requests an arrival is not sent and
  is recorded as a failure (``DROPPED``): the server is past saturation.

``--requests-log PATH`` writes one JSON line per request (when it started, its status ``ok``/``failed``/``cut``
— cut: still streaming when the run stopped —, every token chunk's arrival and size) and one per test event
(``test_start``, ``spawning_complete``, ``test_stop``): ``loadtest.figures`` computes exact percentiles and
goodput from it.

Settings: custom Locust arguments, each with an environment variable (see ``--help``).
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import gevent
from gevent.pool import Group
from locust import FastHttpUser, events, task

from dcut.prompts import load_prompts

DEFAULT_PROMPTS = Path(__file__).resolve().parent.parent / "models" / "heldout_prompts.jsonl"
SSE_TYPE = "SSE"


@events.init_command_line_parser.add_listener
def _arguments(parser):
    parser.add_argument("--model", env_var="LOADTEST_MODEL", default="",
                        help="Model name to ask for (default: the first one /v1/models lists).")
    parser.add_argument("--prompt-file", env_var="LOADTEST_PROMPT_FILE", default=str(DEFAULT_PROMPTS),
                        help="JSON lines with a 'prompt' field.")
    parser.add_argument("--prompt-chars", env_var="LOADTEST_PROMPT_CHARS", default="64:512",
                        help="MIN:MAX characters: each prompt is cut to a length drawn uniformly from this range.")
    parser.add_argument("--max-tokens", env_var="LOADTEST_MAX_TOKENS", default="16:128",
                        help="MIN:MAX output tokens, drawn uniformly per request.")
    parser.add_argument("--chat-fraction", env_var="LOADTEST_CHAT_FRACTION", type=float, default=0.5,
                        help="Share of requests sent to /v1/chat/completions (the rest: /v1/completions).")
    parser.add_argument("--api-key", env_var="LOADTEST_API_KEY", default="", is_secret=True,
                        help="Sent as 'Authorization: Bearer <key>' when set.")
    parser.add_argument("--temperature", env_var="LOADTEST_TEMPERATURE", type=float, default=0.0)
    parser.add_argument("--ignore-eos", env_var="LOADTEST_IGNORE_EOS", default="true",
                        help="true: every request produces exactly its max_tokens (controlled output lengths).")
    parser.add_argument("--think-time", env_var="LOADTEST_THINK_TIME", default="0:0",
                        help="MIN:MAX seconds a user waits between requests.")
    parser.add_argument("--request-timeout", env_var="LOADTEST_REQUEST_TIMEOUT", type=float, default=600.0,
                        help="Seconds without data before a request fails.")
    parser.add_argument("--seed", env_var="LOADTEST_SEED", type=int, default=0)
    parser.add_argument("--request-rate", env_var="LOADTEST_REQUEST_RATE", type=float, default=0.0,
                        help="> 0: open loop, Poisson arrivals at this many requests/s (run with -u 1).")
    parser.add_argument("--max-in-flight", env_var="LOADTEST_MAX_IN_FLIGHT", type=int, default=1024,
                        help="Open loop: arrivals beyond this many open requests are dropped (and fail).")
    parser.add_argument("--requests-log", env_var="LOADTEST_REQUESTS_LOG", default="",
                        help="JSON lines: one per request (timings of every token chunk) and per test event.")


class RequestsLog:
    """The ``--requests-log`` file: appended line by line (greenlets of one process, so no interleaving)."""

    file = None

    @classmethod
    def open(cls, path: str) -> None:
        if path and cls.file is None:
            cls.file = open(path, "a", buffering=1)  # noqa: SIM115 - closed at quit

    @classmethod
    def write(cls, record: dict) -> None:
        if cls.file is not None:
            cls.file.write(json.dumps(record, separators=(",", ":")) + "\n")


@events.init.add_listener
def _init(environment, **_kwargs):
    """Open the requests log; keep the user class of the chosen loop (closed: OpenAIStreamUser, open:
    PoissonArrivals), so a plain ``locust -f loadtest/locustfile.py`` runs as it always did."""
    opts = environment.parsed_options
    if opts is None:
        return
    RequestsLog.open(opts.requests_log)
    wanted = PoissonArrivals if opts.request_rate > 0 else OpenAIStreamUser
    if environment.user_classes and wanted in environment.user_classes:
        environment.user_classes[:] = [wanted]


def _event(name: str):
    def listener(**_kwargs):
        RequestsLog.write({"event": name, "t": time.time()})
    return listener


events.test_start.add_listener(_event("test_start"))
events.spawning_complete.add_listener(_event("spawning_complete"))
events.test_stop.add_listener(_event("test_stop"))


def parse_range(text: str, cast=int) -> tuple:
    """``"16:128"`` -> (16, 128); ``"64"`` -> (64, 64)."""
    lo, _, hi = str(text).partition(":")
    lo, hi = cast(lo), cast(hi or lo)
    if hi < lo:
        raise ValueError(f"range {text!r}: MAX < MIN")
    return lo, hi


def error_message(status: int, body: bytes | str | None) -> str:
    """``HTTP <status>: <message>`` from an OpenAI-style error body (or the raw body)."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else (body or "")
    try:
        err = json.loads(text)["error"]
        message = err.get("message") if isinstance(err, dict) else str(err)
    except (ValueError, KeyError, TypeError):
        message = text.strip()[:300] or "(empty body)"
    return f"HTTP {status}: {message}"


class StreamError(Exception):
    """The stream broke the OpenAI SSE protocol, or carried an error object."""


@dataclass
class StreamTimings:
    """What one streamed answer delivered, and when (perf_counter seconds)."""

    start: float
    wall_start: float = field(default_factory=time.time)
    token_times: list[float] = field(default_factory=list)   # arrival of each chunk that carried tokens
    token_counts: list[int] = field(default_factory=list)    # tokens in that chunk
    prompt_tokens: int = 0
    done: bool = False
    end: float = 0.0

    @property
    def output_tokens(self) -> int:
        return sum(self.token_counts)

    def ttft_ms(self) -> float:
        return (self.token_times[0] - self.start) * 1000

    def tpot_ms(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) * 1000 / (self.output_tokens - 1)

    def record(self, status: str, path: str, max_tokens: int, error: str | None = None) -> dict:
        """The requests-log line: ``start`` the wall-clock time the request was sent, every other time in seconds
        after it (``end``: the stream ended, or the line was written; ``chunks``: [arrival, tokens])."""
        end = self.end or time.perf_counter()
        return {"start": self.wall_start, "path": path, "max_tokens": max_tokens, "status": status,
                "error": error, "prompt_tokens": self.prompt_tokens, "end": round(end - self.start, 6),
                "chunks": [[round(t - self.start, 6), n] for t, n in zip(self.token_times, self.token_counts,
                                                                          strict=True)]}


class SSEParser:
    """Incremental parser of an OpenAI stream: feed bytes as they arrive, get the parsed events back.

    Events are separated by a blank line; ``data:`` lines of one event are joined. Comments (``:``)
    and other fields are skipped. Token counts come from the cumulative ``usage.completion_tokens``
    (``stream_options.continuous_usage_stats``); without it each chunk with text counts as one token.
    """

    def __init__(self, timings: StreamTimings):
        self.timings = timings
        self._buffer = b""
        self._completion_tokens = 0

    def feed(self, data: bytes, now: float) -> None:
        self._buffer += data.replace(b"\r\n", b"\n")
        while b"\n\n" in self._buffer:
            raw, self._buffer = self._buffer.split(b"\n\n", 1)
            self._event(raw.decode("utf-8", "replace"), now)

    def close(self, now: float) -> None:
        if self._buffer.strip():
            self._event(self._buffer.decode("utf-8", "replace"), now)
            self._buffer = b""
        self.timings.end = now
        if not self.timings.done:
            raise StreamError("stream ended without 'data: [DONE]'")

    def _event(self, raw: str, now: float) -> None:
        lines = [line[5:].removeprefix(" ") for line in raw.split("\n") if line.startswith("data:")]
        if not lines:
            return
        data = "\n".join(lines)
        if self.timings.done:
            raise StreamError(f"data after [DONE]: {data[:100]!r}")
        if data == "[DONE]":
            self.timings.done = True
            return
        try:
            chunk = json.loads(data)
        except ValueError as e:
            raise StreamError(f"malformed SSE chunk ({e}): {data[:100]!r}") from None
        if not isinstance(chunk, dict):
            raise StreamError(f"SSE chunk is not an object: {data[:100]!r}")
        if "error" in chunk:
            err = chunk["error"]
            message = err.get("message") if isinstance(err, dict) else err
            code = err.get("code") if isinstance(err, dict) else None
            raise StreamError(f"error in stream ({code}): {message}")
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            raise StreamError(f"SSE chunk without 'choices': {data[:100]!r}")
        usage = chunk.get("usage") or {}
        self.timings.prompt_tokens = usage.get("prompt_tokens", self.timings.prompt_tokens)
        if "completion_tokens" in usage:
            new = usage["completion_tokens"] - self._completion_tokens
            self._completion_tokens = usage["completion_tokens"]
        else:
            new = sum(1 for c in choices if _choice_text(c))
            self._completion_tokens += new
        if new > 0 and choices:  # the final usage-only chunk repeats the total, with no choices
            self.timings.token_times.append(now)
            self.timings.token_counts.append(new)


def _choice_text(choice: dict) -> str:
    if "text" in choice:
        return choice["text"] or ""
    return (choice.get("delta") or {}).get("content") or ""


class OpenAIStreamUser(FastHttpUser):
    """One closed-loop client: pick a prompt and a length, stream the answer, time it, repeat."""

    _prompts: list[str] | None = None
    _model: str | None = None
    _started = 0  # users built so far: user i draws its requests from Random(f"{seed}-{i}")

    def __init__(self, environment):
        opts = environment.parsed_options
        if opts is not None:  # connection timeouts are read when the client is built
            self.network_timeout = self.connection_timeout = opts.request_timeout
        super().__init__(environment)
        self.opts = opts
        self.think_time = parse_range(opts.think_time, float)
        self.rng = random.Random(f"{opts.seed}-{OpenAIStreamUser._started}")
        OpenAIStreamUser._started += 1
        self.prompt_chars = parse_range(opts.prompt_chars)
        self.max_tokens = parse_range(opts.max_tokens)
        self.headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
        self.ignore_eos = str(opts.ignore_eos).lower() in ("1", "true", "yes")
        if OpenAIStreamUser._prompts is None:
            OpenAIStreamUser._prompts = load_prompts(opts.prompt_file)

    def wait_time(self) -> float:
        return self.rng.uniform(*self.think_time)

    def on_start(self) -> None:
        if OpenAIStreamUser._model is None:
            OpenAIStreamUser._model = self.opts.model or self._first_model()

    def _first_model(self) -> str:
        with self.client.get("/v1/models", headers=self.headers, name="/v1/models", catch_response=True) as r:
            if r.status_code != 200:
                r.failure(error_message(r.status_code, _safe_content(r)) if r.status_code
                          else f"connection error: {getattr(r, 'error', None)!r}")
                raise RuntimeError("GET /v1/models failed")  # stops this user; the failure is recorded
            return r.json()["data"][0]["id"]

    def request_body(self) -> tuple[str, dict]:
        prompt = self.rng.choice(self._prompts)
        prompt = prompt[: self.rng.randint(*self.prompt_chars)]
        body = {"model": self._model, "max_tokens": self.rng.randint(*self.max_tokens),
                "temperature": self.opts.temperature, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.rng.random() < self.opts.chat_fraction:
            return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
        return "/v1/completions", {**body, "prompt": prompt}

    @task
    def stream_completion(self) -> None:
        self.send(*self.request_body())

    def send(self, path: str, body: dict) -> None:
        """Stream one request; its requests-log line is written however it ends (``cut``: killed mid-way
        when the run stopped)."""
        timings = StreamTimings(start=time.perf_counter())
        outcome = {"status": "cut", "error": None}
        try:
            self._stream(path, body, timings, outcome)
        finally:
            RequestsLog.write(timings.record(outcome["status"], path, body["max_tokens"], outcome["error"]))

    def _stream(self, path: str, body: dict, timings: StreamTimings, outcome: dict) -> None:
        def fail(resp, message: str) -> None:
            resp.failure(message)
            outcome.update(status="failed", error=message)

        with self.client.post(path, json=body, headers={**self.headers, "Accept": "text/event-stream"},
                              name=path, stream=True, catch_response=True) as resp:
            if resp.status_code != 200:
                fail(resp, error_message(resp.status_code, _safe_content(resp)) if resp.status_code
                     else f"connection error: {getattr(resp, 'error', None)!r}")
                return
            parser = SSEParser(timings)
            # Line by line: geventhttpclient's read(n) (and so iter_content) waits for n bytes, which
            # would hold chunks back; readline returns each line as soon as it has arrived.
            raw = resp._response
            reported = 0
            try:
                while line := raw.readline(b"\n"):
                    parser.feed(line, time.perf_counter())
                    reported = self._report_tokens(timings, reported)
                parser.close(time.perf_counter())
                if not timings.token_times:
                    raise StreamError("stream delivered no tokens")
            except StreamError as e:
                fail(resp, str(e))
                return
            except Exception as e:  # noqa: BLE001 - a timeout or a broken connection mid-stream
                fail(resp, f"stream broken after {timings.output_tokens} tokens: {type(e).__name__}: {e}")
                return
            finally:
                resp.request_meta["response_time"] = (time.perf_counter() - timings.start) * 1000
                resp.request_meta["response_length"] = timings.output_tokens
            resp.success()
            outcome["status"] = "ok"
        self._report(timings)

    def _report_tokens(self, t: StreamTimings, reported: int) -> int:
        """TTFT / ITL entries for the token chunks that arrived since ``reported``, as they arrive
        (so a run's token counts include requests still streaming when it ends)."""
        for i in range(reported, len(t.token_times)):
            if i == 0:
                self._fire("TTFT", t.ttft_ms(), t.token_counts[0])
            else:
                self._fire("ITL", (t.token_times[i] - t.token_times[i - 1]) * 1000, t.token_counts[i])
        return len(t.token_times)

    def _report(self, t: StreamTimings) -> None:
        if (tpot := t.tpot_ms()) is not None:
            self._fire("TPOT", tpot, t.output_tokens)
        self._fire("TOKENS_PER_S", t.output_tokens / max(t.end - t.start, 1e-9), t.output_tokens)

    def _fire(self, name: str, value: float, tokens: int) -> None:
        self.environment.events.request.fire(request_type=SSE_TYPE, name=name, response_time=value,
                                             response_length=tokens, exception=None, context={},
                                             response=None, url=None)


class PoissonArrivals(OpenAIStreamUser):
    """Open loop: one user that sends requests at Poisson arrival times (``--request-rate`` per second), each
    in its own greenlet, never waiting for answers. Arrival gaps come from their own seeded generator, so every
    arm of a comparison sees the same arrival times and the same requests."""

    fixed_count = 1

    def __init__(self, environment):
        opts = environment.parsed_options
        if opts is not None:  # the connection pool must hold every open request
            self.concurrency = max(opts.max_in_flight, 1)
        super().__init__(environment)
        self.rng = random.Random(f"{opts.seed}-open")
        self.arrival_rng = random.Random(f"{opts.seed}-arrivals")
        self.in_flight = Group()

    def wait_time(self) -> float:
        return 0.0

    @task
    def stream_completion(self) -> None:
        rate = self.opts.request_rate
        if rate <= 0:
            raise ValueError("PoissonArrivals needs --request-rate > 0")
        due = time.perf_counter()
        while True:
            due += self.arrival_rng.expovariate(rate)
            path, body = self.request_body()
            gevent.sleep(max(0.0, due - time.perf_counter()))
            if len(self.in_flight) >= self.opts.max_in_flight:
                self.environment.events.request.fire(
                    request_type="POST", name=path, response_time=0, response_length=0, context={},
                    exception=RuntimeError(f"DROPPED: {len(self.in_flight)} requests in flight (--max-in-flight)"),
                    response=None, url=None)
                RequestsLog.write(StreamTimings(start=time.perf_counter()).record(
                    "dropped", path, body["max_tokens"], "DROPPED: --max-in-flight requests in flight"))
                continue
            self.in_flight.spawn(self.send, path, body)

    def on_stop(self) -> None:
        self.in_flight.kill(block=True, timeout=5)  # their log lines are written as they die (status cut)


def _safe_content(resp) -> bytes | None:
    try:
        return resp.content
    except Exception:  # noqa: BLE001 - the body of a broken response is only for the message
        return None
