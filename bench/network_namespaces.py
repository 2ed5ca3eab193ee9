"""Simulated hosts with their own addresses on one machine: network namespaces joined by veth pairs (root and
iproute2). Two hosts are one veth pair, end to end; more hang off a bridge in a namespace of its own (the switch),
each by its own pair. `shape` puts tc's token-bucket filter (tbf) on every end, so each host's link carries at most
`rate` each way, as a full-duplex NIC does.

Names are `<tag><random>`, so jobs of different users, or the same script twice, never collide; every namespace
(and with it every veth end and qdisc in it) is deleted by `delete`, which the context manager and the bench
scripts' signal handlers call.
"""

from __future__ import annotations

import os
import secrets
import subprocess

SUBNET = "10.231.0"


class NetworkNamespaces:
    """`hosts` namespaces, host i at `addresses[i]` on interface `links[i]` (inside namespace `names[i]`)."""

    def __init__(self, tag: str = "mt", hosts: int = 2):
        if hosts < 2:
            raise ValueError(f"hosts={hosts}: at least 2")
        stem = f"{tag}{secrets.token_hex(3)}"  # interface names take 15 characters at most
        if len(stem) + 3 > 15:
            raise ValueError(f"tag {tag!r}: too long for an interface name (at most 7 characters)")
        self.names = [f"{stem}n{i}" for i in range(hosts)]
        self.links = [f"{stem}v{i}" for i in range(hosts)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(hosts)]
        self.switch = f"{stem}sw" if hosts > 2 else None
        self.switch_ports = [f"{stem}p{i}" for i in range(hosts)] if self.switch else []
        self.created: list[str] = []

    def create(self) -> None:
        """The namespaces and their links, up; on a failure what was made is deleted and the error raised."""
        try:
            for name in self.names + ([self.switch] if self.switch else []):
                self.ip("netns", "add", name)
                self.created.append(name)
                self.ip("-n", name, "link", "set", "lo", "up")
            if self.switch is None:
                self.ip("link", "add", self.links[0], "netns", self.names[0], "type", "veth", "peer", "name",
                        self.links[1], "netns", self.names[1])
            else:
                self.ip("-n", self.switch, "link", "add", "br0", "type", "bridge", "stp_state", "0",
                        "forward_delay", "0")
                self.ip("-n", self.switch, "link", "set", "br0", "up")
                for name, link, port in zip(self.names, self.links, self.switch_ports):
                    self.ip("link", "add", link, "netns", name, "type", "veth", "peer", "name", port, "netns",
                            self.switch)
                    self.ip("-n", self.switch, "link", "set", port, "master", "br0")
                    self.ip("-n", self.switch, "link", "set", port, "up")
            for name, link, address in zip(self.names, self.links, self.addresses):
                self.ip("-n", name, "addr", "add", f"{address}/24", "dev", link)
                self.ip("-n", name, "link", "set", link, "up")
        except BaseException:
            self.delete()
            raise

    def ends(self) -> list[tuple[str, str]]:
        """Every (namespace, interface) a host's traffic leaves by: each host's own end, and the switch's port
        towards it (or, for two hosts, the other host's end, already listed)."""
        ends = list(zip(self.names, self.links))
        return ends + [(self.switch, port) for port in self.switch_ports] if self.switch else ends

    def shape(self, rate: str, burst: str, latency: str = "50ms") -> None:
        """tbf on every end: `rate` (tc's units: 1gbit, 100mbit), `burst` the bucket (at least one GSO packet,
        64 KB, or large sends stall), `latency` how long a packet may wait in the queue before it is dropped."""
        for name, link in self.ends():
            self.ip_tool("tc", "-n", name, "qdisc", "replace", "dev", link, "root", "tbf", "rate", rate, "burst",
                         burst, "latency", latency)

    def unshape(self) -> None:
        """Every end back to the kernel's default queue: the link as fast as the machine moves bytes."""
        for name, link in self.ends():
            subprocess.run(["tc", "-n", name, "qdisc", "del", "dev", link, "root"], capture_output=True, timeout=30)

    def delete(self) -> None:
        """Every namespace made (their veth ends and qdiscs go with them); safe to call twice."""
        for name in self.names + ([self.switch] if self.switch else []):
            if name in self.created or os.path.exists(f"/run/netns/{name}"):
                subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        self.created.clear()

    def prefix(self, host: int) -> list[str]:
        """The command prefix that runs a program inside host `host`'s namespace."""
        return ["ip", "netns", "exec", self.names[host]]

    def __enter__(self) -> NetworkNamespaces:
        self.create()
        return self

    def __exit__(self, *exc) -> None:
        self.delete()

    @staticmethod
    def ip(*args: str) -> None:
        NetworkNamespaces.ip_tool("ip", *args)

    @staticmethod
    def ip_tool(tool: str, *args: str) -> None:
        subprocess.run([tool, *args], check=True, capture_output=True, timeout=30)


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    import shutil

    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    return f"network namespaces need iproute2 ({', '.join(missing)} not found)" if missing else None
