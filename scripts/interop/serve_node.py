"""Start a bare echo-rl libp2p node (Noise + yamux, identify, ping) and print its multiaddr."""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from libp2p.crypto.ed25519 import Ed25519PrivateKey  # noqa: E402

from p2p.host import Host  # noqa: E402

host = Host(Ed25519PrivateKey.new()).start()
host.handle("/echo/chunk/1", lambda peer, msg: {"ok": True})
print(host.addrs[0], flush=True)
time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 60)
host.stop()
