"""Shared fixtures: the real daemon in a subprocess on a free port (the embedded model, loaded
once per test session), the real `openai` client, and a scripted judge endpoint."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
API_KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    """`python -m ocrl serve` as a user starts it, with its own run directory."""

    def __init__(self, record_dir: Path, *flags: str, api_key: str = API_KEY, env: dict[str, str] | None = None):
        self.env = {**os.environ, **(env or {})}
        self.port = free_port()
        self.record_dir = record_dir
        self.api_key = api_key
        self.url = f"http://127.0.0.1:{self.port}"
        self.flags = flags
        self.proc = None
        self.log_path = record_dir.parent / f"daemon-{self.port}.log"

    def start(self, timeout: float = 300) -> "Daemon":
        cmd = [sys.executable, "-m", "ocrl", "serve", "--headless", "--port", str(self.port), "--record-dir", str(self.record_dir), *self.flags]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"daemon did not come up:\n{self.log_path.read_text()[-3000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode

    def stats(self) -> dict:
        return httpx.get(self.url + "/v1/ocrl/stats", headers={"Authorization": f"Bearer {self.api_key}"}).json()

    def client(self, **kwargs):
        from openai import AsyncOpenAI

        return AsyncOpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0, **kwargs)


class ScriptedJudge:
    """An OpenAI-compatible judge endpoint whose answers are scripted by the next state: the
    judge prompt contains the next state, and a next state holding `[votes: 1,-1,x]` makes the
    i-th vote answer `\\boxed{1}`, `\\boxed{-1}`, or unparseable text. `[think: N]` makes every
    vote a thinking model's: N words of thinking in `<think>...</think>` before its answer, cut
    at the request's max_tokens (one word a token) with finish_reason "length", as a server does;
    `[think: N split]` returns the thinking in `reasoning_content`, as a reasoning parser does."""

    def __init__(self):
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse
        from starlette.routing import Route
        import re

        self.calls = 0
        self.lock = threading.Lock()
        self.per_prompt: dict[str, int] = {}

        async def completions(request: Request):
            body = await request.json()
            prompt = "\n".join(m["content"] for m in body["messages"])
            match = re.search(r"\[votes: ([^\]]*)\]", prompt)
            with self.lock:
                self.calls += 1
                key = match.group(0) + prompt if match else prompt
                i = self.per_prompt.get(key, 0)
                self.per_prompt[key] = i + 1
            votes = match.group(1).split(",") if match else ["0"]
            vote = votes[i % len(votes)].strip()
            text = "no idea" if vote == "x" else f"Reasoning... \\boxed{{{vote}}}"
            think = re.search(r"\[think: (\d+)( split)?\]", prompt)
            if think is None:
                return JSONResponse({"choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]})
            words = ["<think>"] + ["hmm"] * int(think.group(1)) + ["</think>"] + text.split()
            budget = body.get("max_tokens") or len(words)
            finish = "length" if len(words) > budget else "stop"
            words = words[:budget]
            message = {"role": "assistant", "content": " ".join(words)}
            if think.group(2):  # a reasoning parser: thinking apart, the answer (if any) as content
                closed = "</think>" in words
                thinking = words[1 : words.index("</think>")] if closed else words[1:]
                answer = words[words.index("</think>") + 1 :] if closed else []
                message = {"role": "assistant", "content": " ".join(answer) or None, "reasoning_content": " ".join(thinking)}
            return JSONResponse({"choices": [{"index": 0, "message": message, "finish_reason": finish}]})

        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        app = Starlette(routes=[Route("/v1/chat/completions", completions, methods=["POST"])])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="session")
def daemon(tmp_path_factory):
    """The embedded model behind the real HTTP server, with an API key, no training."""
    d = Daemon(tmp_path_factory.mktemp("run") / "run", "--no-train", "--threads", "1").start()
    yield d
    d.stop()


@pytest.fixture(scope="session")
def scripted_judge():
    judge = ScriptedJudge()
    yield judge
    judge.stop()


@pytest.fixture(scope="session")
def judged_daemon(tmp_path_factory, scripted_judge):
    """A daemon whose PRM is the scripted judge endpoint (generate mode, m=3, over HTTP)."""
    d = Daemon(
        tmp_path_factory.mktemp("judged") / "run", "--no-train", "--threads", "1",
        "--prm-mode", "generate", "--prm-url", scripted_judge.url, "--prm-m", "3", "--max-batch-size", "16",
    ).start()
    yield d
    d.stop()


@pytest.fixture(scope="session")
def embedded():
    """The embedded model in the test process, for teacher-forced checks."""
    import torch

    from ocrl import models

    torch.set_num_threads(1)
    return models.load("embedded")
