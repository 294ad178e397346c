"""cluster.yaml's node types on a simulated multi-node Ray cluster (Ray's fake
multi-node provider, no docker): scaling the prefill pool makes Ray's autoscaler
start a `prefill` node and the decode pool a `decode` node, each rank on a node of
its own type. Everything runs in subprocesses (this test process may hold its own
embedded Ray), and only processes started here are stopped, by pid."""

from __future__ import annotations

import json
import os
import queue
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from pdserve.bench.kv_transfer import WARMUPS

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fake_config(gcs_port: int) -> dict:
    """The node types of cluster.yaml, shrunk to fit this machine, on the fake provider."""
    real = yaml.safe_load((REPO / "cluster.yaml").read_text())
    types = {"ray.head.default": {"resources": {"CPU": 2}, "node_config": {}, "max_workers": 0}}
    for pool in ("prefill", "decode"):
        node = real["available_node_types"][pool]
        resources = dict(node["resources"], CPU=2)
        types[pool] = {"resources": resources, "node_config": {}, "min_workers": 0,
                       "max_workers": min(node["max_workers"], 2)}
    return {
        "cluster_name": "pdserve-fake", "max_workers": 4, "upscaling_speed": 2.0,
        "idle_timeout_minutes": 5, "docker": {},
        "provider": {"type": "fake_multinode", "gcs_address": f"127.0.0.1:{gcs_port}",
                     "use_node_id_as_ip": True, "disable_node_updaters": True,
                     "disable_launch_config_check": True},
        "auth": {"ssh_user": "ubuntu"}, "available_node_types": types,
        "head_node_type": "ray.head.default", "file_mounts": {}, "cluster_synced_files": [],
        "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": [],
        "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
        "worker_setup_commands": [], "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


def _pids_using(marker: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if marker in cmdline:
            pids.append(int(entry))
    return pids


def _stop_pids(marker: str) -> None:
    """Stop the processes of the cluster started here: those naming its own temp dir."""
    # SIGTERM's grace is long enough for each raylet to end the processes it started
    # (renamed by setproctitle, they no longer name the temp dir)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = _pids_using(marker)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + 5
        while _alive(pids) and time.monotonic() < deadline:
            time.sleep(0.2)


def _alive(pids):
    out = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            out.append(pid)
    return out


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from pdserve.engine.model.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


# `ray start`'s own words when its GCS port was taken between _free_port and the bind
PORT_TAKEN = "Failed to start the grpc server"


@pytest.fixture
def fake_cluster(tmp_path, tiny_model_dir):
    temp_dir = f"/tmp/pdfk{os.getpid() % 100000}"
    cfg = tmp_path / "fake.yaml"
    # `ray start` needs an auth token of its own (token auth stays on): one per cluster,
    # in a file only this user can read, never in the environment's value itself.
    token = tmp_path / "ray-token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    # AUTOSCALER_UPDATE_INTERVAL_S: Ray's autoscaler looks every second, not every 5
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", RAY_FAKE_CLUSTER="1",
               AUTOSCALER_UPDATE_INTERVAL_S="1",
               RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
    # A free port can be taken before Ray binds it (seen once in a full run: another
    # process's ephemeral port): up to three ports, each attempt cleaned up; any other
    # failure is reported at once.
    for _ in range(3):
        gcs_port = _free_port()
        cfg.write_text(yaml.safe_dump(_fake_config(gcs_port)))
        start = subprocess.run(
            [str(BIN / "ray"), "start", "--head", f"--port={gcs_port}", "--num-cpus=2",
             f"--ray-client-server-port={_free_port()}", "--include-dashboard=false",
             f"--temp-dir={temp_dir}", f"--autoscaling-config={cfg}", "--disable-usage-stats"],
            env=env, capture_output=True, text=True, timeout=120)
        if start.returncode == 0 or PORT_TAKEN not in start.stdout + start.stderr:
            break
        _stop_pids(temp_dir)
    try:
        assert start.returncode == 0, start.stdout + start.stderr
        yield {"address": f"127.0.0.1:{gcs_port}", "env": env, "model": tiny_model_dir}
    finally:
        _stop_pids(temp_dir)


def _nodes(address: str, env: dict) -> list[dict]:
    code = (f"import json, ray; ray.init(address={address!r}, log_to_driver=False); "
            "print(json.dumps([{'id': n['NodeID'], 'resources': n['Resources']} "
            "for n in ray.nodes() if n['Alive']]))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _drain(lines: queue.Queue) -> str:
    out = []
    while not lines.empty():
        out.append(lines.get_nowait())
    return "".join(out)


def _pdserve(*args, env, timeout=240):
    return subprocess.run([sys.executable, "-m", "pdserve.cli", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_scaling_pools_makes_the_autoscaler_start_matching_nodes(fake_cluster, tmp_path):
    env, address = fake_cluster["env"], fake_cluster["address"]
    assert not [n for n in _nodes(address, env) if "prefill" in n["resources"]
                or "decode" in n["resources"]]  # only the head to start with
    serve = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "serve", "--ray-address", address, "--port", "0",
         "--model", fake_cluster["model"], "--prefill", "1", "--decode", "1",
         "--num-cpus", "0.5"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in serve.stdout], daemon=True).start()
    try:
        router, log, deadline = None, [], time.monotonic() + 240
        while time.monotonic() < deadline and serve.poll() is None:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            log.append(line)
            if line.startswith("pdserve router listening on "):
                router = line.split()[-1]
            if line.startswith("self-check") and ("passed" in line or "FAILED" in line):
                break
        assert router and "self-check passed" in "".join(log), "".join(log)

        # Grow both pools at once: Ray has no free `prefill`/`decode` unit, so the
        # autoscaler must launch one node of each type.
        procs = [subprocess.Popen([sys.executable, "-m", "pdserve.cli", "scale", "--address",
                                   router, pool, "2"], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
                 for pool in ("prefill", "decode")]
        for p in procs:
            out, err = p.communicate(timeout=240)
            assert p.returncode == 0, err
        state = json.loads(_pdserve("status", "--address", router, "--json", env=env).stdout)
        nodes = {n["id"]: n["resources"] for n in _nodes(address, env)}
        for pool in state["pools"]:
            name = pool["name"]
            assert len(pool["ranks"]) == 2, pool
            homes = [r["nodeId"] for r in pool["ranks"]]
            assert len(set(homes)) == 2, pool  # one rank per node: one unit per node
            for home in homes:
                assert nodes[home].get(name) == 1, (name, nodes[home])  # a node of its type
        assert sum(1 for r in nodes.values() if r.get("prefill")) == 2
        assert sum(1 for r in nodes.values() if r.get("decode")) == 2
        # served by the new ranks too: four clients at once (each a CLI process)
        clients = [subprocess.Popen([sys.executable, "-m", "pdserve.cli", "generate",
                                     "--address", router, "--max-tokens", "4", "--json",
                                     "--timeout", "30", f"one {i}"], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                   for i in range(4)]
        for c in clients:
            out, err = c.communicate(timeout=90)
            assert c.returncode == 0, (err, _pdserve("status", "--address", router,
                                                     env=env).stdout, _drain(lines))
            assert json.loads(out)["finish_reason"] == "length"

        # KV between two nodes, each with its own object store: the ray transport's
        # object path (Ray's node-to-node transfer), the blocks checked on arrival
        result = tmp_path / "kv.json"
        bench = _pdserve("bench", "kv-transfer", "--ray-address", address, "--across-nodes",
                         "--transports", "ray", "--sizes", "1", "--repeats", "1",
                         "--prompt-tokens", "none", "--no-plot", "--result-file", str(result),
                         env=env, timeout=120)
        assert bench.returncode == 0, bench.stdout + bench.stderr
        kv = json.loads(result.read_text())
        assert kv["import_paths"]["ray_across_nodes"] == {"shared memory": 0,
                                                          "object": WARMUPS + 1}
        assert kv["ratio_to_memcpy"]["ray_across_nodes_deliver"][0] > 0
    finally:
        serve.send_signal(signal.SIGINT)
        try:
            serve.wait(30)
        except subprocess.TimeoutExpired:
            serve.kill()
