"""A small internet for tests: network namespaces, a NAT router, and a link shaped with delay, loss and a rate.

    inet (10.77.0.10: learner, public peers) --veth-- router (10.77.0.1, NAT) --shaped link-- home (192.168.7.2)

`home` reaches `inet` through the router, which masquerades its traffic as 10.77.0.1; nothing in `inet` can
reach `home` (no route to 192.168.7.0/24), as with a worker behind a home router.

The shaped link is a userspace link emulator (`python -m tests.netlab link ...`): one TUN device in each of
the two namespaces, and a process that carries every IP packet across after a one-way delay, at a rate,
dropping a share of them at random. The kernels our tests run on come without the netem qdisc (tc says
"Specified qdisc kind is unknown"), so delay and loss cannot be set with tc; this does what netem would, one
packet at a time, for the few MB/s a test needs. Needs root, `ip`, `iptables` and /dev/net/tun.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import os
import random
import select
import shutil
import struct
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INET_IP, ROUTER_WAN_IP, ROUTER_LAN_IP, HOME_IP = "10.77.0.10", "10.77.0.1", "192.168.7.1", "192.168.7.2"

CLONE_NEWNET = 0x40000000
TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
QUEUE_PACKETS = 1000  # a link's buffer; further packets are dropped (drop-tail, as a router's queue)


def missing() -> str | None:
    """Why this machine cannot build a netlab, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (scripts/setup.sh installs it)"
    if not os.path.exists("/dev/net/tun"):
        return "/dev/net/tun is missing"
    return None


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


@dataclass
class Shape:
    """One direction of a link: `delay_ms` one way, `loss` the share of packets dropped, `rate` bytes/s."""

    delay_ms: float = 100.0
    loss: float = 0.01
    rate: float = 2e6


class Netlab:
    """Namespaces <prefix>-inet, -router, -home as drawn in the module docstring; close() removes all of it."""

    def __init__(self, shape: Shape) -> None:
        self.prefix = f"er{os.getpid() % 100000}"
        self.inet, self.router, self.home = (f"{self.prefix}-{n}" for n in ("inet", "router", "home"))
        self.shape = shape
        self.made: list[str] = []
        self.link: subprocess.Popen | None = None
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        for ns in (self.inet, self.router, self.home):
            sh("ip", "netns", "add", ns)
            self.made.append(ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        wan, inet_if = f"{self.prefix}w", f"{self.prefix}i"
        sh("ip", "link", "add", wan, "netns", self.router, "type", "veth", "peer", "name", inet_if, "netns", self.inet)
        sh("ip", "-n", self.router, "addr", "add", f"{ROUTER_WAN_IP}/24", "dev", wan)
        sh("ip", "-n", self.inet, "addr", "add", f"{INET_IP}/24", "dev", inet_if)
        sh("ip", "-n", self.router, "link", "set", wan, "up")
        sh("ip", "-n", self.inet, "link", "set", inet_if, "up")
        sh("ip", "netns", "exec", self.router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        nat = ("iptables", "-t", "nat", "-A", "POSTROUTING", "-o", wan, "-j", "MASQUERADE")
        sh("ip", "netns", "exec", self.router, *nat)
        s = self.shape
        self.link = subprocess.Popen(
            [sys.executable, "-m", "tests.netlab", "link", f"{self.home}:{self.prefix}h:{HOME_IP}:{ROUTER_LAN_IP}",
             f"{self.router}:{self.prefix}r:{ROUTER_LAN_IP}:{HOME_IP}",
             "--delay-ms", str(s.delay_ms), "--loss", str(s.loss), "--rate", str(s.rate)],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )  # fmt: skip
        if self.link.stdout.readline().strip() != b"ready":
            raise RuntimeError("the link emulator did not start")
        sh("ip", "-n", self.home, "route", "add", "default", "via", ROUTER_LAN_IP)

    def exec_prefix(self, ns: str) -> list[str]:
        """What runs a command in namespace `ns`."""
        return ["ip", "netns", "exec", ns]

    def close(self) -> None:
        if self.link is not None:
            self.link.stdin.close()  # the emulator exits when its stdin closes; its TUN devices go with it
            try:
                self.link.wait(10)
            except subprocess.TimeoutExpired:
                self.link.kill()
                self.link.wait(10)
        for ns in reversed(self.made):  # the veth pair goes with its namespaces
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.made.clear()


# -- the link emulator (its own process: python -m tests.netlab link A B) --------------------------------


def open_tun(netns: str, name: str) -> int:
    """A TUN device `name` created in namespace `netns` (it lives as long as the descriptor)."""
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        if libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns {netns}")
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
        return fd
    finally:
        libc.setns(home, CLONE_NEWNET)
        os.close(home)
        os.close(target)


class Direction:
    """Packets read on one TUN device, written on the other after serialisation at `rate` and `delay`."""

    def __init__(self, out_fd: int, shape: Shape, rng: random.Random) -> None:
        self.out_fd, self.shape, self.rng = out_fd, shape, rng
        self.queue: deque[tuple[float, bytes]] = deque()  # (when it leaves, packet), in order
        self.line_free = 0.0  # when the last queued packet has been serialised
        self.dropped = 0

    def take(self, packet: bytes, now: float) -> None:
        if self.rng.random() < self.shape.loss or len(self.queue) >= QUEUE_PACKETS:
            self.dropped += 1
            return
        self.line_free = max(now, self.line_free) + len(packet) / self.shape.rate
        self.queue.append((self.line_free + self.shape.delay_ms / 1000, packet))

    def send_due(self, now: float) -> float | None:
        """Write the packets whose time has come; returns when the next one is due."""
        while self.queue and self.queue[0][0] <= now:
            try:
                os.write(self.out_fd, self.queue.popleft()[1])
            except OSError:  # the device is down or its queue full: the packet is lost, as on a wire
                self.dropped += 1
        return self.queue[0][0] if self.queue else None


def run_link(ends: list[str], shape: Shape, seed: int) -> None:
    fds = []
    for end in ends:  # NETNS:DEV:ADDR:PEER
        netns, dev, addr, peer = end.split(":")
        fds.append(open_tun(netns, dev))
        sh("ip", "-n", netns, "addr", "add", addr, "peer", peer, "dev", dev)
        sh("ip", "-n", netns, "link", "set", dev, "up")
    rng = random.Random(seed)
    towards = {fds[0]: Direction(fds[1], shape, rng), fds[1]: Direction(fds[0], shape, rng)}
    print("ready", flush=True)
    stdin = sys.stdin.fileno()
    while True:
        now = time.monotonic()
        due = [t for d in towards.values() if (t := d.send_due(now)) is not None]
        timeout = max(0.0, min(due) - time.monotonic()) if due else None
        readable, _, _ = select.select([*towards, stdin], [], [], timeout)
        if stdin in readable and not os.read(stdin, 4096):
            return  # the test is done with us
        now = time.monotonic()
        for fd in readable:
            if fd == stdin:
                continue
            for _ in range(64):  # what the device holds now, a bounded amount per wake-up
                try:
                    towards[fd].take(os.read(fd, 65536), now)
                except BlockingIOError:
                    break


def main() -> None:
    parser = argparse.ArgumentParser(description="Carry IP packets between two namespaces with delay and loss.")
    parser.add_argument("command", choices=["link"])
    parser.add_argument("ends", nargs=2, help="NETNS:TUN_NAME:ADDRESS:PEER_ADDRESS, one per side")
    parser.add_argument("--delay-ms", type=float, default=100.0, help="one-way delay")
    parser.add_argument("--loss", type=float, default=0.01, help="share of packets dropped, each direction")
    parser.add_argument("--rate", type=float, default=2e6, help="bytes/s, each direction")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    run_link(args.ends, Shape(args.delay_ms, args.loss, args.rate), args.seed)


if __name__ == "__main__":
    main()
