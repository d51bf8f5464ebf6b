"""Stands in for upstream's tests/utils.py RemoteOpenAIServer (the only fixture changed; written here, not
copied): it launches THIS engine's `vllm serve` on its built-in model, served under the name the upstream test
asks for, with the test's own server args minus the LoRA ones (LoRA is out of scope), on 127.0.0.1."""
import os
import socket
import subprocess
import sys
import time

import openai
import requests

LORA_FLAGS_WITH_VALUE = {"--lora-modules", "--max-lora-rank", "--max-cpu-loras", "--max-loras"}
LORA_FLAGS = {"--enable-lora"}


def _drop_lora_args(args):
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in LORA_FLAGS:
            continue
        if a in LORA_FLAGS_WITH_VALUE:
            skip = True
            continue
        out.append(a)
    return out


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteOpenAIServer:
    DUMMY_API_KEY = "token-abc123"

    def __init__(self, model, vllm_serve_args, *, env_dict=None, seed=0, auto_port=True,
                 max_wait_seconds=None, override_hf_configs=None):
        self.host = "127.0.0.1"
        self.port = _free_port()
        args = _drop_lora_args(list(vllm_serve_args))
        self.show_hidden_metrics = any(a.startswith("--show-hidden-metrics-for-version") for a in args)
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "--served-model-name", model,
               "--host", self.host, "--port", str(self.port), *args]
        # The built-in model (trained on Python code) never writes its end-of-turn token in a chat, so a request
        # without max_tokens would run to the 8192-token context (minutes each on 2 CPU cores): default 32.
        if "--generation-config" not in args:
            cmd += ["--generation-config", os.path.join(os.path.dirname(__file__), "..", "genconfig")]
        if seed is not None and "--seed" not in args:
            cmd += ["--seed", str(seed)]
        env = dict(os.environ)
        if env_dict:
            env.update(env_dict)
        self.log_path = os.path.join(os.path.dirname(__file__), "..", "logs", f"server_{self.port}.log")
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        self._log = open(self.log_path, "w")
        self._log.write(" ".join(cmd) + "\n")
        self._log.flush()
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self._wait_for_server(max_wait_seconds or 240)

    def _wait_for_server(self, timeout):
        start = time.time()
        while True:
            try:
                if requests.get(self.url_for("health"), timeout=2).status_code == 200:
                    return
            except Exception:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log_path}")
            if time.time() - start > timeout:
                raise RuntimeError(f"server did not start in {timeout}s; see {self.log_path}")
            time.sleep(0.5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()

    @property
    def url_root(self):
        return f"http://{self.host}:{self.port}"

    def url_for(self, *parts):
        return self.url_root + "/" + "/".join(parts)

    def get_client(self, **kwargs):
        kwargs.setdefault("timeout", 600)
        return openai.OpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs)

    def get_async_client(self, **kwargs):
        kwargs.setdefault("timeout", 600)
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0,
                                  **kwargs)
