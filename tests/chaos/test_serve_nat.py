"""Outside loopback, `echo-rl serve`'s swarm: a worker at home, behind a NAT router on a link with 200 ms round
trips and 1% loss (echo_cli/netlab.py), joins serve on the "internet" namespace, fetches the base model and two
tenants' samplers' adapters over that link, and draws both tenants' requests (the multi-slot messages: the
heartbeat's active versions, the lease's held ones), verified by serve's replay; `echo-rl status` asked across
the namespace shows it. Real processes, real libp2p, the real SDK."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tinker")

from echo_cli import netlab  # noqa: E402
from tests.chaos.test_kills import wait_for  # noqa: E402
from tests.chaos.test_nat import lab, status  # noqa: E402, F401 - lab: the fixture
from tests.swarm import ROOT  # noqa: E402
from tests.test_serve import KEY_A, KEY_B  # noqa: E402

WAIT = 300.0  # seconds any wait below may take on a loaded machine before the test fails


def started(cmd: list[str], log: Path) -> subprocess.Popen:
    out = open(log, "w")  # noqa: SIM115 - as long as the process
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    proc.log_path = log  # (wait_for shows its tail on a failure)
    return proc


def test_a_worker_behind_nat_on_a_lossy_link_draws_two_tenants_samples_for_serve(lab, tmp_path):  # noqa: F811 - the fixture
    inet, home = lab.exec_prefix(lab.inet), lab.exec_prefix(lab.home)
    (tmp_path / "keys").write_text(f"{KEY_A}\n{KEY_B}\n")
    serve = started([
        *inet, sys.executable, "-m", "echo_cli", "serve", "--models", "tiny", "--port", "8000", "--device", "cpu",
        "--api-key-file", str(tmp_path / "keys"), "--cache-dir", str(tmp_path / "cache"),
        "--checkpoint-dir", str(tmp_path / "ckpt"), "--swarm-listen", f"/ip4/{netlab.INET_IP}/tcp/0",
        "--swarm-dir", str(tmp_path / "swarm"), "--sample-seed", "3", "--sampler-threads", "1",
    ], tmp_path / "serve.log")  # fmt: skip
    procs = [("serve", serve)]
    worker = None
    try:
        addr_file = tmp_path / "swarm" / "learner.addr"
        wait_for(addr_file.exists, WAIT, "serve's swarm address", procs)
        addr = addr_file.read_text().strip()
        worker = started([
            *home, sys.executable, "-m", "echo_cli", "worker", "join", "--learner", addr, "--engine", "transformers",
            "--threads", "1", "--max-batch", "4", "--listen", f"/ip4/{netlab.HOME_IP}/tcp/0",
            "--identity", str(tmp_path / "home.key"), "--work-dir", str(tmp_path / "home"),
        ], tmp_path / "home.log")  # fmt: skip
        procs.append(("home", worker))
        wait_for(lambda: any(p["version"] >= 0 for p in status(lab, addr)["peers"]), WAIT, "the worker holds v0", procs)

        client = subprocess.run(
            [*inet, sys.executable, "-m", "tests.chaos.serve_tenants", "http://127.0.0.1:8000", KEY_A, KEY_B],
            capture_output=True, text=True, timeout=WAIT, cwd=ROOT,
        )  # fmt: skip
        assert client.returncode == 0, client.stderr[-3000:]
        samples = json.loads(client.stdout.strip().splitlines()[-1])
        assert [len(s) for s in samples] == [3, 3, 3, 3]

        doc = status(lab, addr)
        assert doc["kind"] == "serve" and doc["answered"] == 4 and doc["sampled_here"] == 0, doc
        [row] = doc["peers"]
        assert row["answered"] == 4 and row["tokens_per_s"] > 0 and not row["flagged"], row
        assert doc["version"] == 2 and doc["verification"]["groups_checked"] >= 4  # both tenants' samplers
    finally:
        for _, proc in reversed(procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(30)
