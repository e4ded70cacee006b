"""Which local address and network interface reach a host (torchrun --local-addr, *_SOCKET_IFNAME).

Needs no iproute2 (the image has none): when a UDP socket `connect`s, the kernel picks the source
address it would route from, and no packet is sent; the interface owning that address comes from
the kernel's own tables (an ioctl for IPv4, /proc/net/if_inet6 for IPv6). `interface_for` is pure.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from collections.abc import Mapping, Sequence

_SIOCGIFADDR = 0x8915  # linux/sockios.h: get an interface's (primary) IPv4 address


def source_address(host: str, port: int) -> str:
    """The local IP this machine would use to reach host:port. Resolves names; raises OSError."""
    last: OSError | None = None
    for family, kind, proto, _, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM):
        try:
            with socket.socket(family, kind, proto) as s:
                s.connect(sockaddr)  # UDP: chooses a route and source address, sends nothing
                return s.getsockname()[0]
        except OSError as e:
            last = e
    raise last or OSError(f"{host} has no usable address")


def interface_addresses() -> dict[str, list[str]]:
    """{interface name: its IPv4 and IPv6 addresses} from the kernel (Linux)."""
    import fcntl

    out: dict[str, list[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                reply = fcntl.ioctl(
                    s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15])
                )
            except OSError:
                continue  # this interface has no IPv4 address
            out.setdefault(name, []).append(socket.inet_ntoa(reply[20:24]))
    try:
        with open("/proc/net/if_inet6", encoding="ascii") as f:
            for line in f:
                fields = line.split()
                if len(fields) == 6:
                    addr = ipaddress.IPv6Address(bytes.fromhex(fields[0]))
                    out.setdefault(fields[5], []).append(str(addr))
    except OSError:
        pass  # no IPv6 on this machine
    return out


def interface_for(address: str, interfaces: Mapping[str, Sequence[str]]) -> str | None:
    """The interface that owns `address`; any loopback address belongs to the loopback interface."""
    try:
        want = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return None
    for name, addrs in interfaces.items():
        for a in addrs:
            have = ipaddress.ip_address(a.split("%", 1)[0])
            if have == want or (want.is_loopback and have.is_loopback):
                return name
    return None
