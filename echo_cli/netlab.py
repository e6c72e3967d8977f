"""A small internet for tests and benchmarks: network namespaces, NAT routers, and links with delay, loss
and a rate. Needs root, `ip`, `iptables` and /dev/net/tun (scripts/setup.sh installs the tools).

Two layouts:

- Netlab, one worker at home:

      inet (10.77.0.10: learner, public peers) --veth-- router (10.77.0.1, NAT) --shaped link-- home (192.168.7.2)

- Wan, a star of sites around a core router, one shaped link each (the last mile: delay, loss, an uplink and
  a downlink rate); a site with `nat` sits behind a home router of its own that masquerades its traffic:

      site k (10.78.k.2) --shaped link-- core          site k (192.168.k.2) --veth-- router k (NAT, 10.78.k.2)
                                                                                        --shaped link-- core

  The round trip between sites i and j is 2 (delay_i + delay_j). Nothing outside can reach a NATed site
  (there is no route to 192.168.k.0/24), as with a worker behind a home router without port forwarding;
  two NATed sites cannot dial each other, and anyone can dial a public site.

The shaped links are a userspace link emulator (`python -m echo_cli.netlab links ...`, one process for all
links): a TUN device at each end, and a loop that carries every IP packet across after serialising it at
the link's rate and waiting its one-way delay, dropping a share at random and what overflows a queue of
QUEUE_SECONDS at that rate (drop-tail, as a home router's buffer). The kernels our tests run on have no
netem qdisc (tc says "Specified qdisc kind is unknown"), so tc cannot delay or drop packets. The links'
MTU is 9000 by default so that one Python process carries tens of MB/s; loss then drops 9000-byte packets.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import json
import os
import random
import select
import shutil
import struct
import subprocess
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INET_IP, ROUTER_WAN_IP, ROUTER_LAN_IP, HOME_IP = "10.77.0.10", "10.77.0.1", "192.168.7.1", "192.168.7.2"

CLONE_NEWNET = 0x40000000
TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
QUEUE_SECONDS = 0.25  # a link's buffer, in seconds of its rate; further packets are dropped
MIN_QUEUE = 64 * 1024  # bytes a queue holds however slow the link


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


@dataclass
class LinkEnd:
    """One end of an emulated link: a TUN device `dev` in namespace `netns` with address `addr`."""

    netns: str
    dev: str
    addr: str


@dataclass
class Link:
    """A point-to-point link between `a` and `b`: `a_to_b` and `b_to_a` shape each direction."""

    a: LinkEnd
    b: LinkEnd
    a_to_b: Shape
    b_to_a: Shape
    mtu: int = 9000


class Emulator:
    """The link emulator process (`python -m echo_cli.netlab links JSON`); close() ends it and its devices."""

    def __init__(self, links: list[Link], seed: int = 0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "echo_cli.netlab", "links", json.dumps([asdict(link) for link in links]),
             "--seed", str(seed)],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )  # fmt: skip
        if self.proc.stdout.readline().strip() != b"ready":
            self.close()
            raise RuntimeError("the link emulator did not start")

    def cut(self, seconds: float) -> None:
        """Drop every packet on every link, both ways, for `seconds` from now (a cable pulled, a laptop asleep)."""
        self.proc.stdin.write(f"cut {seconds}\n".encode())
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # the emulator exits when its stdin closes; its TUN devices go with it
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class Namespaces:
    """Network namespaces named <prefix>-<name>; close() removes every one made (and the devices in them)."""

    def __init__(self, tag: str) -> None:
        self.prefix = f"{tag}{os.getpid() % 100000}"
        self.made: list[str] = []
        self.emulator: Emulator | None = None

    def add(self, name: str) -> str:
        ns = f"{self.prefix}-{name}"
        sh("ip", "netns", "add", ns)
        self.made.append(ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        return ns

    def veth(self, ns_a: str, addr_a: str, ns_b: str, addr_b: str, name: str) -> None:
        """A veth pair between two namespaces, each end with an address in one /24."""
        a, b = f"{self.prefix}{name}a", f"{self.prefix}{name}b"
        sh("ip", "link", "add", a, "netns", ns_a, "type", "veth", "peer", "name", b, "netns", ns_b)
        for ns, dev, addr in ((ns_a, a, addr_a), (ns_b, b, addr_b)):
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")

    def masquerade(self, router: str, out_dev: str) -> None:
        """Make `router` forward and hide what it forwards out of `out_dev` behind its own address."""
        sh("ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        nat = ("iptables", "-t", "nat", "-A", "POSTROUTING", "-o", out_dev, "-j", "MASQUERADE")
        sh("ip", "netns", "exec", router, *nat)

    def exec_prefix(self, ns: str) -> list[str]:
        """What runs a command in namespace `ns`."""
        return ["ip", "netns", "exec", ns]

    def close(self) -> None:
        if self.emulator is not None:
            self.emulator.close()
        for ns in reversed(self.made):  # veth pairs go with their namespaces
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.made.clear()


class Netlab(Namespaces):
    """Namespaces <prefix>-inet, -router, -home as drawn in the module docstring; close() removes all of it."""

    def __init__(self, shape: Shape) -> None:
        super().__init__("er")
        try:
            self.inet, self.router, self.home = (self.add(n) for n in ("inet", "router", "home"))
            self.veth(self.router, ROUTER_WAN_IP, self.inet, INET_IP, "w")
            self.masquerade(self.router, f"{self.prefix}wa")
            home_end = LinkEnd(self.home, f"{self.prefix}h", HOME_IP)
            router_end = LinkEnd(self.router, f"{self.prefix}r", ROUTER_LAN_IP)
            self.emulator = Emulator([Link(home_end, router_end, shape, shape, mtu=1500)])
            sh("ip", "-n", self.home, "route", "add", "default", "via", ROUTER_LAN_IP)
        except BaseException:
            self.close()
            raise


@dataclass
class Site:
    """A machine on the Wan: its last mile's one-way delay, loss, uplink and downlink (bytes/s; None: no cap),
    and whether a home router NATs it."""

    delay_ms: float
    up: float | None = None
    down: float | None = None
    loss: float = 0.0
    nat: bool = False


class Wan(Namespaces):
    """A star of sites around a core router (the module docstring); site k runs in namespace `ns[k]` and its
    processes listen on `ip[k]` (the address the others dial for a public site)."""

    def __init__(self, sites: list[Site], mtu: int = 9000, seed: int = 0, sysctls: tuple[str, ...] = ()) -> None:
        """`sysctls`: KEY=VALUE settings for every site's namespace (e.g. net.ipv4.tcp_slow_start_after_idle=0)."""
        super().__init__("ew")
        if not 1 <= len(sites) <= 200:
            raise ValueError(f"a Wan has 1 to 200 sites, not {len(sites)}")
        self.sites, self.ns, self.ip = sites, [], []
        try:
            core = self.add("core")
            sh("ip", "netns", "exec", core, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            links = []
            for k, site in enumerate(sites):
                ns = self.add(f"s{k}")
                for setting in sysctls:
                    sh("ip", "netns", "exec", ns, "sysctl", "-qw", setting)
                wan_ip, core_ip = f"10.78.{k}.2", f"10.78.{k}.1"
                edge = ns
                if site.nat:  # the site's own router, between it and its link
                    edge = self.add(f"r{k}")
                    self.veth(ns, f"192.168.{k}.2", edge, f"192.168.{k}.1", f"l{k}")
                    sh("ip", "-n", ns, "route", "add", "default", "via", f"192.168.{k}.1")
                up, down = site.up or 1e10, site.down or 1e10  # (no cap: faster than the emulator can go)
                links.append(Link(
                    LinkEnd(edge, f"{self.prefix}e{k}", wan_ip), LinkEnd(core, f"{self.prefix}c{k}", core_ip),
                    Shape(site.delay_ms, site.loss, up), Shape(site.delay_ms, site.loss, down), mtu,
                ))  # fmt: skip
                self.ns.append(ns)
                self.ip.append(f"192.168.{k}.2" if site.nat else wan_ip)
            self.emulator = Emulator(links, seed)
            for k, site in enumerate(sites):
                edge = f"{self.prefix}-r{k}" if site.nat else self.ns[k]
                sh("ip", "-n", edge, "route", "add", "default", "dev", f"{self.prefix}e{k}")
                if site.nat:
                    self.masquerade(edge, f"{self.prefix}e{k}")
        except BaseException:
            self.close()
            raise

    def rtt_ms(self, i: int, j: int) -> float:
        """The round trip between sites i and j, before queueing."""
        return 2 * (self.sites[i].delay_ms + self.sites[j].delay_ms)


# -- the link emulator (its own process) ------------------------------------------------------------------


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
        self.limit = max(MIN_QUEUE, shape.rate * QUEUE_SECONDS)  # bytes waiting to be serialised, at most
        self.dropped = 0
        self.cut_until = 0.0  # the link carries nothing before this time

    def take(self, packet: bytes, now: float) -> None:
        backlog = (self.line_free - now) * self.shape.rate  # bytes not yet serialised
        if now < self.cut_until or self.rng.random() < self.shape.loss or backlog > self.limit:
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


def run_links(links: list[Link], seed: int) -> None:
    rng = random.Random(seed)
    towards: dict[int, Direction] = {}
    for link in links:
        fds = []
        for end, peer in ((link.a, link.b), (link.b, link.a)):
            fds.append(open_tun(end.netns, end.dev))
            sh("ip", "-n", end.netns, "addr", "add", end.addr, "peer", peer.addr, "dev", end.dev)
            sh("ip", "-n", end.netns, "link", "set", end.dev, "mtu", str(link.mtu), "up")
        towards[fds[0]] = Direction(fds[1], link.a_to_b, rng)
        towards[fds[1]] = Direction(fds[0], link.b_to_a, rng)
    print("ready", flush=True)
    stdin = sys.stdin.fileno()
    while True:
        now = time.monotonic()
        due = [t for d in towards.values() if (t := d.send_due(now)) is not None]
        timeout = max(0.0, min(due) - time.monotonic()) if due else None
        readable, _, _ = select.select([*towards, stdin], [], [], timeout)
        if stdin in readable:
            command = os.read(stdin, 4096)
            if not command:
                return  # the test is done with us
            for line in command.decode().splitlines():  # "cut SECONDS": the links carry nothing for a while
                if line.startswith("cut "):
                    until = time.monotonic() + float(line.split()[1])
                    for direction in towards.values():
                        direction.cut_until = until
                        direction.queue.clear()
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
    parser = argparse.ArgumentParser(description="Carry IP packets between namespaces with delay, loss and a rate.")
    parser.add_argument("command", choices=["links"])
    parser.add_argument("links", help="a JSON list of links (echo_cli.netlab.Link as a dict)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    links = []
    for d in json.loads(args.links):
        ends = [LinkEnd(**d[k]) for k in ("a", "b")]
        links.append(Link(*ends, Shape(**d["a_to_b"]), Shape(**d["b_to_a"]), d.get("mtu", 9000)))
    run_links(links, args.seed)


if __name__ == "__main__":
    main()
