"""Chaos: workers without the swarm secret or off the allow-list (the attacks of a hostile worker with
access are in test_adversary.py)."""

import pytest

from p2p.host import Unauthorized
from p2p.identity import load_identity, peer_id_of
from p2p.messages import LEASE, STATUS
from tests.chaos.hostile import hostile_host


def test_only_workers_with_the_secret_or_on_the_allow_list_get_work(swarm, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("correct horse battery staple 42\n")
    wrong = tmp_path / "wrong"
    wrong.write_text("a wrong secret of enough length\n")
    allowed_id = peer_id_of(load_identity(tmp_path / "good.key"))
    (tmp_path / "allow").write_text(
        f"# workers we know\n{allowed_id}\n{peer_id_of(load_identity(tmp_path / 'bad.key'))}\n"
    )
    learner = swarm.learner(
        "--steps", "3", "--secret-file", str(secret), "--allow", str(tmp_path / "allow"), "--no-autoscale"
    )  # fmt: skip
    swarm.worker("good", "--secret-file", str(secret))
    swarm.worker("bad", "--secret-file", str(wrong))  # on the list, wrong secret
    swarm.worker("stranger", "--secret-file", str(secret))  # right secret, not on the list
    lid = swarm.addr.rsplit("/p2p/", 1)[-1]
    outsider = hostile_host()
    try:
        outsider.connect(swarm.addr)
        assert outsider.request(lid, STATUS, {})["run_id"]  # status stays open, read-only
        with pytest.raises(Unauthorized):
            outsider.request(lid, LEASE, {"version": 0, "max_groups": 1})
        assert swarm.wait(learner, 240) == 0
        status_groups = {g for m in swarm.metrics() for g in m["workers"]}
        assert status_groups == {allowed_id[-8:]}, status_groups  # only the good worker ever worked
    finally:
        outsider.stop()
    assert "wrong swarm secret" in swarm.log("bad")
    assert "allow-list" in swarm.log("stranger")
    assert "now on v" not in swarm.log("bad") and "now on v" not in swarm.log("stranger")
