"""Attack a live learner as a hostile worker would, and report what each attack did.

    .venv/bin/python scripts/adversary.py --learner /ip4/127.0.0.1/tcp/4001/p2p/12D3KooW... [--secret-file F]

Runs every attack of tests/chaos/adversary.py (broken and expensive frames, absurd stated values,
stream floods, lease theft, replays, forged logprobs, unsampled text) from fresh identities, prints one
line per attack (ok / FAIL, what was expected, what happened, the penalties it earned), then syncs the
newest published version and checks that its weights are finite. Exit status 0 when every attack got
the outcome the learner owes and the weights are finite. Use it only against a learner you run.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2p.auth import read_secret  # noqa: E402
from tests.chaos.adversary import Adversary, weights_finite  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--learner", required=True, help="the learner's full multiaddr (RUN_DIR/learner.addr)")
    parser.add_argument("--secret-file", help="the swarm secret, if the learner has one")
    parser.add_argument("--tries", type=int, default=12, help="forgeries from one identity before giving up")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    args = parser.parse_args()
    secret = read_secret(args.secret_file) if args.secret_file else None
    adversary = Adversary(args.learner, secret, tries=args.tries)

    def report(o) -> None:
        if not args.json:
            print(f"{'ok  ' if o.ok else 'FAIL'} {o.name}\n     expected: {o.expected}\n     observed: {o.observed}"
                  f"\n     penalties: {o.details.get('penalties')}", flush=True)  # fmt: skip

    try:
        outcomes = adversary.run(report)
        version, finite = weights_finite(adversary)
        status = adversary.status()
    finally:
        adversary.close()
    ok = all(o.ok for o in outcomes) and finite
    summary = {
        "attacks": len(outcomes), "failed": [o.name for o in outcomes if not o.ok], "newest_version": version,
        "weights_finite": finite, "learner_step": status["step"], "penalties": status["penalties"],
        "banned": len(status["banned"]), "flagged": len(status["verification"]["flagged"]),
    }  # fmt: skip
    if args.json:
        print(json.dumps({"outcomes": [asdict(o) for o in outcomes], **summary}))
    else:
        print(f"\n{len(outcomes) - len(summary['failed'])} of {len(outcomes)} attacks got the expected outcome; "
              f"learner at step {status['step']}, v{version} weights finite: {finite}")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
