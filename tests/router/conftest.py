"""Shared fixtures: one embedded Ray for the session, the tiny model, routers in threads,
and test credentials written at test time (token files, a CA and a server certificate
for localhost / 127.0.0.1: nothing secret is committed)."""

from __future__ import annotations

import datetime
import ipaddress
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdserve.bench.harness import RouterHarness

PDSERVE = [sys.executable, "-m", "pdserve.cli"]


class ServeProcess:
    """`pdserve serve ...` as a child process; its output is read line by line."""

    def __init__(self, args: list[str], env: dict) -> None:
        self.proc = subprocess.Popen([*PDSERVE, "serve", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env)
        self.env = env
        self.lines: queue.Queue = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=lambda: [self.lines.put(x) for x in self.proc.stdout],
                         daemon=True).start()

    @property
    def log(self) -> str:
        return "".join(self.seen)

    def wait_for(self, prefix: str, timeout: float) -> str | None:
        """The next output line starting with `prefix` (None: timed out or exited)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                if self.proc.poll() is not None:
                    return None
                continue
            self.seen.append(line)
            if line.startswith(prefix):
                return line
        return None

    def stop(self, timeout: float = 60) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return None


@pytest.fixture(scope="session")
def spawn_serve():
    """Start `pdserve serve` processes; any still running at the end are stopped."""
    started: list[ServeProcess] = []

    def spawn(args: list[str], env: dict) -> ServeProcess:
        started.append(ServeProcess(args, env))
        return started[-1]

    yield spawn
    for serve in started:
        serve.stop()


def router_config(model_dir: str, **overrides):
    from pdserve.router.config import PoolConfig, RouterConfig

    engine = dict(num_kv_blocks=128, max_num_seqs=32, block_size=16)
    engine.update(overrides.pop("engine", {}))
    prefill = overrides.pop("prefill", 1)
    decode = overrides.pop("decode", 1)
    normal = overrides.pop("normal", 1)
    overrides.setdefault("collective_timeout_s", 10.0)
    return RouterConfig(
        model_dir=model_dir, port=0,
        prefill=PoolConfig("prefill", replicas=prefill, num_cpus=0.5,
                           resources={"prefill": 1}, engine=engine),
        decode=PoolConfig("decode", replicas=decode, num_cpus=0.5,
                          resources={"decode": 1}, engine=engine),
        normal=PoolConfig("normal", replicas=normal, num_cpus=0.5, engine=engine),
        **overrides)


@pytest.fixture(scope="session")
def make_router(ray_session, tiny_model_dir):
    started: list[RouterHarness] = []

    def make(**overrides) -> RouterHarness:
        harness = RouterHarness(router_config(tiny_model_dir, **overrides))
        started.append(harness)
        return harness

    yield make
    for h in started:
        try:
            h.close()
        except Exception:
            pass


@pytest.fixture(scope="session")
def shared_router(make_router):
    """One disaggregated router (1 prefill + 1 decode rank to start) for several modules."""
    return make_router(prefill=1, decode=1)


@pytest.fixture(scope="session")
def real_router(ray_session, real_model_path):
    """The real model served disaggregated (1 prefill + 1 decode rank), for every module
    that needs it: loaded once per session. Its decode rank drafts (n-gram speculative
    decoding, which leaves every output as it is): each real-model service test runs
    through it too."""
    from pdserve.router.config import PoolConfig, RouterConfig

    # fp32 activations: the service's tokens are held to transformers' (int8 ones are
    # held to perplexity, tests/model/test_int8_activations.py)
    engine = dict(num_kv_blocks=256, max_num_seqs=16, block_size=16, activation_precision="fp32")
    decode_engine = dict(engine, speculative="ngram", speculative_adaptive=False)
    config = RouterConfig(
        model_dir=real_model_path, port=0, served_model_name="smollm2-135m-instruct",
        collective_timeout_s=10.0,
        prefill=PoolConfig("prefill", replicas=1, num_cpus=0.5, resources={"prefill": 1},
                           engine=engine),
        decode=PoolConfig("decode", replicas=1, num_cpus=0.5, resources={"decode": 1},
                          engine=decode_engine))
    harness = RouterHarness(config)
    yield harness
    harness.close()


@pytest.fixture(scope="session")
def reference(tiny_model_dir):
    """Greedy outputs of the offline LLM(mode="normal"), memoised per (prompt, max_tokens)."""
    from pdserve.engine.llm import LLM
    from pdserve.scheduler.sampling_params import SamplingParams

    llm = LLM(tiny_model_dir, mode="normal")
    cache: dict = {}

    def ref(prompts: list, max_tokens: int) -> list[list[int]]:
        todo = [p for p in prompts if (repr(p), max_tokens) not in cache]
        if todo:
            texts = [p for p in todo if isinstance(p, str)]
            ids = [p for p in todo if not isinstance(p, str)]
            sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
            if texts:
                for p, out in zip(texts, llm.generate(texts, sp), strict=True):
                    cache[(repr(p), max_tokens)] = list(out.token_ids)
            if ids:
                for p, out in zip(ids, llm.generate(prompt_token_ids=ids, sampling_params=sp), strict=True):
                    cache[(repr(p), max_tokens)] = list(out.token_ids)
        return [cache[(repr(p), max_tokens)] for p in prompts]

    return ref


@pytest.fixture(scope="session")
def kill_decode_under_load(reference):
    """A function: 16 greedy requests (32 tokens each) through ``router``, and a decode
    rank killed once one holding a request passes ``eligible``; it checks that every
    request still ends with the offline tokens within 90 s and returns the victim and
    the prompts' wanted tokens."""
    import asyncio

    import ray

    from pdserve.router.client import AsyncClient

    def run(router, label: str, eligible=lambda rank: True):
        n, max_tokens = 16, 32
        prompts = [f"{label} {i}: the quick brown fox" for i in range(n)]
        want = reference(prompts, max_tokens)
        pool = router.service.pools["decode"]

        async def load():
            async with AsyncClient(router.address, timeout=90) as client:
                async def one(i):
                    await asyncio.sleep(0.03 * i)
                    return await client.generate(prompts[i], max_tokens=max_tokens,
                                                 temperature=0, ignore_eos=True)

                tasks = [asyncio.create_task(one(i)) for i in range(n)]
                victim = None
                for _ in range(3000):
                    victim = next((r for r in pool.ready() if r.inflight and eligible(r)),
                                  None)
                    if victim is not None:
                        break
                    await asyncio.sleep(0.005)
                assert victim is not None, "no decode rank ever held a request"
                ray.kill(victim.actor, no_restart=True)
                return victim, await asyncio.gather(*tasks, return_exceptions=True)

        started = time.monotonic()
        victim, outs = asyncio.run(load())
        assert time.monotonic() - started < 90
        for i, out in enumerate(outs):
            assert not isinstance(out, BaseException), out
            assert out.finish_reason == "length" and out.token_ids == want[i], (i, out.error)
        assert victim.state == "dead"
        return victim, prompts, want

    return run


# -- credentials ---------------------------------------------------------------------


def write_private(path: Path, text: str) -> str:
    path.write_text(text)
    os.chmod(path, 0o600)
    return str(path)


@dataclass
class Tokens:
    alice: str
    bob: str
    admin: str
    tenant_file: str
    admin_file: str


def make_tokens(folder: Path) -> Tokens:
    alice, alice_old, bob, admin = (secrets.token_urlsafe(24) for _ in range(4))
    tenant_file = write_private(folder / "tokens", "# tenant token\n"
                                f"alice {alice}\nalice {alice_old}  # being rotated out\n"
                                f"\nbob {bob}\n")
    admin_file = write_private(folder / "admin_token", f"{admin}\n")
    return Tokens(alice, bob, admin, tenant_file, admin_file)


@dataclass
class TLSFiles:
    ca: str
    cert: str
    key: str
    other_ca: str  # a CA that did not sign the server's certificate


def _name(common: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _ca(common: str):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(common)).issuer_name(_name(common))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def make_tls(folder: Path) -> TLSFiles:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    ca_key, ca_cert = _ca("pdserve test CA")
    _, other_cert = _ca("some other CA")
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name("localhost"))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    (folder / "ca.pem").write_bytes(ca_cert.public_bytes(pem))
    (folder / "other_ca.pem").write_bytes(other_cert.public_bytes(pem))
    (folder / "server.pem").write_bytes(cert.public_bytes(pem))
    write_private(folder / "server.key", key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode())
    return TLSFiles(str(folder / "ca.pem"), str(folder / "server.pem"),
                    str(folder / "server.key"), str(folder / "other_ca.pem"))


@pytest.fixture(scope="session")
def tokens(tmp_path_factory) -> Tokens:
    return make_tokens(tmp_path_factory.mktemp("tokens"))


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory) -> TLSFiles:
    return make_tls(tmp_path_factory.mktemp("tls"))
