"""`spec-batch serve` as a process: graceful shutdown lets an in-flight streamed request finish; --help names the
flags that mirror the settings; --require-keys; the compose api service."""

from __future__ import annotations

import os
import signal
import subprocess
import threading

import openai
import pytest
import yaml
from online_server import KEY, SPEC_BATCH, start_server

from bench.processes import REPO


@pytest.mark.slow
def test_sigterm_lets_the_stream_in_flight_finish(tmp_path):
    server = start_server(tmp_path)
    client = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)
    stream = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Count to 50."}],
        max_tokens=40,
        temperature=0,
        stream=True,
    )
    chunks = [next(iter(stream))]
    stopper = threading.Timer(0.2, server.process.send_signal, args=(signal.SIGTERM,))
    stopper.start()
    chunks.extend(stream)  # the server is shutting down meanwhile: the stream still runs to its end
    stopper.join()
    finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    assert finish in ("stop", "length")
    assert server.process.wait(60) in (0, -signal.SIGTERM)
    assert "Application shutdown complete" in server.output()


def test_help_names_the_flags():
    out = subprocess.run([SPEC_BATCH, "serve", "--help"], capture_output=True, text=True, check=True).stdout
    for flag in ("--host", "--port", "--target", "--draft", "--weights", "--runner", "SPEC_BATCH_API_HOST"):
        assert flag in out


def test_require_keys_refuses_to_start_without_keys():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPEC_BATCH_API_KEYS")}
    done = subprocess.run([SPEC_BATCH, "serve", "--require-keys"], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 2 and "SPEC_BATCH_API_KEYS" in done.stderr


def test_compose_api_service_listens_everywhere_and_requires_keys():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    api = compose["services"]["api"]
    assert api["environment"]["SPEC_BATCH_API_HOST"] == "0.0.0.0"
    assert "--require-keys" in api["command"] and api["command"][:2] == ["spec-batch", "serve"]
