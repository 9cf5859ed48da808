"""A real NAT on one machine: Linux network namespaces, veth pairs and nftables masquerade routers.

Topology (every name carries a per-lab tag, so labs never collide and cleanup removes exactly what was made)::

    public  (25.0.0.1/24 on a bridge; the bootstrap/relay node and clients live here)
      |-- router r1: 25.0.0.11 outside, 192.168.101.1/24 inside, masquerade, no inbound -- home h1: 192.168.101.2
      |-- router r2: 25.0.0.12 outside, 192.168.102.1/24 inside, masquerade, no inbound -- home h2: 192.168.102.2
      ...

Every address is assigned here, inside namespaces made here, none of which has a route out of the lab: nothing
outside is reachable from it, and it is not reachable from outside. The "public" side needs addresses libp2p counts
as public: a relay leaves documentation and private ranges (203.0.113.0/24, 10/8, ...) out of the reservations it
grants, so relayed addresses would never form. So it uses 25.0.0.0/24, which is someone's real space: only ever
inside the lab's own namespaces, and only processes the lab starts there are given these addresses. Needs root,
``ip`` (iproute2) and ``nft`` (nftables).
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from dataclasses import dataclass, field

from gpunet.testing.wan import Profile

PUBLIC_PREFIX = "25.0.0"
_labs = itertools.count()


class LabUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, or no iproute2/nftables, or the kernel refuses)."""


def _run(*argv: str, input: str | None = None) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, input=input, timeout=30)
    if result.returncode != 0:
        raise LabUnavailable(f"{' '.join(argv)}: {result.stderr.strip() or result.stdout.strip()}")


@dataclass
class Home:
    """A home network behind its own NAT router: ``ns`` is the host's namespace, ``addr`` its private address."""

    ns: str
    router: str
    addr: str
    router_public: str


class _Lab:
    """What every lab shares: its namespaces, made under one tag and removed on close, and commands run in them;
    optionally a WAN profile's latency, jitter and loss on every home's arriving traffic (gpunet.testing.wan)."""

    tag: str
    public: str
    _made: list[str]
    profile: "Profile | None" = None

    @property
    def public_addr(self) -> str:
        return f"{PUBLIC_PREFIX}.1"

    @staticmethod
    def available(latency: bool = False) -> str | None:
        """Why a lab cannot be made here, or None when it can. ``latency``: with a profile's delays (iptables)."""
        if os.geteuid() != 0:
            return "network namespaces need root"
        for tool in ("ip", "nft") + (("iptables",) if latency else ()):
            if shutil.which(tool) is None:
                return f"{tool} is not installed (apt-get install iproute2 nftables iptables)"
        return None

    def __enter__(self):
        try:
            self.build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _netns(self, name: str) -> str:
        _run("ip", "netns", "add", name)
        self._made.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")
        return name

    def _public_bridge(self) -> str:
        """The lab's public side: a namespace with a bridge at ``public_addr``, the others' switch (the first thing
        a lab builds: LabUnavailable, saying why, where it cannot be built)."""
        why = self.available(latency=bool(self.profile and (self.profile.one_way_ms or self.profile.loss_pct)))
        if why:
            raise LabUnavailable(why)
        self.public = self._netns(f"{self.tag}-pub")
        _run("ip", "-n", self.public, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.public, "addr", "add", f"{self.public_addr}/24", "dev", "br0")
        _run("ip", "-n", self.public, "link", "set", "br0", "up")
        return self.public

    def build(self) -> None:
        raise NotImplementedError

    def exec_argv(self, ns: str, argv: list[str]) -> list[str]:
        """``argv`` run inside namespace ``ns`` (``ip netns exec`` execs it: the PID is the command's own)."""
        return ["ip", "netns", "exec", ns, *argv]

    def tcp_peers(self, ns: str) -> set[str]:
        """The remote addresses of the TCP connections established in namespace ``ns`` now (a punched connection
        shows as one from a home straight to another home's router)."""
        out = subprocess.run(self.exec_argv(ns, ["ss", "-tnH", "state", "established"]), capture_output=True,
                             text=True, timeout=30).stdout
        return {line.split()[-1].rsplit(":", 1)[0] for line in out.splitlines() if line.strip()}

    def can_connect(self, ns: str, addr: str, port: int, timeout: float = 2.0) -> bool:
        """Whether a TCP connection from namespace ``ns`` to ``addr:port`` gets through."""
        code = (f"import socket,sys\ns=socket.socket();s.settimeout({timeout})\n"
                f"sys.exit(0 if s.connect_ex(({addr!r},{port}))==0 else 1)")
        import sys

        return subprocess.run(self.exec_argv(ns, [sys.executable, "-c", code]), timeout=timeout + 10).returncode == 0

    def tcp_seconds(self, src: str, dst: str, dst_addr: str, nbytes: int, timeout: float = 600) -> float:
        """Seconds to send ``nbytes`` over one raw TCP connection from namespace ``src`` to ``dst_addr`` in ``dst``
        (the sender's clock, from connecting until the receiver has every byte): a link's floor for any transfer."""
        import sys

        sink = subprocess.Popen(self.exec_argv(dst, [sys.executable, "-c", _SINK, dst_addr]), stdout=subprocess.PIPE,
                                text=True)
        try:
            port = int(sink.stdout.readline())
            done = subprocess.run(self.exec_argv(src, [sys.executable, "-c", _SEND, dst_addr, str(port),
                                                       str(nbytes)]), capture_output=True, text=True,
                                  timeout=timeout, check=True)
            return float(done.stdout)
        finally:
            sink.kill()
            sink.wait()

    def _home_link(self, ns: str) -> None:
        """The profile's latency, jitter and loss on what arrives at namespace ``ns`` from outside: a delayer
        process inside it (killed with the namespace), bound before this returns."""
        p = self.profile
        if p is None or not (p.one_way_ms or p.loss_pct):
            return
        import subprocess
        import sys

        from gpunet.testing import wan

        for argv in wan.rules(0):
            _run(*self.exec_argv(ns, argv))
        proc = subprocess.Popen(self.exec_argv(ns, [sys.executable, "-m", "gpunet.testing.wan", str(p.one_way_ms),
                                                    str(p.jitter_ms), str(p.loss_pct), "0"]),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        self._delayers.append(proc)
        if proc.stdout.readline().strip() != "ready":  # (it exits on any error, closing its stdout)
            proc.wait(timeout=10)
            raise LabUnavailable(f"the delayer in {ns} did not start: {proc.stderr.read().strip()[-500:]}")
        proc.stdout.close()

    def check_delayers(self) -> None:
        """Raise if a delayer has ended: the rules' bypass would let its home's traffic through undelayed, and
        figures measured meanwhile would not be the profile's."""
        gone = [p for p in self._delayers if p.poll() is not None]
        if gone:
            raise RuntimeError(f"{len(gone)} delayer(s) of the lab ended: {gone[0].stderr.read().strip()[-500:]}")

    def round_trip_ms(self, src: str, dst: str, dst_addr: str, count: int = 21) -> float:
        """The median round trip, in ms, of one byte echoed over a TCP connection from namespace ``src`` to
        ``dst_addr`` in ``dst``: the path's own latency, as the profile made it."""
        import subprocess
        import sys

        echo = subprocess.Popen(self.exec_argv(dst, [sys.executable, "-c", _ECHO, dst_addr]), stdout=subprocess.PIPE,
                                text=True)
        try:
            port = echo.stdout.readline().strip()
            done = subprocess.run(self.exec_argv(src, [sys.executable, "-c", _PING, dst_addr, port, str(count)]),
                                  capture_output=True, text=True, timeout=120, check=True)
            self.check_delayers()
            return float(done.stdout)
        finally:
            echo.kill()
            echo.wait()
            echo.stdout.close()

    def close(self) -> None:
        """Remove every namespace this lab made (their veths go with them). Processes still inside are killed first."""
        for proc in self._delayers:
            proc.kill()
            proc.wait()
            proc.stderr.close()
        self._delayers.clear()
        for name in reversed(self._made):
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self._made.clear()


@dataclass
class NatLab(_Lab):
    homes_count: int = 2
    tag: str = field(default_factory=lambda: f"g{os.getpid() % 100000}{next(_labs) % 10}")
    public: str = ""
    homes: list[Home] = field(default_factory=list)
    _made: list[str] = field(default_factory=list)
    profile: Profile | None = None  # latency, loss and each home's up/down link (gpunet.testing.wan.PROFILES)
    _delayers: list = field(default_factory=list)
    #: Public addresses for public nodes (``public_addrs``, in namespace ``relay_ns``): go-libp2p hole-punches only
    #: once peers at 4 distinct addresses observed a node's public one (gpunet.dht.observers), so a lab for that runs
    #: a public node on each.
    observers: int = 1
    #: Those addresses in a namespace of their own, as far from everyone as a home is (the profile's latency on what
    #: arrives there): a relayed transit then costs two legs, as through a real relay; else they are the public
    #: side's own, beside the client.
    far_relays: bool = False
    relay_ns: str = ""

    @property
    def public_addrs(self) -> list[str]:
        first = 21 if self.far_relays else 1
        return [f"{PUBLIC_PREFIX}.{first + i}" for i in range(self.observers)]

    def build(self) -> None:
        t, pub = self.tag, self._public_bridge()
        self.relay_ns = pub
        if self.far_relays:
            far = self.relay_ns = self._netns(f"{t}-far")
            _run("ip", "link", "add", f"{t}fo", "netns", far, "type", "veth", "peer", "name", f"{t}fp", "netns", pub)
            _run("ip", "-n", pub, "link", "set", f"{t}fp", "master", "br0", "up")
            _run("ip", "-n", far, "link", "set", f"{t}fo", "name", "eth0", "up")
            for addr in self.public_addrs:
                _run("ip", "-n", far, "addr", "add", f"{addr}/24", "dev", "eth0")
            self._home_link(far)
        else:
            for extra in self.public_addrs[1:]:
                _run("ip", "-n", pub, "addr", "add", f"{extra}/24", "dev", "br0")
        for i in range(1, self.homes_count + 1):
            router, home = self._netns(f"{t}-r{i}"), self._netns(f"{t}-h{i}")
            outside, inside = f"{PUBLIC_PREFIX}.{10 + i}", f"192.168.{100 + i}"
            # router <-> public bridge
            _run("ip", "link", "add", f"{t}r{i}o", "netns", router, "type", "veth", "peer", "name", f"{t}p{i}",
                 "netns", pub)
            _run("ip", "-n", pub, "link", "set", f"{t}p{i}", "master", "br0", "up")
            _run("ip", "-n", router, "link", "set", f"{t}r{i}o", "name", "wan", "up")
            _run("ip", "-n", router, "addr", "add", f"{outside}/24", "dev", "wan")
            # router <-> home host
            _run("ip", "link", "add", f"{t}r{i}i", "netns", router, "type", "veth", "peer", "name", f"{t}h{i}",
                 "netns", home)
            _run("ip", "-n", router, "link", "set", f"{t}r{i}i", "name", "lan", "up")
            _run("ip", "-n", router, "addr", "add", f"{inside}.1/24", "dev", "lan")
            _run("ip", "-n", home, "link", "set", f"{t}h{i}", "name", "eth0", "up")
            _run("ip", "-n", home, "addr", "add", f"{inside}.2/24", "dev", "eth0")
            _run("ip", "-n", home, "route", "add", "default", "via", f"{inside}.1")
            _run("ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            # A home router: outgoing connections masqueraded, nothing from outside gets in unless it answers one.
            _run("ip", "netns", "exec", router, "nft", "-f", "-", input="""
table ip nat {
    chain postrouting { type nat hook postrouting priority 100; oifname "wan" masquerade; }
}
table ip filter {
    chain forward {
        type filter hook forward priority 0; policy drop;
        ct state established,related accept
        iifname "lan" oifname "wan" accept
    }
    chain input {
        type filter hook input priority 0; policy accept;
        iifname "wan" ct state new drop
    }
}
""")
            if self.profile is not None and self.profile.up_mbit:  # the home's uplink (its router's way out)
                _run("ip", "netns", "exec", router, "tc", "qdisc", "add", "dev", "wan", "root",
                     *_tbf(self.profile.up_mbit))
            if self.profile is not None and self.profile.down_mbit:  # and its downlink (the router's way in)
                _run("ip", "netns", "exec", router, "tc", "qdisc", "add", "dev", "lan", "root",
                     *_tbf(self.profile.down_mbit))
            self._home_link(home)
            self.homes.append(Home(home, router, f"{inside}.2", outside))


@dataclass
class LinkLab(_Lab):
    """Hosts on one switch, each behind a link of its own as a home's is: ``up_mbit`` out of it and ``down_mbit``
    into it (token-bucket shaped; None: the veth's own speed). Addresses are public (no NAT): the lab for what
    bandwidth costs, where every host on one machine would otherwise share loopback's.

    Topology: the public namespace's bridge at 25.0.0.1; host i (from 0) at 25.0.0.(100 + i), namespace ``hosts[i]``.
    """

    hosts_count: int = 2
    up_mbit: float | None = None
    down_mbit: float | None = None
    tag: str = field(default_factory=lambda: f"l{os.getpid() % 100000}{next(_labs) % 10}")
    public: str = ""
    hosts: list[str] = field(default_factory=list)
    addrs: list[str] = field(default_factory=list)
    _made: list[str] = field(default_factory=list)
    profile: Profile | None = None  # latency and loss (and, unless given above, the links' speeds)
    _delayers: list = field(default_factory=list)

    def build(self) -> None:
        if self.profile is not None:
            self.up_mbit = self.up_mbit or self.profile.up_mbit
            self.down_mbit = self.down_mbit or self.profile.down_mbit
        t, pub = self.tag, self._public_bridge()
        for i in range(self.hosts_count):
            host, addr = self._netns(f"{t}-x{i}"), f"{PUBLIC_PREFIX}.{100 + i}"
            _run("ip", "link", "add", f"{t}x{i}", "netns", host, "type", "veth", "peer", "name", f"{t}s{i}",
                 "netns", pub)
            _run("ip", "-n", pub, "link", "set", f"{t}s{i}", "master", "br0", "up")
            _run("ip", "-n", host, "link", "set", f"{t}x{i}", "name", "eth0", "up")
            _run("ip", "-n", host, "addr", "add", f"{addr}/24", "dev", "eth0")
            if self.up_mbit:  # what leaves the host: its uplink
                _run("ip", "netns", "exec", host, "tc", "qdisc", "add", "dev", "eth0", "root", *_tbf(self.up_mbit))
            if self.down_mbit:  # what the switch sends it: its downlink
                _run("ip", "netns", "exec", pub, "tc", "qdisc", "add", "dev", f"{t}s{i}", "root",
                     *_tbf(self.down_mbit))
            self._home_link(host)
            self.hosts.append(host)
            self.addrs.append(addr)


#: tcp_seconds' two ends: a sink that says its port, reads to the end and acknowledges, and a timed sender.
_SINK = """
import socket, sys
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
while conn.recv(1 << 20):
    pass
conn.sendall(b"k")
"""
_SEND = """
import socket, sys, time
addr, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
block = bytes(1 << 20)
t0 = time.perf_counter()
with socket.create_connection((addr, port)) as c:
    while n > 0:
        c.sendall(block[:min(n, len(block))])
        n -= len(block)
    c.shutdown(socket.SHUT_WR)
    c.recv(1)
print(time.perf_counter() - t0)
"""

#: round_trip_ms' two ends: an echo server that says its port, and a client that times ``count`` one-byte echoes.
_ECHO = """
import socket, sys
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while data := conn.recv(1):
    conn.sendall(data)
"""
_PING = """
import socket, sys, time
with socket.create_connection((sys.argv[1], int(sys.argv[2]))) as c:
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    times = []
    for _ in range(int(sys.argv[3])):
        t0 = time.perf_counter()
        c.sendall(b"x")
        c.recv(1)
        times.append(time.perf_counter() - t0)
print(sorted(times)[len(times) // 2] * 1e3)
"""


def _tbf(mbit: float) -> list[str]:
    """A token bucket at ``mbit``: bursts of 10 ms of the rate (at least 64 KB), up to 100 ms queued."""
    burst = max(64 * 1024, int(mbit * 1e6 / 8 / 100))
    return ["tbf", "rate", f"{mbit:g}mbit", "burst", str(burst), "latency", "100ms"]
